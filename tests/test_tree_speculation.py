"""Tree speculation end to end: greedy trees equal target-only greedy for every draft kind that
grows trees, at every tree size; a draft's tree step scores each node as its own chain would;
tree growth keeps the best-scored, ancestor-closed set; recursive rejection sampling over a tree
keeps the target's distribution (with controls that fail)."""
import pytest
import torch

from runtime.batching import PlainGroup, Sequence
from runtime.generation import generate, run_group
from runtime.sampling import SamplingParams
from runtime.speculative import speculative_generate
from runtime.tree import paths as tree_paths
from runtime.tree.draft import TreeShape, grow
from runtime.tree.group import TreeSpeculativeGroup
from speculative_fixtures import assert_greedy_margin, chi_square_p, runners, target_with_mtp
from tolerances import assert_within

PROMPTS = [[5, 9, 17, 33, 4, 8, 11], [7], [12, 13, 14], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [3, 60]]
TREE_MODES = ["mtp", "eagle", "eagle3", "dflash", "dspark", "peagle", "dspark_nvfp4"]
SHAPES = [TreeShape(1, 1, 1), TreeShape(5, 2, 3), TreeShape(16, 4, 4)]


@pytest.fixture(scope="module")
def pair(checkpoints, tmp_path_factory):
    target_dir = target_with_mtp(checkpoints["moe"], tmp_path_factory.mktemp("tree") / "target")
    return runners(target_dir)


@pytest.fixture(scope="module")
def reference(pair):
    target, _ = pair
    out = generate(target, PROMPTS, 40).output_ids
    assert_greedy_margin(target, PROMPTS, out)
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.max_nodes}n{s.topk}k{s.depth}d")
@pytest.mark.parametrize("mode", TREE_MODES)
def test_greedy_tree_speculation_equals_target_greedy(mode, shape, pair, reference):
    target, proposer = pair
    result = speculative_generate(target, proposer(mode), PROMPTS, 40, shape.depth, tree=shape)
    assert result.output_ids == reference
    stats = result.extra["acceptance"]["tree"]
    assert stats["steps_by_size"], "no tree step ran"
    assert set(stats["steps_by_size"]) <= {str(n) for n in range(2, shape.max_nodes + 2)}
    if shape.max_nodes >= 16:
        assert max(int(s) for s in stats["steps_by_size"]) == shape.max_nodes + 1


def test_trees_accept_paths_a_chain_would_miss(pair, reference):
    """With a 16-node tree, some accepted paths go through a node that is not the draft's top choice,
    and the tree accepts at least as much as the chain of those top choices on the same prompts."""
    target, proposer = pair
    chain = speculative_generate(target, proposer("eagle3"), PROMPTS, 40, 4).extra["acceptance"]
    tree = speculative_generate(target, proposer("eagle3"), PROMPTS, 40, 4, tree=TreeShape(16, 4, 4)).extra["acceptance"]
    assert tree["tree"]["accepted_off_chain"] > 0
    assert tree["mean_accepted_tokens"] > chain["mean_accepted_tokens"]


def test_greedy_tree_with_penalties_equals_target_only(pair):
    """Repetition and presence penalties shape each tree row with its own root path's history."""
    target, proposer = pair
    params = SamplingParams(repetition_penalty=1.4, presence_penalty=0.3)
    want = run_group(PlainGroup(target, 80), PROMPTS[:3], 30, params)
    group = TreeSpeculativeGroup(target, lambda: proposer("eagle3"), TreeShape(8, 2, 4), 80)
    got = run_group(group, PROMPTS[:3], 30, params)
    assert [s.outputs for s in got] == [s.outputs for s in want]
    assert group.tree_sizes


def test_greedy_tree_with_a_bad_word_equals_target_only(pair, reference):
    """A two-token bad word bans its second token in every tree row whose root path ends with its
    first: the tree's output equals target-only decoding with the same ban."""
    target, proposer = pair
    word = tuple(reference[0][2:4])
    params = SamplingParams(bad_sequences=(word,))
    want = run_group(PlainGroup(target, 80), PROMPTS[:3], 30, params)
    assert [s.outputs for s in want][0] != reference[0][:30]
    group = TreeSpeculativeGroup(target, lambda: proposer("eagle3"), TreeShape(8, 2, 4), 80)
    got = run_group(group, PROMPTS[:3], 30, params)
    assert [s.outputs for s in got] == [s.outputs for s in want] and group.tree_sizes


