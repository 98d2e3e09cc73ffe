"""``--matmul_precision medium``: the compiled CPU path's fp32 products from bf16-rounded x and w, the
exact products summed in fp32 (torch.set_float32_matmul_precision's name for it). The kernel's form
against a float64 oracle of the rounded inputs, rows independent of the call's row count, and the
embedded model end to end: compiled greedy ids equal the eager path's in the same precision (inputs
rounded, then torch's linear), speculative equal target-only, and the option checked where it is
given."""
import pytest
import torch

from builder import embedded
from builder.backends import torch_backend
from builder.engine import BuildOptions
from builder.errors import BuildError, NemospecError
from runtime.compiled import small_linear
from runtime.compiled.steps import cache_dir
from runtime.generation import generate
from runtime.loading import open_checkpoint
from runtime.speculative import speculative_generate
from tests.tolerances import assert_within, matmul_bound


@pytest.fixture(scope="module")
def bf16_products():
    """The kernel's medium form: bf16 dot products, as AVX512-BF16 instructions where the CPU has them,
    else as fp32 FMAs (the same sums); skips only on a CPU with neither of the kernel's forms (AVX-512F,
    AVX2 + FMA), where the compiled path rounds the inputs and calls torch's linear."""
    if not small_linear.supported():
        pytest.skip("the kernel needs an x86-64 CPU with AVX-512F, or AVX2 and FMA")
    assert small_linear.load(cache_dir().parent), f"the kernel's {small_linear.choose()} form did not build"
    return torch.ops.nemospec.small_linear_bf16


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 9, 16])
@pytest.mark.parametrize("n, k", [(838, 192), (5, 100), (7, 7), (80, 41), (192, 768), (2048, 192)])
def test_products_of_rounded_inputs_match_the_float64_oracle(bf16_products, rows, n, k):
    """bf16(x) @ bf16(w)^T (round to nearest even, as torch rounds) summed in fp32, an fp32 result,
    from the first call on (w packed then) and from the cached copy; odd K (a zero-padded last pair)
    included. The control: x was rounded too (the bf16-weights form, x as given, is not it)."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    xr, wr = x.bfloat16().float(), w.bfloat16().float()
    want = xr.double() @ wr.double().T
    bound = matmul_bound(xr, wr.T) / 2
    for call in ("first use (packs)", "packed (cached)"):
        got = bf16_products(x, w)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert_within(got, want, bound, f"bf16 products {rows}x{k} @ {n}x{k}, {call}")
    weights_only = x.double() @ wr.double().T
    assert ((got.double() - weights_only).abs() > bound).any(), "x was not rounded"


def test_rows_do_not_depend_on_the_row_count(bf16_products):
    """Each row is summed in one fixed order whatever the call's row count (tiles of 1..6 rows, a
    second pass past 6), so a verify's products are a decode's bit for bit."""
    g = torch.Generator().manual_seed(12)
    x, w = torch.randn(1, 9, 192, generator=g), torch.randn(838, 192, generator=g)
    whole = bf16_products(x, w)
    for rows in (1, 2, 3, 5):
        parts = torch.cat([bf16_products(x[:, i:i + rows], w) for i in range(0, 9 - rows + 1, rows)], 1)
        assert torch.equal(parts, whole[:, :parts.shape[1]]), f"{rows}-row calls differ from one 9-row call"


def test_eager_form_rounds_the_inputs():
    """Outside the kernel (eager calls, a CPU with neither of its forms) ``linear`` under the medium form
    multiplies the rounded inputs with torch's linear: exactly torch's product of bf16(x) and bf16(w)."""
    g = torch.Generator().manual_seed(13)
    x, w, b = torch.randn(2, 3, 64, generator=g), torch.randn(24, 64, generator=g), torch.randn(24, generator=g)
    with torch_backend.product_form("bf16"):
        got = torch_backend.linear(x, w, b)
    assert torch.equal(got, torch.nn.functional.linear(x.bfloat16().float(), w.bfloat16().float(), b))
    assert not torch.equal(torch_backend.linear(x, w, b), got), "outside the form the product is fp32's"


def test_option_is_checked():
    """One clear error for a precision we do not have, at build and at load."""
    with pytest.raises(BuildError, match="--matmul_precision: expected highest or medium, got high"):
        BuildOptions(matmul_precision="high").validate()
    BuildOptions(matmul_precision="medium").validate()
    with pytest.raises(NemospecError, match="--matmul_precision: expected highest or medium, got low"):
        open_checkpoint(embedded.target_dir(), backend="compiled", matmul_precision="low")


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_medium_precision_speculation_is_exact(one_thread):
    """The embedded model at medium precision, compiled: target-only greedy ids equal the eager path's
    in the same precision (every product's inputs rounded to bf16; only the order of fp32 sums
    differs), eagle3 speculation equals that target-only output, the target's and draft's steps
    trace the bf16 form (routed to the kernel where it runs: test_small_linear), and the eager
    reference is not the fp32 one (the control: rounding happened). A prompt of 70 tokens is
    prefilled eagerly in both."""
    target, draft = embedded.target_dir(), embedded.draft_dir("eagle3")
    eager = open_checkpoint(target, backend="torch")
    loaded = open_checkpoint(target, mode="eagle3", draft_dir=draft, backend="compiled", matmul_precision="medium")
    proposer = loaded.proposer()
    assert loaded.runner.product_form == "bf16" and proposer.draft._chains.product_form == "bf16"
    prompts = [[(i * 37) % 2000 + 3 for i in range(70)]]
    new = 16
    with torch_backend.product_form("bf16"):
        want = generate(eager.runner, prompts, new).output_ids
    for _ in range(2):   # the second run through compiled graphs
        only = generate(loaded.runner, prompts, new).output_ids
        assert only == want, "compiled medium target-only differs from the eager path in the same precision"
        got = speculative_generate(loaded.runner, proposer, prompts, new, 4)
        assert got.output_ids == want, "medium speculation differs from target-only"
    assert got.extra["acceptance"]["mean_accepted_tokens"] > 1.0
    assert loaded.runner._forward.ready and proposer.draft._chains.ready, "the steps ran compiled"
    ids = torch.tensor(prompts, dtype=torch.int32)
    args = (ids, torch.arange(70, dtype=torch.int32)[None], torch.tensor([70], dtype=torch.int32),
            torch.tensor([[69]], dtype=torch.int32))
    fp32 = eager.runner.forward(*args, eager.runner.new_state(1, 96))[0]
    with torch_backend.product_form("bf16"):
        rounded = eager.runner.forward(*args, eager.runner.new_state(1, 96))[0]
    assert not torch.equal(fp32, rounded), "the medium form changed nothing"


def test_without_dot_instructions_the_fma_form_gives_the_same_sums(bf16_products, tmp_path):
    """Where VDPBF16PS is missing (``NEMOSPEC_BF16_DOT=0`` stands for such a CPU, in a fresh process)
    the kernel adds the same exact bf16 products in the same order with fp32 FMAs: medium-precision
    and bf16-model products within the oracle's bound there, and, on a CPU with AVX512-BF16, equal
    bit for bit to the instructions' sums (on one without, both processes run the FMA form)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    code = (
        "import sys, torch; from runtime.compiled import small_linear; from runtime.compiled.steps import cache_dir\n"
        "from tests.test_matmul_precision import _fma_products\n"
        "assert small_linear.load(cache_dir().parent)\n"
        "assert not torch.ops.nemospec.small_linear_bf16_hardware()\n"
        "torch.save(_fma_products(), sys.argv[1])\n")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, NEMOSPEC_BF16_DOT="0", PYTHONPATH=str(root))
    saved = tmp_path / "fma.pt"
    done = subprocess.run([sys.executable, "-c", code, str(saved)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    fma = torch.load(saved)
    for (x, w, medium, bf16), (rows, n, k) in zip(fma, _SHAPES):
        xr, wr = x.bfloat16().float(), w.bfloat16().float()
        want = xr.double() @ wr.double().T
        for got in medium:
            assert_within(got, want, matmul_bound(xr, wr.T) / 2, f"FMA form, medium {rows}x{k} @ {n}x{k}")
        for got in bf16:
            assert got.dtype == torch.bfloat16
            assert_within(got, want, matmul_bound(xr, wr.T) / 2 + want.abs() * torch.finfo(torch.bfloat16).eps,
                          f"FMA form, bf16 {rows}x{k} @ {n}x{k}")
    here = _fma_products()
    for (_, _, medium, bf16), (_, _, medium_here, bf16_here) in zip(fma, here):
        for a, b in zip(medium + bf16, medium_here + bf16_here):
            assert torch.equal(a, b), "the FMA form's sums differ from the dot instructions'"


_SHAPES = ((1, 838, 192), (5, 80, 41), (9, 7, 7), (3, 40, 96))


def _fma_products():
    """Medium-precision and bf16 products of fixed random inputs (each twice: packing, then packed),
    with the inputs, in the kernel's form this process runs."""
    g = torch.Generator().manual_seed(14)
    out = []
    for rows, n, k in _SHAPES:
        x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
        xb, wb = x.bfloat16(), w.bfloat16()
        out.append((x, w, [torch.ops.nemospec.small_linear_bf16(x, w) for _ in range(2)],
                    [torch.ops.nemospec.small_linear(xb, wb) for _ in range(2)]))
    return out
