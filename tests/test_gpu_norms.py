"""RMSNorm and the gated RMSNorm kernels (builder/backends/gpu/norms.py) under TRITON_INTERPRET=1
against the torch ops, and their declines.

Bound: both sides compute in fp32 and differ in the order of the group's sum of squares (gamma_G of
it) and the rsqrt's last bits (a few fp32 ulps); that relative difference d of the normalised value
can move each rounding to the output dtype by one unit: |kernel - torch| <= (2 u_out + 2 u_x [gated]
+ d) |out| in float64, with d = 2 gamma_G + 8 u_fp32."""
import logging
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from gpu_kernel_helpers import count_launches  # noqa: E402

from builder.backends import gpu, torch_backend  # noqa: E402
from builder.backends.gpu import norms  # noqa: E402
from tolerances import assert_within, gamma, unit_roundoff  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def launches(monkeypatch):
    return count_launches(monkeypatch, norms)


def _bound(ref, width, x_dtype, out_dtype, gated):
    d = 2 * gamma(width) + 8 * unit_roundoff(torch.float32)
    u = 2 * unit_roundoff(out_dtype) + (2 * unit_roundoff(x_dtype) if gated else 0.0)
    return (u + d) * ref.double().abs() + 1e-30


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype, launches):
    """Rows of 48 (a width off the power of two) and [2, 3] leading dims."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, 48, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(dtype)
    want = torch_backend.rms_norm(x, w, 1e-5)
    with gpu.forced():
        got = torch_backend.rms_norm(x, w, 1e-5)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert_within(got, want, _bound(want, 48, dtype, dtype, False), f"rms_norm {dtype}")
    assert launches == ["_norm_kernel"]


@pytest.mark.parametrize("dtype, w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
def test_gated_rms_norm(dtype, w_dtype, launches):
    """Four groups of 24 per row: each normalised on its own; the output dtype is the weight's and x's
    promotion, as the torch op's product makes it."""
    g = torch.Generator().manual_seed(1)
    x, z = (torch.randn(5, 96, generator=g) * 2).to(dtype), torch.randn(5, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(w_dtype)
    want = torch_backend.gated_rms_norm(x, z, w, 1e-5, 24)
    with gpu.forced():
        got = torch_backend.gated_rms_norm(x, z, w, 1e-5, 24)
    assert got.dtype == want.dtype == torch.promote_types(w_dtype, dtype) and got.shape == want.shape
    assert_within(got, want, _bound(want, 24, dtype, want.dtype, True), f"gated_rms_norm {dtype} x {w_dtype}")
    # a group normalised over the wrong columns fails the bound
    wrong = torch_backend.gated_rms_norm(x, z, w, 1e-5, 48)
    with pytest.raises(AssertionError, match="exceeds its bound"):
        assert_within(got, wrong, _bound(want, 24, dtype, want.dtype, True))
    assert launches == ["_norm_kernel"]


def test_gated_norm_reads_the_gate_and_x_in_place_as_slices_of_wider_rows(launches, monkeypatch):
    """As the model passes them: the gate a column slice of the input projection [B, T, W], x a slice
    too; the kernel reads both by their row strides (no copy) and writes a contiguous output."""
    g = torch.Generator().manual_seed(2)
    proj = torch.randn(2, 3, 96 + 40, generator=g).to(torch.bfloat16)
    z, x = proj[..., 5:53], proj[..., 60:108]                             # 48 columns each, rows 136 apart
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(torch.bfloat16)
    copies = []
    real = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda t, *a, **k: (copies.append(t.shape), real(t, *a, **k))[1])
    want = torch_backend.gated_rms_norm(x, z, w, 1e-5, 12)
    copies.clear()
    with gpu.forced():
        got = torch_backend.gated_rms_norm(x, z, w, 1e-5, 12)
    monkeypatch.undo()
    assert launches == ["_norm_kernel"] and got.is_contiguous() and got.shape == x.shape
    assert all(shape == (48,) for shape in copies), copies                 # only the weight's (a no-op)
    assert_within(got, want, _bound(want, 12, torch.bfloat16, torch.bfloat16, True), "strided gated norm")


@pytest.mark.parametrize("call, reason", [
    (lambda: torch_backend.rms_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-5),
     "dtypes"),
    (lambda: torch_backend.gated_rms_norm(torch.ones(1, 2 * 16400), torch.ones(1, 2 * 16400), torch.ones(2 * 16400),
                                          1e-5, 16400), "group of 16400"),
    (lambda: torch_backend.gated_rms_norm(torch.ones(2, 8), torch.ones(2, 8), torch.ones(1, 8), 1e-5, 4),
     "weight or gate shape"),
])
def test_declines_run_the_torch_op_and_say_so(call, reason, caplog, monkeypatch, launches):
    monkeypatch.setattr(gpu, "_warned", set())
    want = call()
    with caplog.at_level(logging.WARNING, logger="nemospec.gpu"), gpu.forced():
        got = call()
    assert torch.equal(got, want) and launches == [] and reason in caplog.text
