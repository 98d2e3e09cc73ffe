"""torch <-> TensorRT data types (shared by the network recorder and the refit map)."""
from __future__ import annotations

import torch

from builder.backends.trt_import import trt

_TORCH_TO_TRT = {
    torch.float32: trt.float32,
    torch.float16: trt.float16,
    torch.bfloat16: trt.bfloat16,
    torch.int32: trt.int32,
    torch.int64: trt.int64,
    torch.int8: trt.int8,
    torch.uint8: trt.uint8,
    torch.bool: trt.bool,
}
_TRT_TO_TORCH = {v: k for k, v in _TORCH_TO_TRT.items()}


def trt_dtype(dtype: torch.dtype):
    try:
        return _TORCH_TO_TRT[dtype]
    except KeyError:
        raise TypeError(f"no TensorRT data type for torch dtype {dtype}") from None


def torch_dtype(dtype) -> torch.dtype:
    try:
        return _TRT_TO_TORCH[dtype]
    except KeyError:
        raise TypeError(f"no torch dtype for TensorRT data type {dtype}") from None
