"""nemospec::small_linear, the compiled CPU path's GEMM for few rows: against a float64 oracle at the
shapes the runtime feeds it (tails of K, N and row groups included), inside a compiled graph, and
routed only while ``torch.compile`` traces (the eager path stays torch's own linear)."""
import pytest
import torch

from builder.backends import torch_backend
from runtime.compiled import small_linear
from runtime.compiled.steps import _configure, cache_dir
from tests.tolerances import assert_within, matmul_bound, unit_roundoff

@pytest.fixture(scope="module")
def op():
    """The kernel itself, in the form this CPU runs (AVX-512, else AVX2 + FMA); its own tests skip,
    with the reason, only on a CPU with neither (there the compiled path keeps MKL:
    test_unsupported_cpu_keeps_torch_gemm)."""
    if not small_linear.supported():
        pytest.skip("the kernel needs an x86-64 CPU with AVX-512F, or AVX2 and FMA")
    assert small_linear.load(cache_dir().parent), f"the kernel's {small_linear.choose()} form did not build"
    return torch.ops.nemospec.small_linear


@pytest.fixture(scope="module")
def kernel():
    """What the routing tests hand the torch backend: the kernel where it runs, else torch's linear
    (routing does not depend on which product is behind it)."""
    if small_linear.supported() and small_linear.load(cache_dir().parent):
        return torch.ops.nemospec.small_linear
    return torch.nn.functional.linear


def test_unsupported_cpu_keeps_torch_gemm(monkeypatch, tmp_path):
    """Without AVX-512F (or with NEMOSPEC_SMALL_LINEAR=0) nothing is built or installed."""
    previous = torch_backend.small_linear_kernels()
    try:
        torch_backend.use_small_linear(None)
        monkeypatch.setattr(small_linear, "supported", lambda: False)
        assert small_linear.load.__wrapped__(tmp_path) is False
        monkeypatch.setattr(small_linear, "load", small_linear.load.__wrapped__)
        assert small_linear.install(tmp_path) is False
        assert torch_backend._small_linear is None
        assert not (tmp_path / "kernels").exists()
    finally:
        torch_backend.use_small_linear(*previous)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16])
# 838, 112 and 80 outputs: 53, 7 and 5 column blocks, the remainders after each row count's full
# tiles going through every narrower tile
@pytest.mark.parametrize("n, k", [(838, 192), (5, 100), (1, 16), (7, 7), (2048, 192), (192, 768), (112, 64),
                                  (80, 40)])
def test_matches_float64_oracle(op, rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    want = x.double() @ w.double().T
    for call in ("row-major (first use)", "packing (second use)", "packed (cached)"):
        got = op(x, w)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert_within(got, want, matmul_bound(x, w.T) / 2, f"small_linear {rows}x{k} @ {n}x{k}, {call}")


def _check(op, x, w, what):
    assert_within(op(x, w), x.double() @ w.double().T, matmul_bound(x, w.T) / 2, what)


def _packed_size(w) -> int:
    n = small_linear.lanes()   # the packed layout's column block: 16 (AVX-512) or 8 (AVX2)
    return (w.shape[0] + n - 1) // n * n * w.shape[1] * 4


def test_second_use_packs_within_the_budget(op):
    """A weight is copied into the packed layout at its second use; copies stop at the byte budget
    (a weight past it stays row-major and is still right); a dead weight's copy is released when
    the next new weight comes."""
    packed_bytes = torch.ops.nemospec.small_linear_packed_bytes
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 96, generator=g)
    w1, w2 = torch.randn(70, 96, generator=g), torch.randn(70, 96, generator=g)
    size = _packed_size(w1)
    _check(op, x, w1, "first use")            # (a new weight also releases dead weights' copies)
    before = packed_bytes()
    previous = torch.ops.nemospec.small_linear_pack_budget(before + size)
    try:
        _check(op, x, w1, "second use")
        assert packed_bytes() == before + size, "the second use packs the weight"
        for _ in range(3):
            _check(op, x, w2, "over the budget")
        assert packed_bytes() == before + size, "no copy past the budget"
        del w1
        _check(op, x, torch.randn(3, 96, generator=g), "a new weight")
        assert packed_bytes() == before, "the dead weight's copy is released"
    finally:
        torch.ops.nemospec.small_linear_pack_budget(previous)


