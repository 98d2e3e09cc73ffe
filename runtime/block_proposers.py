"""The draft side of the speculative loop for drafts that read the target's captured layers as
context and propose a step's K tokens in one forward: block drafts (dflash, dspark: one
bidirectional block [anchor, mask, ...]) and the parallel draft (peagle: EAGLE-3 catch-up rows, then
K-1 placeholder rows). The chain drafts and what every proposer shares are ``runtime.proposers``."""
from __future__ import annotations

import torch

from runtime.proposers import _Chain, _PerSequence, _any_queued, _joined, _kept_copy
from runtime.sampling import top_probability
from runtime.tree.draft import DraftTree, TreeShape, grow


class _AuxProposer(_PerSequence):
    """A proposer whose draft reads the target's captured layers (``aux_hidden``) as context."""

    def __init__(self, draft, prefill_chunk=512):
        self.draft, self.prefill_chunk = draft, prefill_chunk
        self.features = ("aux_hidden",)
        self.module = draft.module


class BlockDraftProposer(_AuxProposer):
    """DFlash / DSpark: one draft forward proposes a whole block.

    The draft's context is the target's captured features of every accepted token (row p is the
    feature of token x_p at position p, no shift). Each step runs ONE network: the context rows
    verified since the last step, then the block [anchor, mask, ...] at the anchor's position
    (bidirectional inside the block). DFlash chooses every draft row independently; DSpark adds its
    Markov bias W2(W1[previous token]) row by row, left to right. Slots past the anchor are
    overwritten by the next step's context, so nothing is rolled back.
    """

    _lists = ("context", "context_start", "anchor", "position")

    def start(self, prompts, first_tokens, features, capacity):
        self.state = self.draft.new_state(len(prompts), capacity)
        self.capacity = capacity
        self.context = [[f] for f in features["aux_hidden"]]        # rows not yet written: chunks, per sequence
        self.context_start = [0] * len(prompts)
        self.anchor = list(first_tokens)
        self.position = [len(p) for p in prompts]                   # the anchor's position

    def _run(self, k, block=None):
        """Writes pending context (in chunks) and runs the block; returns draft-row logits [B, k, Vd],
        or with ``block(feeds, state) -> (out, state)`` what it returns for the block's network."""
        dev, m = self.draft.device, self.module
        block = block or self.draft.logits_and_state
        while True:
            context = [_joined(c) for c in self.context]
            # every row is padded to the widest: a newcomer's long context beside a row near the cache's
            # end wrote past it, so a call writes at most what the nearest row has room for (an early
            # call one row less: its throwaway block writes one row past its chunk)
            limit = min(self.prefill_chunk, max(1, self.capacity - max(self.context_start)))
            last = all(len(c) <= limit for c in context)
            take = [min(len(c), limit if last else max(1, limit - 1)) for c in context]
            width = max(1, max(take))
            pad = getattr(self.draft, "pad_to", 0)  # one context width per step (a compiled draft's graph);
            if last and width < pad <= k + 1:        # the padded rows' slots are the block's, overwritten by it
                width = pad
            aux = torch.zeros(len(take), width, m.aux_width, dtype=m.dtype, device=dev)
            for b, n in enumerate(take):
                aux[b, :n] = context[b][:n]
            cpos = torch.tensor(self.context_start, dtype=torch.int32, device=dev)[:, None] + torch.arange(width, dtype=torch.int32, device=dev)
            if last:
                ids, pos, lengths, index = m.block_inputs(torch.tensor(self.anchor, device=dev),
                                                          torch.tensor(self.position, device=dev), k)
            else:  # an early chunk of a long prompt: a throwaway one-row block past the chunk
                ids = torch.full((len(take), 1), m.mask_token_id, dtype=torch.int32, device=dev)
                pos = cpos[:, -1:] + 1
                lengths = torch.ones(len(take), dtype=torch.int32, device=dev)
                index = torch.zeros(len(take), 1, dtype=torch.int32, device=dev)
            feeds = {"aux": aux, "context_positions": cpos,
                     "context_lengths": torch.tensor([max(1, n) for n in take], dtype=torch.int32, device=dev),
                     "input_ids": ids, "positions": pos, "lengths": lengths, "logit_index": index}
            logits, self.state = (block if last else self.draft.logits_and_state)(feeds, self.state)
            self.context = [[c[n:]] for c, n in zip(context, take)]
            self.context_start = [s + n for s, n in zip(self.context_start, take)]
            if last:
                return logits

    def _block_width(self, k: int) -> int:
        """Draft rows a block runs for a step of K: a compiled draft's whole width, its one graph
        (a shorter block would run eagerly: 3-4 ms against 1 ms on the wide embedded model), wherever
        the block's slots fit in the cache. One forward drafts the whole block whatever K, so a step
        of a shorter K (an adaptive or per-request K, a batch size's schedule) pays the same draft and
        verifies only the first K of it."""
        full = getattr(self.draft, "pad_to", 0) - 1
        return full if k < full <= self.capacity - 1 - max(self.position) else k

    def propose(self, k, params, stop_below=0.0, caps=None):
        if hasattr(self.draft, "block_chain") and all(p.argmax for p in params):
            anchor = torch.tensor(self.anchor, dtype=torch.long, device=self.draft.device)
            tokens, conf = self._run(self._block_width(k),
                                     lambda feeds, state: self.draft.block_chain(feeds, state, anchor))
            return tokens, None, conf.cpu() if stop_below else None
        # a compiled draft's block at its one width (its graph; a shorter block ran eagerly every step),
        # of which the first k rows are drawn: the draws' q is that block's, so the accept stays exact
        base = self._run(self._block_width(k))                      # [B, >= k, Vd]
        chain = _Chain(params, self.draft.target_vocab, stop_below, caps)
        prev = torch.tensor(self.anchor, dtype=torch.long)[:, None]
        for j in range(k):
            token = chain.draw(self.draft.block_row(base, j, prev)[:, 0])
            prev = token.long().cpu()[:, None]
        return chain.result()

    def propose_tree(self, shape: TreeShape, params) -> DraftTree:
        """DDTree-style: block row d's top-k tokens are the children of every depth-d node (after the
        node's own token, for DSpark's Markov head); one draft forward per step. Greedy rows grow the
        tree in the same call as the block (``draft.block_tree``)."""
        anchor = torch.tensor(self.anchor, dtype=torch.long, device=self.draft.device)
        if hasattr(self.draft, "block_tree") and all(p.argmax for p in params):
            tree = self._run(shape.depth, lambda feeds, state: self.draft.block_tree(feeds, state, anchor, shape))
            return DraftTree(*tree, None)
        base = self._run(shape.depth)
        root = self.draft.block_row(base, 0, anchor[:, None])[:, 0]
        return grow(root, lambda tokens, parent, depth: self.draft.block_row(base, depth, tokens), shape, params,
                    shape.max_nodes)

    def accept(self, accepted, next_tokens, drafts, verify_features):
        """Queues the verified rows' features as context (written by the next step's network)."""
        kept = accepted.tolist()
        feats = _kept_copy(verify_features["aux_hidden"], kept)
        for b, m in enumerate(kept):
            if not _any_queued(self.context[b]):
                self.context_start[b] = self.position[b]             # verify rows began at the anchor
            self.context[b].append(feats[b, :m + 1])
            self.position[b] += m + 1
        self.anchor = next_tokens.tolist()


