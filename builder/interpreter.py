"""CPU evaluation of a built TensorRT ``INetworkDefinition``, layer by layer, with torch.

This is how CI proves a lowering computes what the eager path computes on machines with no GPU: it
reads the network TensorRT would build (layer types, attributes, constants) and evaluates each layer
with its documented semantics, in the layer's declared data type (torch, so bf16 works). It knows
nothing of how the network was recorded (it must not import the backend that recorded it).

``run_network(network, inputs)`` returns every marked output by name. A layer type it does not know
raises :class:`UnsupportedLayerError` naming the layer.
"""
from __future__ import annotations

import ctypes
import math

import numpy as np
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

SUPPORTED_LAYER_TYPES = tuple(sorted(t.name for t in _CLASSES))


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


# --- shapes and data movement ----------------------------------------------------------------------
def _shape(ctx, layer, ins):
    return [torch.tensor(list(ins[0].shape), dtype=torch.int64)]


def _shuffle(ctx, layer, ins):
    x = ins[0]
    x = x.permute(list(layer.first_transpose)[: x.dim()])
    if len(ins) > 1 and ins[1] is not None:
        dims = _ints(ins[1])
    else:
        dims = None if layer.reshape_dims is None else _dims(layer.reshape_dims)
    if dims is not None:
        if layer.zero_is_placeholder:
            dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
        x = x.reshape(dims)
    return [x.permute(list(layer.second_transpose)[: x.dim()])]


def _slice(ctx, layer, ins):
    x = ins[0]
    rank = x.dim()

    def param(i, attr):
        if len(ins) > i and ins[i] is not None:
            return _ints(ins[i])
        return _dims(getattr(layer, attr))

    start, size, stride = param(1, "start"), param(2, "shape"), param(3, "stride")
    fill = ins[4] if len(ins) > 4 and ins[4] is not None else None
    if len(ins) > 5 and ins[5] is not None:
        axes = [a % rank for a in _ints(ins[5])]
        full_start, full_size, full_stride = [0] * rank, list(x.shape), [1] * rank
        for j, a in enumerate(axes):
            full_start[a], full_size[a], full_stride[a] = start[j], size[j], stride[j]
        start, size, stride = full_start, full_size, full_stride
    mode = layer.mode
    out = x
    valid = torch.ones([1] * rank, dtype=torch.bool)
    for axis in range(rank):
        n = x.shape[axis]
        idx = start[axis] + torch.arange(size[axis]) * stride[axis]
        if mode == trt.SampleMode.STRICT_BOUNDS:
            if size[axis] and (idx.min() < 0 or idx.max() >= n):
                ctx.fail(f"slice out of bounds on axis {axis}: start {start}, size {size}, input {list(x.shape)}")
        elif mode == trt.SampleMode.FILL:
            ok = (idx >= 0) & (idx < n)
            valid = valid & ok.reshape([-1 if a == axis else 1 for a in range(rank)])
            idx = idx.clamp(0, max(n - 1, 0))
        elif mode == trt.SampleMode.CLAMP:
            idx = idx.clamp(0, n - 1)
        elif mode == trt.SampleMode.WRAP:
            idx = idx % n
        else:
            ctx.unsupported(f"slice mode {mode}")
        if n == 0:
            if size[axis]:
                shape = list(out.shape)
                shape[axis] = size[axis]
                out = torch.zeros(shape, dtype=x.dtype)
                valid = valid & torch.zeros([1] * rank, dtype=torch.bool)
            continue
        out = out.index_select(axis, idx)
    if mode == trt.SampleMode.FILL:
        value = torch.zeros((), dtype=x.dtype) if fill is None else fill.reshape(()).to(x.dtype)
        out = torch.where(valid, out, value)
    return [out]


def _concat(ctx, layer, ins):
    return [torch.cat(ins, dim=layer.axis)]


def _gather(ctx, layer, ins):
    data, index = ins[0], ins[1].long()
    mode, axis = layer.mode, layer.axis
    nb = layer.num_elementwise_dims
    if mode == trt.GatherMode.DEFAULT:
        if nb != 0:
            ctx.unsupported("DEFAULT gather with elementwise dims")
        n = data.shape[axis]
        index = torch.where(index < 0, index + n, index)
        flat = data.index_select(axis, index.reshape(-1))
        shape = list(data.shape[:axis]) + list(index.shape) + list(data.shape[axis + 1:])
        return [flat.reshape(shape)]
    if mode == trt.GatherMode.ELEMENT:
        return [torch.gather(data, axis, index)]
    if mode == trt.GatherMode.ND:
        k = index.shape[-1]
        batch = list(data.shape[:nb])
        if list(index.shape[:nb]) != batch:
            ctx.fail(f"ND gather batch dims differ: data {list(data.shape)}, indices {list(index.shape)}")
        queries = list(index.shape[nb:-1])
        nbatch = math.prod(batch)
        d = data.reshape([nbatch] + list(data.shape[nb:]))
        idx = index.reshape(nbatch, -1, k)
        rows = torch.arange(nbatch)[:, None].expand(idx.shape[:2])
        picked = d[(rows,) + tuple(idx[..., j] for j in range(k))]
        return [picked.reshape(batch + queries + list(data.shape[nb + k:]))]
    ctx.unsupported(f"gather mode {mode}")


