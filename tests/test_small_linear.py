"""nemospec::small_linear, the compiled CPU path's GEMM for few rows: against a float64 oracle at the
shapes the runtime feeds it (tails of K, N and row groups included), inside a compiled graph, and
routed only while ``torch.compile`` traces (the eager path stays torch's own linear)."""
import pytest
import torch

from builder.backends import torch_backend
from runtime import compiled, small_linear
from tests.tolerances import assert_within, matmul_bound

@pytest.fixture(scope="module")
def op():
    """The kernel itself; its own tests skip, with the reason, on a CPU without AVX-512F (there the
    compiled path keeps MKL: test_unsupported_cpu_keeps_torch_gemm)."""
    if not small_linear.supported():
        pytest.skip("the kernel needs an x86-64 CPU with AVX-512F")
    assert small_linear.load(compiled.cache_dir().parent), "the kernel did not build on an AVX-512 CPU"
    return torch.ops.nemospec.small_linear


@pytest.fixture(scope="module")
def kernel():
    """What the routing tests hand the torch backend: the kernel where it runs, else torch's linear
    (routing does not depend on which product is behind it)."""
    if small_linear.supported() and small_linear.load(compiled.cache_dir().parent):
        return torch.ops.nemospec.small_linear
    return torch.nn.functional.linear


def test_unsupported_cpu_keeps_torch_gemm(monkeypatch, tmp_path):
    """Without AVX-512F (or with NEMOSPEC_SMALL_LINEAR=0) nothing is built or installed."""
    previous = torch_backend._small_linear
    try:
        torch_backend.use_small_linear(None)
        monkeypatch.setattr(small_linear, "supported", lambda: False)
        assert small_linear.load.__wrapped__(tmp_path) is False
        monkeypatch.setattr(small_linear, "load", small_linear.load.__wrapped__)
        assert small_linear.install(tmp_path) is False
        assert torch_backend._small_linear is None
        assert not (tmp_path / "kernels").exists()
    finally:
        torch_backend.use_small_linear(previous)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16])
@pytest.mark.parametrize("n, k", [(838, 192), (5, 100), (1, 16), (7, 7), (2048, 192), (192, 768)])
def test_matches_float64_oracle(op, rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    got = op(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    want = x.double() @ w.double().T
    assert_within(got, want, matmul_bound(x, w.T) / 2, f"small_linear {rows}x{k} @ {n}x{k}")


def test_leading_dims_and_strided_inputs(op):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 40, generator=g)[:, :, :33]     # [B, T, K] with a row stride past K
    w = torch.randn(33, 50, generator=g).T                  # [N=50, K=33], not contiguous
    got = op(x, w)
    assert got.shape == (2, 3, 50)
    assert_within(got, x.double() @ w.double().T, matmul_bound(x.reshape(-1, 33), w.T).reshape(2, 3, 50) / 2)


def test_bad_input_is_one_clear_error(op):
    with pytest.raises(RuntimeError, match="fp32"):
        op(torch.ones(1, 4, dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="has 5 features, w expects 4"):
        op(torch.ones(1, 5), torch.ones(3, 4))


def test_routed_only_inside_compiled_graphs(kernel):
    """The torch backend's ``linear`` calls the kernel while dynamo traces and torch's linear
    eagerly; a graph built with it computes the same product (and its fake shape is right)."""
    calls = []

    def counting(x, w):
        calls.append(tuple(x.shape))
        return kernel(x, w)

    x, w = torch.randn(1, 5, 192), torch.randn(64, 192)
    previous = torch_backend._small_linear
    try:
        torch_backend.use_small_linear(counting)
        torch_backend.linear(x, w)
        assert calls == [], "the eager path must stay torch's linear (the reference)"
        torch._dynamo.reset()
        fn = torch.compile(lambda a, b: torch_backend.linear(a, b, bias=torch.ones(64)) * 2, fullgraph=True,
                           options={"cpp_wrapper": True})
        got = fn(x, w)
        assert calls, "the compiled graph did not trace through the kernel"
        want = (x.double() @ w.double().T + 1) * 2
        assert_within(got, want, 2 * matmul_bound(x.reshape(5, 192), w.T).reshape(1, 5, 64) + 4e-7 * want.abs())
        many = torch.randn(1, torch_backend.SMALL_LINEAR_ROWS + 1, 192)
        calls.clear()
        torch.compile(lambda a, b: torch_backend.linear(a, b), fullgraph=True)(many, w)
        assert calls == [], "more rows than SMALL_LINEAR_ROWS keep torch's GEMM"
    finally:
        torch_backend.use_small_linear(previous)
        torch._dynamo.reset()


def test_compiled_path_installs_it(op):
    """Every compiled step (``runtime.compiled._Steps``) configures inductor through ``_configure``,
    which hands the kernel to the torch backend."""
    previous = torch_backend._small_linear
    try:
        torch_backend.use_small_linear(None)
        compiled._configure()
        assert torch_backend._small_linear is op
    finally:
        torch_backend.use_small_linear(previous)


def test_dynamic_batch_graphs_keep_torch_gemm_without_a_guard(kernel):
    """A batch-2+ graph (batch dim dynamic, as runtime.compiled marks it) must not branch on the batch
    size: one graph serves batch 2, 3 and 5 (a guard on it would recompile, which compiled steps
    that skip guard evaluation refuse), and the kernel stays out of it."""
    calls = []

    def counting(x, w):
        calls.append(tuple(x.shape))
        return kernel(x, w)

    w = torch.randn(64, 192)
    previous = torch_backend._small_linear
    try:
        torch_backend.use_small_linear(counting)
        torch._dynamo.reset()
        fn = torch.compile(lambda a: torch_backend.linear(a, w), fullgraph=True, dynamic=False)
        for batch in (2, 3, 5):
            x = torch.randn(batch, 5, 192)
            torch._dynamo.maybe_mark_dynamic(x, 0)
            if batch == 2:
                fn(x)
                continue
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                got = fn(x)    # raises if the batch-2 graph's guards would not serve this batch
            assert_within(got, x.double() @ w.double().T, matmul_bound(x.reshape(-1, 192), w.T).reshape(batch, 5, 64))
        assert calls == []
    finally:
        torch_backend.use_small_linear(previous)
        torch._dynamo.reset()
