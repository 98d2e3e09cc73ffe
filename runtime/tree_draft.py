"""Growing a token tree from a draft (EAGLE-2's dynamic tree), for one verify of many candidates.

Depth by depth: the ``topk`` most probable nodes of the last depth (the frontier; the root at
first) each get ``topk`` children, the top-k tokens of the draft's distribution at that node; every
child is scored by its cumulative draft log-probability along its root path. A draft kind supplies
the frontier's distributions (``expand``): a chain draft runs one forward over the frontier rows,
a block draft reads its block row at that depth (with DSpark's Markov bias from each node's token).
The tree keeps the ``max_nodes`` best-scored candidates (a child never outranks its parent, so the
kept set is closed under ancestors) and lists them parents first.

Sampled sequences draw a node's children without replacement from the draft's sampling
distribution q (Gumbel top-k, in draw order) and keep candidates in creation order (depth, frontier
rank, draw order) rather than by their own scores: which children a node has then never depends on
their own values, which is what lets :func:`runtime.tree.rejection_accept` keep the target's
distribution exactly. Every sequence of a batch grows the same number of candidates, so a batch's
trees have one size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.sampling import SamplingParams, ban, probabilities


@dataclass(frozen=True)
class TreeShape:
    """The build/serve options of tree speculation (``--max_tree_nodes``, ``--tree_topk``, depth)."""
    max_nodes: int = 16      # drafted nodes per verify, the root excluded
    topk: int = 4            # children per expanded node and nodes expanded per depth
    depth: int = 4           # the deepest node (draft forwards per step: depth - 1 for chain drafts)

    def __post_init__(self):
        if self.max_nodes < 1:
            raise ValueError(f"--max_tree_nodes: expected >= 1, got {self.max_nodes}")
        if self.topk < 1:
            raise ValueError(f"--tree_topk: expected >= 1, got {self.topk}")
        if self.depth < 1:
            raise ValueError(f"tree depth: expected >= 1, got {self.depth}")

    @property
    def draft_rows(self) -> int:
        """Draft KV slots a chain draft's tree steps write past its position (frontiers of depth 1..depth-1)."""
        return (self.depth - 1) * self.topk


@dataclass
class DraftTree:
    """tokens / parents [B, T] (row 0 the root: the last accepted token, parent -1; parents[r] < r),
    depth [B, T], and for sampled sequences ``q`` [B, T, V]: the distribution row r's children were
    drawn from (zero for other rows; None when no sequence samples)."""
    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    q: torch.Tensor | None

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


def _children(logits, params: list[SamplingParams], k: int):
    """logits [B, F, V] -> (tokens [B, F, k], log q [B, F, k], q [B, F, V] or None). Greedy rows: the
    top-k of the softmax; sampled rows: k draws without replacement from the sampling distribution."""
    logits = ban(logits, params)
    logp = torch.log_softmax(logits.float(), -1).cpu()
    top = logp.topk(k, dim=-1)
    tokens, scores = top.indices, top.values
    q = None
    for row, p in enumerate(params):
        if not p.temperature:
            continue
        if q is None:
            q = torch.zeros(logp.shape)
        q[row] = probabilities(logits[row], p.temperature, p.top_p, p.top_k).cpu()
        gumbel = -torch.log(-torch.log(torch.rand(q[row].shape, generator=p.generator).clamp_min(1e-20)))
        keys = torch.log(q[row]) + gumbel                       # top-k of log q + Gumbel: draws without replacement
        draws = keys.topk(k, dim=-1).indices
        tokens[row], scores[row] = draws, torch.log(q[row].gather(-1, draws))
    return tokens, scores, q


