"""W4A16 NVFP4 products for few rows: ``linear_nvfp4`` as one Triton-lang kernel.

A step's linears see 1..K+1 token rows, so the product is a GEMV-like sweep over the weight: each
program owns ``BLOCK_N`` output features, streams their FP4 bytes and FP8 block scales over K once,
decodes them in registers and accumulates ``x @ W.T`` in fp32 for all (<= 16) rows at once. The
weight is never materialised in 16 bits. Numerics follow the torch op (``torch_backend.linear_nvfp4``):
block scale ``fp8 * scale_2`` rounded to x's dtype, then ``e2m1 * block scale`` rounded to x's
dtype, so the weights are bit-identical to the reference's and only the summation order differs
(|kernel - torch| <= 2 gamma_K sum|x w| + two roundings of the output to x's dtype; see the tests).

Declines (the torch op runs): more than 16 rows, stacked weights (3-D shapes), dtypes other than
fp32/fp16/bf16, layouts the reference would reject, tensors on different devices.
"""
from __future__ import annotations

import torch

from builder.backends import gpu

try:
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency
    tl = None

OP = "linear_nvfp4"
MAX_ROWS = 16
BLOCK_SIZE = 16          # NVFP4: one FP8 scale per 16 inputs
_ROUND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


if tl is not None:

    def _nvfp4_kernel(x_ptr, w_ptr, s_ptr, s2_ptr, b_ptr, o_ptr, M, N, K, sxm, sxk,
                      HAS_BIAS: tl.constexpr, ROUND: tl.constexpr, F32_DOT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program n: out[:, n-block] = x @ W[n-block].T (+ bias), W decoded per K block here.

        ROUND: 0 keeps the decoded weight in fp32, 1 rounds it to fp16, 2 to bf16 (by bits: the
        interpreter's bf16 cast truncates, so the rounding is written out to match torch's RNE)."""
        rows = tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        cols64 = cols.to(tl.int64)
        scale_2 = tl.load(s2_ptr).to(tl.float32)
        half = tl.arange(0, BLOCK_K // 2)
        nblk = tl.arange(0, BLOCK_K // 16)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            # FP4 codes: BLOCK_K/2 bytes per row, low nibble = even element; interleave back to K order
            bmask = col_ok[:, None] & ((k0 // 2 + half) < K // 2)[None, :]
            byte = tl.load(w_ptr + cols64[:, None] * (K // 2) + (k0 // 2 + half)[None, :], mask=bmask,
                           other=0).to(tl.int32)
            code = tl.reshape(tl.join(byte & 15, byte >> 4), (BLOCK_N, BLOCK_K))
            mag = code & 7
            exp, man = mag >> 1, (mag & 1).to(tl.float32)
            value = tl.where(exp == 0, 0.5 * man,
                             (1.0 + 0.5 * man) * tl.where(exp == 3, 4.0, tl.where(exp == 2, 2.0, 1.0)))
            value = tl.where(code >= 8, -value, value)
            # FP8 E4M3 block scales, one per 16: decoded once per block, then broadcast over its 16
            smask = col_ok[:, None] & ((k0 // 16 + nblk) < K // 16)[None, :]
            sbyte = tl.load(s_ptr + cols64[:, None] * (K // 16) + (k0 // 16 + nblk)[None, :], mask=smask,
                            other=0).to(tl.int32)
            sexp, sman = (sbyte >> 3) & 15, sbyte & 7
            normal = (((sexp + 120) << 23) | (sman << 20)).to(tl.float32, bitcast=True)
            scale = tl.where(sexp == 0, sman.to(tl.float32) * 0.001953125, normal)   # subnormal: m * 2^-9
            scale = tl.where((sbyte & 0x7F) == 0x7F, float("nan"), scale)
            scale = tl.where(sbyte >= 128, -scale, scale) * scale_2
            if ROUND == 1:
                scale = scale.to(tl.float16).to(tl.float32)
            elif ROUND == 2:
                bits = scale.to(tl.int32, bitcast=True)
                scale = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
            scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // 16, 16)),
                               (BLOCK_N, BLOCK_K))
            w = value * scale
            if ROUND == 1:
                w = w.to(tl.float16).to(tl.float32)
            elif ROUND == 2:
                bits = w.to(tl.int32, bitcast=True)
                w = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * sxm + ks[None, :] * sxk,
                        mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
            if F32_DOT:
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:  # 16-bit operands on the tensor cores (w is exact in x's dtype)
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if ROUND == 2:
            bits = acc.to(tl.int32, bitcast=True)
            acc = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        tl.store(o_ptr + rows[:, None] * N + cols64[None, :], acc.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
else:  # pragma: no cover
    _nvfp4_kernel = None


def _launch(kernel, grid, *args, **meta):
    """One kernel launch (a seam for tests counting launches)."""
    gpu.jit(kernel)[grid](*args, **meta)


def _decline(x, packed, scale, scale_2, shape, bias):
    """Why the kernel does not take these inputs, or None."""
    if tl is None:
        return "triton is not installed"
    if len(shape) != 2:
        return "stacked (3-D) weights"
    n, k = shape
    if x.dtype not in _ROUND:
        return f"activation dtype {x.dtype}"
    if x.dim() < 1 or x.shape[-1] != k or k <= 0 or n <= 0 or k % BLOCK_SIZE:
        return "shapes the reference rejects"
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (n, k // 2):
        return "packed weight layout"
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (n, k // BLOCK_SIZE):
        return "block scale layout"
    if scale_2.dtype != torch.float32 or scale_2.numel() != 1:
        return "global scale layout"
    if bias is not None and (bias.dtype != x.dtype or tuple(bias.shape) != (n,)):
        return "bias dtype or shape"
    if any(t.device != x.device for t in (packed, scale, scale_2) + ((bias,) if bias is not None else ())):
        return "tensors on different devices"
    rows = x.numel() // k
    if rows == 0:
        return "no rows"
    if rows > MAX_ROWS:
        return f"more than {MAX_ROWS} rows"
    return None


@gpu.register(OP)
def linear_nvfp4(x, packed, scale, scale_2, shape, bias=None):
    """``torch_backend.linear_nvfp4`` for <= 16 rows: [..., N] in x's dtype, or None (declined)."""
    shape = tuple(int(d) for d in shape)
    reason = _decline(x, packed, scale, scale_2, shape, bias)
    if reason is not None:
        gpu.fallback(OP, reason)
        return None
    n, k = shape
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_n = 64 if n >= 64 else max(16, 1 << (n - 1).bit_length())
    block_k = 128 if k % 128 == 0 else (64 if k % 64 == 0 else 32)   # K % 16 == 0: masks cover the rest
    f32_dot = x.dtype == torch.float32 or gpu.interpreting()   # the interpreter's 16-bit dot is wrong
    bias_t = bias.contiguous() if bias is not None else x2
    _launch(_nvfp4_kernel, (-(-n // block_n),), x2, packed.contiguous(), scale.contiguous().view(torch.uint8),
            scale_2.reshape(1), bias_t, out, rows, n, k, x2.stride(0), x2.stride(1),
            HAS_BIAS=bias is not None, ROUND=_ROUND[x.dtype], F32_DOT=f32_dot,
            BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k)
    return out.reshape(*x.shape[:-1], n)
