"""CPU evaluation of a built TensorRT ``INetworkDefinition``, layer by layer, with torch.

This is how CI proves a lowering computes what the eager path computes on machines with no GPU: it
reads the network TensorRT would build (layer types, attributes, constants) and evaluates each layer
with its documented semantics, in the layer's declared data type (torch, so bf16 works). It knows
nothing of how the network was recorded (it must not import the backend that recorded it).

``run_network(network, inputs)`` returns every marked output by name. A layer type it does not know
raises :class:`UnsupportedLayerError` naming the layer.

This module schedules the layers and dispatches each to its evaluator: ``layers`` (the native compute
layers), ``weights`` (constants in every data type, FP8/FP4 included, and dequantize); ``base`` holds
what they share (errors, data types, the per-layer context).
"""
from __future__ import annotations

import math

import torch

from builder.backends.trt_import import trt
from builder.interpreter.base import _FP4, _LT, InterpreterError, UnsupportedLayerError, _Ctx, _torch_dtype
from builder.interpreter.layers import (_activation, _cast, _concat, _cumulative, _einsum, _elementwise, _fill,
                                        _gather, _identity, _matmul, _reduce, _scatter, _select, _shape, _shuffle,
                                        _slice, _softmax, _squeeze, _topk, _unary, _unsqueeze)
from builder.interpreter.weights import _constant_low_precision, _decode_fp4, _dequantize

_CLASSES = {
    _LT.ACTIVATION: trt.IActivationLayer,
    _LT.CAST: trt.ICastLayer,
    _LT.CONCATENATION: trt.IConcatenationLayer,
    _LT.CONSTANT: trt.IConstantLayer,
    _LT.CUMULATIVE: trt.ICumulativeLayer,
    _LT.EINSUM: trt.IEinsumLayer,
    _LT.ELEMENTWISE: trt.IElementWiseLayer,
    _LT.FILL: trt.IFillLayer,
    _LT.GATHER: trt.IGatherLayer,
    _LT.IDENTITY: trt.IIdentityLayer,
    _LT.MATRIX_MULTIPLY: trt.IMatrixMultiplyLayer,
    _LT.REDUCE: trt.IReduceLayer,
    _LT.SCATTER: trt.IScatterLayer,
    _LT.SELECT: trt.ISelectLayer,
    _LT.SHAPE: trt.IShapeLayer,
    _LT.SHUFFLE: trt.IShuffleLayer,
    _LT.SLICE: trt.ISliceLayer,
    _LT.SOFTMAX: trt.ISoftMaxLayer,
    _LT.TOPK: trt.ITopKLayer,
    _LT.UNARY: trt.IUnaryLayer,
}
for _name, _cls in (("SQUEEZE", "ISqueezeLayer"), ("UNSQUEEZE", "IUnsqueezeLayer")):
    if hasattr(_LT, _name) and hasattr(trt, _cls):
        _CLASSES[getattr(_LT, _name)] = getattr(trt, _cls)
_CLASSES[_LT.DEQUANTIZE] = trt.IDequantizeLayer

_HANDLERS = {
    _LT.ACTIVATION: _activation,
    _LT.CAST: _cast,
    _LT.CONCATENATION: _concat,
    _LT.CONSTANT: _constant_low_precision,
    _LT.CUMULATIVE: _cumulative,
    _LT.EINSUM: _einsum,
    _LT.ELEMENTWISE: _elementwise,
    _LT.FILL: _fill,
    _LT.GATHER: _gather,
    _LT.IDENTITY: _identity,
    _LT.MATRIX_MULTIPLY: _matmul,
    _LT.REDUCE: _reduce,
    _LT.SCATTER: _scatter,
    _LT.SELECT: _select,
    _LT.SHAPE: _shape,
    _LT.SHUFFLE: _shuffle,
    _LT.SLICE: _slice,
    _LT.SOFTMAX: _softmax,
    _LT.TOPK: _topk,
    _LT.UNARY: _unary,
}
if hasattr(_LT, "SQUEEZE"):
    _HANDLERS[_LT.SQUEEZE] = _squeeze
if hasattr(_LT, "UNSQUEEZE"):
    _HANDLERS[_LT.UNSQUEEZE] = _unsqueeze
