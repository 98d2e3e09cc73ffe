"""Constant layers read from the network (numpy arrays, and the bytes behind ``trt.Weights`` numpy
cannot view: bf16, FP8, FP4) and the dequantize layer (NVFP4 weights: builder/nvfp4_format.py)."""
from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from builder.interpreter.base import _FP4, _FP4_CONTAINER, _FP8, _ITEM_BYTES, InterpreterError, _dims, _torch_dtype


# --- constants -------------------------------------------------------------------------------------
def _weights_bytes(weights, dtype, count: int) -> bytes:
    """Raw bytes of a ``trt.Weights`` numpy cannot view (bf16): see ``_raw_weights``."""
    return _raw_weights(weights, dtype, count, count * _ITEM_BYTES[dtype])


def _constant(ctx, layer, ins):
    dtype = layer.get_output(0).dtype
    shape = _dims(layer.shape)
    count = math.prod(shape)
    weights = layer.weights
    if isinstance(weights, np.ndarray):
        arr = weights
        value = torch.from_numpy(np.array(arr, copy=arr.nbytes < _VIEW_BYTES or not arr.flags.writeable))
        if value.dtype != _torch_dtype(dtype, ctx.where):
            value = value.to(_torch_dtype(dtype, ctx.where))
    elif dtype in _ITEM_BYTES:
        raw = _weights_bytes(weights, dtype, count)
        value = _bytes_tensor(raw).view(torch.int16).view(_torch_dtype(dtype, ctx.where))
    else:
        ctx.unsupported(f"constant of type {dtype} cannot be read")
    if value.numel() != count:
        ctx.fail(f"constant holds {value.numel()} values for shape {shape}")
    return [value.reshape(shape)]


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _raw_weights(weights, dtype, count: int, nbytes: int) -> bytes:
    """The bytes behind a constant's ``trt.Weights``, read from its C++ struct through the pybind11
    instance (numpy cannot view bf16/FP8/FP4). ``nvinfer1::Weights`` is {DataType type; const void*
    values; int64_t count}."""
    holder = ctypes.c_void_p.from_address(id(weights) + object.__basicsize__).value
    if not holder:
        raise InterpreterError("cannot locate the data of a constant's weights")
    kind = ctypes.c_int32.from_address(holder).value
    values = ctypes.c_void_p.from_address(holder + 8).value
    n = ctypes.c_int64.from_address(holder + 16).value
    if kind != int(dtype) or n != count or not values:
        raise InterpreterError(f"unexpected weights layout (type {kind} vs {int(dtype)}, count {n} vs {count})")
    if nbytes >= _VIEW_BYTES:  # a weight: viewed where it lies (the recorder keeps it alive), not copied
        return (ctypes.c_char * nbytes).from_address(values)
    return ctypes.string_at(values, nbytes)


#: constants at least this large are read in place (full-width weights would otherwise be copied twice)
_VIEW_BYTES = 1 << 20


def _bytes_tensor(raw) -> torch.Tensor:
    """uint8 tensor over ``raw``: a view of a ctypes array, or a copy of small ``bytes``."""
    return torch.frombuffer(raw if not isinstance(raw, bytes) else bytearray(raw), dtype=torch.uint8)


def _constant_low_precision(ctx, layer, ins):
    """FP8 and FP4 constants (FP4: two values per byte, element 2i in the low nibble); others as before."""
    dtype = layer.get_output(0).dtype
    if dtype not in (_FP4, _FP8) or dtype is None:
        return _constant(ctx, layer, ins)
    shape = _dims(layer.shape)
    count = math.prod(shape)
    if dtype == _FP8:
        raw = _raw_weights(layer.weights, dtype, count, count)
        value = _bytes_tensor(raw).view(torch.float8_e4m3fn)
        return [value.reshape(shape)]
    raw = _raw_weights(layer.weights, dtype, count, (count + 1) // 2)
    return [_decode_fp4(_bytes_tensor(raw), count).reshape(shape)]


def _decode_fp4(packed: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` E2M1 values (in the FP4 container) of packed bytes, element 2i in the low nibble."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(-1)[:count]
    return _E2M1[codes.long()].to(_FP4_CONTAINER)


def _dequantize(ctx, layer, ins):
    """``to_type((x * scale))`` computed in fp32: per-tensor (scalar scale), per-axis (1-D scale along
    ``axis``) or block quantization (scale of the input's rank; a dim of the scale smaller than the
    input's is blocked, block = input dim / scale dim)."""
    x, scale = ins[0], ins[1]
    if len(ins) > 2 and ins[2] is not None and bool(ins[2].ne(0).any()):
        ctx.unsupported("dequantize with a nonzero zero point")
    target = _torch_dtype(layer.to_type, ctx.where)
    xf, s = x.float(), scale.float()
    if s.numel() == 1 and s.dim() <= 1:
        s = s.reshape([1] * xf.dim())
    elif s.dim() == 1:
        axis = layer.axis % xf.dim()
        if s.shape[0] != xf.shape[axis]:
            ctx.fail(f"per-axis scale of {s.shape[0]} values for axis {axis} of {list(xf.shape)}")
        s = s.reshape([-1 if a == axis else 1 for a in range(xf.dim())])
    elif s.dim() == xf.dim():
        for a in range(xf.dim()):
            if s.shape[a] != xf.shape[a]:
                if s.shape[a] == 0 or xf.shape[a] % s.shape[a]:
                    ctx.fail(f"block scale {list(s.shape)} does not tile input {list(xf.shape)} on axis {a}")
                s = s.repeat_interleave(xf.shape[a] // s.shape[a], dim=a)
    else:
        ctx.fail(f"scale of shape {list(s.shape)} for input {list(xf.shape)}")
    return [(xf * s).to(target)]
