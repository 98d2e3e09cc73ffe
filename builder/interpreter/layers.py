"""Evaluators of the native compute layers: shapes and data movement (shuffle, slice, concat, gather,
scatter, fill, cast, squeeze), arithmetic (elementwise, unary, activation, matrix multiply, reduce,
softmax, top-k, select, cumulative sum, einsum). Each takes ``(ctx, layer, ins)`` and returns the
layer's outputs."""
from __future__ import annotations

import math

import torch

from builder.backends.trt_import import trt
from builder.interpreter.base import _axes, _dims, _ints, _torch_dtype


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