@pytest.mark.parametrize("mode", ["eagle3", "eagle", "mtp"])
def test_draft_tree_step_scores_each_node_as_its_own_chain(mode, pair):
    """Two frontier nodes with different parents, fed in one tree step, get the logits the chain
    draft gives after each node's own path (attention sees only its ancestors' slots)."""
    target, proposer = pair
    prop = proposer(mode)
    inner = getattr(prop, "inner", prop)
    prompt = [5, 9, 17, 33, 4]
    _start(target, prop, prompt)
    draft, state0 = inner.draft, {k: v.clone() for k, v in inner.state.items()}
    position = inner.position[0]
    root_hidden = inner.hidden
    # chains: [a] then [a, c] and [b] then [b, d]
    a, b, c, d = 3, 4, 5, 6
    one = torch.ones(1, dtype=torch.int32)
    zero = torch.zeros(1, 1, dtype=torch.int32)
    want = []
    for first, second in ((a, c), (b, d)):
        st = {k: v.clone() for k, v in state0.items()}
        _, h1, st = draft.step(torch.tensor([[first]], dtype=torch.int32), None, root_hidden[:, None],
                               torch.tensor([[position]], dtype=torch.int32), one, zero, st)
        logits, _, _ = draft.step(torch.tensor([[second]], dtype=torch.int32), None, h1,
                                  torch.tensor([[position + 1]], dtype=torch.int32), one, zero, st)
        want.append(logits[0, 0])
    # the tree: depth 1 frontier [a, b] at slots position, position + 1; depth 2 frontier [c, d]
    st = {k: v.clone() for k, v in state0.items()}
    slots_all = torch.arange(next(iter(st.values())).shape[1])
    committed = slots_all < position
    vis1 = committed.expand(1, 2, -1).clone()
    vis1[0, 0, position], vis1[0, 1, position + 1] = True, True
    _, h, st = draft.tree_step(torch.tensor([[a, b]], dtype=torch.int32), root_hidden[:, None].expand(-1, 2, -1),
                               torch.full((1, 2), position, dtype=torch.int32),
                               torch.tensor([[position, position + 1]], dtype=torch.int32), vis1, st)
    vis2 = vis1.clone()
    vis2[0, 0, position + 2], vis2[0, 1, position + 3] = True, True
    logits, _, _ = draft.tree_step(torch.tensor([[c, d]], dtype=torch.int32), h,
                                   torch.full((1, 2), position + 1, dtype=torch.int32),
                                   torch.tensor([[position + 2, position + 3]], dtype=torch.int32), vis2, st)
    finite = torch.isfinite(want[0])                         # a draft vocabulary maps to target ids, -inf elsewhere
    for node in range(2):
        assert torch.equal(torch.isfinite(logits[0, node]), finite)
        w = want[node][finite]
        assert_within(logits[0, node][finite], w, 1e-4 * (1 + float(w.abs().max())), f"{mode} node {node}")
    assert (logits[0, 0][finite] - want[1][finite]).abs().max() > 1e-3   # the two paths differ: the check has power


def _prefill_args(prompt):
    from runtime.state import chunk_inputs
    ids, positions, lengths = chunk_inputs([prompt], [0])
    return ids, positions, lengths, (lengths - 1)[:, None].int()


def _start(target, prop, prompt):
    logits, _, features = target.forward(*_prefill_args(prompt), target.new_state(1, 32))
    prop.start([prompt], [int(logits[0, 0].argmax())], features, 32)


