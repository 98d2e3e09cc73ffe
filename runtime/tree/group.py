"""Tree speculation: each step verifies a token tree in one target forward instead of a chain.

The draft grows a tree (``runtime.tree.draft``); the target scores every node along its own root
path (``NemotronH.forward(..., tree=...)``: tree attention mask, Mamba scan and conv along ancestor
paths); acceptance keeps the longest agreeing root path (greedy) or walks the tree by recursive
rejection sampling (``runtime.tree.paths``); the target's state is rolled back to that path
(``tree_rollback``: Mamba states from the path's kept inputs, attention rows compacted into place).
The draft is then told what was kept exactly as after a chain step (the path's tokens and the
target's features along it), so every proposer's catch-up works unchanged.

A step that cannot grow a full tree (the cache is nearly full, a request asked for fewer draft
tokens than the tree is deep, the policy turned speculation off) runs as a chain or target-only
step: exactness never depends on which kind of step ran.
"""
from __future__ import annotations

from collections import Counter

import torch

from runtime.batching import SpeculativeGroup, _logprobs
from runtime.logits_shaping import shape_tree
from runtime.step_costs import Stopwatch
from runtime.tree import paths as tree_paths
from runtime.tree.draft import DraftTree, TreeShape


class TreeSpeculativeGroup(SpeculativeGroup):
    """A SpeculativeGroup whose steps verify token trees of ``shape``."""

    def __init__(self, target, make_proposer, shape: TreeShape, capacity: int, prefill_chunk: int = 512,
                 policy=None, trace=None):
        if not hasattr(target, "tree_rollback"):
            raise ValueError("--tree: this backend's target cannot verify token trees; use --backend torch or compiled")
        super().__init__(target, make_proposer, shape.depth, capacity, prefill_chunk, policy, trace)
        self.step_costs = None             # --draft_len_adaptive: trees keep their shape, and their chain steps the K
        self.position_factors = None
        self.shape = shape
        self.tree_sizes = Counter()        # verify rows (root included) per tree step
        self.path_depths = Counter()       # accepted drafted tokens per sequence per tree step
        self.off_chain = 0                 # accepted paths that took a node other than its parent's first child

    def _tree_fits(self) -> bool:
        room = self.capacity - max(s.position for s in self.seqs)
        return (room > self.shape.max_nodes + 1 and room > self.shape.draft_rows + 1
                and all(s.max_draft is None or s.max_draft >= self.shape.depth for s in self.seqs)
                and self.policy.k_for_batch(len(self.seqs)) >= self.shape.depth)

    def step(self):
        if self._draft_len() == 0 or not self._tree_fits():
            return super().step()
        watch = Stopwatch()
        dev = self.target.device
        n = len(self.seqs)
        params = [s.params for s in self.seqs]
        tree = self.proposer.propose_tree(self.shape, params)
        draft = watch.lap()
        size = tree.size
        rows = torch.arange(size, dtype=torch.int32, device=dev)
        tokens, parents = tree.tokens.cpu().clone(), tree.parents.cpu()     # (host copies: emitting needs them)
        tokens[:, 0] = torch.tensor([s.last for s in self.seqs])
        base = torch.tensor([s.position for s in self.seqs], dtype=torch.int32, device=dev)
        ids, positions = tokens.to(device=dev, dtype=torch.int32), base[:, None] + rows
        watch.lap()
        if hasattr(self.target, "verify_tree_greedy") and all(p.plain_greedy for p in params):
            # plain greedy rows: verify, accept and roll back in one call (accept time is in verify)
            paths, lengths, bonus, logits, self.state, features = self.target.verify_tree_greedy(
                ids, positions, self.state, parents.to(dev), base.long(), self.shape.depth)
            paths, lengths, bonus = paths.cpu(), lengths.cpu(), bonus.cpu()
            verify, accept, raw = watch.lap(), 0.0, None   # unshaped: the raw rows themselves
        else:
            anc = tree_paths.ancestors(parents)
            raw, verified, features = self.target.forward(
                ids, positions, torch.full((n,), size, dtype=torch.int32, device=dev), rows.expand(n, -1), self.state,
                verify=True, tree=(parents.to(dev), anc.to(dev)))
            verify = watch.lap()
            depth = tree.depth.cpu()
            logits = shape_tree(raw, self.seqs, tokens, parents, depth)
            paths, lengths, bonus = tree_paths.accept(DraftTree(tokens, parents, depth, tree.q), logits, params, anc)
            width = self.shape.depth + 1                                        # one path width per shape
            if paths.shape[1] < width:
                paths = torch.cat([paths, paths[:, -1:].expand(-1, width - paths.shape[1])], 1)
            self.state = self.target.tree_rollback(self.state, verified, paths.to(dev), lengths.to(dev), base.long())
            accept = watch.lap()
        kept = lengths - 1
        self.off_chain += _off_chain(parents, paths, lengths)
        path_tokens = tokens.gather(1, paths)[:, 1:]                           # [B, D]: drafted tokens on the path
        along = {k: _gather_path(v, paths) for k, v in features.items()}
        self.proposer.accept(kept, bonus, path_tokens, along)
        draft += watch.lap()
        self.verifies += 1
        self.forwards += 1
        self.steps += 1
        self.draft_lens[self.shape.depth] += 1
        self.tree_sizes[size] += 1
        out, emitted = [], 0
        want_logprobs = any(p.logprobs for p in params)
        for b, (s, d, m, t) in enumerate(zip(self.seqs, path_tokens.tolist(), kept.tolist(), bonus.tolist())):
            gained = d[:m] + [t]
            lp = None
            if want_logprobs:
                rows_b = paths[b, :m + 1]
                lp = _logprobs(logits[b:b + 1, rows_b], torch.tensor([gained]), [s],
                               None if raw is None else raw[b:b + 1, rows_b])[0]
            s.gained[len(gained)] += 1
            s.drafted += size - 1          # every drafted node was proposed and verified
            self.histogram[len(gained)] += 1
            self.path_depths[m] += 1
            self.draft_tokens += size - 1
            for j in range(m):
                self.accepted_at[j] += 1
            s.acceptance.record(m, self.shape.depth)   # the policy's rate is per path, as a chain's
            out.append(s.emit(gained, lp))
            emitted += len(out[-1])       # emitted: a run past max_new_tokens or an end id is cut
            if self.trace is not None:
                self._trace(s, size - 1, d[:m], m, t, out[-1], draft, verify, tree_parents=parents[b].tolist(),
                            tree_tokens=tokens[b].tolist(), accepted_path=paths[b, :m + 1].tolist())
            s.position, s.last = s.position + len(gained), t
        self.costs.add(watch.total(), tokens=emitted, rows=n, proposals=n * (size - 1), draft=draft,
                       verify=verify, accept=accept)
        return out


def _off_chain(parents, paths, lengths) -> int:
    """How many accepted paths pass through a node that is not its parent's first child (the draft's
    top choice there): what a chain of the draft's top choices would have missed."""
    later = (parents[:, :, None] == parents[:, None, :]).tril(-1).any(-1)      # a sibling comes before the row
    taken = torch.arange(1, paths.shape[1]) < lengths[:, None]                # accepted path rows
    return int((later.gather(1, paths[:, 1:]) & taken).any(1).sum())


def _gather_path(feature: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
    """Rows [B, T, ...] of a tree verify's feature -> [B, D+1, ...] along each accepted path."""
    index = paths.to(feature.device).reshape(paths.shape + (1,) * (feature.dim() - 2))
    return feature.gather(1, index.expand(paths.shape + feature.shape[2:]))
