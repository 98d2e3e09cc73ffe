"""builder/backends/gpu/mamba.py: the Mamba-2 Triton kernels, run under TRITON_INTERPRET on CPU
tensors inside gpu.forced(), against the torch ops they stand behind (called outside forced()).

Bounds come from the dtype and the magnitudes summed (tests/tolerances.py): a conv output is a sum
of K products plus the bias; a state after t rows carries each row's rounding (decay, exp, products,
add: under 8 + |dt A| unit roundoffs a row, |dt A| for exp's argument and the chunked reference's
cumulative decay sums) scaled by the magnitude recurrence |h| -> |h| e^(dt A) + |dt x| |B|; an output
adds C . h's own sum and, below fp32, one rounding of each side to the dtype."""
import os

os.environ["TRITON_INTERPRET"] = "1"   # before any kernel is jitted

import logging

import pytest
import torch

from builder.backends import gpu
from builder.backends import torch_backend as tb
from builder.backends import torch_tree as tt
from builder.backends.gpu import mamba
from tolerances import assert_within, gamma, sum_bound, unit_roundoff

BATCH, HEADS, DIM, STATE, GROUPS, CHANS, WIDTH = 2, 4, 8, 16, 2, 24, 4
PARENTS = [[-1, 0, 0, 1, 1, 2, 4], [-1, 0, 1, 0, 3, 3, 5]]   # two branching trees of 7 rows


@pytest.fixture
def launches(monkeypatch):
    """Names of the kernels launched: a test passing via the torch fallback would see none."""
    seen = []

    def counting(fn):
        seen.append(fn.__name__)
        return gpu.jit(fn)

    monkeypatch.setattr(mamba, "jit", counting)
    return seen