def grow(root_logits: torch.Tensor, expand, shape: TreeShape, params: list[SamplingParams]) -> DraftTree:
    """root_logits [B, V] (the draft's distribution after the root); ``expand(tokens [B, F],
    parent [B, F] (each node's parent's index in the previous frontier), depth)`` returns the
    draft's logits [B, F, V] at those nodes. Returns the tree over target ids."""
    batch = root_logits.shape[0]
    k = min(shape.topk, root_logits.shape[-1])
    sampled = torch.tensor([bool(p.temperature) for p in params])
    tokens, parents, scores, depths, qs = [], [], [], [], []   # per candidate, columns [B]
    front_index = torch.full((batch, 1), -1)                    # frontier nodes' candidate indices (-1: root)
    front_score = torch.zeros(batch, 1)
    logits = root_logits[:, None]
    for d in range(1, shape.depth + 1):
        child, logq, q = _children(logits, params, k)            # [B, F, k]
        width = child.shape[1]
        first = len(tokens)
        for f in range(width):
            qs.append(None if q is None else q[:, f])
            for j in range(k):
                tokens.append(child[:, f, j])
                parents.append(front_index[:, f])
                scores.append(front_score[:, f] + logq[:, f, j])
                depths.append(d)
        if d == shape.depth or (bool(sampled.all()) and len(tokens) >= shape.max_nodes):
            break                                                # (sampled trees keep creation order)
        cand = torch.stack(scores[first:], 1)                    # [B, width * k]
        best = cand.topk(min(shape.topk, cand.shape[1]), dim=1).indices
        front_index = first + best
        front_score = cand.gather(1, best)
        parent_in_front = best // k
        logits = expand(torch.stack(tokens[first:], 1).gather(1, best), parent_in_front, d)
    return _select(tokens, parents, scores, depths, qs, shape.max_nodes, sampled, k)


def _select(tokens, parents, scores, depths, qs, max_nodes, sampled, k) -> DraftTree:
    """The kept candidates, as tree rows (root first, then creation order: parents before children)."""
    tokens, parents, scores = torch.stack(tokens, 1), torch.stack(parents, 1), torch.stack(scores, 1)
    batch, n = tokens.shape
    keep = min(max_nodes, n)
    order = torch.arange(n).expand(batch, -1)
    ranked = torch.sort(-scores, dim=1, stable=True).indices     # ties: the earlier candidate (a parent) first
    chosen = torch.where(sampled[:, None], order, ranked)[:, :keep].sort(dim=1).values
    row_of = torch.full((batch, n + 1), -1, dtype=torch.long)    # candidate index (+1; 0 = root) -> tree row
    row_of[:, 0] = 0
    row_of.scatter_(1, chosen + 1, torch.arange(1, keep + 1).expand(batch, -1))
    rows_tokens = tokens.gather(1, chosen)
    rows_parents = row_of.gather(1, parents.gather(1, chosen) + 1)
    assert bool((rows_parents >= 0).all()), "tree selection dropped a kept node's parent"
    depth = torch.tensor(depths)[chosen]
    zero = torch.zeros(batch, 1, dtype=torch.long)
    q = None
    if any(x is not None for x in qs):
        # qs[i] belongs to the i-th node that had children: the root, then each frontier in turn
        vocab = next(x for x in qs if x is not None).shape[-1]
        q = torch.zeros(batch, keep + 1, vocab)
        q[:, 0] = qs[0]
        expanded = _expanded_candidates(parents, k)               # [B, len(qs) - 1] candidate index of each
        for i, cand in enumerate(expanded.unbind(1), start=1):
            if qs[i] is None:
                continue
            r = row_of.gather(1, cand[:, None] + 1)[:, 0]
            has = r > 0
            q[has, r[has]] = qs[i][has]
    return DraftTree(torch.cat([zero, rows_tokens], 1), torch.cat([zero - 1, rows_parents], 1),
                     torch.cat([zero, depth], 1), q)


def _expanded_candidates(parents, k):
    """Candidate indices of the expanded nodes in expansion order: every block of k candidates shares
    a parent, and blocks after the root's are in the order their parents were expanded."""
    return parents[:, k::k]
