"""The routed-MoE kernels (builder/backends/gpu/moe.py) under TRITON_INTERPRET=1 against the torch op
``moe`` (and its ``route``), and their declines falling back to the torch op.

Bounds (tests/tolerances.py), from the reference's own intermediates in float64. Routing: logits are
fp32 sums of H products in another order (2 gamma_H |r| @ |W|.T), sigmoid has slope <= 1/4, and
sigmoid/normalisation/scaling add a few fp32 roundings. Experts, per chosen (row, expert): the
pre-activation z differs by 2 gamma_Hin (|up| @ |x|) (both sum in fp32; the reference's CPU linear
does for 16-bit inputs too) plus one rounding to x's dtype each side; the activation's slope L over
|z| carries that, plus a few fp32 ulps of the two implementations and one rounding to x's dtype; the
down product adds |down| @ dh, 2 gamma_I and a rounding; the weighted k-term fp32 sum and the final
rounding to x's dtype add their own. Indices must be equal exactly: the inputs' choice values are
distinct (checked), and exact ties are tested apart."""
import logging
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from gpu_kernel_helpers import count_launches  # noqa: E402

from builder.backends import gpu, torch_backend  # noqa: E402
from builder.backends.gpu import moe as gm  # noqa: E402
from tolerances import assert_within, gamma, unit_roundoff  # noqa: E402

E, H, I, TOP_K = 8, 32, 16, 2
U32 = unit_roundoff(torch.float32)
SLOPE = {"relu": 1.0, "silu": 1.1, "gelu": 1.13}   # max |act'| (relu2's, 2|z|, is per element)
ACTS = {"relu2": lambda z: torch.relu(z) ** 2, "relu": torch.relu, "silu": torch.nn.functional.silu,
        "gelu": torch.nn.functional.gelu}


@pytest.fixture
def launches(monkeypatch):
    """Names of the kernels launched (so no test passes through the torch fallback)."""
    return count_launches(monkeypatch, gm)


def _inputs(rows, dtype, seed, lead=()):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(*lead, rows, H, generator=g)
    x = torch.randn(*lead, rows, H, generator=g).to(dtype)
    w = torch.randn(E, H, generator=g) * 0.3
    b = torch.randn(E, generator=g) * 0.1
    up = (torch.randn(E, I, H, generator=g) * 0.25).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * 0.25).to(dtype)
    return r, x, w, b, up, down


def _route_bound(r, w, index, norm, scale):
    """[N, k] bound on |kernel weight - reference weight| (see the module docstring)."""
    r, w = r.double(), w.double()
    scores = torch.sigmoid(r @ w.t()).gather(1, index)
    ds = 0.25 * 2 * gamma(H) * (r.abs() @ w.abs().t()).gather(1, index) + 4 * U32 * scores
    if not norm:
        return abs(scale) * (ds + 2 * U32 * scores)
    total = scores.sum(-1, keepdim=True)
    wn = scores / total
    return abs(scale) * ((ds + wn * ds.sum(-1, keepdim=True)) / total + (TOP_K + 4) * U32 * wn)


def _check_route(r, w, b, n_group, topk_group, norm, scale, k=TOP_K):
    want_i, want_w = torch_backend.route(r, w, b, k, n_group, topk_group, norm, scale)
    with gpu.forced():
        got_i, got_w = gm.route(r, w, b, k, n_group, topk_group, norm, scale)
    assert got_i.dtype == torch.int64 and got_w.dtype == torch.float32
    return got_i, got_w, want_i, want_w