def _conv_inputs(seq, dtype, seed=0):
    """x as the model has it (a column slice of a wider projection), conv state, weight, bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, seq, CHANS + 5, generator=g)[..., 2:2 + CHANS].to(dtype)
    state = torch.randn(BATCH, WIDTH - 1, CHANS, generator=g).to(dtype)
    weight = (torch.randn(CHANS, WIDTH, generator=g) / 2).to(dtype)
    bias = torch.randn(CHANS, generator=g).to(dtype)
    return x, state, weight, bias


def _ssm_inputs(seq, dtype, seed=0):
    """x, dt, A, B, C, D, state shaped as the model passes them (x, B, C views of one projection)."""
    g = torch.Generator().manual_seed(seed)
    xbc = torch.randn(BATCH, seq, HEADS * DIM + 2 * GROUPS * STATE + 3, generator=g).to(dtype)
    x = xbc[..., :HEADS * DIM].unflatten(-1, (HEADS, DIM))
    B = xbc[..., HEADS * DIM:HEADS * DIM + GROUPS * STATE].unflatten(-1, (GROUPS, STATE))
    C = xbc[..., HEADS * DIM + GROUPS * STATE:-3].unflatten(-1, (GROUPS, STATE))
    dt = (0.05 + 0.45 * torch.rand(BATCH, seq, HEADS + 1, generator=g))[..., 1:].to(dtype)
    A = -(0.5 + torch.rand(HEADS, generator=g))
    D = torch.randn(HEADS, generator=g)
    state = torch.randn(BATCH, HEADS, DIM, STATE, generator=g)
    return x, dt, A, B, C, D, state


def _tree(seq):
    """parents [B, T] and ancestors [B, T, T] (self included) of the first seq rows of PARENTS."""
    parents = torch.tensor([p[:seq] for p in PARENTS])
    anc = torch.zeros(BATCH, seq, seq, dtype=torch.bool)
    for b in range(BATCH):
        for i in range(seq):
            if parents[b, i] >= 0 and i > 0:
                anc[b, i] = anc[b, parents[b, i]]
            anc[b, i, i] = True
    return parents, anc


def _paths(anc):
    return [[[j for j in range(anc.shape[1]) if anc[b, i, j]] for i in range(anc.shape[1])] for b in range(BATCH)]


def _state_bounds(x, dt, A, B, state, paths):
    """Per (b, row): (bound on |h - h_ref|, |h| magnitude) [H, P, N] after the rows of that row's path."""
    x, dt, A, state = x.double(), dt.double(), A.double(), state.double()
    Bh = B.double().repeat_interleave(HEADS // GROUPS, dim=2)
    decay = torch.exp(dt * A)                                                # [B, T, H]
    spread = (dt * A).abs().sum(1)                                           # [B, H]: sum |dt A| over the chunk
    out = []
    for b, rows in enumerate(paths):
        per_row = []
        for path in rows:
            mag = state[b].abs()
            for j in path:
                mag = mag * decay[b, j, :, None, None] + (dt[b, j, :, None] * x[b, j]).abs()[..., None] * Bh[b, j, :, None, :].abs()
            steps = len(path) if len(path) else 1
            per_row.append((2 * mag * torch.tensor([gamma(int(steps * (8 + s)) + 1) for s in spread[b].tolist()],
                                                   dtype=torch.float64)[:, None, None], mag))
        out.append(per_row)
    return out


def _y_bound(x, C, D, bounds, dtype):
    """[B, T, H, P] bound on |y - y_ref| from each row's state bound and magnitude."""
    Ch = C.double().repeat_interleave(HEADS // GROUPS, dim=2).abs()
    seq = x.shape[1]
    err = torch.stack([torch.stack([(Ch[b, t, :, None, :] * bounds[b][t][0]).sum(-1) for t in range(seq)])
                       for b in range(BATCH)])
    mag = torch.stack([torch.stack([(Ch[b, t, :, None, :] * bounds[b][t][1]).sum(-1) for t in range(seq)])
                       for b in range(BATCH)]) + (x.double() * D.double()[:, None]).abs()
    rounding = 2 * unit_roundoff(dtype) * mag if dtype != torch.float32 else 0
    return err + sum_bound(mag, STATE + 1) + rounding


def _chain(seq):
    return [[list(range(t + 1)) for t in range(seq)] for _ in range(BATCH)]


def _conv_bound(window_abs_terms, dtype):
    """K products and the bias: reference rounds its sum (maybe in dtype) and the bias add apart."""
    return sum_bound(window_abs_terms, WIDTH + 2, dtype)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq", [1, 3, 5])
def test_causal_conv1d_matches_torch(seq, dtype, launches):
    x, state, weight, bias = _conv_inputs(seq, dtype, seed=seq)
    lengths = torch.tensor([seq, max(seq - 2, 0)])   # one full, one padded (0 valid rows at seq 1)
    with_bias = seq != 3
    b = bias if with_bias else None
    want_y, want_state = tb.causal_conv1d(x, state, weight, b, lengths)
    with gpu.forced():
        got_y, got_state = tb.causal_conv1d(x, state, weight, b, lengths)
    assert launches == ["_conv_kernel"]
    assert got_y.dtype == want_y.dtype == dtype and got_state.dtype == dtype
    padded = torch.cat([state, x], 1).double()
    terms = torch.einsum("btck,ck->btc", padded.unfold(1, WIDTH, 1).abs(), weight.double().abs())
    terms = terms + (bias.double().abs() if with_bias else 0)
    assert_within(got_y, want_y, _conv_bound(terms, dtype), "conv y")
    assert torch.equal(got_state, want_state)                                # the window is a copy


def _silu_bound(conv_bound, want, dtype):
    """silu moves a difference of its input by at most 1.1x (its slope's bound); each side then has
    its own fp32 exp and divide (a few units) and one rounding to dtype."""
    return 1.1 * conv_bound + (2 * unit_roundoff(dtype) + 8 * unit_roundoff(torch.float32)) * (
        want.double().abs() + conv_bound)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tree", [False, True])
def test_conv_with_its_silu_in_the_same_launch_matches_torch(tree, dtype, launches):
    """Mamba-2's conv then silu: one launch, the silu on the rounded conv output as the torch op."""
    seq = 5
    x, state, weight, bias = _conv_inputs(seq, dtype, seed=20 + tree)
    x = x * 3                                                  # conv outputs across silu's bend and tails
    parents, _ = _tree(seq)
    lengths = torch.tensor([seq, 3])

    def run():
        if tree:
            return tt.tree_conv1d(x, state, weight, bias, parents, "silu")
        return tb.causal_conv1d(x, state, weight, bias, lengths, "silu")[0]
    want = run()
    with gpu.forced():
        got = run()
    assert launches == ["_conv_kernel"] and got.dtype == dtype
    assert torch.equal(want, torch.nn.functional.silu(
        tt.tree_conv1d(x, state, weight, bias, parents) if tree else tb.causal_conv1d(x, state, weight, bias, lengths)[0]))
    terms = (x.double().abs().amax() + state.double().abs().amax()) * weight.double().abs().sum(1) + bias.double().abs()
    conv = _conv_bound(terms.expand(BATCH, seq, CHANS), dtype)
    assert_within(got, want, _silu_bound(conv, want, dtype), "conv + silu")


def test_conv_declines_an_activation_it_does_not_have(launches, caplog):
    x, state, weight, bias = _conv_inputs(3, torch.float32)
    with caplog.at_level(logging.WARNING, logger="nemospec.gpu"), gpu.forced():
        got = tb.causal_conv1d(x, state, weight, bias, torch.tensor([3, 3]), "relu2")[0]
    assert launches == [] and "activation 'relu2'" in caplog.text
    assert torch.equal(got, tb.activation(tb.causal_conv1d(x, state, weight, bias, torch.tensor([3, 3]))[0], "relu2"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("limits", [(0.0, float("inf")), (1e-3, 0.1), (None, None)])
def test_time_step_in_one_launch_matches_the_torch_ops(limits, dtype, launches):
    """mamba_dt: softplus(dt + bias), the clamp and the padding mask as one kernel, against the torch
    composition, across softplus's threshold (20) and tails, with a padded row (exactly 0)."""
    g = torch.Generator().manual_seed(5)
    seq = 6
    dt = (4 * torch.randn(BATCH, seq, HEADS + 1, generator=g))[..., 1:].to(dtype)   # a column slice, as the model's
    dt[0, 0] = torch.tensor([-40.0, -19.5, 20.5, 60.0]).to(dtype)
    dt[0, 1, 2] = float("nan")                                                   # stays NaN through the clamp
    bias = torch.randn(HEADS, generator=g).to(dtype)
    lengths = torch.tensor([seq, 4])
    want = tb.mamba_dt(dt, bias, *limits, lengths)
    with gpu.forced():
        got = tb.mamba_dt(dt, bias, *limits, lengths)
    assert launches == ["_dt_kernel"] and got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(want, tb.mask_padding(tb.clamp(tb.activation(dt + bias, "softplus"), *limits), lengths),
                               rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got.isnan(), want.isnan()) and want[0, 1, 2].isnan()
    got, want = got.nan_to_num(0.0), want.nan_to_num(0.0)
    assert (got[1, 4:] == 0).all()
    if limits[1] is not None and limits[1] < float("inf"):
        assert (want == torch.tensor(limits[1]).to(dtype)).any()      # the upper bound was met
    # the same v = dt + bias on both sides; fp32 softplus (log1p vs Kahan's form: a few units) and a
    # rounding to dtype each
    bound = (2 * unit_roundoff(dtype) + 8 * unit_roundoff(torch.float32)) * want.double().abs()
    assert_within(got, want, bound + torch.finfo(dtype).smallest_normal, "mamba_dt")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq", [5, 7])
def test_tree_conv1d_matches_torch(seq, dtype, launches):
    x, state, weight, bias = _conv_inputs(seq, dtype, seed=10 + seq)
    parents, _ = _tree(seq)
    want = tt.tree_conv1d(x, state, weight, bias, parents)
    with gpu.forced():
        got = tt.tree_conv1d(x, state, weight, bias, parents)
    assert launches == ["_conv_kernel"] and got.dtype == dtype
    terms = (x.double().abs().amax() + state.double().abs().amax()) * weight.double().abs().sum(1) + bias.double().abs()
    assert_within(got, want, _conv_bound(terms.expand(BATCH, seq, CHANS), dtype), "tree conv y")
    chain = tb.causal_conv1d(x, state, weight, bias, torch.tensor([seq] * BATCH))[0]
    with gpu.forced():   # a tree that is a chain is the chain conv
        got_chain = tt.tree_conv1d(x, state, weight, bias, torch.arange(-1, seq - 1).expand(BATCH, -1))
    assert_within(got_chain, chain, _conv_bound(terms.expand(BATCH, seq, CHANS), dtype), "chain as tree")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq", [1, 3, 5])
def test_ssm_scan_and_state_match_torch(seq, dtype, launches):
    x, dt, A, B, C, D, state = _ssm_inputs(seq, dtype, seed=seq)
    want_y, want_h = tb.ssm_scan(x, dt, A, B, C, D, state, 128)
    want_only = tb.ssm_state(x, dt, A, B, state)
    with gpu.forced():
        got_y, got_h = tb.ssm_scan(x, dt, A, B, C, D, state, 128)
        got_only = tb.ssm_state(x, dt, A, B, state)
    assert launches == ["_ssm_kernel", "_ssm_kernel"]
    assert got_y.dtype == dtype and got_h.dtype == got_only.dtype == torch.float32
    bounds = _state_bounds(x, dt, A, B, state, _chain(seq))
    h_bound = torch.stack([bounds[b][-1][0] for b in range(BATCH)])
    assert_within(got_h, want_h, h_bound, "final state")
    assert_within(got_only, want_only, h_bound, "ssm_state")
    assert_within(got_y, want_y, _y_bound(x, C, D, bounds, dtype), "y")


def test_ssm_scan_past_the_recurrent_rows_matches_the_chunked_reference(launches):
    """12 rows: the reference takes its chunked (SSD) form, the kernel still the recurrence."""
    seq = 12
    assert tb.RECURRENT_TOKENS < seq <= mamba.MAX_TOKENS
    x, dt, A, B, C, D, state = _ssm_inputs(seq, torch.float32, seed=7)
    want_y, want_h = tb.ssm_scan(x, dt, A, B, C, D, state, 4)
    with gpu.forced():
        got_y, got_h = tb.ssm_scan(x, dt, A, B, C, D, state, 4)
    assert launches == ["_ssm_kernel"]
    bounds = _state_bounds(x, dt, A, B, state, _chain(seq))
    assert_within(got_h, want_h, torch.stack([bounds[b][-1][0] for b in range(BATCH)]), "final state")
    assert_within(got_y, want_y, _y_bound(x, C, D, bounds, torch.float32), "y")


@pytest.mark.parametrize("dtype", DTYPES)
def test_ssm_scan_states_are_the_states_of_each_prefix(dtype, launches):
    seq = 5
    x, dt, A, B, C, D, state = _ssm_inputs(seq, dtype, seed=3)
    y, states = mamba.ssm_scan_states(x, dt, A, B, C, D, state)
    assert launches == ["_ssm_kernel"] and states.shape == (BATCH, seq, HEADS, DIM, STATE)
    bounds = _state_bounds(x, dt, A, B, state, _chain(seq))
    for t in range(seq):
        want = tb.ssm_state(x[:, :t + 1], dt[:, :t + 1], A, B[:, :t + 1], state)
        assert_within(states[:, t], want, torch.stack([bounds[b][t][0] for b in range(BATCH)]), f"state {t}")
    assert_within(y, tb.ssm_scan(x, dt, A, B, C, D, state, 128)[0], _y_bound(x, C, D, bounds, dtype), "y")
    with pytest.raises(ValueError, match="float64"):
        mamba.ssm_scan_states(x.double(), dt, A, B, C, D, state)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_ssm_scan_matches_torch(dtype, launches):
    seq = 7
    x, dt, A, B, C, D, state = _ssm_inputs(seq, dtype, seed=5)
    _, anc = _tree(seq)
    want = tt.tree_ssm_scan(x, dt, A, B, C, D, state, anc)
    with gpu.forced():
        got = tt.tree_ssm_scan(x, dt, A, B, C, D, state, anc)
    assert launches == ["_tree_ssm_kernel"] and got.dtype == dtype
    bounds = _state_bounds(x, dt, A, B, state, _paths(anc))
    assert_within(got, want, _y_bound(x, C, D, bounds, dtype), "tree y")


def _fallback_cases():
    conv = lambda seq, dtype: _conv_inputs(seq, dtype)                    # noqa: E731
    ssm = lambda seq, dtype: _ssm_inputs(seq, dtype)                      # noqa: E731
    return {
        "causal_conv1d": (lambda a: tb.causal_conv1d(*a, torch.tensor([a[0].shape[1]] * BATCH)), conv),
        "tree_conv1d": (lambda a: tt.tree_conv1d(*a, _tree(min(a[0].shape[1], 7))[0] if a[0].shape[1] <= 7
                                                 else torch.arange(-1, a[0].shape[1] - 1).expand(BATCH, -1)), conv),
        "ssm_scan": (lambda a: tb.ssm_scan(*a, 16), ssm),
        "ssm_state": (lambda a: tb.ssm_state(a[0], a[1], a[2], a[3], a[6]), ssm),
        "tree_ssm_scan": (lambda a: tt.tree_ssm_scan(*a, torch.ones(a[0].shape[1], a[0].shape[1]).tril()
                                                     .bool().expand(BATCH, -1, -1)), ssm),
    }


@pytest.mark.parametrize("case", [(op, why) for op in _fallback_cases() for why in ("long", "float64")])
def test_declined_inputs_run_the_torch_op_and_say_so_once(case, launches, monkeypatch, caplog):
    op, why = case
    call, make = _fallback_cases()[op]
    seq = mamba.MAX_TOKENS + 8 if why == "long" else 5
    args = make(seq, torch.float64 if why == "float64" else torch.float32)
    monkeypatch.setattr(gpu, "_warned", set())
    want = call(args)
    with caplog.at_level(logging.WARNING, logger="nemospec.gpu"), gpu.forced():
        got = [call(args), call(args)]
    assert launches == []
    for g in got:
        for a, b in zip(g if isinstance(g, tuple) else (g,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(a, b)
    said = [r.getMessage() for r in caplog.records if r.name == "nemospec.gpu"]
    reason = f"{seq} tokens" if why == "long" else "dtype torch.float64"
    assert len(said) == 1 and said[0].startswith(f"{op}: ") and reason in said[0], said


@pytest.mark.parametrize("why,reason", [("float64", "dtype torch.float64"), ("bias", "dt_bias dtype differs"),
                                        ("lengths", "shapes outside the op's contract")])
def test_time_step_declines_what_it_was_not_written_for(why, reason, launches, monkeypatch, caplog):
    """mamba_dt takes any number of rows; a float64 dt, a dt_bias of another dtype (the torch op
    promotes) or lengths that are not [B] run the torch op, said once."""
    dt = torch.randn(BATCH, 5, HEADS, dtype=torch.float64 if why == "float64" else torch.float32)
    bias = torch.randn(HEADS, dtype={"float64": torch.float64, "bias": torch.bfloat16}.get(why, torch.float32))
    lengths = torch.tensor([5, 3] if why != "lengths" else [5, 3, 1])
    monkeypatch.setattr(gpu, "_warned", set())
    call = lambda: tb.mamba_dt(dt, bias, 0.0, float("inf"), lengths[:BATCH] if why != "lengths" else lengths)  # noqa: E731
    if why == "lengths":
        with gpu.forced(), caplog.at_level(logging.WARNING, logger="nemospec.gpu"):
            with pytest.raises(RuntimeError):      # the torch op refuses it too: no silent answer
                call()
    else:
        want = call()
        with caplog.at_level(logging.WARNING, logger="nemospec.gpu"), gpu.forced():
            got = [call(), call()]
        assert all(torch.equal(g, want) for g in got)
    said = [r.getMessage() for r in caplog.records if r.name == "nemospec.gpu"]
    assert launches == [] and len(said) == 1 and reason in said[0], said


def test_a_kernel_that_fails_on_cuda_falls_back_to_the_torch_op_once(monkeypatch, caplog):
    """A kernel raising outside tests (an older Triton on the device that cannot compile it) is
    dropped for the process: the torch op answers, and the log says why, once."""
    from builder.backends import gpu

    def broken(*args):
        raise RuntimeError("cannot compile")
    monkeypatch.setitem(gpu._KERNELS, "ssm_state", gpu.Kernel("ssm_state", broken, lambda *args: None, "() -> Tensor"))
    monkeypatch.setattr(gpu, "_loaded", True)
    assert gpu.dispatch("ssm_state", None) is None
    assert "ssm_state" not in gpu._KERNELS
    assert gpu.dispatch("ssm_state", None) is None
    assert [r.getMessage() for r in caplog.records].count(
        "ssm_state: Triton kernel not used (RuntimeError: cannot compile); running the torch op") == 1


def test_the_kernels_stay_out_of_compiled_graphs_unless_asked(monkeypatch):
    """While torch.compile traces, the ops keep their torch lowering (inductor's), even for tensors
    that would take a kernel, unless NEMOSPEC_KERNELS_IN_GRAPHS=1 (tests/test_gpu_graph_ops.py)."""
    from builder.backends import gpu

    x = torch.zeros(2)
    with gpu.forced():
        assert gpu.active(x)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        monkeypatch.setattr(gpu, "IN_GRAPHS", False)
        assert not gpu.active(x)
        monkeypatch.setattr(gpu, "IN_GRAPHS", True)
        assert gpu.active(x)