def _synthetic_expand(vocab, seed):
    """Draft logits that depend on (depth, token): a deterministic table."""
    table = torch.randn(8, vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 2

    def expand(tokens, parent, depth):
        return table[depth][tokens]
    return expand


def test_grow_keeps_the_best_scored_ancestor_closed_nodes():
    vocab, shape = 12, TreeShape(max_nodes=9, topk=3, depth=3)
    root = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1)) * 2
    expand = _synthetic_expand(vocab, 2)
    t = grow(root, expand, shape, [SamplingParams(), SamplingParams()])
    assert t.tokens.shape == (2, 10) and t.q is None
    for b in range(2):
        parents = t.parents[b].tolist()
        assert parents[0] == -1 and all(0 <= p < r for r, p in enumerate(parents) if r)
        # brute force: every depth-d candidate that EAGLE-2 could have produced, scored along its path
        logp = lambda logits: torch.log_softmax(logits, -1)  # noqa: E731
        score = {}
        for r in range(1, 10):
            path = tree_paths.path_to(t.parents[b:b + 1], torch.tensor([r]), 4)[0].tolist()
            path = list(dict.fromkeys(path))
            s, prev = 0.0, None
            for depth, row in enumerate(path[1:], start=1):
                dist = root[b] if depth == 1 else expand(torch.tensor([[prev]]), None, depth - 1)[0, 0]
                tok = int(t.tokens[b, row])
                s += float(logp(dist)[tok])
                prev = tok
            score[r] = s
            assert int(t.depth[b, r]) == len(path) - 1
        # root's children are among its top-3 tokens (the best one always kept), and the kept nodes
        # outscore every candidate left out
        kids = t.tokens[b, [r for r, p in enumerate(parents) if p == 0]].tolist()
        top = root[b].topk(3).indices.tolist()
        assert set(kids) <= set(top) and top[0] in kids
        assert min(score.values()) >= _best_left_out(root[b], expand, shape, set(score.values())) - 1e-5


def _best_left_out(root, expand, shape, kept_scores):
    """Best score among EAGLE-2's candidates that the tree did not keep (-inf if none)."""
    cands = []
    logq = torch.log_softmax(root, -1)
    front = [(0.0, None)]
    for depth in range(1, shape.depth + 1):
        level = []
        for s, tok in front:
            dist = logq if tok is None else torch.log_softmax(expand(torch.tensor([[tok]]), None, depth - 1)[0, 0], -1)
            top = dist.topk(shape.topk)
            level += [(s + float(v), int(i)) for v, i in zip(top.values, top.indices)]
        cands += level
        front = sorted(level, key=lambda x: -x[0])[:shape.topk]
    left = sorted((s for s, _ in cands), reverse=True)[len(kept_scores):]
    return left[0] if left else float("-inf")


def test_sampled_children_are_distinct_draws_in_creation_order():
    vocab = 10
    g = torch.Generator().manual_seed(4)
    t = grow(torch.randn(1, vocab), _synthetic_expand(vocab, 5), TreeShape(6, 3, 3),
             [SamplingParams(temperature=1.0, generator=g)])
    parents = t.parents[0].tolist()
    assert parents == sorted(parents)                     # creation order: parents before children, in rank
    for p in set(parents[1:]):
        kids = [int(t.tokens[0, r]) for r, q in enumerate(parents) if q == p and r]
        assert len(kids) == len(set(kids))                # without replacement
        assert float(t.q[0, p].sum()) == pytest.approx(1.0, abs=1e-5)


def _toy_tree(g, vocab, children):
    """A root with ``children`` children drawn without replacement from q, and the target logits."""
    q = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1)
    p_logits = torch.randn(1 + children, vocab, generator=g) * 1.5
    return q, p_logits


