"""Uniform stepping of feature-reading drafts (eagle, eagle3, mtp) for FeatureDraftProposer.

``step(ids, target_features, own_hidden, positions, lengths, logit_index, state)`` takes either
the target's features for every row (a catch-up chunk) or the draft's own recycled hidden (one
proposal row) and returns (logits over the TARGET vocabulary, hidden_out, new_state): a draft
vocabulary is mapped back with ``d2t`` (target id = draft id + d2t[draft id]).
"""
from __future__ import annotations

import torch


class EagerDraft:
    """A draft module run eagerly (CPU or CUDA)."""

    def __init__(self, module, target_vocab: int, device="cpu"):
        self.module, self.kind = module, module.kind
        self.feature = "aux_hidden" if self.kind == "eagle3" else "hidden"
        self.device = torch.device(device)
        self.target_vocab = target_vocab
        d2t = getattr(module, "d2t", None)
        self.target_ids = None if d2t is None else (torch.arange(d2t.shape[0]) + d2t.long()).to(self.device)

    def new_state(self, batch, capacity):
        from runtime.state import allocate
        return allocate(self.module.state_spec(batch, capacity), self.device)

    def to_target_vocab(self, logits):
        if self.target_ids is None:
            return logits
        full = torch.full(logits.shape[:-1] + (self.target_vocab,), float("-inf"), dtype=logits.dtype,
                          device=logits.device)
        return full.index_copy_(-1, self.target_ids, logits) if logits.dim() == 1 else \
            full.scatter_(-1, self.target_ids.expand(logits.shape), logits)

    @torch.inference_mode()
    def step(self, ids, target_features, own_hidden, positions, lengths, logit_index, state):
        m = self.module
        if self.kind == "eagle3":
            batch, rows = ids.shape
            hidden_size = m.hidden_size
            width = len(m.aux_layer_ids) * hidden_size
            from_target = torch.full((batch, rows), int(target_features is not None), dtype=torch.int32, device=self.device)
            aux = target_features if target_features is not None else torch.zeros(batch, rows, width, dtype=m.dtype, device=self.device)
            hidden = own_hidden if own_hidden is not None else torch.zeros(batch, rows, hidden_size, dtype=m.dtype, device=self.device)
            logits, out, new_state = m.forward(ids, aux, hidden, from_target, positions, lengths, logit_index, state)
        else:
            hidden = target_features if target_features is not None else own_hidden
            logits, out, new_state = m.forward(ids, hidden, positions, lengths, logit_index, state)
        return self.to_target_vocab(logits), out, new_state
