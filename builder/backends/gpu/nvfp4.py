"""W4A16 NVFP4 products for few rows: ``linear_nvfp4`` and the DSpark FP4 Markov head on the GPU path,
both launching the one kernel of ``plugins/nvfp4_rows.py``.

A step's linears see 1..K+1 token rows, so the product is a GEMV-like sweep over the weight: each
program owns ``BLOCK_N`` output features, streams their FP4 bytes and FP8 block scales over K once,
decodes them in registers and accumulates ``x @ W.T`` in fp32 for all (<= 16) rows at once. The
weight is never materialised in 16 bits. Numerics follow the torch op (``torch_backend.linear_nvfp4``):
block scale ``fp8 * scale_2`` rounded to x's dtype, then ``e2m1 * block scale`` rounded to x's
dtype, so the weights are bit-identical to the reference's and only the summation order differs
(|kernel - torch| <= 2 gamma_K sum|x w| + two roundings of the output to x's dtype; see the tests).

Declines (the torch op runs): more than 16 rows, stacked weights (3-D shapes), dtypes other than
fp32/fp16/bf16, layouts the reference would reject, tensors on different devices. The Markov head
checks its inputs as its reference does (same errors) and declines only tensors on different devices.
"""
from __future__ import annotations

import torch

from builder.backends import gpu
from plugins import fp4_markov_head as markov
from plugins import nvfp4_rows

OP = "linear_nvfp4"
MARKOV_OP = "fp4_markov_head"
MAX_ROWS = 16
BLOCK_SIZE = nvfp4_rows.BLOCK_SIZE


def _launch(kernel, grid, *args, **meta):
    """One kernel launch (a seam for tests counting launches)."""
    gpu.jit(kernel)[grid](*args, **meta)


def _decline(x, packed, scale, scale_2, shape, bias=None):
    """Why the kernel does not take these inputs, or None."""
    if nvfp4_rows.tl is None:
        return "triton is not installed"
    if len(shape) != 2:
        return "stacked (3-D) weights"
    n, k = (int(d) for d in shape)
    if x.dtype not in nvfp4_rows.ROUNDING:
        return f"activation dtype {x.dtype}"
    if x.dim() < 1 or x.shape[-1] != k or k <= 0 or n <= 0 or k % BLOCK_SIZE:
        return "shapes the reference rejects"
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (n, k // 2):
        return "packed weight layout"
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (n, k // BLOCK_SIZE):
        return "block scale layout"
    if not isinstance(scale_2, torch.Tensor) or scale_2.dtype != torch.float32 or scale_2.numel() != 1:
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


def _linear_fake(x, packed, scale, scale_2, shape, bias=None):
    return x.new_empty((*x.shape[:-1], int(shape[0])))


@gpu.register(OP, "(Tensor x, Tensor packed, Tensor scale, Tensor scale_2, int[] shape, Tensor? bias=None) -> Tensor",
              _decline, _linear_fake)
def linear_nvfp4(x, packed, scale, scale_2, shape, bias=None):
    """``torch_backend.linear_nvfp4`` for <= 16 rows: [..., N] in x's dtype."""
    n, k = (int(d) for d in shape)
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    f32_dot = x.dtype == torch.float32 or gpu.interpreting()   # the interpreter's 16-bit dot is wrong
    nvfp4_rows.launch(_launch, x2, packed.contiguous(), scale.contiguous().view(torch.uint8), scale_2.reshape(1),
                      out, rows, n, k, bias=bias.contiguous() if bias is not None else None, f32_dot=f32_dot)
    return out.reshape(*x.shape[:-1], n)


def _markov_check(logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2):
    if nvfp4_rows.tl is None:
        return "triton is not installed"
    if any(t.device != logits.device for t in (prev_ids, w1, w2_packed, w2_scale)):
        return "tensors on different devices"
    return None


def _markov_fake(logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


@gpu.register(MARKOV_OP, "(Tensor logits, Tensor prev_ids, Tensor w1, Tensor w2_packed, Tensor w2_scale, "
              "Tensor w2_scale_2) -> Tensor", _markov_check, _markov_fake)
def fp4_markov_head(logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2):
    """The DSpark Markov head (``plugins/fp4_markov_head.py``) on the same kernel."""
    return markov.fp4_markov_head_triton(logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2)
