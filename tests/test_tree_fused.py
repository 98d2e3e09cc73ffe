"""The fused greedy tree paths against the step-by-step ones they replace: a draft's whole tree in
one call (``tree_chain``, ``block_tree``) grows the trees the per-depth path grows, and the target's
verify + greedy accept + tree rollback in one call (``verify_tree_greedy``) keeps the paths the
separate steps keep, on a ragged batch at several tree shapes; the tensor-only acceptance and
off-chain count equal their host versions on random trees."""
import pytest
import torch

from runtime.drafts import EagerDraft
from runtime.runner import TorchRunner
from runtime.speculative import speculative_generate
from runtime.tree import paths as tree_paths
from runtime.tree.draft import TreeShape
from runtime.tree.group import _off_chain
from speculative_fixtures import runners, target_with_mtp

PROMPTS = [[5, 9, 17, 33, 4, 8, 11], [7], [12, 13, 14], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]
SHAPES = [TreeShape(1, 1, 1), TreeShape(5, 2, 3), TreeShape(16, 4, 4)]
FUSED = {"tree_chain": EagerDraft, "block_tree": EagerDraft, "verify_tree_greedy": TorchRunner}


@pytest.fixture(scope="module")
def pair(checkpoints, tmp_path_factory):
    return runners(target_with_mtp(checkpoints["moe"], tmp_path_factory.mktemp("fused") / "target"))


def _trees(target, proposer, shape, monkeypatch, fused: bool):
    """Output ids and every tree step's (step, sequence, tree tokens, parents, accepted path); with
    ``fused`` the fused calls must have run, without it they are removed."""
    calls = []
    for name, owner in FUSED.items():
        if fused:
            original = getattr(owner, name)
            monkeypatch.setattr(owner, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
        else:
            monkeypatch.delattr(owner, name)
    records = []
    out = speculative_generate(target, proposer, PROMPTS, 24, shape.depth, tree=shape, trace=records.append)
    monkeypatch.undo()
    steps = [(r["step"], r["sequence"], tuple(r["tree_tokens"]), tuple(r["tree_parents"]), tuple(r["accepted_path"]))
             for r in records if "tree_parents" in r]
    assert steps, "no tree step ran"
    return out.output_ids, steps, set(calls)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.max_nodes}n{s.topk}k{s.depth}d")
@pytest.mark.parametrize("mode", ["eagle3", "eagle", "mtp", "dflash", "dspark"])
def test_fused_tree_steps_grow_and_keep_what_the_step_by_step_path_does(mode, shape, pair, monkeypatch):
    target, proposer = pair
    want_ids, want_steps, _ = _trees(target, proposer(mode), shape, monkeypatch, fused=False)
    ids, steps, calls = _trees(target, proposer(mode), shape, monkeypatch, fused=True)
    assert ids == want_ids and steps == want_steps
    assert calls == {"verify_tree_greedy", "block_tree" if mode in ("dflash", "dspark") else "tree_chain"}


def _random_tree(g, batch, size, vocab):
    """parents [B, T] (each row's parent drawn among the earlier rows), tokens [B, T], and each row's
    target argmax [B, T]: often a child's token, so accepted paths of every depth occur."""
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, r, (), generator=g)) for r in range(1, size)])
                           for _ in range(batch)])
    tokens = torch.randint(0, vocab, (batch, size), generator=g)
    best = torch.randint(0, vocab, (batch, size), generator=g)
    for b in range(batch):
        for r in range(size):
            kids = [c for c in range(size) if int(parents[b, c]) == r]
            if kids and float(torch.rand((), generator=g)) < 0.8:
                best[b, r] = tokens[b, kids[int(torch.randint(0, len(kids), (), generator=g))]]
    return parents, tokens, best


def test_tensor_greedy_path_equals_greedy_accept_on_random_trees():
    """Fixed-level ancestors and greedy_path (the fused verify's acceptance) against the host
    versions (ancestors with its early stop, greedy_accept), padded to the fixed width."""
    g = torch.Generator().manual_seed(3)
    lengths_seen = set()
    for size in (1, 2, 5, 17):
        parents, tokens, best = _random_tree(g, 6, size, 7)
        anc = tree_paths.ancestors(parents)
        depth = int(anc.sum(-1).max()) - 1
        fixed = tree_paths.ancestors(parents, depth + 2)                 # more levels than needed change nothing
        assert torch.equal(tree_paths.ancestors(parents, depth), anc) and torch.equal(fixed, anc)
        logits = torch.nn.functional.one_hot(best, 7).float()
        want_paths, want_lengths, want_bonus = tree_paths.greedy_accept(tokens, parents, logits)
        width = depth + 3
        paths, lengths, bonus = tree_paths.greedy_path(tokens, parents, best, anc, width)
        padded = torch.cat([want_paths, want_paths[:, -1:].expand(-1, width - want_paths.shape[1])], 1)
        assert torch.equal(paths, padded) and torch.equal(lengths, want_lengths) and torch.equal(bonus, want_bonus)
        lengths_seen |= set(lengths.tolist())
    assert len(lengths_seen) >= 3


def _off_chain_loop(parents, paths, lengths) -> int:
    """The count as first written: per sequence, per accepted row, in Python."""
    count = 0
    for b in range(parents.shape[0]):
        first = {}
        for r, p in enumerate(parents[b].tolist()[1:], start=1):
            first.setdefault(p, r)
        rows = paths[b, 1:int(lengths[b])].tolist()
        count += any(first[int(parents[b, r])] != r for r in rows)
    return count


def test_off_chain_count_equals_the_row_by_row_count():
    g = torch.Generator().manual_seed(5)
    counts = []
    for size in (1, 4, 17):
        for _ in range(4):
            parents, tokens, best = _random_tree(g, 5, size, 3)
            anc = tree_paths.ancestors(parents)
            paths, lengths, _ = tree_paths.greedy_path(tokens, parents, best, anc, size)
            counts.append(_off_chain_loop(parents, paths, lengths))
            assert _off_chain(parents, paths, lengths) == counts[-1]
    assert max(counts) > 0 and min(counts) == 0
