"""The NVFP4 W4A16 kernel (builder/backends/gpu/nvfp4.py) under TRITON_INTERPRET=1 against the torch op
``linear_nvfp4``, and its declines falling back to the torch op.

Bound: both sides use the same weights (dequantized in x's dtype: the kernel rounds block scales and
weights as the reference does), so they differ only in summation order and output rounding. The
kernel sums K products in fp32 and rounds once; the reference's linear sums in fp32 and may round the
product and the bias sum separately: |kernel - torch| <= 2 gamma_K(fp32) (|x| @ |W|.T) +
2 u (|x| @ |W|.T + |bias|), u the unit roundoff of x's dtype."""
import logging
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from gpu_kernel_helpers import count_launches  # noqa: E402

from builder.backends import gpu, torch_backend  # noqa: E402
from builder.backends.gpu import nvfp4 as gn  # noqa: E402
from tolerances import assert_within, gamma, unit_roundoff  # noqa: E402

from builder.nvfp4_format import dequantize_nvfp4, quantize_nvfp4  # noqa: E402


@pytest.fixture
def launches(monkeypatch):
    """Names of the kernels launched (so no test passes through the torch fallback)."""
    return count_launches(monkeypatch, gn)


def _weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return quantize_nvfp4(torch.randn(n, k, generator=g) * 0.1)


def _compare(x, packed, scale, scale_2, shape, bias):
    want = torch_backend.linear_nvfp4(x, packed, scale, scale_2, shape, bias)
    with gpu.forced():
        got = torch_backend.linear_nvfp4(x, packed, scale, scale_2, shape, bias)
    assert got.dtype == want.dtype == x.dtype and got.shape == want.shape
    w = dequantize_nvfp4(packed, scale, scale_2, shape, x.dtype).double()
    terms = x.double().abs() @ w.abs().t()
    b = bias.double().abs() if bias is not None else 0.0
    bound = 2 * gamma(shape[1]) * terms + 2 * unit_roundoff(x.dtype) * (terms + b) + 1e-30
    assert_within(got, want, bound, f"linear_nvfp4 {x.dtype} {tuple(x.shape)}")
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_nvfp4(dtype, launches):
    """N=32, K=64 for 1, 5 ([1, 5, K]) and 16 ([2, 8, K]) rows, with and without a bias."""
    packed, scale, scale_2 = _weight(32, 64)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(32, generator=g).to(dtype)
    for lead in ((1,), (1, 5), (2, 8)):
        x = torch.randn(*lead, 64, generator=g).to(dtype)
        _compare(x, packed, scale, scale_2, (32, 64), None)
        _compare(x, packed, scale, scale_2, (32, 64), bias)
    assert launches == ["_nvfp4_kernel"] * 6


def test_linear_nvfp4_ragged_and_every_scale(launches):
    """K=112 (not a multiple of the K block), N=40 (not of the N block), strided x, and block scales
    over every finite E4M3 byte pattern (280 blocks: subnormals, zero, negative ones) so the in-kernel
    decode is checked field by field."""
    n, k = 40, 112
    packed, _, _ = _weight(n, k, seed=3)
    codes = torch.arange(n * k // 16) % 256
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)           # no NaN patterns
    scale = codes.to(torch.uint8).view(torch.float8_e4m3fn).reshape(n, k // 16)
    scale_2 = torch.tensor(2.0 ** -6)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 2 * k, generator=torch.Generator().manual_seed(4)).to(dtype)[:, ::2]
        _compare(x, packed, scale, scale_2, (n, k), None)
    assert launches == ["_nvfp4_kernel"] * 2


def _declines(call, reason, caplog, monkeypatch, launches):
    monkeypatch.setattr(gpu, "_warned", set())
    want = call()
    with caplog.at_level(logging.WARNING, logger="nemospec.gpu"), gpu.forced():
        got, again = call(), call()
    assert torch.equal(got, want) and torch.equal(again, want)
    logged = [r.getMessage() for r in caplog.records if r.name == "nemospec.gpu"]
    assert logged == [f"linear_nvfp4: Triton kernel not used ({reason}); running the torch op"]
    assert launches == []


def test_linear_nvfp4_declines(caplog, monkeypatch, launches):
    packed, scale, scale_2 = _weight(32, 64)
    x = torch.randn(17, 64)
    _declines(lambda: torch_backend.linear_nvfp4(x, packed, scale, scale_2, (32, 64)), "more than 16 rows",
              caplog, monkeypatch, launches)
    caplog.clear()
    x = torch.randn(2, 64, dtype=torch.float64)
    _declines(lambda: torch_backend.linear_nvfp4(x, packed, scale, scale_2, (32, 64)),
              "activation dtype torch.float64", caplog, monkeypatch, launches)


def test_linear_nvfp4_declines_stacked(caplog, monkeypatch, launches):
    """A stack of expert weights (3-D shape) is not a linear's weight: the kernel declines it."""
    monkeypatch.setattr(gpu, "_warned", set())
    packed, scale, scale_2 = _weight(2 * 32, 64)
    with caplog.at_level(logging.WARNING, logger="nemospec.gpu"):
        assert gpu.dispatch("linear_nvfp4", torch.randn(1, 64), packed.view(2, 32, 32), scale.view(2, 32, 4),
                            scale_2, (2, 32, 64)) is None
    assert [r.getMessage() for r in caplog.records] == [
        "linear_nvfp4: Triton kernel not used (stacked (3-D) weights); running the torch op"]
    assert launches == []
