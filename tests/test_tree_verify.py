"""Tree verify on the hybrid target (eager path): every row of a token tree scored in one forward
equals decoding its own root path, and the state after accepting any path (Mamba conv/SSM states
from the path's kept inputs, attention rows compacted into place) equals target-only decoding of
that path."""
import pytest
import torch

from runtime.state import chunk_inputs
from runtime.tree import paths as tree_paths
from speculative_fixtures import runners
from tolerances import assert_within

PARENTS = [-1, 0, 0, 1, 1, 2, 3, 6]           # 8 rows, depth 4, branching at the root and at row 1
PROMPT = [5, 9, 17, 33, 4]


@pytest.fixture(scope="module")
def target(checkpoints):
    runner, _ = runners(checkpoints["two_attention"])
    return runner


def _prefill(runner, prompt, capacity=32):
    ids, positions, lengths = chunk_inputs([prompt], [0])
    _, state, _ = runner.module.forward(ids, positions, lengths, (lengths - 1)[:, None], runner.new_state(1, capacity))
    return state


def _decode(runner, state, tokens, start):
    """Target-only decoding of ``tokens`` from position ``start``: per-token logits and the state."""
    rows = []
    for t, token in enumerate(tokens):
        ids = torch.tensor([[token]], dtype=torch.int32)
        pos = torch.tensor([[start + t]], dtype=torch.int32)
        logits, state, _ = runner.module.forward(ids, pos, torch.ones(1, dtype=torch.int32),
                                                 torch.zeros(1, 1, dtype=torch.int32), state)
        rows.append(logits[0, 0])
    return torch.stack(rows), state


def _clone(state):
    return {k: v.clone() for k, v in state.items()}


def _tree_verify(runner, state, tokens, base):
    parents = torch.tensor([PARENTS])
    t = len(PARENTS)
    ids = torch.tensor([tokens], dtype=torch.int32)
    positions = base + torch.arange(t, dtype=torch.int32)[None]
    index = torch.arange(t, dtype=torch.int32)[None]
    logits, verified, _ = runner.module.forward(ids, positions, torch.full((1,), t, dtype=torch.int32), index,
                                                _clone(state), verify=True, tree=(parents, tree_paths.ancestors(parents)))
    return logits[0], verified, parents