def _scatter(ctx, layer, ins):
    data, index, updates = ins[0], ins[1].long(), ins[2]
    out = data.clone()
    if layer.mode == trt.ScatterMode.ELEMENT:
        return [out.scatter_(layer.axis, index, updates)]
    if layer.mode == trt.ScatterMode.ND:
        k = index.shape[-1]
        idx = index.reshape(-1, k)
        upd = updates.reshape([idx.shape[0]] + list(data.shape[k:]))
        out[tuple(idx[:, j] for j in range(k))] = upd
        return [out]
    ctx.unsupported(f"scatter mode {layer.mode}")


def _fill(ctx, layer, ins):
    dtype = _torch_dtype(layer.get_output(0).dtype, ctx.where)
    if layer.operation != trt.FillOperation.LINSPACE:
        ctx.unsupported(f"fill operation {layer.operation}")
    shape = _ints(ins[0]) if len(ins) > 0 and ins[0] is not None else _dims(layer.shape)
    rank = len(shape)
    alpha = ins[1].reshape(()) if len(ins) > 1 and ins[1] is not None else torch.tensor(layer.alpha)
    if len(ins) > 2 and ins[2] is not None:
        delta = ins[2].reshape(-1)
    else:
        delta = torch.tensor(layer.beta).reshape(1).expand(rank)
    compute = torch.float64 if dtype.is_floating_point else torch.int64
    out = torch.zeros(shape, dtype=compute) + alpha.to(compute)
    for axis in range(rank):
        step = torch.arange(shape[axis], dtype=compute) * delta[axis].to(compute)
        out = out + step.reshape([-1 if a == axis else 1 for a in range(rank)])
    return [out.to(dtype)]


def _identity(ctx, layer, ins):
    return [ins[0].to(_torch_dtype(layer.get_output(0).dtype, ctx.where)).clone()]


def _cast(ctx, layer, ins):
    target = _torch_dtype(layer.to_type, ctx.where)
    x = ins[0]
    if x.dtype.is_floating_point and not target.is_floating_point and target != torch.bool:
        x = torch.trunc(x)
    return [x.to(target)]


def _squeeze(ctx, layer, ins):
    axes = sorted((a % ins[0].dim() for a in _ints(ins[1])), reverse=True)
    x = ins[0]
    for a in axes:
        x = x.squeeze(a)
    return [x]


def _unsqueeze(ctx, layer, ins):
    rank = ins[0].dim() + ins[1].numel()
    x = ins[0]
    for a in sorted(a % rank for a in _ints(ins[1])):
        x = x.unsqueeze(a)
    return [x]


# --- arithmetic ------------------------------------------------------------------------------------
def _float_div(a, b):
    if a.dtype.is_floating_point:
        return a / b
    return torch.div(a, b, rounding_mode="trunc")


_EW = {
    trt.ElementWiseOperation.SUM: torch.add,
    trt.ElementWiseOperation.PROD: torch.mul,
    trt.ElementWiseOperation.MAX: torch.maximum,
    trt.ElementWiseOperation.MIN: torch.minimum,
    trt.ElementWiseOperation.SUB: torch.sub,
    trt.ElementWiseOperation.DIV: _float_div,
    trt.ElementWiseOperation.POW: torch.pow,
    trt.ElementWiseOperation.FLOOR_DIV: lambda a, b: torch.div(a, b, rounding_mode="floor"),
    trt.ElementWiseOperation.AND: torch.logical_and,
    trt.ElementWiseOperation.OR: torch.logical_or,
    trt.ElementWiseOperation.XOR: torch.logical_xor,
    trt.ElementWiseOperation.EQUAL: torch.eq,
    trt.ElementWiseOperation.GREATER: torch.gt,
    trt.ElementWiseOperation.LESS: torch.lt,
}


