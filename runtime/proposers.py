"""The draft side of the speculative loop: proposes K tokens per step for a batch of sequences.

The chain drafts (block and parallel drafts: ``runtime.block_proposers``):

* ``ModelDraftProposer`` (draft_target): a smaller NemotronH with the same vocabulary consumes
  tokens like the target. It keeps one state snapshot per draft step and, after verification,
  restores the snapshot of the accepted position (its Mamba state cannot be truncated). Its token
  trees grow by tree forwards from the state before the root, which they leave as it was.
* ``FeatureDraftProposer`` (eagle, eagle3, mtp): the draft reads the target's hidden features. A
  draft row pairs the token at position p+1 with the target feature of position p and uses
  position p (vLLM's convention). After a verify that kept m drafts, one "catch-up" chunk of
  m+1 rows feeds the verified features and already yields the first proposal of the next step;
  the remaining K-1 proposals recycle the draft's own output hidden. Its KV rows past the
  accepted position are overwritten, so it needs no rollback.

``propose(k, params, stop_below)`` returns draft tokens [B, k'], the distributions they were drawn
from when sampling (else None), and the draft's probability of each token [B, k'] when
``stop_below`` > 0 (else None); chain drafts stop drafting (k' < k) once every sequence has drawn a
token under ``stop_below``. ``accept`` after a step with no drafts (k' = 0, a target-only step)
queues the verified token; the draft consumes queued tokens at its next proposal.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from runtime.prefill import prefill
from runtime.rollback import select_snapshots
from runtime.sampling import draw
from runtime.state import chunk_inputs, keep_rows
from runtime.tree.draft import DraftTree, TreeShape, feature_expand, grow, model_expand
from runtime.tree.paths import ancestors


def _take_rows(state: dict, keep: torch.Tensor) -> dict:
    return {k: v[keep.to(v.device)] for k, v in state.items()}


def _padded(rows: list, length: int, dev) -> torch.Tensor:
    """Per-sequence feature rows (None: nothing this chunk) -> [B, length, W], each sequence's rows
    first and zeros after; one sequence whose rows fill the chunk is passed as it is."""
    if len(rows) == 1 and rows[0] is not None and rows[0].shape[0] == length:
        return rows[0][None].to(dev)
    first = next(r for r in rows if r is not None)
    out = torch.zeros(len(rows), length, first.shape[-1], dtype=first.dtype, device=dev)
    for b, r in enumerate(rows):
        if r is not None:
            out[b, :r.shape[0]] = r
    return out


def _joined(chunks: list):
    """A sequence's queued feature rows as one tensor (None: none queued). Each step appends its rows
    as a chunk, joined once here when the draft reads them: a stretch of target-only steps (a batch
    size the schedule does not speculate at) had copied the whole queue again every step."""
    if not chunks:
        return None
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def _any_queued(chunks: list) -> bool:
    """Whether a never-empty chunk list (a consumed queue is one chunk of no rows) holds rows."""
    return len(chunks) > 1 or len(chunks[0]) > 0


def _kept_copy(features: torch.Tensor, kept: list) -> torch.Tensor:
    """A step's rows that a queue keeps ([B, max kept + 1, W]): a copy, not a view, since they wait
    past the next step's call, which may reuse its output buffers (a CUDA graph's replay)."""
    return features[:, :max(kept) + 1].clone()


def _cat(a: dict, b: dict) -> dict:
    return {k: torch.cat([a[k], b[k]]) for k in a}


class _PerSequence:
    """Batched draft state plus per-sequence bookkeeping that follows sequences leaving (``keep``)
    and joining (``merge``) the in-flight batch."""
    _lists: tuple = ()      # per-sequence Python lists
    _tensors: tuple = ()    # per-sequence tensors batched on dim 0

    def keep(self, keep: torch.Tensor):
        idx = keep.tolist()
        self.state = _take_rows(self.state, keep)
        for f in self._lists:
            setattr(self, f, [getattr(self, f)[i] for i in idx])
        for f in self._tensors:
            setattr(self, f, getattr(self, f)[keep])

    def merge(self, other):
        """Appends another proposer's sequences (started on newcomers) after this one's."""
        self.state = _cat(self.state, other.state)
        for f in self._lists:
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for f in self._tensors:
            setattr(self, f, torch.cat([getattr(self, f), getattr(other, f)]))


def confidence(logits, token, q):
    """The draft's probability of each chosen token [B]: q where the row sampled, softmax else."""
    index = token.long()[:, None]
    p = torch.softmax(logits.float(), -1).gather(-1, index.to(logits.device))[:, 0].cpu()
    if q is not None:
        p = torch.where(q.sum(-1) > 0, q.gather(-1, index.cpu())[:, 0], p)
    return p