_HANDLERS[_LT.DEQUANTIZE] = _dequantize
SUPPORTED_LAYER_TYPES = tuple(sorted(t.name for t in _CLASSES))


def _check_output(ctx, tensor, value: torch.Tensor, j: int):
    want = _torch_dtype(tensor.dtype, ctx.where)
    if value.dtype != want:
        ctx.fail(f"output {j} computed as {value.dtype}, declared {want}")
    declared = tuple(tensor.shape)
    if len(declared) != value.dim() or any(d >= 0 and d != v for d, v in zip(declared, value.shape)):
        ctx.fail(f"output {j} has shape {tuple(value.shape)}, declared {declared}")


def _schedule(network) -> list[int]:
    """Layer indices in network order, except that a layer whose input is set later (``set_input``
    with a tensor made afterwards) waits for its producer: a stable topological order."""
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    producer = {}
    for i, layer in enumerate(layers):
        for j in range(layer.num_outputs):
            producer[layer.get_output(j).name] = i
    deps = []
    for layer in layers:
        names = [layer.get_input(j) for j in range(layer.num_inputs)]
        deps.append([producer[t.name] for t in names if t is not None and t.name in producer])
    if all(d < i for i, ds in enumerate(deps) for d in ds):
        return list(range(len(layers)))
    order, state = [], [0] * len(layers)  # 0 new, 1 visiting, 2 done
    for root in range(len(layers)):
        stack = [(root, 0)]
        while stack:
            i, k = stack.pop()
            if state[i] == 2:
                continue
            state[i] = 1
            if k < len(deps[i]):
                stack.append((i, k + 1))
                d = deps[i][k]
                if state[d] == 1:
                    raise InterpreterError(f"layer {i} {layers[i].name!r} is part of a cycle")
                if state[d] == 0:
                    stack.append((d, 0))
                continue
            state[i] = 2
            order.append(i)
    return order


def run_network(network, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Evaluate every layer of ``network`` on CPU torch tensors; returns all marked outputs by name."""
    env: dict[str, torch.Tensor] = {}
    for i in range(network.num_inputs):
        t = network.get_input(i)
        if t.name not in inputs:
            raise InterpreterError(f"network input {t.name!r} was not given")
        value = torch.as_tensor(inputs[t.name]).cpu()
        if t.dtype == _FP4 and value.dtype == torch.uint8:  # packed bytes as bound at load: decode them
            value = _decode_fp4(value.reshape(-1), math.prod(value.shape) * 2).reshape(*value.shape[:-1], -1)
        want = _torch_dtype(t.dtype, f"input {t.name!r}")
        if value.dtype != want:
            raise InterpreterError(f"network input {t.name!r} is {value.dtype}, the network declares {want}")
        shape = tuple(t.shape)
        if len(shape) != value.dim() or any(d >= 0 and d != v for d, v in zip(shape, value.shape)):
            raise InterpreterError(f"network input {t.name!r} has shape {tuple(value.shape)}, declared {shape}")
        env[t.name] = value
    for i in _schedule(network):
        layer = network.get_layer(i)
        kind = layer.type
        ctx = _Ctx(i, layer)
        handler = _HANDLERS.get(kind)
        if handler is None:
            raise UnsupportedLayerError(f"{ctx.where}: layer type {kind.name} is not supported by the interpreter "
                                        f"(supported: {', '.join(SUPPORTED_LAYER_TYPES)})")
        ins = []
        for j in range(layer.num_inputs):
            t = layer.get_input(j)
            if t is None:
                ins.append(None)
                continue
            if t.name not in env:
                ctx.fail(f"input {j} {t.name!r} has not been computed")
            ins.append(env[t.name])
        layer.__class__ = _CLASSES[kind]
        try:
            outs = handler(ctx, layer, ins)
        except InterpreterError:
            raise
        except Exception as exc:  # a torch error inside a layer: say which layer
            raise InterpreterError(f"{ctx.where}: {type(exc).__name__}: {exc}") from exc
        for j, value in enumerate(outs):
            tensor = layer.get_output(j)
            _check_output(ctx, tensor, value, j)
            env[tensor.name] = value
    return {network.get_output(i).name: env[network.get_output(i).name] for i in range(network.num_outputs)}
