"""Token trees for speculation: the structure a tree verify takes, and greedy acceptance on it.

A tree of T rows: row 0 the root (the last accepted token), ``parents[b, r] < r`` for the others.
Greedy acceptance keeps the deepest row whose every token along the root path equals the target's
argmax at its parent (the longest agreeing path; the first such row among equals), then the bonus
token is the target's argmax at that row: exactly what greedy decoding would have produced.
"""
from __future__ import annotations

import torch


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, T] -> [B, T, T] bool: [b, i, j] when row j is row i or an ancestor of it."""
    batch, seq = parents.shape
    out = torch.zeros(batch, seq, seq, dtype=torch.bool)
    out[:, 0, 0] = True
    rows = torch.arange(batch)
    for r in range(1, seq):
        out[:, r] = out[rows, parents[:, r].long()]
        out[:, r, r] = True
    return out


def depths(parents: torch.Tensor) -> torch.Tensor:
    return ancestors(parents).sum(-1) - 1


def path_to(parents: torch.Tensor, node: torch.Tensor, length: int) -> torch.Tensor:
    """[B, length] rows of the root path ending at ``node`` [B], root first, padded with the node."""
    out = []
    for b, n in enumerate(node.tolist()):
        path = [n]
        while path[-1] != 0:
            path.append(int(parents[b, path[-1]]))
        path.reverse()
        out.append(path + [path[-1]] * (length - len(path)))
    return torch.tensor(out, dtype=torch.long)


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor):
    """tokens [B, T] (row 0 the root's token), logits [B, T, V] of the tree verify ->
    (paths [B, D+1] root first, path lengths [B], bonus token [B])."""
    batch, seq = tokens.shape
    best = logits.argmax(-1)                                # [B, T]
    rows = torch.arange(batch)
    ok = torch.zeros(batch, seq, dtype=torch.bool)
    ok[:, 0] = True
    for r in range(1, seq):
        parent = parents[:, r].long()
        ok[:, r] = ok[rows, parent] & (tokens[:, r] == best[rows, parent])
    d = depths(parents)
    score = torch.where(ok, d, -1)
    node = score.argmax(-1)                                 # deepest agreeing row (first among equals)
    lengths = d[rows, node] + 1
    return path_to(parents, node, int(d.max()) + 1), lengths, best[rows, node]
