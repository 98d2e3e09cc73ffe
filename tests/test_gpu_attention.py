"""Triton attention kernels (builder/backends/gpu/attention.py) under TRITON_INTERPRET=1 against their
torch ops: causal GQA with window and sinks, the split-K path, tree and mask visibility, and every
decline falling back to the torch op.

Bounds (tolerances.py's reasoning): a score s_j = scale q.k_j errs by at most
delta = (2u + gamma_D + 2u32) * A, A = scale sum_d |q_d k_jd| (the reference rounds the product and the
scaled score to the dtype; both sides sum D products in fp32). Softmax weights move by a factor within
exp(+-2 delta), so the output moves by expm1(2 delta) W, W = sum_j p_j |v_j|; rounding the weights (u),
their fp32 sums (gamma_S) and the output (u |o|) add the rest. Kernel vs exact fp64 uses only the
kernel's own roundings (the interpreter computes in fp32)."""
import logging
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from gpu_kernel_helpers import count_launches  # noqa: E402

from builder.backends import gpu, torch_backend, torch_tree  # noqa: E402
from builder.backends.gpu import attention as ga  # noqa: E402
from tolerances import assert_within, gamma, unit_roundoff  # noqa: E402

B, HQ, HKV, D, S = 2, 4, 2, 16, 40
SCALE = D ** -0.5
U32 = unit_roundoff(torch.float32)
# the interpreter divides 0/0 for padding rows of a row block (and rows seeing nothing: NaN, as wanted)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")


@pytest.fixture
def launches(monkeypatch):
    """Names of the kernels launched (so no test passes through the torch fallback)."""
    return count_launches(monkeypatch, ga)


def _inputs(dtype, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, rows, D, generator=g).to(dtype).transpose(1, 2)    # strided, as a projection's view
    k = torch.randn(B, S, HKV, D, generator=g).to(dtype)
    v = torch.randn(B, S, HKV, D, generator=g).to(dtype)
    return q, k, v


def _causal(positions, window=None):
    keys = torch.arange(S)
    vis = keys[None, None, :] <= positions[:, :, None]
    if window is not None:
        vis = vis & (keys[None, None, :] > positions[:, :, None] - window)
    return vis


def _exact(q, k, v, visible, sinks=None):
    """fp64 output [B, T, Hq, D], W = sum_j p_j |v_j| and A = max_j (visible) scale sum_d |q_d k_jd|."""
    group = HQ // HKV
    kk = k.double().repeat_interleave(group, dim=2)                          # [B, S, Hq, D]
    vv = v.double().repeat_interleave(group, dim=2)
    qd = q.double()
    scores = torch.einsum("bthd,bshd->bhts", qd, kk) * SCALE
    absum = torch.einsum("bthd,bshd->bhts", qd.abs(), kk.abs()) * SCALE
    mask = visible[:, None].expand_as(scores)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.double()[None, :, None, None].expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    out = torch.einsum("bhts,bshd->bthd", probs, vv)
    w = torch.einsum("bhts,bshd->bthd", probs, vv.abs())
    a = absum.masked_fill(~mask, 0).amax(-1).permute(0, 2, 1)[..., None]     # [B, T, Hq, 1]
    return out, w, a


def _check(got, want, q, k, v, visible, sinks=None, what=""):
    """got (kernel) vs want (torch op) and vs the exact output, NaN where the reference has NaN."""
    assert got.dtype == want.dtype == q.dtype and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN pattern differs"
    exact, w, a = _exact(q, k, v, visible, sinks)
    u = unit_roundoff(q.dtype)
    g_d, g_s = gamma(D), gamma(S + 4)
    ok = ~nan
    mine = torch.expm1(2 * (g_d + 2 * U32) * a) * w + 2 * g_s * w + u * exact.abs()
    assert_within(got.double()[ok], exact[ok], (mine * 1.01 + 1e-30)[ok], f"{what} kernel vs exact")
    ref = torch.expm1(2 * (2 * u + g_d + 2 * U32) * a) * w + (u + 2 * g_s) * w + u * exact.abs()
    assert_within(got.double()[ok], want.double()[ok], ((mine + ref) * 1.01 + 1e-30)[ok], f"{what} kernel vs torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_attention(dtype, rows, launches):
    q, k, v = _inputs(dtype, rows, seed=rows)
    positions = torch.tensor([[S - 16 - rows + t for t in range(rows)], [S - rows + t for t in range(rows)]])
    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(7))
    for window, sink in ((None, None), (7, None), (None, sinks), (5, sinks)):
        want = torch_backend.attention(q, k, v, positions, SCALE, window, sink)
        with gpu.forced():
            got = torch_backend.attention(q, k, v, positions, SCALE, window, sink)
        _check(got, want, q, k, v, _causal(positions, window), sink, f"window={window} sinks={sink is not None}")
    assert launches == ["_attn_kernel"] * 4


