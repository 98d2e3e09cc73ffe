"""Hidden capture on the GPU path: the residual add of the layer whose output a draft reads also
writes that output into its capture slot, in one launch (``plugins/hidden_capture.py``'s kernel in its
functional form), so capturing costs no launch beyond the add the layer makes anyway.

Declines (the torch op runs): dtypes other than fp32/fp16/bf16, tensors on different devices.
"""
from __future__ import annotations

import torch

from builder.backends import gpu
from plugins import hidden_capture as capture

OP = "hidden_capture"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@gpu.register(OP)
def hidden_capture(residual, delta, buffer, slot):
    """``torch_backend.hidden_capture`` as one kernel launch: (x_new, buffer_new), or None (declined)."""
    if capture.tl is None:
        gpu.fallback(OP, "triton is not installed")
        return None
    if residual.dtype not in DTYPES:
        gpu.fallback(OP, f"dtype {residual.dtype}")
        return None
    if any(t is not None and t.device != residual.device for t in (delta, buffer)):
        gpu.fallback(OP, "tensors on different devices")
        return None
    return capture.hidden_capture_triton_functional(residual, delta, buffer, int(slot))
