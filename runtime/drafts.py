"""Uniform stepping of feature-reading drafts (eagle, eagle3, mtp) for FeatureDraftProposer.

``step(ids, target_features, own_hidden, positions, lengths, logit_index, state)`` takes either
the target's features for every row (a catch-up chunk) or the draft's own recycled hidden (one
proposal row) and returns (logits over the TARGET vocabulary, hidden_out, new_state): a draft
vocabulary is mapped back with ``d2t`` (target id = draft id + d2t[draft id]). Feeds are named as
the draft engine's inputs, so the eager module and the engine are driven the same way.
"""
from __future__ import annotations

import torch

from builder.engine import BuildOptions, draft_component
from runtime.state import allocate


class EagerDraft:
    """A draft module run eagerly (CPU or CUDA)."""

    def __init__(self, module, target_vocab: int, device="cpu"):
        self.module, self.kind = module, module.kind
        self.feature = "aux_hidden" if self.kind == "eagle3" else "hidden"
        self.device = torch.device(device)
        self.target_vocab = target_vocab
        d2t = getattr(module, "d2t", None)
        self.target_ids = None if d2t is None else (torch.arange(d2t.shape[0]) + d2t.long()).to(self.device)
        self.component = draft_component(module, BuildOptions())

    def new_state(self, batch, capacity):
        return allocate(self.module.state_spec(batch, capacity), self.device)

    def to_target_vocab(self, logits):
        if self.target_ids is None:
            return logits
        full = torch.full(logits.shape[:-1] + (self.target_vocab,), float("-inf"), dtype=logits.dtype,
                          device=logits.device)
        return full.scatter_(-1, self.target_ids.expand(logits.shape), logits)

    def row_inputs(self, ids, target_features, own_hidden) -> dict:
        """The draft's feature inputs for a chunk fed either target features or its own hidden."""
        if self.kind != "eagle3":
            return {"hidden": target_features if target_features is not None else own_hidden}
        batch, rows = ids.shape
        m = self.module
        zeros = lambda width: torch.zeros(batch, rows, width, dtype=m.dtype, device=self.device)  # noqa: E731
        return {"aux_hidden": target_features if target_features is not None
                else zeros(m.aux_width),
                "hidden": own_hidden if own_hidden is not None else zeros(m.hidden_size),
                "from_target": torch.full((batch, rows), int(target_features is not None), dtype=torch.int32,
                                          device=self.device)}

    @torch.inference_mode()
    def step(self, ids, target_features, own_hidden, positions, lengths, logit_index, state):
        feeds = {"input_ids": ids, "positions": positions, "lengths": lengths, "logit_index": logit_index}
        feeds.update(self.row_inputs(ids, target_features, own_hidden))
        feeds.update({"past." + k: v for k, v in state.items()})
        out = self.component.call(feeds)
        new_state = {n[len("present."):]: v for n, v in out.items() if n.startswith("present.")}
        return self.to_target_vocab(out["logits"]), out["hidden_out"], new_state