def test_bf16_valued_weight_is_packed_in_half_the_bytes(op):
    """A weight whose values are all bf16 numbers (a bf16 checkpoint run in fp32) is packed as bf16:
    half the bytes, the same fp32 product; one value off the bf16 grid keeps the fp32 copy."""
    packed_bytes = torch.ops.nemospec.small_linear_packed_bytes
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 96, generator=g)
    exact = torch.randn(70, 96, generator=g).bfloat16().float()
    off_grid = exact.clone()
    off_grid[69, 95] += 2.0 ** -20 * off_grid[69, 95].abs().clamp(min=1.0)
    for w, size in ((exact, _packed_size(exact) // 2), (off_grid, _packed_size(off_grid))):
        _check(op, x, w, "first use")
        before = packed_bytes()
        for call in ("second use", "cached"):
            _check(op, x, w, call)
        assert packed_bytes() == before + size


def test_weight_written_in_place_is_packed_again(op):
    """A packed copy follows its weight's version counter: written in place, the weight is read
    as it is now (row-major at once, packed again at its next use)."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 64, generator=g), torch.randn(40, 64, generator=g)
    for _ in range(2):
        _check(op, x, w, "before the write")
    with torch.no_grad():
        w.mul_(-2.0).add_(1.0)
    for _ in range(3):
        _check(op, x, w, "after the write")


def test_views_of_one_storage_are_packed_apart(op):
    """Slices and transposes of one storage (fused weights cut at run time) each get their own
    packed copy: the key holds offset, shape and strides, not the storage alone."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(48, 48, generator=g)
    views = {"top": base[:20], "bottom": base[20:], "transposed": base.T, "columns": base[:, 8:40]}
    x = torch.randn(3, 48, generator=g)
    for _ in range(3):
        for name, w in views.items():
            xw = x[:, :w.shape[1]]
            _check(op, xw, w, f"view {name}")


def test_a_new_weight_in_a_dead_ones_memory_is_not_confused(op):
    """A weight freed after packing, and a new one of the same shape (likely at the same address):
    the new one is read, not the old copy."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 96, generator=g)
    for seed in range(4):
        w = torch.randn(70, 96, generator=torch.Generator().manual_seed(seed))
        for _ in range(3):
            _check(op, x, w, f"weight {seed}")
        del w


def test_inference_tensors_and_transient_weights(op):
    """Weights made under inference_mode (no version counter to watch) and weights computed afresh
    for every call are read as they are."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 32, generator=g)
    with torch.inference_mode():
        w = torch.randn(24, 32, generator=g)
        for _ in range(3):
            _check(op, x, w, "inference tensor")
    base = torch.randn(24, 32, generator=g)
    for i in range(3):
        _check(op, x, base * (i + 1), f"transient weight {i}")


@pytest.mark.parametrize("rows", [1, 3, 5, 9])
@pytest.mark.parametrize("n, k", [(838, 192), (7, 7), (2048, 192)])
def test_bf16_weights_form_multiplies_by_the_rounded_weight(op, rows, n, k):
    """small_linear_bf16w is x @ bf16(w)^T (round to nearest even, as torch rounds), computed in
    fp32 from its first call on; the control: it is not the fp32 product."""
    g = torch.Generator().manual_seed(rows * 7 + n + k)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    rounded = w.bfloat16().double()
    want = x.double() @ rounded.T
    for call in ("first use", "cached"):
        got = torch.ops.nemospec.small_linear_bf16w(x, w)
        assert_within(got, want, matmul_bound(x, rounded.T.float()) / 2, f"bf16w {rows}x{k} @ {n}x{k}, {call}")
    exact = x.double() @ w.double().T
    assert ((got.double() - exact).abs() > matmul_bound(x, w.T) / 2).any(), "the weights were not rounded"


@pytest.fixture(scope="module")
def bf16_op(op):
    """The kernel's bf16 form: VDPBF16PS where the CPU has AVX512-BF16, else the same sums from fp32
    FMAs (both are tested on an AVX512-BF16 CPU: test_matmul_precision runs the FMA form there)."""
    return op


def _bf16_product_bound(x, w, want):
    """fp32 sums of exact bf16 products (two orders) plus the result's rounding to bf16 (half a bf16
    ulp of the exact value, taken as one for the sum's own error)."""
    return matmul_bound(x.float(), w.float().T) / 2 + want.abs() * unit_roundoff(torch.bfloat16) * 2


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16])
@pytest.mark.parametrize("n, k", [(838, 192), (5, 100), (1, 16), (7, 7), (2048, 192), (192, 768), (80, 41)])
def test_bf16_products_match_the_float64_oracle(bf16_op, rows, n, k):
    """bf16 x and w (a bf16 model): bf16 dot products summed in fp32, rounded to bf16 once;
    odd K (a zero-padded last pair) included."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    want = x.double() @ w.double().T
    for call in ("first use (packs)", "packed (cached)"):
        got = bf16_op(x, w)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        assert_within(got, want, _bf16_product_bound(x, w, want), f"bf16 small_linear {rows}x{k} @ {n}x{k}, {call}")


def test_bf16_rows_do_not_depend_on_the_row_count(bf16_op):
    """Each row of a bf16 product is summed in one fixed order whatever the call's row count, so a
    verify's rows are bit for bit a decode's (the row tiles of 1..6 and a second pass of 6)."""
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(1, 9, 192, generator=g).bfloat16(), torch.randn(838, 192, generator=g).bfloat16()
    whole = bf16_op(x, w)
    for rows in (1, 2, 3, 5):
        parts = torch.cat([bf16_op(x[:, i:i + rows], w) for i in range(0, 9 - rows + 1, rows)], 1)
        assert torch.equal(parts, whole[:, :parts.shape[1]]), f"{rows}-row calls differ from one 9-row call"


def test_bf16_products_are_routed_in_compiled_graphs(bf16_op):
    """A bf16 ``linear`` traced by dynamo calls the kernel (its fake returns bf16) and computes the
    product; told the kernel has no bf16 form (``bf16=False``) it keeps torch's."""
    traced = []
    x, w = torch.randn(1, 5, 96).bfloat16(), torch.randn(40, 96).bfloat16()
    previous = torch_backend.small_linear_kernels()
    try:
        torch_backend.use_small_linear(lambda a, b: (traced.append(a.dtype), bf16_op(a, b))[1], bf16=True)
        torch._dynamo.reset()
        got = torch.compile(lambda a, b: torch_backend.linear(a, b), fullgraph=True)(x, w)
        assert traced == [torch.bfloat16] and got.dtype == torch.bfloat16
        want = x.double() @ w.double().T
        assert_within(got, want, _bf16_product_bound(x[0], w, want[0]))
        traced.clear()
        torch_backend.use_small_linear(lambda a, b: (traced.append(a.dtype), bf16_op(a, b))[1], bf16=False)
        torch._dynamo.reset()
        torch.compile(lambda a, b: torch_backend.linear(a, b), fullgraph=True)(x, w)
        assert traced == [], "without bf16 support a bf16 product keeps torch's linear"
    finally:
        torch_backend.use_small_linear(*previous)
        torch._dynamo.reset()