def _moe_bound(x, up, down, index, weights, dweights, act, dtype):
    """[N, Hin] bound on |kernel - reference| from the chosen experts' float64 products. A rounding
    to x's dtype on both sides of values within d of v moves them apart by <= d + 2u (|v| + d)."""
    u = unit_roundoff(dtype)
    x2 = x.reshape(-1, H).double()
    out = torch.zeros(x2.shape, dtype=torch.float64)
    for n in range(x2.shape[0]):
        terms, exact = torch.zeros(H, dtype=torch.float64), torch.zeros(H, dtype=torch.float64)
        for j in range(index.shape[1]):
            e, wt, dw = int(index[n, j]), abs(float(weights[n, j])), float(dweights[n, j])
            upe, downe = up[e].double(), down[e].double()
            a, mag = upe @ x2[n], upe.abs() @ x2[n].abs()
            dzs = 2 * gamma(H) * mag                                   # two fp32 sums of Hin products
            dz = dzs + 2 * u * (a.abs() + dzs)                         # each rounded to x's dtype
            slope = 2 * (a.abs() + dz) if act == "relu2" else SLOPE[act]
            fa = ACTS[act](a)
            dfa = slope * dz + 8 * U32 * (a.abs() + fa.abs())          # + the two fp32 implementations
            dh = dfa + 2 * u * (fa.abs() + dfa)                        # each rounded to x's dtype
            y0, ymag, ydh = downe @ fa, downe.abs() @ (fa.abs() + dh), downe.abs() @ dh
            dys = ydh + 2 * gamma(I) * ymag
            dy = dys + 2 * u * (y0.abs() + dys)
            out[n] += wt * dy + (y0.abs() + dy) * dw + 2 * U32 * wt * (y0.abs() + dy)
            terms += wt * (y0.abs() + dy)
            exact += float(weights[n, j]) * y0
        out[n] += 2 * gamma(index.shape[1]) * terms + 2 * u * (exact.abs() + out[n])
    return out.reshape(x.shape)


def _check_moe(lead, rows, dtype, act, n_group, topk_group, norm=True, scale=2.5, seed=0, k=TOP_K, inputs=None):
    r, x, w, b, up, down = inputs if inputs is not None else _inputs(rows, dtype, seed, lead)
    args = (r, x, w, b, up, down, k, n_group, topk_group, norm, scale, act)
    want = torch_backend.moe(*args)
    with gpu.forced():
        got = gpu.dispatch("moe", *args)
    assert got is not None and got.dtype == want.dtype == dtype and got.shape == want.shape == x.shape
    r2 = r.reshape(-1, H)
    index, weights = torch_backend.route(r2, w, b, k, n_group, topk_group, norm, scale)
    dweights = _route_bound(r2, w, index, norm, scale)
    assert_within(got, want, _moe_bound(x, up, down, index, weights, dweights, act, dtype),
                  f"moe {dtype} {act} rows={rows} groups={n_group}/{topk_group}")
    return got


def _distinct(r, w, b):
    choice = torch.sigmoid(r.reshape(-1, H) @ w.t()) + b
    gaps = choice.sort(-1)[0].diff(dim=-1)
    assert (gaps > 1e-4).all(), "test inputs must have distinct choice values"


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (2, 1), (2, 2)])
@pytest.mark.parametrize("norm", [True, False])
def test_route(n_group, topk_group, norm, launches):
    """Distinct scores: indices equal exactly (torch.topk's descending order), weights within the
    fp32 bound, for 1 and 5 rows."""
    for rows, seed in ((1, 1), (5, 2)):
        r, _, w, b, _, _ = _inputs(rows, torch.float32, seed)
        _distinct(r, w, b)
        got_i, got_w, want_i, want_w = _check_route(r, w, b, n_group, topk_group, norm, 1.7)
        assert torch.equal(got_i, want_i)
        assert_within(got_w, want_w, _route_bound(r, w, want_i, norm, 1.7), f"route weights {n_group}/{topk_group}")
    assert launches == ["_route_kernel"] * 2


def test_route_ties(launches):
    """Exact ties (experts 1, 5, 6 with zero router rows and equal bias: choice 1.5 each, above the
    rest): the kernel orders tied experts by ascending index. torch.topk's order among ties is
    unspecified (on the CPU it varies by row), so only the chosen set is compared; with top_k = 3 the
    tie does not straddle the k-th place, and the MoE output (summed in expert order) matches."""
    r, x, w, b, up, down = _inputs(5, torch.float32, 3)
    w[[1, 5, 6]] = 0.0
    b[[1, 5, 6]] = 1.0
    got_i, got_w, want_i, want_w = _check_route(r, w, b, 1, 1, False, 1.0, k=3)
    assert got_i.tolist() == [[1, 5, 6]] * 5
    assert torch.equal(want_i.sort(-1)[0], got_i) and torch.equal(got_w, torch.full_like(got_w, 0.5))
    _check_moe((), 5, torch.float32, "silu", 1, 1, norm=False, scale=1.0, k=3, inputs=(r, x, w, b, up, down))
    assert launches == ["_route_kernel"] * 2 + ["_up_kernel", "_down_kernel", "_sum_kernel"]