def _elementwise(ctx, layer, ins):
    a, b = ins
    if a.dim() != b.dim():
        ctx.fail(f"operands of rank {a.dim()} and {b.dim()} (TensorRT needs equal ranks)")
    if a.dtype != b.dtype:
        ctx.fail(f"operand types differ ({a.dtype} vs {b.dtype})")
    return [_EW[layer.op](a, b)]


_UN = {
    trt.UnaryOperation.EXP: torch.exp,
    trt.UnaryOperation.LOG: torch.log,
    trt.UnaryOperation.SQRT: torch.sqrt,
    trt.UnaryOperation.RECIP: torch.reciprocal,
    trt.UnaryOperation.ABS: torch.abs,
    trt.UnaryOperation.NEG: torch.neg,
    trt.UnaryOperation.SIN: torch.sin,
    trt.UnaryOperation.COS: torch.cos,
    trt.UnaryOperation.TAN: torch.tan,
    trt.UnaryOperation.SINH: torch.sinh,
    trt.UnaryOperation.COSH: torch.cosh,
    trt.UnaryOperation.ASIN: torch.asin,
    trt.UnaryOperation.ACOS: torch.acos,
    trt.UnaryOperation.ATAN: torch.atan,
    trt.UnaryOperation.ASINH: torch.asinh,
    trt.UnaryOperation.ACOSH: torch.acosh,
    trt.UnaryOperation.ATANH: torch.atanh,
    trt.UnaryOperation.CEIL: torch.ceil,
    trt.UnaryOperation.FLOOR: torch.floor,
    trt.UnaryOperation.ERF: torch.erf,
    trt.UnaryOperation.NOT: torch.logical_not,
    trt.UnaryOperation.SIGN: torch.sign,
    trt.UnaryOperation.ROUND: torch.round,
    trt.UnaryOperation.ISINF: torch.isinf,
    trt.UnaryOperation.ISNAN: torch.isnan,
}


def _unary(ctx, layer, ins):
    fn = _UN.get(layer.op)
    if fn is None:
        ctx.unsupported(f"unary op {layer.op}")
    return [fn(ins[0])]


def _activation(ctx, layer, ins):
    x = ins[0]
    alpha, beta = layer.alpha, layer.beta
    A = trt.ActivationType
    kind = layer.type  # on IActivationLayer, ``type`` is the ActivationType
    if kind == A.RELU:
        return [torch.relu(x)]
    if kind == A.SIGMOID:
        return [torch.sigmoid(x)]
    if kind == A.TANH:
        return [torch.tanh(x)]
    if kind == A.LEAKY_RELU:
        return [torch.where(x >= 0, x, x * alpha)]
    if kind == A.ELU:
        return [torch.where(x >= 0, x, alpha * (torch.exp(x) - 1))]
    if kind == A.SELU:
        return [beta * torch.where(x >= 0, x, alpha * (torch.exp(x) - 1))]
    if kind == A.SOFTSIGN:
        return [x / (1 + torch.abs(x))]
    if kind == A.SOFTPLUS:
        return [alpha * torch.log(torch.exp(beta * x) + 1)]
    if kind == A.CLIP:
        return [torch.clamp(x, alpha, beta)]
    if kind == A.HARD_SIGMOID:
        return [torch.clamp(alpha * x + beta, 0, 1)]
    if kind == A.SCALED_TANH:
        return [alpha * torch.tanh(beta * x)]
    if kind == A.THRESHOLDED_RELU:
        return [torch.where(x > alpha, x, torch.zeros_like(x))]
    if hasattr(A, "GELU_ERF") and kind == A.GELU_ERF:
        return [torch.nn.functional.gelu(x)]
    if hasattr(A, "GELU_TANH") and kind == A.GELU_TANH:
        return [torch.nn.functional.gelu(x, approximate="tanh")]
    ctx.unsupported(f"activation {kind}")


def _matmul(ctx, layer, ins):
    ops = trt.MatrixOperation
    a, b = ins
    if layer.op0 == ops.TRANSPOSE:
        a = a.transpose(-1, -2)
    elif layer.op0 == ops.VECTOR:
        a = a.unsqueeze(-2)
    if layer.op1 == ops.TRANSPOSE:
        b = b.transpose(-1, -2)
    elif layer.op1 == ops.VECTOR:
        b = b.unsqueeze(-1)
    if a.dtype != b.dtype:
        ctx.fail(f"operand types differ ({a.dtype} vs {b.dtype})")
    out = _batched_matmul(a, b)
    if layer.op1 == ops.VECTOR:
        out = out.squeeze(-1)
    if layer.op0 == ops.VECTOR:
        out = out.squeeze(-1 if layer.op1 == ops.VECTOR else -2)
    return [out]