def test_recursive_rejection_over_siblings_is_distributed_as_the_target():
    """The first emitted token after a root with 3 sampled children, 20k draws: chi-square against p.
    Controls: trying every sibling against the unchanged p, or drawing siblings with replacement but
    updating q as without, are both caught."""
    vocab, children, n = 6, 3, 20000
    g = torch.Generator().manual_seed(0)
    q, p_logits = _toy_tree(g, vocab, children)
    params = SamplingParams(temperature=1.0, generator=g)
    p = torch.softmax(p_logits[0], -1)
    counts = {"right": torch.zeros(vocab), "no_residual": torch.zeros(vocab)}
    parents = torch.tensor([-1] + [0] * children)
    for _ in range(n):
        draws = torch.multinomial(q, children, replacement=False, generator=g)
        tokens = torch.cat([torch.zeros(1, dtype=torch.long), draws])
        qs = torch.zeros(1 + children, vocab)
        qs[0] = q
        path, bonus = tree_paths.rejection_accept(tokens, parents, qs, p_logits, params)
        counts["right"][int(tokens[path[1]]) if len(path) > 1 else bonus] += 1
        counts["no_residual"][_no_residual(draws, q, p, g)] += 1
    pvalue, dof = chi_square_p(counts["right"].long(), p)
    assert dof >= 3 and pvalue > 1e-3, pvalue
    wrong, _ = chi_square_p(counts["no_residual"].long(), p)
    assert wrong < 1e-6, wrong


def _no_residual(draws, q, p, g):
    """A wrong scheme: each sibling tried against the original p and q."""
    for t in draws.tolist():
        if float(torch.rand((), generator=g)) * float(q[t]) < float(p[t]):
            return t
    return int(torch.multinomial(p, 1, generator=g)[0])


@pytest.mark.parametrize("mode", ["eagle3", "dspark"])
def test_tree_sampling_preserves_the_target_distribution(mode, pair, monkeypatch):
    """The 2nd generated token (the first a tree proposes) of 2500 seeded tree-speculative samples
    against the exact target marginal; a walker that always takes the first child is caught."""
    from test_speculative import _second_token_marginal
    target, proposer = pair
    prompt, temperature, n = [5, 9, 17], 1.3, 2500
    marginal = _second_token_marginal(target, prompt, temperature)
    shape = TreeShape(6, 3, 2)
    result = speculative_generate(target, proposer(mode), [prompt] * n, 3, 2, temperature=temperature, seed=11, tree=shape)
    second = torch.tensor([o[1] for o in result.output_ids])
    pvalue, dof = chi_square_p(torch.bincount(second, minlength=marginal.shape[0]), marginal)
    assert dof >= 5 and pvalue > 1e-3, (pvalue, dof)
    assert result.extra["acceptance"]["tree"]["steps_by_size"]

    def first_child(tokens, parents, q, logits, params):
        path = [0]
        while True:
            kids = [r for r in range(1, tokens.shape[0]) if int(parents[r]) == path[-1]]
            if not kids:
                break
            path.append(kids[0])
        p = torch.softmax(logits[path[-1]] / params.temperature, -1)
        return path, int(torch.multinomial(p, 1, generator=params.generator)[0])

    monkeypatch.setattr(tree_paths, "rejection_accept", first_child)
    biased = speculative_generate(target, proposer(mode), [prompt] * n, 3, 2, temperature=temperature, seed=11, tree=shape)
    second = torch.tensor([o[1] for o in biased.output_ids])
    pvalue, _ = chi_square_p(torch.bincount(second, minlength=marginal.shape[0]), marginal)
    assert pvalue < 1e-6


@pytest.fixture(scope="module")
def model_pair(checkpoints, tmp_path_factory):
    """The moe target with a draft_target draft (its own NemotronH: noisy copies of its layers)."""
    from speculative_fixtures import layer_subset_draft
    target_dir = checkpoints["moe"]
    target, proposer = runners(target_dir, layer_subset_draft(target_dir, tmp_path_factory.mktemp("tree_model") / "d"))
    return target, lambda: proposer("draft_target")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.max_nodes}n{s.topk}k{s.depth}d")
def test_draft_target_trees_equal_target_greedy(shape, model_pair):
    """A draft_target draft grows trees by one tree forward of its own per depth (each node's Mamba
    state along its own ancestor path, its committed state untouched): ragged batch, every shape,
    output equal to target-only greedy, and the tree accepts paths its top-1 chain would miss."""
    target, proposer = model_pair
    want = generate(target, PROMPTS, 40).output_ids
    assert_greedy_margin(target, PROMPTS, want)
    result = speculative_generate(target, proposer(), PROMPTS, 40, shape.depth, tree=shape)
    assert result.output_ids == want
    stats = result.extra["acceptance"]
    assert stats["tree"]["steps_by_size"], "no tree step ran"
    if shape.max_nodes >= 16:
        chain = speculative_generate(target, proposer(), PROMPTS, 40, shape.depth).extra["acceptance"]
        assert stats["tree"]["accepted_off_chain"] > 0
        assert stats["mean_accepted_tokens"] > chain["mean_accepted_tokens"]


