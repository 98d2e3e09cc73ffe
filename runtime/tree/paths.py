"""Token trees for speculation: the structure a tree verify takes, and greedy acceptance on it.

A tree of T rows: row 0 the root (the last accepted token), ``parents[b, r] < r`` for the others.
Greedy acceptance keeps the deepest row whose every token along the root path equals the target's
argmax at its parent (the longest agreeing path; the first such row among equals), then the bonus
token is the target's argmax at that row: exactly what greedy decoding would have produced.
"""
from __future__ import annotations

import torch


def ancestors(parents: torch.Tensor, levels: int | None = None) -> torch.Tensor:
    """parents [B, T] -> [B, T, T] bool: [b, i, j] when row j is row i or an ancestor of it (one
    gather per tree level: every row climbs one step at a time). ``levels``: the tree's depth when
    the shape fixes it; then exactly that many gathers and no host check (a compiled graph's form)."""
    batch, seq = parents.shape
    up = parents.long().clamp_min(0)                                  # the root is its own parent here
    node = torch.arange(seq, device=parents.device).expand(batch, -1)
    out = torch.zeros(batch, seq, seq, dtype=torch.bool, device=parents.device)
    out.scatter_(2, node[..., None], True)
    for _ in range(seq - 1 if levels is None else levels):
        node = up.gather(1, node)
        out.scatter_(2, node[..., None], True)
        if levels is None and not bool(node.any()):                   # every row reached the root
            break
    return out


def depths(parents: torch.Tensor) -> torch.Tensor:
    return ancestors(parents).sum(-1) - 1


def path_to(parents: torch.Tensor, node: torch.Tensor, length: int, anc: torch.Tensor | None = None) -> torch.Tensor:
    """[B, length] rows of the root path ending at ``node`` [B], root first, padded with the node."""
    anc = ancestors(parents) if anc is None else anc
    batch, seq = parents.shape
    on_path = anc.gather(1, node.long()[:, None, None].expand(-1, 1, seq))[:, 0]   # [B, T]: rows on the path
    rows = torch.arange(seq, device=parents.device).expand(batch, -1)
    ordered = torch.where(on_path, rows, seq).sort(dim=1).values[:, :length]
    if ordered.shape[1] < length:
        ordered = torch.cat([ordered, ordered.new_full((batch, length - ordered.shape[1]), seq)], 1)
    return torch.where(ordered < seq, ordered, node.long()[:, None])


def greedy_path(tokens: torch.Tensor, parents: torch.Tensor, best: torch.Tensor, anc: torch.Tensor, width: int):
    """Greedy acceptance in tensor ops only (no host sync, fixed shapes: one graph per tree shape).
    tokens, parents [B, T]; best [B, T] the target's argmax per row; ``width`` >= the tree's depth + 1.
    Returns (paths [B, width] root first, padded with the last row; lengths [B]; bonus [B])."""
    rows = torch.arange(tokens.shape[1], device=tokens.device)
    match = (tokens.long() == best.gather(1, parents.long().clamp_min(0))) | (rows == 0)  # agrees with its parent's argmax
    ok = ~(anc & ~match[:, None, :]).any(-1)                          # every row on the path agrees
    d = anc.sum(-1) - 1
    node = torch.where(ok, d, -1).argmax(-1)                          # deepest agreeing row (first among equals)
    lengths = d.gather(1, node[:, None])[:, 0] + 1
    return path_to(parents, node, width, anc), lengths, best.gather(1, node[:, None])[:, 0]


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, anc: torch.Tensor | None = None):
    """tokens [B, T] (row 0 the root's token), logits [B, T, V] of the tree verify ->
    (paths [B, D+1] root first, path lengths [B], bonus token [B]). ``anc``: ancestors(parents)."""
    anc = ancestors(parents) if anc is None else anc
    return greedy_path(tokens.cpu(), parents, logits.argmax(-1).cpu(), anc, int(anc.sum(-1).max()))


def rejection_accept(tokens, parents, q, logits, params):
    """Recursive rejection sampling down one sampled sequence's tree (SpecInfer's multi-candidate
    verification, with children drawn without replacement). At an accepted node with target
    distribution p, its children c_1, c_2, ... (drawn in that order from q, each without the earlier
    ones) are tried in turn: c_i is kept with probability min(1, p(c_i) / q_i(c_i)); after a rejection
    p becomes norm(max(p - q_i, 0)) and q_{i+1} is q_i without c_i, renormalised. When every child
    is rejected (or there is none) the token is drawn from p. The emitted tokens are distributed as
    sampling from the target.

    tokens, parents [T]; q [T, V] (each row's children's distribution); logits [T, V]. Returns (the
    accepted path's rows, root first; the token drawn after it)."""
    from runtime.sampling import probabilities
    children = [[] for _ in range(tokens.shape[0])]
    for r in range(1, tokens.shape[0]):
        children[int(parents[r])].append(r)
    node, path = 0, [0]
    while True:
        p = probabilities(logits[node], params.temperature, params.top_p, params.top_k).cpu()
        qi = q[node].clone()
        kept = None
        for c in children[node]:
            t = int(tokens[c])
            u = float(torch.rand((), generator=params.generator))
            if u * float(qi[t]) < float(p[t]):
                kept = c
                break
            residual = torch.clamp(p - qi, min=0)
            if float(residual.sum()) > 0:
                p = residual / residual.sum()
            qi[t] = 0
            if float(qi.sum()) <= 0:
                break
            qi = qi / qi.sum()
        if kept is None:
            return path, int(torch.multinomial(p, 1, generator=params.generator)[0])
        node = kept
        path.append(node)


def accept(tree, logits, params, anc=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence: greedy acceptance, or recursive rejection sampling with its own settings.
    Returns (paths [B, D+1] tree rows root first, padded with the last; lengths [B]; bonus [B])."""
    paths, lengths, bonus = greedy_accept(tree.tokens, tree.parents, logits, anc)
    sampled = [b for b, p in enumerate(params) if p.temperature]
    if not sampled:
        return paths, lengths, bonus
    rows = {b: rejection_accept(tree.tokens[b], tree.parents[b], tree.q[b], logits[b].float(), params[b])
            for b in sampled}
    width = max([paths.shape[1]] + [len(r[0]) for r in rows.values()])
    paths = torch.cat([paths, paths[:, -1:].expand(-1, width - paths.shape[1])], 1)
    for b, (path, token) in rows.items():
        paths[b] = torch.tensor(path + [path[-1]] * (width - len(path)))
        lengths[b], bonus[b] = len(path), token
    return paths, lengths, bonus