def test_attention_row_seeing_nothing(launches):
    """A row at position -1 sees no key: NaN as the reference's softmax, 0 with sinks."""
    q, k, v = _inputs(torch.float32, 3)
    positions = torch.tensor([[-1, 10, 11], [30, 31, 32]])
    sinks = torch.randn(HQ)
    for sink in (None, sinks):
        want = torch_backend.attention(q, k, v, positions, SCALE, None, sink)
        with gpu.forced():
            got = torch_backend.attention(q, k, v, positions, SCALE, None, sink)
        _check(got, want, q, k, v, _causal(positions), sink, "empty row")
    assert launches == ["_attn_kernel"] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_split(dtype, launches, monkeypatch):
    """Long-cache path, made to trigger at S=40: keys split over programs, merged by a second kernel
    (with a window some splits of some rows see nothing; sinks join in the merge)."""
    monkeypatch.setattr(ga, "KEY_BLOCK", 16)
    monkeypatch.setattr(ga, "SPLIT_MIN_KEYS", 16)
    monkeypatch.setattr(ga, "SPLIT_CHUNK", 8)
    assert ga._splits(B * HKV, S, 16)[0] == 3
    q, k, v = _inputs(dtype, 5, seed=3)
    positions = torch.tensor([[20, 21, 22, 23, 24], [35, 36, 37, 38, 39]])
    sinks = torch.randn(HQ)
    for window, sink in ((None, None), (6, sinks)):
        want = torch_backend.attention(q, k, v, positions, SCALE, window, sink)
        with gpu.forced():
            got = torch_backend.attention(q, k, v, positions, SCALE, window, sink)
        _check(got, want, q, k, v, _causal(positions, window), sink, f"split window={window}")
    assert launches == ["_attn_kernel", "_merge_kernel"] * 2


def _tree(parents, batch=B):
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    return anc.expand(batch, n, n).clone()


def _tree_visible(positions, ancestors):
    """Independent of the op: keys before the base row, and among the chunk's rows only ancestors."""
    keys = torch.arange(S)
    vis = (keys[None, None, :] < positions[:, :1, None]).expand(-1, positions.shape[1], -1).clone()
    for b in range(positions.shape[0]):
        for j, p in enumerate(positions[b].tolist()):
            vis[b, :, p] = ancestors[b, :, j]
    return vis


