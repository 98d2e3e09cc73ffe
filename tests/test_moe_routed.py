"""nemospec::moe_routed, the compiled CPU path's MoE experts for the few rows of a step: each expert
some row chose runs on those rows only (a decode reads its top-k experts, a verify the union over its
rows), against a float64 oracle with a bound derived from the sums' sizes, a row's result independent
of the call's row count, and routed only while ``torch.compile`` traces with the kernel installed."""
import pytest
import torch

from builder.backends import torch_backend
from runtime.compiled import small_linear
from runtime.compiled.steps import cache_dir
from tests.tolerances import assert_within, gamma, unit_roundoff

E, I, H, TOP_K = 6, 40, 24, 2


@pytest.fixture(scope="module")
def op():
    if not small_linear.supported():
        pytest.skip("the kernel needs an x86-64 CPU with AVX-512F, or AVX2 and FMA")
    assert small_linear.load(cache_dir().parent), f"the kernel's {small_linear.choose()} form did not build"
    return torch.ops.nemospec.moe_routed


def _layer(seed: int, rows: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, H, generator=g)
    up, down = torch.randn(E, I, H, generator=g) / 4, torch.randn(E, H, I, generator=g) / 4
    router = torch.randn(E, H, generator=g)
    index, weights = torch_backend.route(x, router, torch.zeros(E), TOP_K, 1, 1, True, 1.0)
    return x, index, weights, up, down, router


def _packed(op, *args):
    """The op's result once its weights are packed (a weight is packed at its second use)."""
    op(*args)
    return op(*args)


def _oracle_and_bound(x, index, weights, up, down):
    """relu2 experts in float64, and a bound on an fp32 computation's distance from them: each
    product's two-order bound (gamma_n sum|terms|), carried through the square and the weighted sum."""
    u = unit_roundoff(torch.float32)
    x64 = x.double()
    want, bound = torch.zeros(x.shape, dtype=torch.float64), torch.zeros(x.shape, dtype=torch.float64)
    for n in range(x.shape[0]):
        for slot in range(index.shape[1]):
            e, w = int(index[n, slot]), float(weights[n, slot])
            h = x64[n] @ up[e].double().T
            e_h = gamma(H) * (x64[n].abs() @ up[e].double().abs().T)
            h2 = torch.relu(h) ** 2
            e_h2 = 2 * h.abs() * e_h + e_h ** 2 + u * h2
            y = h2 @ down[e].double().T
            e_y = gamma(I) * ((h2 + e_h2) @ down[e].double().abs().T) + e_h2 @ down[e].double().abs().T
            want[n] += w * y
            bound[n] += abs(w) * (e_y + u * y.abs()) + gamma(index.shape[1] + 1) * abs(w) * (y.abs() + e_y)
    return want, bound


@pytest.mark.parametrize("rows", [1, 2, 5, 9])
def test_matches_a_float64_oracle(op, rows):
    x, index, weights, up, down, _ = _layer(rows, rows)
    want, bound = _oracle_and_bound(x, index, weights, up, down)
    for call in ("row-major (first use)", "packed"):
        got = op(x, index, weights, up, down, 0, 0)
        assert got.shape == x.shape and got.dtype == torch.float32
        assert_within(got, want, bound, f"moe_routed {rows} rows, {call}")


def test_a_row_does_not_depend_on_the_call_row_count(op):
    """A verify's row equals a decode's: the same experts' products, added in the same order."""
    x, index, weights, up, down, _ = _layer(7, 5)
    together = _packed(op, x, index, weights, up, down, 0, 0)
    for n in range(5):
        alone = op(x[n:n + 1], index[n:n + 1], weights[n:n + 1], up, down, 0, 0)
        assert torch.equal(alone[0], together[n]), f"row {n} alone differs from row {n} of five"


