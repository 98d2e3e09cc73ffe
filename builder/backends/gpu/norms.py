"""RMSNorm and Mamba-2's gated RMSNorm on the GPU path, one launch each: the torch ops
(``torch_backend.rms_norm``, ``gated_rms_norm``) are seven to nine kernels apiece (casts, square,
mean, rsqrt, products, the SiLU gate), which inside a decode's CUDA graph cost more than the bytes
they move (full width: a norm per block plus the gated one per Mamba layer).

One program per (row, group) holds its group in registers in fp32: the gate ``g * sigmoid(g)``
multiplied in (gated; written out as g / (1 + exp(-g)): ``tl.sigmoid`` is a stdlib jit function, which
an xdist worker that imported triton uninterpreted first cannot interpret), the mean of squares,
``rsqrt(mean + eps)``. Roundings as the torch ops make
them: RMSNorm multiplies by the fp32 weight and rounds once to x's dtype; the gated norm rounds the
normalised value to x's dtype, then multiplies by the weight in the promoted dtype of the two (bf16
by bits: the interpreter's bf16 cast truncates). Only the order of the group's sum and the rsqrt's
last bits differ from torch.

Declines (the torch op runs): dtypes other than fp32/fp16/bf16, groups over :data:`MAX_GROUP`,
a weight or gate of another shape, tensors on different devices.
"""
from __future__ import annotations

import torch

from builder.backends import gpu

try:
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency
    tl = None

MAX_GROUP = 16384
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_ROUND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


if tl is not None:

    def _norm_kernel(x_ptr, g_ptr, w_ptr, o_ptr, G, groups, eps, sx, sg,
                     GATED: tl.constexpr, X_ROUND: tl.constexpr, OUT_ROUND: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row, group): out = norm(x (* silu(g))) * w over the group's G columns. x and g rows
        start sx and sg elements apart (the gate is a slice of Mamba's input projection, read in
        place); out is contiguous."""
        row = tl.program_id(0).to(tl.int64)
        grp = tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        ok = cols < G
        base = row * G * groups + grp * G
        h = tl.load(x_ptr + row * sx + grp * G + cols, mask=ok, other=0.0).to(tl.float32)
        if GATED:
            gv = tl.load(g_ptr + row * sg + grp * G + cols, mask=ok, other=0.0).to(tl.float32)
            h = h * (gv / (1.0 + tl.exp(-gv)))   # SiLU; not tl.sigmoid: a stdlib jit function (see mamba.py)
        ms = tl.reduce(h * h, 0, tl.standard._sum_combine) / G
        n = h * (1.0 / tl.sqrt(ms + eps))
        w = tl.load(w_ptr + grp * G + cols, mask=ok, other=0.0).to(tl.float32)
        if GATED:   # normalised value rounded to x's dtype first, then times the weight
            if X_ROUND == 1:
                n = n.to(tl.float16).to(tl.float32)
            elif X_ROUND == 2:
                bits = n.to(tl.int32, bitcast=True)
                n = tl.where(n != n, n,   # NaN stays NaN (0x7FFFFFFF would carry into the sign)
                             ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True))
        out = n * w
        if OUT_ROUND == 2:
            bits = out.to(tl.int32, bitcast=True)
            out = tl.where(out != out, out,   # NaN stays NaN (0x7FFFFFFF would carry into the sign)
                         ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True))
        tl.store(o_ptr + base + cols, out.to(o_ptr.dtype.element_ty), mask=ok)
else:  # pragma: no cover
    _norm_kernel = None


def _launch(kernel, grid, *args, **meta):
    """One kernel launch (a seam for tests counting launches)."""
    gpu.jit(kernel)[grid](*args, **meta)


def _decline(x, weight, width: int, gate=None):
    """Why the kernel does not take these inputs, or None."""
    if tl is None:
        return "triton is not installed"
    if x.dtype not in FLOATS or weight.dtype not in FLOATS or (gate is not None and gate.dtype not in FLOATS):
        return f"dtypes {x.dtype}, {weight.dtype}"
    if width <= 0 or width > MAX_GROUP or x.shape[-1] % width or x.numel() == 0:
        return f"group of {width} columns"
    if tuple(weight.shape) != (x.shape[-1],) or (gate is not None and gate.shape != x.shape):
        return "weight or gate shape"
    if any(t is not None and t.device != x.device for t in (weight, gate)):
        return "tensors on different devices"
    return None


def _rows(t):
    """t as [rows, C] with unit column stride: a view where the layout allows one (a column slice of
    a wider tensor does), a copy otherwise."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] == 1 else t2.contiguous()


def _run(x, gate, weight, eps, width, out_dtype):
    x2 = _rows(x)
    g2 = x2 if gate is None else _rows(gate)
    rows, groups = x2.shape[0], x2.shape[-1] // width
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _launch(_norm_kernel, (rows, groups), x2, g2, weight.contiguous(), out,
            width, groups, float(eps), x2.stride(0), g2.stride(0), GATED=gate is not None, X_ROUND=_ROUND[x.dtype],
            OUT_ROUND=_ROUND[out_dtype], BLOCK=max(16, 1 << (width - 1).bit_length()))
    return out


def _rms_norm_check(x, weight, eps):
    return _decline(x, weight, x.shape[-1])


@gpu.register("rms_norm", "(Tensor x, Tensor weight, float eps) -> Tensor", _rms_norm_check)
def rms_norm(x, weight, eps):
    """``torch_backend.rms_norm``: fp32 math, x's dtype out."""
    return _run(x, None, weight, eps, x.shape[-1], x.dtype)


def _gated_rms_norm_check(x, gate, weight, eps, group_size):
    return _decline(x, weight, int(group_size), gate)


@gpu.register("gated_rms_norm", "(Tensor x, Tensor gate, Tensor weight, float eps, int group_size) -> Tensor",
              _gated_rms_norm_check)
def gated_rms_norm(x, gate, weight, eps, group_size):
    """``torch_backend.gated_rms_norm``: out in the promoted dtype of the weight and x."""
    return _run(x, gate, weight, eps, int(group_size), torch.promote_types(weight.dtype, x.dtype))
