"""The one Triton-lang kernel for NVFP4 (ModelOpt W4A16) weights times a few rows: ``x @ W.T``.

Two ops stand on it: ``linear_nvfp4`` on the GPU path (``builder/backends/gpu/nvfp4.py``: a step's
1..K+1 token rows, an optional bias) and the DSpark FP4 Markov head (``plugins/fp4_markov_head.py``:
each row of x gathered from the table W1 by the previous token, the logits added). Each program owns
``BLOCK_N`` output features and every row of its row block, streams their FP4 bytes and FP8 block
scales over K once (one byte load per two codes, one scale decode per 16), decodes them in
registers and accumulates in fp32: the weight is read once per row block and never materialised.

Numerics follow the torch ops: block scale ``fp8 * scale_2`` and then ``e2m1 * block scale``, each
rounded to the activations' dtype (ROUND: 0 fp32, 1 fp16, 2 bf16, by bits, since the interpreter's
bf16 cast truncates), so the weights equal the reference's bit for bit and only the summation order
differs. A gathered row whose index is outside the table comes out NaN (never another row's values).
"""
from __future__ import annotations

import torch

try:
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency
    tl = None

BLOCK_SIZE = 16          # NVFP4: one FP8 scale per 16 inputs
BLOCK_M = 16             # rows per program (tl.dot's smallest M)
ROUNDING = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


if tl is not None:

    def _nvfp4_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, s2_ptr, s2_value, b_ptr, add_ptr, o_ptr, M, N, K, sxm, sxk,
                      TABLE, S2_PTR: tl.constexpr, GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr,
                      ROUND: tl.constexpr, F32_DOT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (n block, row block): out = x @ W[n-block].T (+ bias) (+ add), W decoded per K block.

        GATHER: row m of x is row ids[m] of the table at x_ptr (TABLE rows). ADD: out += add[m, n] in
        fp32 after the sum (the Markov head's logits). S2_PTR: the global scale is read from s2_ptr (a
        device tensor: no host sync, capturable in a CUDA graph), else it is s2_value."""
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        cols64, rows64 = cols.to(tl.int64), rows.to(tl.int64)
        if GATHER:
            src = tl.load(ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
            src_ok = (src >= 0) & (src < TABLE)
            x_ok = row_ok & src_ok
            src = tl.where(src_ok, src, 0)
        else:
            src, x_ok = rows64, row_ok
        if S2_PTR:
            scale_2 = tl.load(s2_ptr).to(tl.float32)
        else:
            scale_2 = s2_value
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
                scale = tl.where(scale != scale, scale,   # NaN stays NaN (0x7FFFFFFF would carry into the sign)
                             ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True))
            scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // 16, 16)),
                               (BLOCK_N, BLOCK_K))
            w = value * scale
            if ROUND == 1:
                w = w.to(tl.float16).to(tl.float32)
            elif ROUND == 2:
                bits = w.to(tl.int32, bitcast=True)
                w = tl.where(w != w, w,   # NaN stays NaN (0x7FFFFFFF would carry into the sign)
                             ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True))
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + src[:, None] * sxm + ks[None, :] * sxk,
                        mask=x_ok[:, None] & (ks < K)[None, :], other=0.0)
            if F32_DOT:
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:  # 16-bit operands on the tensor cores (w is exact in x's dtype)
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        omask = row_ok[:, None] & col_ok[None, :]
        offsets = rows64[:, None] * N + cols64[None, :]
        if HAS_ADD:
            acc = tl.load(add_ptr + offsets, mask=omask, other=0.0).to(tl.float32) + acc
        if GATHER:
            acc = tl.where(x_ok[:, None], acc, float("nan"))
        if ROUND == 2:
            bits = acc.to(tl.int32, bitcast=True)
            acc = tl.where(acc != acc, acc,   # NaN stays NaN (0x7FFFFFFF would carry into the sign)
                         ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True))
        tl.store(o_ptr + offsets, acc.to(o_ptr.dtype.element_ty), mask=omask)
else:  # pragma: no cover
    _nvfp4_kernel = None


def block_sizes(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): 64 features per program (fewer for a narrow weight), K in blocks of 128 where
    it divides (the masks cover a K that is only a multiple of 16)."""
    block_n = 64 if n >= 64 else max(16, 1 << (n - 1).bit_length())
    block_k = 128 if k % 128 == 0 else (64 if k % 64 == 0 else 32)
    return block_n, block_k


def launch(run, x, packed, scale_bytes, scale_2, out, rows: int, n: int, k: int, *, ids=None, table: int = 0,
           bias=None, add=None, f32_dot: bool = True, blocks: tuple | None = None) -> None:
    """``run(kernel, grid, *args, **meta)`` the kernel for ``rows`` rows of x (2-D, any strides; with
    ``ids`` a [V_prev, k] table and one index per row) into ``out`` [rows, n] (contiguous).
    ``scale_bytes`` are the FP8 scales viewed as uint8, ``scale_2`` the global scale (a one-element fp32
    tensor on x's device, or a float), ``add`` a contiguous [rows, n] tensor added in fp32. ``blocks``:
    (BLOCK_N, BLOCK_K) instead of ``block_sizes``' (powers of two, BLOCK_K >= 32: a device run sweeps
    them)."""
    block_n, block_k = blocks if blocks is not None else block_sizes(n, k)
    grid = (-(-n // block_n), -(-rows // BLOCK_M))
    dummy = out
    on_device = isinstance(scale_2, torch.Tensor)
    run(_nvfp4_kernel, grid, x, ids if ids is not None else dummy, packed, scale_bytes,
        scale_2 if on_device else dummy, 1.0 if on_device else float(scale_2),
        bias if bias is not None else dummy, add if add is not None else dummy, out, rows, n, k,
        x.stride(0), x.stride(1), table, S2_PTR=on_device,
        GATHER=ids is not None, HAS_BIAS=bias is not None, HAS_ADD=add is not None,
        ROUND=ROUNDING[x.dtype] if ids is None else 0, F32_DOT=f32_dot,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k)