def test_reads_only_the_chosen_experts(op):
    """The counts the cost report reads: a 1-row call runs its top-k experts, a 5-row call the
    union of its rows' choices; an expert nobody chose is never touched (NaN weights would show)."""
    x, index, weights, up, down, _ = _layer(11, 5)
    unused = sorted(set(range(E)) - set(index.flatten().tolist()))
    poisoned_up, poisoned_down = up.clone(), down.clone()
    poisoned_up[unused], poisoned_down[unused] = float("nan"), float("nan")
    before = torch.ops.nemospec.moe_routed_counts()
    one = op(x[:1], index[:1], weights[:1], poisoned_up, poisoned_down, 0, 0)
    five = op(x, index, weights, poisoned_up, poisoned_down, 0, 0)
    after = torch.ops.nemospec.moe_routed_counts()
    assert torch.isfinite(one).all() and torch.isfinite(five).all()
    calls, experts = (after - before)[0], (after - before)[1]
    assert calls[1] == 1 and experts[1] == len(set(index[0].tolist())) == TOP_K
    assert calls[5] == 1 and experts[5] == len(set(index.flatten().tolist()))


def test_bf16_weight_form_multiplies_by_the_rounded_weights(op):
    """Form 1 (``--draft_weight_dtype bfloat16``): the products of the weights rounded to bf16."""
    x, index, weights, up, down, _ = _layer(3, 5)
    got = _packed(op, x, index, weights, up, down, 0, 1)
    want = _packed(op, x, index, weights, up.bfloat16().float(), down.bfloat16().float(), 0, 0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("act, code", [("relu", 1), ("silu", 2), ("gelu", 3)])
def test_other_activations_match_the_eager_loop(op, act, code):
    x, index, weights, up, down, router = _layer(5, 3)
    got = _packed(op, x, index, weights, up, down, code, 0)
    want = torch_backend.moe(x, x, router, torch.zeros(E), up, down, TOP_K, 1, 1, True, 1.0, act)
    # two product orders per expert (each bounded by its sums' sizes), through a 1-Lipschitz-ish activation
    scale = (x.abs() @ up.abs().reshape(-1, H).T).max() * down.abs().sum(-1).max()
    assert_within(got, want, 4 * (gamma(H) + gamma(I)) * scale + 1e-30, f"moe_routed {act}")


def test_bad_input_is_one_clear_error(op):
    x, index, weights, up, down, _ = _layer(1, 2)
    with pytest.raises(RuntimeError, match="nemospec::moe_routed: expected up"):
        op(x, index, weights, up, down[:, :, :-1], 0, 0)
    with pytest.raises(RuntimeError, match="nemospec::moe_routed: activation 9"):
        op(x, index, weights, up, down, 9, 0)
    with pytest.raises(RuntimeError, match="nemospec::moe_routed: x has 23 features"):
        op(x[:, :-1], index, weights, up, down, 0, 0)


def test_routed_only_inside_compiled_graphs_with_the_kernel(op):
    """Traced few-row MoE calls the op (and its fake shape is right), the eager path keeps its loop
    (the reference), and without the op installed the compiled graph keeps the branch-free form."""
    x, _, _, up, down, router = _layer(13, 5)
    x = x[None]
    calls = []

    def counting(*args):
        calls.append(tuple(args[0].shape))
        return op(*args)

    def step(a):
        return torch_backend.moe(a, a, router, torch.zeros(E), up, down, TOP_K, 1, 1, True, 1.0, "relu2")

    previous = torch_backend.small_linear_kernels()
    try:
        torch_backend.use_small_linear(torch.ops.nemospec.small_linear, moe_kernel=counting)
        want = step(x)
        assert calls == [], "the eager path must keep its own loop (the reference)"
        torch._dynamo.reset()
        got = torch.compile(step, fullgraph=True, options={"cpp_wrapper": True})(x)
        assert calls == [(5, H)], "the compiled graph did not run the routed experts' op"
        _, bound = _oracle_and_bound(x[0], *torch_backend.route(x[0], router, torch.zeros(E), TOP_K, 1, 1, True, 1.0),
                                     up, down)
        assert_within(got[0], want[0], 2 * bound, "compiled moe_routed vs the eager loop")
        calls.clear()
        torch_backend.use_small_linear(torch.ops.nemospec.small_linear)
        torch._dynamo.reset()
        torch.compile(step, fullgraph=True)(x)
        assert calls == [], "without the op the branch-free form runs"
    finally:
        torch_backend.use_small_linear(*previous)
        torch._dynamo.reset()