def test_ancestors_and_paths():
    parents = torch.tensor([PARENTS])
    anc = tree_paths.ancestors(parents)[0]
    assert anc[7].nonzero()[:, 0].tolist() == [0, 1, 3, 6, 7] and anc[4].nonzero()[:, 0].tolist() == [0, 1, 4]
    assert tree_paths.path_to(parents.repeat(2, 1), torch.tensor([5, 2]), 5).tolist() == [[0, 2, 5, 5, 5], [0, 2, 2, 2, 2]]
    chain = torch.tensor([[-1, 0, 1, 2]])
    assert torch.equal(tree_paths.ancestors(chain)[0], torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_every_tree_row_scores_like_its_own_path(target):
    base = len(PROMPT)
    tokens = [8, 21, 22, 23, 24, 25, 26, 27]
    state = _prefill(target, PROMPT)
    logits, _, parents = _tree_verify(target, state, tokens, base)
    bound = None
    for node in range(len(PARENTS)):
        path = tree_paths.path_to(parents, torch.tensor([node]), 1 + int(tree_paths.depths(parents)[0, node]))[0].tolist()
        want, _ = _decode(target, _clone(state), [tokens[r] for r in path], base)
        bound = 1e-4 * float(want.abs().max())      # the file's whole-network fp32 tolerance
        assert_within(logits[node], want[-1], bound, f"tree row {node} (path {path})")
    chain, _ = _decode(target, _clone(state), [tokens[0]] + [99] * 2, base)  # a non-ancestor changes the result
    assert (logits[3] - chain[1]).abs().max() > 100 * bound


@pytest.mark.parametrize("node", range(len(PARENTS)))
def test_state_after_accepting_any_path_equals_decoding_it(target, node):
    base = len(PROMPT)
    tokens = [8, 21, 22, 23, 24, 25, 26, 27]
    state = _prefill(target, PROMPT)
    _, verified, parents = _tree_verify(target, state, tokens, base)
    path = tree_paths.path_to(parents, torch.tensor([node]), 5)
    length = 1 + tree_paths.depths(parents)[0, node]
    rolled = target.module.tree_rollback(_clone(state), verified, path, length[None] if length.dim() == 0 else length,
                                         torch.tensor([base]))
    kept = path[0, :int(length)].tolist()
    _, want = _decode(target, _clone(state), [tokens[r] for r in kept], base)
    for name, value in want.items():
        if "cache" in name:   # attention rows past the path are stale and never read
            value, got = value[:, :base + len(kept)], rolled[name][:, :base + len(kept)]
        else:
            got = rolled[name]
        assert_within(got.float(), value.float(), 1e-5 * (1 + float(value.abs().max())), f"{name} after path {kept}")
    after_tree, _ = _decode(target, rolled, [3, 4], base + len(kept))
    after_chain, _ = _decode(target, want, [3, 4], base + len(kept))
    assert_within(after_tree, after_chain, 1e-4 * float(after_chain.abs().max()), "decoding after the rollback")


def test_greedy_acceptance_keeps_the_longest_agreeing_path():
    parents = torch.tensor([PARENTS])
    tokens = torch.tensor([[8, 21, 22, 23, 24, 25, 26, 27]])
    logits = torch.zeros(1, 8, 50)
    best = {0: 21, 1: 23, 3: 26, 6: 40, 2: 25, 4: 1, 5: 1, 7: 1}   # rows 0 -> 1 -> 3 -> 6 agree; 7 not
    for r, t in best.items():
        logits[0, r, t] = 1.0
    paths, lengths, bonus = tree_paths.greedy_accept(tokens, parents, logits)
    assert lengths.tolist() == [4] and paths[0, :4].tolist() == [0, 1, 3, 6] and bonus.tolist() == [40]
    logits[0, 0] = 0
    logits[0, 0, 9] = 1.0                                           # nothing agrees at the root
    paths, lengths, bonus = tree_paths.greedy_accept(tokens, parents, logits)
    assert lengths.tolist() == [1] and bonus.tolist() == [9]


def test_tree_verify_network_interprets_like_eager(target):
    """The tree verify recorded as a TensorRT network (every layer of the target, tree ops included)
    evaluates on the CPU interpreter to the eager logits and kept rollback inputs."""
    from network_checks import check
    module = target.module
    capacity, t = 16, len(PARENTS)
    spec = module.state_spec(1, capacity)
    names = sorted(spec)

    def fn(ids, positions, lengths, index, parents, anc, *state):
        logits, new_state, _ = module.forward(ids, positions, lengths, index, dict(zip(names, state)), verify=True,
                                              tree=(parents, anc))
        return [logits] + [new_state[k] for k in sorted(new_state)]

    state = _prefill(target, PROMPT, capacity)
    parents = torch.tensor([PARENTS], dtype=torch.int32)
    base = len(PROMPT)
    case = [torch.tensor([[8, 21, 22, 23, 24, 25, 26, 27]], dtype=torch.int32),
            base + torch.arange(t, dtype=torch.int32)[None], torch.tensor([t], dtype=torch.int32),
            torch.arange(t, dtype=torch.int32)[None], parents, tree_paths.ancestors(parents),
            *[state[k].clone() for k in names]]
    specs = [("ids", torch.int32, (-1, -1)), ("positions", torch.int32, (-1, -1)), ("lengths", torch.int32, (-1,)),
             ("index", torch.int32, (-1, -1)), ("parents", torch.int32, (-1, -1)), ("anc", torch.bool, (-1, -1, -1))]
    specs += [(k, spec[k][1], (-1,) + tuple(spec[k][0][1:])) for k in names]
    check(fn, specs, [case], tol=dict(rtol=1e-4, atol=1e-4))