class ParallelDraftProposer(_AuxProposer):
    """P-EAGLE: EAGLE-3 rows (token x_{p+1}, target feature g_p, position p) for the tokens verified
    since the last step, then K-1 placeholder rows; all K drafts come from one forward, each from
    its own row. Stale slots are overwritten by the next catch-up rows: nothing is rolled back."""

    _lists = ("rows", "feats", "start_pos")

    def start(self, prompts, first_tokens, features, capacity):
        self.state = self.draft.new_state(len(prompts), capacity)
        self.capacity = capacity
        self.rows = [p[1:] + [t] for p, t in zip(prompts, first_tokens)]
        self.feats = [[f] for f in features["aux_hidden"]]          # queued feature rows: chunks, per sequence
        self.start_pos = [0] * len(prompts)

    def _width(self, k: int, free: int) -> int:
        """Drafts one forward computes for a step of K: a compiled draft's own K (its one graph per K:
        another K ran eagerly after a server's warm-up), where its placeholders fit the ``free`` slots
        past the rows; the step uses the first k. Placeholder rows attend causally, so the first k
        rows' drafts are those of a forward of k (within float reordering; the target verifies)."""
        full = getattr(self.draft, "parallel_width", 0) // 2
        return full if k < full <= free + 1 else k

    def _logits(self, k):
        """Writes the queued rows (in chunks) and runs K placeholders: their logits [B, k, V]."""
        m, dev = self.module, self.draft.device
        want = k
        while True:
            # every row is padded to the widest (its rows, then K-1 placeholders): a call writes at most
            # what the row nearest the cache's end has room for. An early call leaves each row at least
            # one row for the last, whose output is its first proposal (a row with none read a padded
            # row's logits)
            room = max(1, self.capacity - max(self.start_pos))
            limit = max(1, min(self.prefill_chunk, room - k + 1))
            last = all(len(r) <= limit for r in self.rows)
            take = [min(len(r), limit) if last else max(0, min(len(r) - 1, self.prefill_chunk, room))
                    for r in self.rows]
            if last:
                k = self._width(want, room - max(take))
            placeholders = k if last else 1
            feats = [_joined(c) for c in self.feats]
            ids, aux, is_mask, pos, lengths, index = m.step_inputs(
                [r[:n] for r, n in zip(self.rows, take)], [f[:n] for f, n in zip(feats, take)],
                self.start_pos, placeholders, getattr(self.draft, "parallel_width", 0) if last else 0)
            if not last:  # an early chunk of a long prompt: its logits are not used
                index = torch.zeros_like(index[:, :1])
            feeds = {"input_ids": ids.to(dev), "aux": aux.to(dev), "is_mask": is_mask.to(dev), "positions": pos.to(dev),
                     "lengths": lengths.to(dev), "logit_index": index.to(dev)}
            logits, self.state = self.draft.logits_and_state(feeds, self.state)
            self.rows = [r[n:] for r, n in zip(self.rows, take)]
            self.feats = [[f[n:]] for f, n in zip(feats, take)]
            self.start_pos = [s + n for s, n in zip(self.start_pos, take)]
            if last:
                return self.draft.to_target_vocab(logits)[:, :want]

    def propose(self, k, params, stop_below=0.0, caps=None):
        logits = self._logits(k)
        if all(p.argmax for p in params):   # every row's argmax (and its probability) at once
            return logits.argmax(-1), None, top_probability(logits).cpu() if stop_below else None
        chain = _Chain(params, self.draft.target_vocab, stop_below, caps)
        for j in range(k):
            chain.draw(logits[:, j])
        return chain.result()

    def propose_tree(self, shape: TreeShape, params) -> DraftTree:
        """Every depth-d node's children are the top-k tokens of placeholder row d (rows are independent)."""
        logits = self._logits(shape.depth)
        return grow(logits[:, 0], lambda tokens, parent, depth: logits[:, depth:depth + 1].expand(-1, tokens.shape[1], -1),
                    shape, params, shape.max_nodes)

    def accept(self, accepted, next_tokens, drafts, verify_features):
        """Queues the verified rows (start_pos already points where the verify chunk began)."""
        kept = accepted.tolist()
        feats = _kept_copy(verify_features["aux_hidden"], kept)
        for b, (d, m, t) in enumerate(zip(drafts.tolist(), kept, next_tokens.tolist())):
            self.rows[b] = self.rows[b] + d[:m] + [t]
            self.feats[b].append(feats[b, :m + 1])