@pytest.mark.parametrize("dtype,act", [(torch.float32, "relu2"), (torch.float32, "relu"), (torch.float32, "silu"),
                                       (torch.float32, "gelu"), (torch.bfloat16, "relu2"), (torch.bfloat16, "relu"),
                                       (torch.bfloat16, "silu"), (torch.bfloat16, "gelu"), (torch.float16, "silu")])
def test_moe(dtype, act, launches):
    """1 row (one group) and 5 rows as [1, 5, H] (two groups, one kept; and both kept)."""
    _check_moe((), 1, dtype, act, 1, 1, seed=4)
    _check_moe((1,), 5, dtype, act, 2, 1, seed=5)
    _check_moe((), 5, dtype, act, 2, 2, norm=False, scale=1.0, seed=6)
    assert launches == ["_route_kernel", "_up_kernel", "_down_kernel", "_sum_kernel"] * 3


def test_moe_reads_only_chosen_experts(launches):
    """Unchosen experts' up and down set to NaN: the output is unchanged (bit for bit) and finite."""
    r, x, w, b, up, down = _inputs(5, torch.bfloat16, 7)
    opts = (2, 2, 1, True, 2.5, "relu2")       # top_k, n_group, topk_group, norm, scale, act
    chosen = torch_backend.route(r, w, b, 2, 2, 1, True, 2.5)[0].unique()
    assert len(chosen) < E
    poisoned = torch.ones(E, dtype=torch.bool)
    poisoned[chosen] = False
    up_nan, down_nan = up.clone(), down.clone()
    up_nan[poisoned], down_nan[poisoned] = float("nan"), float("nan")
    with gpu.forced():
        clean = gpu.dispatch("moe", r, x, w, b, up, down, *opts)
        dirty = gpu.dispatch("moe", r, x, w, b, up_nan, down_nan, *opts)
    assert torch.isfinite(dirty).all() and torch.equal(clean, dirty)
    assert launches == ["_route_kernel", "_up_kernel", "_down_kernel", "_sum_kernel"] * 2


class _Nvfp4Stack:
    is_nvfp4 = True


def _declined_cases():
    r, x, w, b, up, down = _inputs(5, torch.float32, 8)
    big = _inputs(33, torch.float32, 8)
    base = (r, x, w, b, up, down, 2, 2, 1, True, 2.5, "relu2")

    def swap(i, v):
        return base[:i] + (v,) + base[i + 1:]

    return [
        ("33 rows", big + base[6:]),
        ("NVFP4", swap(4, _Nvfp4Stack())),
        ("dtype outside", swap(1, x.double())),
        ("dtype differs", swap(5, down.bfloat16())),
        ("activation 'softplus'", swap(11, "softplus")),
        ("different devices", swap(4, up.to("meta"))),
        ("contract", swap(5, down.transpose(1, 2))),
        ("contract", swap(6, 9)),
        ("contract", swap(7, 3)),
    ]


@pytest.mark.parametrize("reason,args", _declined_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_moe_declines(reason, args, launches, monkeypatch, caplog):
    """Each decline returns None (the torch op then runs) and logs once per reason."""
    monkeypatch.setattr(gpu, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="nemospec.gpu"), gpu.forced():
        assert gpu.dispatch("moe", *args) is None
        assert gpu.dispatch("moe", *args) is None
    records = [rec for rec in caplog.records if rec.name == "nemospec.gpu"]
    assert len(records) == 1 and reason in records[0].getMessage(), [rec.getMessage() for rec in records]
    assert launches == []