def test_draft_target_tree_then_chain_and_target_only_steps(model_pair):
    """Tree steps, chain steps (a request's own K under the depth) and target-only steps (the
    batch-size schedule) interleave on one draft_target draft: its queue of unconsumed tokens
    carries across them, and the output stays the target's."""
    from runtime.draft_policy import DraftPolicy
    target, proposer = model_pair
    want = [generate(target, [PROMPTS[0]], 40).output_ids[0], generate(target, [PROMPTS[1]], 8).output_ids[0]]
    group = TreeSpeculativeGroup(target, proposer, TreeShape(6, 2, 3), 80, policy=DraftPolicy(3, schedule={1: 3, 2: 0}))
    seqs = [Sequence(list(PROMPTS[0]), 40), Sequence(list(PROMPTS[1]), 8)]
    group.add(seqs)
    kinds = []
    while not seqs[0].finished:
        before = (group.target_only_steps, sum(group.tree_sizes.values()))
        group.step()
        after = (group.target_only_steps, sum(group.tree_sizes.values()))
        kinds.append("plain" if after[0] > before[0] else "tree" if after[1] > before[1] else "chain")
        if kinds.count("tree") == 3:
            seqs[0].max_draft = 2              # its own K under the depth: chain steps from here
        group.drop([i for i, s in enumerate(group.seqs) if not s.finished])
    assert [s.outputs for s in seqs] == want
    assert kinds[0] == "plain" and "tree" in kinds and kinds[-1] == "chain", kinds


def test_tree_sampling_with_a_draft_target_draft_keeps_the_target_distribution(model_pair):
    """Sampled tree growth from a draft_target draft: the 2nd generated token of 2500 seeded samples
    against the exact target marginal."""
    from test_speculative import _second_token_marginal
    target, proposer = model_pair
    prompt, temperature, n = [5, 9, 17], 1.3, 2500
    marginal = _second_token_marginal(target, prompt, temperature)
    result = speculative_generate(target, proposer(), [prompt] * n, 3, 2, temperature=temperature, seed=11,
                                  tree=TreeShape(6, 3, 2))
    second = torch.tensor([o[1] for o in result.output_ids])
    pvalue, dof = chi_square_p(torch.bincount(second, minlength=marginal.shape[0]), marginal)
    assert dof >= 5 and pvalue > 1e-3, (pvalue, dof)
    assert result.extra["acceptance"]["tree"]["steps_by_size"]


def test_sequence_asking_for_fewer_drafts_runs_chain_steps(pair):
    """A request whose own K is below the tree's depth decodes by chain steps (exactly)."""
    target, proposer = pair
    group = TreeSpeculativeGroup(target, lambda: proposer("eagle3"), TreeShape(8, 2, 4), 80)
    seqs = [Sequence(list(PROMPTS[0]), 20, max_draft=2)]
    group.add(seqs)
    while not seqs[0].finished:
        group.step()
    assert not group.tree_sizes and group.draft_lens
    assert seqs[0].outputs == generate(target, [PROMPTS[0]], 20).output_ids[0]


def test_trace_of_a_tree_step_names_the_tree_and_its_accepted_path(pair, reference):
    target, proposer = pair
    records = []
    result = speculative_generate(target, proposer("eagle3"), PROMPTS[:2], 40, 4, tree=TreeShape(8, 2, 4),
                                  trace=records.append)
    assert result.output_ids == reference[:2]
    for r in records:
        parents, tokens, path = r["tree_parents"], r["tree_tokens"], r["accepted_path"]
        assert r["k"] == len(parents) - 1 == 8 and parents[0] == -1
        assert path[0] == 0 and all(parents[c] == p for p, c in zip(path, path[1:]))     # a root path
        assert [tokens[c] for c in path[1:]] == r["proposed"] and r["accepted"] == len(path) - 1
    for seq in range(2):
        emitted = sum(r["emitted"] for r in records if r["sequence"] == seq)
        assert emitted == len(result.output_ids[seq]) - 1                                 # all but the prefill's token


