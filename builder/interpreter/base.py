"""What every part of the CPU interpreter shares: its errors, the TensorRT -> torch data types (FP8
and FP4 included), the per-layer context that names a failing layer, and small attribute readers."""
from __future__ import annotations

import torch

from builder.backends.trt_import import trt


class InterpreterError(RuntimeError):
    """The network could not be evaluated (bad inputs, or a layer broke its own contract)."""


class UnsupportedLayerError(InterpreterError, NotImplementedError):
    """The interpreter has no implementation for a layer type (or one of its modes)."""


_DTYPES = {
    trt.float32: torch.float32,
    trt.float16: torch.float16,
    trt.bfloat16: torch.bfloat16,
    trt.int32: torch.int32,
    trt.int64: torch.int64,
    trt.int8: torch.int8,
    trt.uint8: torch.uint8,
    trt.bool: torch.bool,
}
_NUMPY_OK = {trt.float32, trt.float16, trt.int32, trt.int64, trt.int8, trt.uint8, trt.bool}
_ITEM_BYTES = {trt.bfloat16: 2}

_LT = trt.LayerType

# FP8 (E4M3) tensors are held as torch.float8_e4m3fn. FP4 (E2M1) tensors are held decoded, as
# torch.float8_e5m2: every E2M1 value (0, +-0.5 ... +-6) is exact there, and TensorRT has no E5M2 type
# of its own, so the container cannot be confused with a real tensor type.
_FP4 = getattr(trt.DataType, "FP4", None)
_FP8 = getattr(trt.DataType, "FP8", None)
_FP4_CONTAINER = torch.float8_e5m2
if _FP8 is not None:
    _DTYPES[_FP8] = torch.float8_e4m3fn
if _FP4 is not None:
    _DTYPES[_FP4] = _FP4_CONTAINER


def _torch_dtype(dtype, where: str) -> torch.dtype:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise UnsupportedLayerError(f"{where}: data type {dtype} is not supported by the interpreter") from None


def _axes(mask: int, rank: int) -> list[int]:
    return [i for i in range(rank) if mask >> i & 1]


def _dims(d) -> list[int]:
    return [] if d is None else [int(v) for v in d]


class _Ctx:
    def __init__(self, index, layer):
        self.index, self.layer, self.kind = index, layer, layer.type

    @property
    def where(self) -> str:
        return f"layer {self.index} {self.layer.name!r} ({self.kind.name})"

    def fail(self, message):
        raise InterpreterError(f"{self.where}: {message}")

    def unsupported(self, message):
        raise UnsupportedLayerError(f"{self.where}: {message}")


def _ints(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t.reshape(-1).tolist()]