class _Chain:
    """Draws of a chain draft, step by step: tokens, q rows, confidences and who is still confident.
    ``caps`` [B] (optional): each row's own draft length; its positions past it are never verified, so
    they are drawn greedily and leave the row's generator where its own K left it (a seeded request
    draws the same numbers whatever draft length the rest of its batch runs)."""

    def __init__(self, params, vocab, stop_below, caps=None):
        self.params, self.vocab, self.stop_below, self.caps = params, vocab, stop_below, caps
        self.tokens, self.probs, self.conf = [], [], []
        self.going = None

    def _params_at(self, j: int):
        if self.caps is None:
            return self.params
        return [p if j < c or not p.temperature else replace(p, temperature=0.0, generator=None)
                for p, c in zip(self.params, self.caps)]

    def draw(self, logits):
        token, q = draw(logits, self._params_at(len(self.tokens)))
        self.tokens.append(token)
        self.probs.append(q)
        if self.stop_below:
            c = confidence(logits, token, q)
            self.conf.append(c)
            self.going = (c >= self.stop_below) if self.going is None else self.going & (c >= self.stop_below)
        return token

    def stopped(self) -> bool:
        return self.going is not None and not bool(self.going.any())

    def result(self):
        batch = len(self.params)
        conf = torch.stack(self.conf, 1) if self.stop_below else None
        return torch.stack(self.tokens, 1), _stack_q(self.probs, batch, self.vocab), conf


def _stack_q(probs, batch, vocab):
    """Per-step q rows [B, V] (None when every row is greedy) -> [B, K, V] or None."""
    if all(q is None for q in probs):
        return None
    return torch.stack([q if q is not None else torch.zeros(batch, vocab) for q in probs], 1)


class ModelDraftProposer(_PerSequence):
    _lists = ("consumed", "pending")
    features = ()

    def __init__(self, runner, prefill_chunk=512):
        self.runner, self.prefill_chunk = runner, prefill_chunk

    def start(self, prompts, first_tokens, features, capacity):
        self.state = self.runner.new_state(len(prompts), capacity)
        _, self.state, _, _ = prefill(self.runner, prompts, self.state, self.prefill_chunk)
        self.consumed = [len(p) for p in prompts]
        self.pending = [[t] for t in first_tokens]

    def _consume(self, keep_last: bool):
        """Runs the queued tokens through the draft; returns the last row's logits [B, V]."""
        dev = self.runner.device
        chunks = [p[:-1] if keep_last else p for p in self.pending]
        ids, positions, lengths = chunk_inputs([c or [0] for c in chunks], self.consumed, dev)
        logits, new_state, _ = self.runner.forward(ids, positions, lengths, (lengths - 1)[:, None].to(torch.int32),
                                                   self.state)
        self.state = keep_rows(self.state, new_state, [b for b, c in enumerate(chunks) if c], len(chunks))
        self.consumed = [n + len(c) for n, c in zip(self.consumed, chunks)]
        self.pending = [p[-1:] if keep_last else [] for p in self.pending]
        return logits[:, 0]

    def propose(self, k, params, stop_below=0.0, caps=None):
        dev = self.runner.device
        logits = self._consume(keep_last=False)
        self.base = list(self.consumed)
        self.snapshots = [dict(self.state)]
        chain = _Chain(params, logits.shape[-1], stop_below, caps)
        token = chain.draw(logits)
        one = torch.ones(len(self.base), dtype=torch.int32, device=dev)
        zero = torch.zeros(len(self.base), 1, dtype=torch.int32, device=dev)
        base = torch.tensor(self.base, dtype=torch.int32, device=dev)[:, None]
        for i in range(1, k):
            if chain.stopped():
                break
            logits, self.state, _ = self.runner.forward(token.to(torch.int32)[:, None], base + (i - 1), one, zero,
                                                        self.state)
            self.snapshots.append(dict(self.state))
            token = chain.draw(logits[:, 0])
        return chain.result()

    def propose_tree(self, shape: TreeShape, params) -> DraftTree:
        """EAGLE-2 tree growth (``runtime.tree.draft.model_expand``): the queued tokens but the root
        (the last accepted one) are consumed; each depth runs one tree forward of the draft from
        there over the root and the nodes expanded so far, leaving the draft's state as it was.
        ``accept`` then queues the root and the accepted path for the next catch-up."""
        if any(len(p) > 1 for p in self.pending):
            self._consume(keep_last=True)
        dev = self.runner.device
        room = min((v.shape[1] for n, v in self.state.items() if n.endswith("key_cache")), default=0)
        if room and max(self.consumed) + shape.draft_rows + 1 > room:
            raise ValueError(f"tree: draft cache of {room} slots cannot hold {shape.draft_rows + 1} tree rows "
                             f"past position {max(self.consumed)}")
        base = torch.tensor(self.consumed, dtype=torch.int32, device=dev)[:, None]
        batch = len(self.pending)

        def tree_forward(tokens, parents):
            rows = torch.arange(tokens.shape[1], dtype=torch.int32, device=dev).expand(batch, -1)
            logits, _, _ = self.runner.forward(tokens, base + rows, torch.full((batch,), tokens.shape[1], dtype=torch.int32,
                                               device=dev), rows, self.state, verify=True,
                                               tree=(parents, ancestors(parents).to(dev)))
            return logits
        root_logits, expand = model_expand(tree_forward, torch.tensor([p[-1] for p in self.pending], device=dev))
        self.snapshots = None                 # a tree step: accept queues the path, no snapshot to restore
        return grow(root_logits, expand, shape, params)

    def accept(self, accepted, next_tokens, drafts, verify_features):
        if drafts.shape[1] == 0:  # a target-only step: queue the token (consumed with the next proposal)
            self.pending = [p + [int(t)] for p, t in zip(self.pending, next_tokens.tolist())]
            if max(len(p) for p in self.pending) >= self.prefill_chunk:
                self._consume(keep_last=True)
            return
        if self.snapshots is None:  # after a tree step the root is still queued: queue the path after it
            self.pending = [p + d[:m] + [t] for p, d, m, t in zip(self.pending, drafts.tolist(), accepted.tolist(),
                                                                  next_tokens.tolist())]
            return
        k = drafts.shape[1]
        index = torch.clamp(accepted, max=k - 1)
        self.state = select_snapshots(self.snapshots, index)
        self.consumed = [b + int(i) for b, i in zip(self.base, index)]
        self.pending = [[int(t)] if int(m) < k else [int(drafts[b, -1]), int(t)]
                        for b, (m, t) in enumerate(zip(accepted, next_tokens))]
        self.snapshots = []