@pytest.mark.parametrize("dtype,key_block", [(torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 16)])
def test_tree_attention(dtype, key_block, launches, monkeypatch):
    """A 7-node tree with branching; 16-key blocks put the chunk in a later block than the prefix."""
    monkeypatch.setattr(ga, "KEY_BLOCK", key_block)
    parents = [-1, 0, 0, 1, 1, 2, 5]
    ancestors = _tree(parents)
    ancestors[1] = _tree([-1, 0, 1, 0, 3, 3, 1])[0]
    rows = len(parents)
    q, k, v = _inputs(dtype, rows, seed=11)
    positions = torch.tensor([[21 + t for t in range(rows)], [33 + t for t in range(rows)]])
    want = torch_tree.tree_attention(q, k, v, positions, ancestors, SCALE)
    with gpu.forced():
        got = torch_tree.tree_attention(q, k, v, positions, ancestors, SCALE)
    _check(got, want, q, k, v, _tree_visible(positions, ancestors), None, "tree")
    assert launches == ["_attn_kernel"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_attention(dtype, launches):
    """An explicit mask, one row seeing nothing (NaN), and a mask broadcast over the batch."""
    q, k, v = _inputs(dtype, 5, seed=5)
    visible = torch.rand(B, 5, S, generator=torch.Generator().manual_seed(2)) < 0.4
    visible[0, 2] = False
    shared = visible[1:]                                                      # [1, T, S]
    for vis in (visible, shared):
        want = torch_tree.masked_attention(q, k, v, vis, SCALE)
        with gpu.forced():
            got = torch_tree.masked_attention(q, k, v, vis, SCALE)
        _check(got, want, q, k, v, vis.expand(B, -1, -1), None, "mask")
    assert launches == ["_attn_kernel"] * 2


def _declines(op, call, reason, caplog, launches, monkeypatch, also=None):
    """The kernel declines ``call`` (no launch), the torch result comes back and one line is logged
    (plus ``also``: torch_tree.tree_attention runs masked_attention, which asks its own kernel)."""
    monkeypatch.setattr(gpu, "_warned", set())
    want = call()
    with caplog.at_level(logging.WARNING, logger="nemospec.gpu"), gpu.forced():
        got = call()
        again = call()
    assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(again.nan_to_num(), want.nan_to_num())
    logged = [r.getMessage() for r in caplog.records if r.name == "nemospec.gpu"]
    expected = [f"{op}: Triton kernel not used ({reason}); running the torch op"]
    if also is not None:
        expected.append(f"masked_attention: Triton kernel not used ({also}); running the torch op")
    assert logged == expected
    assert launches == []


def test_attention_declines(caplog, launches, monkeypatch):
    q, k, v = _inputs(torch.float32, 33)
    positions = torch.arange(33).expand(B, -1)
    _declines("attention", lambda: torch_backend.attention(q, k, v, positions, SCALE),
              "more than 32 query rows", caplog, launches, monkeypatch)
    caplog.clear()
    q, k, v = (x.double() for x in _inputs(torch.float32, 3))
    positions = torch.tensor([[5, 6, 7], [8, 9, 10]])
    _declines("attention", lambda: torch_backend.attention(q, k, v, positions, SCALE, 4, torch.zeros(HQ)),
              "dtype torch.float64", caplog, launches, monkeypatch)
    caplog.clear()
    q, k, v = torch.randn(1, 1, 1, 272), torch.randn(1, 4, 1, 272), torch.randn(1, 4, 1, 272)
    _declines("attention", lambda: torch_backend.attention(q, k, v, torch.tensor([[2]]), SCALE),
              "head dim over 256", caplog, launches, monkeypatch)


def test_tree_and_mask_declines(caplog, launches, monkeypatch):
    q, k, v = (x.double() for x in _inputs(torch.float32, 3))
    positions = torch.tensor([[20, 21, 22], [30, 31, 32]])
    _declines("tree_attention", lambda: torch_tree.tree_attention(q, k, v, positions, _tree([-1, 0, 0]), SCALE),
              "dtype torch.float64", caplog, launches, monkeypatch, also="dtype torch.float64")
    caplog.clear()
    q, k, v = _inputs(torch.float32, 33)
    chain = _tree(list(range(-1, 32)))
    positions = torch.arange(33).expand(B, -1)
    _declines("tree_attention", lambda: torch_tree.tree_attention(q, k, v, positions, chain, SCALE),
              "more than 32 query rows", caplog, launches, monkeypatch, also="more than 32 query rows")
    caplog.clear()
    visible = chain[:, :, :1].expand(-1, -1, S)
    _declines("masked_attention", lambda: torch_tree.masked_attention(q, k, v, visible, SCALE),
              "more than 32 query rows", caplog, launches, monkeypatch)
    caplog.clear()
    q, k, v = (x.double() for x in _inputs(torch.float32, 3))
    visible = torch.ones(B, 3, S, dtype=torch.bool)
    _declines("masked_attention", lambda: torch_tree.masked_attention(q, k, v, visible, SCALE),
              "dtype torch.float64", caplog, launches, monkeypatch)
