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


def _check(residual, delta, buffer, slot):
    if capture.tl is None:
        return "triton is not installed"
    if residual.dtype not in DTYPES:
        return f"dtype {residual.dtype}"
    if any(t is not None and t.device != residual.device for t in (delta, buffer)):
        return "tensors on different devices"
    return None


@gpu.register(OP, "(Tensor residual, Tensor? delta, Tensor buffer, int slot) -> (Tensor, Tensor)", _check)
def hidden_capture(residual, delta, buffer, slot):
    """``torch_backend.hidden_capture`` as one kernel launch: (x_new, buffer_new)."""
    return capture.hidden_capture_triton_functional(residual, delta, buffer, int(slot))