class FeatureDraftProposer(_PerSequence):
    """``draft`` is a runtime.drafts adapter: feature name, new_state, step()."""

    _lists = ("position", "pending", "pending_features")
    _tensors = ("logits", "hidden")

    def __init__(self, draft, prefill_chunk=512):
        self.draft, self.prefill_chunk = draft, prefill_chunk
        self.features = (draft.feature,)

    def _catch_up(self):
        """Feeds the queued (token, target feature) rows; keeps each sequence's last row's logits and
        hidden (a sequence with nothing queued keeps its own)."""
        dev = self.draft.device
        rows_tokens, rows_features = self.pending, [_joined(c) for c in self.pending_features]
        done = [0] * len(rows_tokens)
        last_logits = [None] * len(rows_tokens) if getattr(self, "logits", None) is None else list(self.logits)
        last_hidden = [None] * len(rows_tokens) if getattr(self, "hidden", None) is None else list(self.hidden)
        while any(d < len(t) for d, t in zip(done, rows_tokens)):
            active = [b for b, t in enumerate(rows_tokens) if done[b] < len(t)]
            chunks = [rows_tokens[b][done[b]:done[b] + self.prefill_chunk] if b in active else [0]
                      for b in range(len(rows_tokens))]
            ids, positions, lengths = chunk_inputs(chunks, [s + d for s, d in zip(self.position, done)], dev)
            feats = _padded([rows_features[b][done[b]:done[b] + len(chunks[b])] if b in active else None
                             for b in range(len(rows_tokens))], ids.shape[1], dev)
            index = (lengths - 1).to(torch.int32)[:, None]
            logits, hidden, new_state = self.draft.step(ids, feats, None, positions, lengths, index, self.state)
            self.state = keep_rows(self.state, new_state, active, len(rows_tokens))
            for b in active:
                last_logits[b] = logits[b, 0]
                last_hidden[b] = hidden[b, len(chunks[b]) - 1]
                done[b] += len(chunks[b])
        self.logits, self.hidden = torch.stack(last_logits), torch.stack(last_hidden)
        self.position = [s + len(t) for s, t in zip(self.position, rows_tokens)]
        self.pending = [[] for _ in rows_tokens]
        self.pending_features = [[] for _ in rows_tokens]

    def start(self, prompts, first_tokens, features, capacity):
        self.state = self.draft.new_state(len(prompts), capacity)
        self.logits = self.hidden = None
        self.position = [0] * len(prompts)
        self.pending = [p[1:] + [t] for p, t in zip(prompts, first_tokens)]
        self.pending_features = [[f] for f in features[self.draft.feature]]
        # the last row stays queued: the first proposal's catch-up, so it can run as one chain call
        hold = hasattr(self.draft, "chain") and all(len(t) > 1 for t in self.pending)
        if hold:
            last = [t[-1:] for t in self.pending], [[f[0][-1:]] for f in self.pending_features]
            self.pending = [t[:-1] for t in self.pending]
            self.pending_features = [[f[0][:-1]] for f in self.pending_features]
        self._catch_up()
        if hold:
            self.pending, self.pending_features = last

    def _fused(self, k, params) -> bool:
        """Whether this proposal can run as one ``draft.chain`` call: k > 1 and what ``_fusable``
        asks. A confidence stop then trims the k drafts afterwards (``DraftPolicy.confident_lengths``)
        rather than stopping the draft: a proposal costs less inside the one call than a call of its
        own."""
        return k > 1 and hasattr(self.draft, "chain") and self._fusable(params)

    def _fusable(self, params) -> bool:
        """Greedy rows with nothing banned, every sequence with 1..prefill_chunk queued rows: the
        catch-up is one chunk and what follows needs no sampling."""
        return (all(p.argmax for p in params)
                and all(0 < len(t) <= self.prefill_chunk for t in self.pending))

    def _queued_chunk(self, tree_depth: int = 0):
        """The queued rows as one catch-up chunk: (ids, target features, positions, lengths), as
        wide as the draft runs it (``catch_up_width``: a compiled draft's bucket), padded rows past
        each sequence's own."""
        dev = self.draft.device
        rows = max(len(t) for t in self.pending)
        width = self.draft.catch_up_width(rows, tree_depth)
        ids, positions, lengths = chunk_inputs(self.pending, self.position, dev, width)
        return ids, _padded([_joined(c) for c in self.pending_features], width, dev), positions, lengths

    def _queued_consumed(self):
        self.position = [s + len(t) for s, t in zip(self.position, self.pending)]
        self.pending = [[] for _ in self.pending]
        self.pending_features = [[] for _ in self.pending]

    def _propose_chain(self, k, stop_below):
        ids, feats, positions, lengths = self._queued_chunk()
        tokens, conf, self.logits, self.hidden, self.state = self.draft.chain(ids, feats, positions, lengths,
                                                                              self.state, k)
        self._queued_consumed()
        return tokens, None, conf.cpu() if stop_below else None

    def propose(self, k, params, stop_below=0.0, caps=None):
        if self._fused(k, params):
            return self._propose_chain(k, stop_below)
        if any(self.pending):
            self._catch_up()
        dev = self.draft.device
        batch = self.logits.shape[0]
        chain = _Chain(params, self.logits.shape[-1], stop_below, caps)
        token = chain.draw(self.logits)
        one = torch.ones(batch, dtype=torch.int32, device=dev)
        zero = torch.zeros(batch, 1, dtype=torch.int32, device=dev)
        position = torch.tensor(self.position, dtype=torch.int32, device=dev)[:, None]
        hidden = self.hidden
        for i in range(1, k):
            if chain.stopped():
                break
            logits, out, self.state = self.draft.step(token.to(torch.int32)[:, None], None, hidden[:, None],
                                                      position + (i - 1), one, zero, self.state)
            hidden = out[:, 0]
            token = chain.draw(logits[:, 0])
        return chain.result()

    def propose_tree(self, shape: TreeShape, params) -> DraftTree:
        """EAGLE-2 tree growth (``runtime.tree.draft.feature_expand``): one draft forward per depth
        over the frontier nodes. Greedy rows with rows queued grow the whole tree in one
        ``draft.tree_chain`` call (catch-up, every depth and the selection); others step by step."""
        room = next(iter(self.state.values())).shape[1]
        after = max(p + len(t) for p, t in zip(self.position, self.pending))
        if after + shape.draft_rows > room:
            raise ValueError(f"tree: draft cache of {room} slots cannot hold {shape.draft_rows} tree rows "
                             f"past position {after}")
        if hasattr(self.draft, "tree_chain") and self._fusable(params):
            ids, feats, positions, lengths = self._queued_chunk(tree_depth=shape.depth)
            tokens, parents, depth, self.logits, self.hidden, self.state = self.draft.tree_chain(
                ids, feats, positions, lengths, self.state, shape)
            self._queued_consumed()
            return DraftTree(tokens, parents, depth, None)
        if any(self.pending):
            self._catch_up()
        position = torch.tensor(self.position, dtype=torch.long, device=self.draft.device)[:, None]
        expand, front = feature_expand(self.draft.tree_step, self.hidden, position, self.state, shape)
        tree = grow(self.logits, expand, shape, params)
        self.state = front["state"]
        return tree

    def accept(self, accepted, next_tokens, drafts, verify_features):
        """Queues the verified rows (the kept drafts and the target's token, with the verify's
        features); the draft consumes them in one catch-up chunk at its next proposal."""
        kept = accepted.tolist()
        feats = _kept_copy(verify_features[self.draft.feature], kept)
        for b, (d, m, t) in enumerate(zip(drafts.tolist(), kept, next_tokens.tolist())):
            self.pending[b] = self.pending[b] + d[:m] + [t]
            self.pending_features[b].append(feats[b, :m + 1])
