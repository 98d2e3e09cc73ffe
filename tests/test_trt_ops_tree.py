"""The TensorRT lowerings of the token-tree ops compute what the eager ops compute (CPU interpreter),
at two tree shapes and batch sizes, and the eager ops reduce to the chain ops on a chain."""
import pytest
import torch

from builder import functional as F
from runtime.tree import paths as tree_paths
from network_checks import check, randn

TREES = [[-1, 0, 0, 1, 1, 2, 3, 6], [-1, 0, 1, 0, 3]]


def _parents(batch, t, seed=0):
    """[B, T] int32: the first tree shape of length t for row 0, a random tree for the others."""
    g = torch.Generator().manual_seed(seed)
    rows = [next(p for p in TREES if len(p) == t)]
    for _ in range(batch - 1):
        rows.append([-1] + [int(torch.randint(0, r, (1,), generator=g)) for r in range(1, t)])
    return torch.tensor(rows, dtype=torch.int32)


CASES = [(1, 8), (3, 5)]


@pytest.mark.parametrize("act", [None, "silu"])
def test_tree_conv1d(act):
    C, K = 6, 4
    w, b = randn(C, K, seed=1), randn(C, seed=2)
    cases = [[randn(bt, t, C, seed=3), randn(bt, K - 1, C, seed=4), _parents(bt, t)] for bt, t in CASES]
    check(lambda x, s, p: F.tree_conv1d(x, s, w, b, p, act),
          [("x", torch.float32, (-1, -1, C)), ("s", torch.float32, (-1, K - 1, C)), ("p", torch.int32, (-1, -1))],
          cases)


def test_tree_ssm_scan():
    H, P, G, N = 4, 3, 2, 5
    A, D = -torch.rand(H, generator=torch.Generator().manual_seed(1)) - 0.5, randn(H, seed=2)

    def case(bt, t):
        parents = _parents(bt, t)
        return [randn(bt, t, H, P, seed=3), torch.rand(bt, t, H, generator=torch.Generator().manual_seed(4)) * 0.5,
                randn(bt, t, G, N, seed=5), randn(bt, t, G, N, seed=6), randn(bt, H, P, N, seed=7),
                tree_paths.ancestors(parents)]
    check(lambda x, dt, B, C, h, anc: F.tree_ssm_scan(x, dt, A, B, C, D, h, anc),
          [("x", torch.float32, (-1, -1, H, P)), ("dt", torch.float32, (-1, -1, H)), ("B", torch.float32, (-1, -1, G, N)),
           ("C", torch.float32, (-1, -1, G, N)), ("h", torch.float32, (-1, H, P, N)), ("anc", torch.bool, (-1, -1, -1))],
          [case(bt, t) for bt, t in CASES])


def test_tree_attention():
    Hq, Hkv, Dh, S = 4, 2, 8, 16

    def case(bt, t):
        base = torch.tensor([3, 6, 0][:bt], dtype=torch.int32)
        positions = base[:, None] + torch.arange(t, dtype=torch.int32)
        return [randn(bt, t, Hq, Dh, seed=1), randn(bt, S, Hkv, Dh, seed=2), randn(bt, S, Hkv, Dh, seed=3),
                positions, tree_paths.ancestors(_parents(bt, t))]
    check(lambda q, k, v, pos, anc: F.tree_attention(q, k, v, pos, anc, Dh ** -0.5),
          [("q", torch.float32, (-1, -1, Hq, Dh)), ("k", torch.float32, (-1, S, Hkv, Dh)),
           ("v", torch.float32, (-1, S, Hkv, Dh)), ("pos", torch.int32, (-1, -1)), ("anc", torch.bool, (-1, -1, -1))],
          [case(bt, t) for bt, t in CASES])


def test_on_a_chain_the_tree_ops_are_the_chain_ops():
    C, K, t = 6, 4, 5
    chain = torch.tensor([[-1, 0, 1, 2, 3]], dtype=torch.int32)
    w, x, s = randn(C, K, seed=1), randn(1, t, C, seed=3), randn(1, K - 1, C, seed=4)
    lengths = torch.tensor([t], dtype=torch.int32)
    torch.testing.assert_close(F.tree_conv1d(x, s, w, None, chain), F.causal_conv1d(x, s, w, None, lengths)[0])
    H, P, G, N = 4, 3, 2, 5
    A, D = -torch.rand(H, generator=torch.Generator().manual_seed(1)) - 0.5, randn(H, seed=2)
    xs, dt = randn(1, t, H, P, seed=3), torch.rand(1, t, H, generator=torch.Generator().manual_seed(4)) * 0.5
    B, Cm, h = randn(1, t, G, N, seed=5), randn(1, t, G, N, seed=6), randn(1, H, P, N, seed=7)
    torch.testing.assert_close(F.tree_ssm_scan(xs, dt, A, B, Cm, D, h, tree_paths.ancestors(chain)),
                               F.ssm_scan(xs, dt, A, B, Cm, D, h, 16)[0], rtol=1e-5, atol=1e-5)


def test_masked_attention():
    """A draft tree step's attention: each row sees a prefix of the cache plus a scattered set of slots
    (its ancestors'), as the proposer's mask says."""
    Hq, Hkv, Dh, S = 4, 2, 8, 16

    def case(bt, t):
        g = torch.Generator().manual_seed(bt * 10 + t)
        visible = torch.rand(bt, t, S, generator=g) < 0.4
        visible[..., 0] = True                      # every row sees at least one slot
        return [randn(bt, t, Hq, Dh, seed=1), randn(bt, S, Hkv, Dh, seed=2), randn(bt, S, Hkv, Dh, seed=3), visible]
    check(lambda q, k, v, vis: F.masked_attention(q, k, v, vis, Dh ** -0.5),
          [("q", torch.float32, (-1, -1, Hq, Dh)), ("k", torch.float32, (-1, S, Hkv, Dh)),
           ("v", torch.float32, (-1, S, Hkv, Dh)), ("vis", torch.bool, (-1, -1, S))],
          [case(bt, t) for bt, t in CASES])


def test_masked_attention_is_causal_attention_under_the_causal_mask():
    q, k, v = randn(2, 3, 4, 8, seed=1), randn(2, 10, 2, 8, seed=2), randn(2, 10, 2, 8, seed=3)
    positions = torch.tensor([[4, 5, 6], [1, 2, 3]], dtype=torch.int32)
    visible = torch.arange(10)[None, None] <= positions[..., None].long()
    assert torch.equal(F.masked_attention(q, k, v, visible, 0.3), F.attention(q, k, v, positions, 0.3))
