"""Driving draft networks from named feeds: eagerly, or through an engine executor.

``EagerDraft`` runs a draft module's component(s) (``builder.engine.draft_components``) on torch
tensors; ``runtime.engine_runner.EngineDraft`` runs the same feeds through engines. Feeds are named
as the draft engine's inputs, so both are driven the same way. Logits over a draft vocabulary are
mapped back with ``d2t`` (target id = draft id + d2t[draft id]).

``step`` is the feature-draft interface (eagle, eagle3, mtp): either the target's features for
every row (a catch-up chunk) or the draft's own recycled hidden (one proposal row).
"""
from __future__ import annotations

import torch

from builder.engine import BuildOptions, draft_components
from runtime.sampling import top_probability
from runtime.state import allocate
from runtime.tree.draft import feature_expand, grow_greedy


def _present(out: dict) -> dict:
    return {n[len("present."):]: v for n, v in out.items() if n.startswith("present.")}


class EagerDraft:
    """A draft module run eagerly (CPU or CUDA)."""

    def __init__(self, module, target_vocab: int, device="cpu"):
        self.module, self.kind = module, module.kind
        self.feature = "hidden" if self.kind in ("eagle", "mtp") else "aux_hidden"
        self.device = torch.device(device)
        self.target_vocab = target_vocab
        d2t = getattr(module, "d2t", None)
        self.target_ids = None if d2t is None else (torch.arange(d2t.shape[0]) + d2t.long()).to(self.device)
        self.components = {c.name: c for c in draft_components(module, BuildOptions(), tree=True)}

    def new_state(self, batch, capacity):
        return allocate(self.module.state_spec(batch, capacity), self.device)

    @torch.inference_mode()
    def run(self, name: str, feeds: dict) -> dict:
        return self.components[name].call(feeds)

    def _call(self, name: str, feeds: dict) -> dict:
        """A component's own call, for the one-call proposals (chain, tree, block): they run inside
        one graph on the compiled path, where ``run`` (compiled per call there) must not nest."""
        return self.components[name].call(feeds)

    def _block_forward(self, feeds: dict, state: dict) -> dict:
        return self._call("draft", {**feeds, **{"past." + k: v for k, v in state.items()}})

    def to_target_vocab(self, logits):
        if self.target_ids is None:
            return logits
        full = torch.full(logits.shape[:-1] + (self.target_vocab,), float("-inf"), dtype=logits.dtype,
                          device=logits.device)
        return full.scatter_(-1, self.target_ids.expand(logits.shape), logits)

    def to_target_ids(self, draft_ids):
        return draft_ids if self.target_ids is None else self.target_ids[draft_ids.long()]

    def row_inputs(self, ids, target_features, own_hidden) -> dict:
        """The draft's feature inputs for a chunk fed either target features or its own hidden."""
        if self.kind != "eagle3":
            return {"hidden": target_features if target_features is not None else own_hidden}
        batch, rows = ids.shape
        m = self.module
        zeros = lambda width: torch.zeros(batch, rows, width, dtype=m.dtype, device=self.device)  # noqa: E731
        return {"aux_hidden": target_features if target_features is not None else zeros(m.aux_width),
                "hidden": own_hidden if own_hidden is not None else zeros(m.hidden_size),
                "from_target": torch.full((batch, rows), int(target_features is not None), dtype=torch.int32,
                                          device=self.device)}

    def step(self, ids, target_features, own_hidden, positions, lengths, logit_index, state):
        return self._step(self.run, ids, target_features, own_hidden, positions, lengths, logit_index, state)

    def _step(self, run, ids, target_features, own_hidden, positions, lengths, logit_index, state, target_vocab=True):
        """(logits over the target vocabulary, or the draft's own with ``target_vocab=False``, hidden_out,
        new state) of one draft chunk."""
        feeds = {"input_ids": ids, "positions": positions, "lengths": lengths, "logit_index": logit_index}
        feeds.update(self.row_inputs(ids, target_features, own_hidden))
        feeds.update({"past." + k: v for k, v in state.items()})
        out = run("draft", feeds)
        return (self.to_target_vocab(out["logits"]) if target_vocab else out["logits"]), out["hidden_out"], _present(out)

    def catch_up_width(self, rows: int, tree_depth: int = 0) -> int:
        """How many rows a catch-up chunk of ``rows`` queued rows runs as (``chain``, or ``tree_chain``
        after a tree of ``tree_depth``): as many here; a compiled draft pads to its graphs' buckets."""
        return rows

    @torch.inference_mode()
    def chain(self, ids, features, positions, lengths, state, k: int):
        return self._chain(ids, features, positions, lengths, state, k)

    def _catch_up(self, ids, features, positions, lengths, state):
        """The catch-up chunk (``ids`` with the target's ``features``, ``lengths`` real rows per
        sequence): (its last row's logits [B, V] and hidden [B, H], the next position [B, 1], state)."""
        index = (lengths - 1).to(torch.int32)[:, None]
        logits, hidden, state = self._step(self._call, ids, features, None, positions, lengths, index, state)
        hidden = hidden.gather(1, index.long()[:, :, None].expand(-1, -1, hidden.shape[-1]))[:, 0]
        return logits[:, 0], hidden, positions[:, :1] + lengths.to(positions.dtype)[:, None], state

    def _chain(self, ids, features, positions, lengths, state, k: int):
        """A feature draft's whole greedy proposal in one call: the catch-up chunk yields the first
        token, then k-1 rows each fed the previous token and the draft's own hidden. Returns (tokens
        [B, k], their draft probabilities [B, k], the catch-up's last-row logits [B, V] and hidden
        [B, H], the state after the last row): what ``k`` calls of ``step`` with argmax in between
        give, without a host round trip per token."""
        first_logits, hidden, position, state = self._catch_up(ids, features, positions, lengths, state)
        first_hidden, logits = hidden, first_logits
        tokens, confidences = [logits.argmax(-1)], [top_probability(logits)]
        one = torch.ones_like(lengths)
        zero = torch.zeros_like(one)[:, None]
        for i in range(1, k):   # argmax over the draft's own vocabulary, then its target ids (a cut head's
            # rows only, not a target-wide scatter of -inf per token)
            logits, out, state = self._step(self._call, tokens[-1].to(torch.int32)[:, None], None, hidden[:, None],
                                            position + (i - 1), one, zero, state, target_vocab=False)
            hidden, logits = out[:, 0], logits[:, 0]
            tokens.append(self.to_target_ids(logits.argmax(-1)))
            confidences.append(top_probability(logits))
        return torch.stack(tokens, 1), torch.stack(confidences, 1), first_logits, first_hidden, state

    @torch.inference_mode()
    def tree_chain(self, ids, features, positions, lengths, state, shape):
        return self._tree_chain(ids, features, positions, lengths, state, shape)

    def _tree_chain(self, ids, features, positions, lengths, state, shape):
        """A feature draft's whole greedy tree in one call: the catch-up chunk, then one tree step per
        depth with the top-k expansion and the final selection (``grow_greedy``) between them, no
        host round trip. Returns (tree tokens, parents, depth [B, T], the catch-up's last-row logits
        and hidden, the state after the last tree step)."""
        logits, hidden, position, state = self._catch_up(ids, features, positions, lengths, state)
        expand, front = feature_expand(self._tree_step, hidden, position, state, shape)
        tree = grow_greedy(logits, expand, shape)
        return tree.tokens, tree.parents, tree.depth, logits, hidden, front["state"]

    @torch.inference_mode()
    def tree_step(self, ids, own_hidden, positions, slots, visible, state):
        return self._tree_step(ids, own_hidden, positions, slots, visible, state)

    def _tree_step(self, ids, own_hidden, positions, slots, visible, state):
        """A feature draft's step over frontier nodes of a token tree (``builder.engine``'s draft_tree
        component): row (b, f) is node f's token with its parent's ``hidden_out``, RoPE at
        ``positions`` (its depth past the draft's position), KV written at ``slots``, attending to the
        slots ``visible`` [B, F, S] marks. Returns (logits over the target vocabulary for every row,
        hidden_out, new state)."""
        batch, rows = ids.shape
        feeds = {"input_ids": ids, "hidden": own_hidden, "positions": positions, "slots": slots, "visible": visible,
                 "lengths": torch.full((batch,), rows, dtype=torch.int32, device=self.device),
                 "logit_index": torch.arange(rows, dtype=torch.int32, device=self.device).expand(batch, -1)}
        out = self._call("draft_tree", {**feeds, **{"past." + k: v for k, v in state.items()}})
        return self.to_target_vocab(out["logits"]), out["hidden_out"], _present(out)

    def block_row(self, base, j: int, prev, call=None, target_vocab=True):
        """Block row j's logits over the target vocabulary [B, F, V] (the draft's own with
        ``target_vocab=False``) after each of the previous tokens ``prev`` [B, F] (DSpark's Markov
        bias; DFlash rows do not depend on them)."""
        batch, width = prev.shape
        row = base[:, j:j + 1]
        if getattr(self.module, "has_markov", False):
            flat = row.expand(-1, width, -1).reshape(batch * width, 1, -1)
            feeds = {"logits": flat, "prev_ids": prev.reshape(-1, 1).to(device=row.device, dtype=torch.int32)}
            row = (call or self.run)("markov", feeds)["markov_logits"].reshape(batch, width, -1)
        else:
            row = row.expand(-1, width, -1)
        return self.to_target_vocab(row) if target_vocab else row

    @torch.inference_mode()
    def block_chain(self, feeds: dict, state: dict, anchor):
        return self._block_chain(feeds, state, anchor)

    def _block_chain(self, feeds: dict, state: dict, anchor):
        """A block draft's greedy proposal in one call: the block's forward, then each draft row's
        argmax (over the draft's vocabulary, as target ids), after DSpark's Markov bias for the previous row's token
        (``anchor`` [B] target ids before the first row). Returns ((target ids [B, K], their draft
        probabilities [B, K]), new state)."""
        out = self._block_forward(feeds, state)
        base, prev, tokens, confidences = out["logits"], anchor.long()[:, None], [], []
        for j in range(base.shape[1]):
            row = self.block_row(base, j, prev, self._call, target_vocab=False)[:, 0]
            tokens.append(self.to_target_ids(row.argmax(-1)))
            confidences.append(top_probability(row))
            prev = tokens[-1][:, None]
        return (torch.stack(tokens, 1), torch.stack(confidences, 1)), _present(out)

    @torch.inference_mode()
    def block_tree(self, feeds: dict, state: dict, anchor, shape):
        return self._block_tree(feeds, state, anchor, shape)

    def _block_tree(self, feeds: dict, state: dict, anchor, shape):
        """A block draft's greedy tree in one call: the block's forward, then per depth the top-k of
        block row d after each frontier node's token (``grow_greedy``, ``max_nodes`` expanded).
        Returns ((tree tokens, parents, depth [B, T]), new state)."""
        out = self._block_forward(feeds, state)
        base = out["logits"]
        root = self.block_row(base, 0, anchor.long()[:, None], self._call)[:, 0]
        tree = grow_greedy(root, lambda tokens, parent, depth: self.block_row(base, depth, tokens, self._call), shape,
                           shape.max_nodes)
        return (tree.tokens, tree.parents, tree.depth), _present(out)

    def logits_and_state(self, feeds: dict, state: dict):
        """Block and parallel drafts: (logits over the draft vocabulary, new state) of one forward."""
        out = self.run("draft", {**feeds, **{"past." + k: v for k, v in state.items()}})
        return out["logits"], _present(out)