_MATMUL_CHUNK_BYTES = 256 << 20


def _batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul``; a large batched (3-D, same batch) right operand is taken a few batch entries at
    a time, so a transposed view of it (all experts of a full-width MoE: GBs) is never copied whole."""
    if b.dim() != 3 or a.dim() != 3 or a.shape[0] != b.shape[0] or b.numel() * b.element_size() <= _MATMUL_CHUNK_BYTES:
        return torch.matmul(a, b)
    step = max(1, _MATMUL_CHUNK_BYTES // (b[0].numel() * b.element_size()))
    return torch.cat([torch.matmul(a[i:i + step], b[i:i + step]) for i in range(0, b.shape[0], step)])


def _reduce(ctx, layer, ins):
    x = ins[0]
    axes = _axes(layer.axes, x.dim())
    keep = layer.keep_dims
    R = trt.ReduceOperation
    op = layer.op
    if op == R.SUM:
        out = x.sum(dim=axes, keepdim=keep, dtype=x.dtype)
    elif op == R.AVG:
        out = x.mean(dim=axes, keepdim=keep)
    elif op == R.PROD:
        out = x
        for a in sorted(axes, reverse=True):
            out = out.prod(dim=a, keepdim=keep)
    elif op in (R.MAX, R.MIN):
        out = x.amax(dim=axes, keepdim=keep) if op == R.MAX else x.amin(dim=axes, keepdim=keep)
    else:
        ctx.unsupported(f"reduce op {op}")
    return [out]


def _softmax(ctx, layer, ins):
    axes = _axes(layer.axes, ins[0].dim())
    if len(axes) != 1:
        ctx.fail(f"softmax over axes {axes}")
    return [torch.softmax(ins[0], dim=axes[0])]


def _topk(ctx, layer, ins):
    x = ins[0]
    axes = _axes(layer.axes, x.dim())
    if len(axes) != 1:
        ctx.fail(f"topk over axes {axes}")
    largest = layer.op == trt.TopKOperation.MAX
    k = _ints(ins[1])[0] if len(ins) > 1 and ins[1] is not None else layer.k
    values, indices = torch.topk(x, k, dim=axes[0], largest=largest, sorted=True)
    index_type = getattr(layer, "indices_type", trt.int32)
    return [values, indices.to(_torch_dtype(index_type, ctx.where))]


def _select(ctx, layer, ins):
    cond, a, b = ins
    if not (cond.dim() == a.dim() == b.dim()):
        ctx.fail(f"select operands of ranks {cond.dim()}, {a.dim()}, {b.dim()}")
    return [torch.where(cond, a, b)]


def _cumulative(ctx, layer, ins):
    x = ins[0]
    axis = _ints(ins[1])[0] % x.dim()
    if layer.op != trt.CumulativeOperation.SUM:
        ctx.unsupported(f"cumulative op {layer.op}")
    if layer.reverse:
        x = x.flip(axis)
    out = torch.cumsum(x, dim=axis, dtype=x.dtype)
    if layer.exclusive:
        out = out - x
    if layer.reverse:
        out = out.flip(axis)
    return [out]


def _einsum(ctx, layer, ins):
    return [torch.einsum(layer.equation, *ins)]


_HANDLERS = {
    _LT.ACTIVATION: _activation,
    _LT.CAST: _cast,
    _LT.CONCATENATION: _concat,
    _LT.CONSTANT: _constant,
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


# --- low-precision constants and dequantize layers (NVFP4 weights: builder/quantization.py) ---------
# FP8 (E4M3) tensors are held as torch.float8_e4m3fn. FP4 (E2M1) tensors are held decoded, as
# torch.float8_e5m2: every E2M1 value (0, +-0.5 ... +-6) is exact there, and TensorRT has no E5M2 type
# of its own, so the container cannot be confused with a real tensor type.
_FP4 = getattr(trt.DataType, "FP4", None)
_FP8 = getattr(trt.DataType, "FP8", None)
_FP4_CONTAINER = torch.float8_e5m2
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
if _FP8 is not None:
    _DTYPES[_FP8] = torch.float8_e4m3fn
if _FP4 is not None:
    _DTYPES[_FP4] = _FP4_CONTAINER


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


_HANDLERS[_LT.CONSTANT] = _constant_low_precision
_CLASSES[_LT.DEQUANTIZE] = trt.IDequantizeLayer
_HANDLERS[_LT.DEQUANTIZE] = _dequantize
SUPPORTED_LAYER_TYPES = tuple(sorted(t.name for t in _CLASSES))