def test_tree_topk_zero_is_the_draft_kinds_default():
    """``--tree_topk 0`` (the build default) resolves by draft kind: block drafts (one forward scores
    every depth) get the wider top-8, chain drafts (a draft row per expanded node) top-4; a recorded
    or given top-k wins, and the node-count ceiling still holds."""
    from types import SimpleNamespace

    from runtime.tree.draft import tree_from
    for mode, k in (("dflash", 8), ("dspark", 8), ("dspark_nvfp4", 8), ("peagle", 8), ("eagle3", 4), ("eagle", 4),
                    ("mtp", 4), (None, 4)):
        assert tree_from(4, {}, None, mode) == TreeShape(16, k, 4), mode
    assert tree_from(4, {"tree_topk": 0, "max_tree_nodes": 12}, None, "dflash") == TreeShape(12, 8, 4)
    assert tree_from(4, {"tree_topk": 3}, None, "dflash").topk == 3
    given = SimpleNamespace(tree_topk=2, max_tree_nodes=None, tree_depth=None)
    assert tree_from(3, {"max_tree_nodes": 16}, given, "dspark") == TreeShape(16, 2, 3)
    with pytest.raises(ValueError, match="--max_tree_nodes: expected at most 12"):
        tree_from(4, {"max_tree_nodes": 12}, SimpleNamespace(max_tree_nodes=16), "dflash")
    # a smaller tree than the kind's top-k or K: the defaults shrink to it; given values past it are refused
    assert tree_from(8, {}, SimpleNamespace(max_tree_nodes=4, tree_topk=None, tree_depth=None), "dflash") == \
        TreeShape(4, 4, 4)
    for flag in ("tree_topk", "tree_depth"):
        with pytest.raises(ValueError, match=f"--{flag}: expected at most --max_tree_nodes \\(4\\), got 5"):
            tree_from(4, {}, SimpleNamespace(**{"max_tree_nodes": 4, "tree_topk": None, "tree_depth": None, flag: 5}))


def test_tree_steps_give_raw_logprobs_from_the_unshaped_rows(pair):
    """A tree step's log-probabilities with ``raw_logprobs`` (serve --logprobs_mode raw_logprobs) are
    the target's own log-softmax along the accepted path, teacher forced, even where a presence
    penalty shapes the rows the tokens are chosen from; without it they are the shaped ones."""
    from speculative_fixtures import teacher_forced_logits
    from tolerances import lm_head_bound, logit_order_bound
    target, proposer = pair
    got = {}
    for raw in (True, False):
        params = SamplingParams(presence_penalty=0.5, logprobs=True, raw_logprobs=raw)
        group = TreeSpeculativeGroup(target, lambda: proposer("eagle3"), TreeShape(8, 2, 4), 80)
        got[raw] = run_group(group, PROMPTS[:2], 20, params)
        assert group.tree_sizes
    for prompt, s, shaped in zip(PROMPTS[:2], got[True], got[False]):
        assert s.outputs == shaped.outputs and len(s.logprobs) == len(s.outputs) == 20
        decode = teacher_forced_logits(target, [prompt], [s.outputs])[0].double()
        spread = float((teacher_forced_logits(target, [prompt], [s.outputs], 5, verify=True)[0].double()
                        - decode).abs().max())
        bound = 2 * float(logit_order_bound(lm_head_bound(target.module.norm_f, target.module.lm_head), spread).max())
        want = torch.log_softmax(decode, -1).gather(-1, torch.tensor(s.outputs)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.logprobs, dtype=torch.float64), want, rtol=0, atol=bound)
        assert max(abs(a - b) for a, b in zip(s.logprobs, shaped.logprobs)) > 10 * bound