def test_leading_dims_and_strided_inputs(op):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 40, generator=g)[:, :, :33]     # [B, T, K] with a row stride past K
    w = torch.randn(33, 50, generator=g).T                  # [N=50, K=33], not contiguous
    got = op(x, w)
    assert got.shape == (2, 3, 50)
    assert_within(got, x.double() @ w.double().T, matmul_bound(x.reshape(-1, 33), w.T).reshape(2, 3, 50) / 2)


def test_bad_input_is_one_clear_error(op):
    with pytest.raises(RuntimeError, match="fp32 or both bf16"):
        op(torch.ones(1, 4, dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="fp32 or both bf16"):
        op(torch.ones(1, 4), torch.ones(3, 4, dtype=torch.bfloat16))
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
    previous = torch_backend.small_linear_kernels()
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
        torch_backend.use_small_linear(*previous)
        torch._dynamo.reset()


def test_product_forms_are_routed_only_where_asked(op):
    """Inside ``torch_backend.product_form(form)`` a traced graph calls that form's kernel: fp32 by
    default (the target), bf16 weights for a draft's ``--draft_weight_dtype bfloat16``, bf16 x and w
    for ``--matmul_precision medium``; an unknown form is one clear error."""
    traced = []

    def counting(name, kernel):
        return lambda x, w: (traced.append(name), kernel(x, w))[1]

    x, w = torch.randn(1, 3, 96), torch.randn(40, 96)
    previous = torch_backend.small_linear_kernels()
    ops = torch.ops.nemospec
    try:
        torch_backend.use_small_linear(counting("float32", op), counting("bf16_weights", ops.small_linear_bf16w),
                                       bf16_products_kernel=counting("bf16", ops.small_linear_bf16))
        for form in torch_backend.PRODUCT_FORMS:
            traced.clear()
            torch._dynamo.reset()
            fn = torch.compile(lambda a, b: torch_backend.linear(a, b), fullgraph=True)
            with torch_backend.product_form(form):
                fn(x, w)
            assert traced == [form], f"product_form({form}) traced {traced}"
        with pytest.raises(ValueError, match="product form: expected one of float32, bf16_weights, bf16, got fp8"):
            with torch_backend.product_form("fp8"):
                pass
    finally:
        torch_backend.use_small_linear(*previous)
        torch._dynamo.reset()


def test_compiled_path_installs_it(op):
    """Every compiled step (``runtime.compiled.steps._Steps``) configures inductor through ``_configure``,
    which hands the kernel to the torch backend."""
    previous = torch_backend.small_linear_kernels()
    try:
        torch_backend.use_small_linear(None)
        _configure()
        assert torch_backend._small_linear is op
    finally:
        torch_backend.use_small_linear(*previous)


def test_dynamic_batch_graphs_run_the_kernel_without_a_guard(kernel):
    """A batch-2+ graph (batch dim dynamic, as runtime.compiled marks it) multiplies through the kernel
    and does not branch on the batch size: one graph serves batch 2, 3, 5 and 11 (55 rows, past
    SMALL_LINEAR_ROWS: the limit is on a sequence's rows; a guard on the batch would recompile, which
    compiled steps that skip guard evaluation refuse). Each sequence's rows are the ones the kernel
    computes for it alone, bit for bit: a request's products do not depend on what it is batched with."""
    calls = []

    def counting(x, w):
        calls.append(tuple(x.shape))
        return kernel(x, w)

    w = torch.randn(64, 192)
    kernel(torch.randn(1, 1, 192), w)   # w's first use: every later product reads its packed copy
    previous = torch_backend.small_linear_kernels()
    try:
        torch_backend.use_small_linear(counting)
        torch._dynamo.reset()
        fn = torch.compile(lambda a: torch_backend.linear(a, w), fullgraph=True, dynamic=False)
        for batch in (2, 3, 5, 11):
            x = torch.randn(batch, 5, 192)
            torch._dynamo.maybe_mark_dynamic(x, 0)
            if batch == 2:
                got = fn(x)
            else:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    got = fn(x)    # raises if the batch-2 graph's guards would not serve this batch
            assert_within(got, x.double() @ w.double().T, matmul_bound(x.reshape(-1, 192), w.T).reshape(batch, 5, 64))
            for b in range(batch):
                assert torch.equal(got[b:b + 1], kernel(x[b:b + 1], w)), f"sequence {b} of {batch}"
        assert calls, "the batch-2+ graph did not trace through the kernel"
    finally:
        torch_backend.use_small_linear(*previous)
        torch._dynamo.reset()


def test_the_form_follows_the_cpu_flags(monkeypatch):
    """AVX-512 where the CPU has AVX-512F, else AVX2 + FMA, else none; the override picks a form the
    CPU can run and refuses one it cannot name."""
    monkeypatch.setattr(small_linear.platform, "machine", lambda: "x86_64")
    both = {"avx512f", "avx2", "fma"}
    monkeypatch.delenv(small_linear.ISA_ENV, raising=False)
    assert small_linear.choose(both) == "avx512"
    assert small_linear.choose({"avx2", "fma", "f16c"}) == "avx2"
    assert small_linear.choose({"avx2"}) is None and small_linear.choose({"sse4_2"}) is None
    assert small_linear.choose(both, "avx2") == "avx2"
    assert small_linear.choose({"avx2", "fma"}, "avx512") is None
    with pytest.raises(ValueError, match=small_linear.ISA_ENV):
        small_linear.choose(both, "avx10")


def test_tasks_split_by_weight_bytes_leave_every_sum_as_it_was(op):
    """A product's column blocks are split across threads by multiply-adds or, for a memory-bound one,
    by weight bytes (``small_linear_task_bytes``): however it is split, each output is one thread's
    sum in one order, so the results are bit for bit the same (fp32 packed, bf16 weights, bf16 dots)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(1024, 768, generator=g)
    threads = torch.get_num_threads()
    previous = torch.ops.nemospec.small_linear_task_bytes(1 << 20)
    try:
        torch.set_num_threads(2)
        for rows in (1, 2, 5, 9):
            x = torch.randn(rows, 768, generator=g)
            for fn in (op, torch.ops.nemospec.small_linear_bf16w, torch.ops.nemospec.small_linear_bf16):
                fn(x, w)   # packed from here on
                results = []
                for task_bytes in (0, 1 << 20, 1 << 14):   # multiply-adds alone, the default, many small tasks
                    torch.ops.nemospec.small_linear_task_bytes(task_bytes)
                    results.append(fn(x, w))
                assert all(torch.equal(r, results[0]) for r in results[1:]), f"{fn} at {rows} rows"
        assert torch.ops.nemospec.small_linear_task_bytes(1 << 20) == 1 << 14   # returns the previous value
    finally:
        torch.ops.nemospec.small_linear_task_bytes(previous)
        torch.set_num_threads(threads)


@pytest.mark.parametrize("form", ["small_linear", "small_linear_bf16w"])
def test_rows_do_not_depend_on_the_row_count(op, form):
    """fp32 products (and bf16 weights): each row summed in one order whatever the call's row count
    and however the rows fall into passes over w (up to 9 a pass in the AVX-512 form, 6 in the AVX2
    one), so a verify's rows are bit for bit a decode's."""
    fn = getattr(torch.ops.nemospec, form)
    g = torch.Generator().manual_seed(12)
    x, w = torch.randn(20, 192, generator=g), torch.randn(838, 192, generator=g)
    fn(x, w)   # packed from here on
    whole = fn(x, w)
    for rows in (1, 2, 5, 6, 7, 8, 9, 10, 16):
        parts = torch.cat([fn(x[i:i + rows], w) for i in range(0, 20 - rows + 1, rows)])
        assert torch.equal(parts, whole[:parts.shape[0]]), f"{form}: {rows}-row calls differ from one 20-row call"


@pytest.mark.parametrize("form", ["small_linear", "small_linear_bf16w"])
def test_the_streaming_tiles_give_the_wide_tiles_sums(op, form):
    """Where packed weights exceed an Intel CPU's L3 the several-row products run tiles of two
    column blocks (faster there from memory, slower from cache): the same sums, bit for bit, at
    every row count and across the narrower tiles of a column tail (838 outputs)."""
    ops, fn = torch.ops.nemospec, getattr(torch.ops.nemospec, form)
    g = torch.Generator().manual_seed(13)
    x, w = torch.randn(9, 192, generator=g), torch.randn(838, 192, generator=g)
    fn(x, w), fn(x, w)   # packed from here on (a bf16-weight copy at the first use, an fp32 one at the second)
    previous = ops.small_linear_tiles("wide")
    try:
        assert previous in ("auto", "wide", "streaming") and not ops.small_linear_streaming()
        wide = [fn(x[:rows], w) for rows in range(1, 10)]
        assert ops.small_linear_tiles("streaming") == "wide"
        assert ops.small_linear_streaming() == (small_linear.form().startswith("avx512"))   # AVX2: its tiles already
        assert all(torch.equal(fn(x[:rows], w), wide[rows - 1]) for rows in range(1, 10)), form
        assert ops.small_linear_tiles("sometimes") == "" and ops.small_linear_tiles("streaming") == "streaming"
    finally:
        ops.small_linear_tiles(previous)
