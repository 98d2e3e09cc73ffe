"""The recorder's layer vocabulary: shape arithmetic and one-layer helpers over TensorRT ``ITensor``s.

:class:`LayerHelpers` is a base of :class:`builder.backends.trt_recorder.Recorder`: shapes computed in the
network when a dim is dynamic (``shape_of``, ``dim``, ``shape_tensor``, ``dim_arith``, reshapes, slices,
iotas, zeros) and single layers (casts, elementwise, unary, matmul, reduce, select, cumsum, concat,
gathers, topk, softmax). Its methods use the recorder's ``network``, ``_out``/``_named`` (layer names),
``_constant``/``scalar`` (constants) and ``has_cumulative``. The enums every lowering spells layers with
(``EW``, ``UN``, ``ACT``) live here too.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from builder.backends.trt_dtypes import torch_dtype, trt_dtype
from builder.backends.trt_import import trt
from builder.errors import BuildError

EW = trt.ElementWiseOperation
UN = trt.UnaryOperation
ACT = trt.ActivationType


class LayerHelpers:
    """Shapes and single layers over ITensors (a base of ``Recorder``; see the module docstring)."""

    # shapes ---------------------------------------------------------------------------------------
    @staticmethod
    def rank(t) -> int:
        return len(t.shape)

    @staticmethod
    def static(t) -> bool:
        return all(d >= 0 for d in t.shape)

    def shape_of(self, t):
        """int64 [rank] shape tensor."""
        return self._out(self.network.add_shape(t), "shape")

    def dim(self, t, axis: int):
        """Dim ``axis`` of t: a Python int when known at build time, else an int64 [1] tensor."""
        d = t.shape[axis]
        if d >= 0:
            return int(d)
        shape = self.shape_of(t)
        idx = self._constant(np.array([axis % self.rank(t)], dtype=np.int64), "axis")
        return self._out(self.network.add_gather(shape, idx, 0), f"dim{axis % self.rank(t)}")

    def shape_tensor(self, parts: Iterable):
        """int64 1-D tensor from ints and int64 [1] tensors."""
        pieces, run = [], []
        for p in parts:
            if isinstance(p, (int, np.integer)):
                run.append(int(p))
                continue
            if run:
                pieces.append(self._constant(np.array(run, dtype=np.int64), "dims"))
                run = []
            pieces.append(p)
        if run:
            pieces.append(self._constant(np.array(run, dtype=np.int64), "dims"))
        if len(pieces) == 1:
            return pieces[0]
        layer = self.network.add_concatenation(pieces)
        layer.axis = 0
        return self._out(layer, "shape_concat")

    def dim_tensor(self, d):
        return self._constant(np.array([d], dtype=np.int64), "dims") if isinstance(d, int) else d

    def dim_arith(self, a, b, op, what="shape_arith"):
        """Arithmetic on dims (ints fold in Python, tensors record int64 layers)."""
        if isinstance(a, int) and isinstance(b, int):
            return {EW.SUM: a + b, EW.SUB: a - b, EW.PROD: a * b, EW.FLOOR_DIV: a // b}[op]
        return self._out(self.network.add_elementwise(self.dim_tensor(a), self.dim_tensor(b), op), what)

    def reshape(self, t, dims, what: str = "reshape"):
        """Reshape to dims: a list of ints (0 copies, -1 infers) or of ints and int64 [1] tensors."""
        if all(isinstance(d, (int, np.integer)) for d in dims):
            layer = self.network.add_shuffle(t)
            layer.reshape_dims = tuple(int(d) for d in dims)
            return self._out(layer, what)
        return self.reshape_like(t, self.shape_tensor(dims), what)

    def reshape_like(self, t, shape_tensor, what: str = "reshape"):
        layer = self.network.add_shuffle(t)
        layer.set_input(1, shape_tensor)
        layer.zero_is_placeholder = False
        return self._out(layer, what)

    def transpose(self, t, perm, what: str = "transpose"):
        layer = self.network.add_shuffle(t)
        layer.first_transpose = tuple(int(p) for p in perm)
        return self._out(layer, what)

    def unsqueeze_leading(self, t, k: int, what: str = "unsqueeze"):
        if k <= 0:
            return t
        if self.static(t):
            return self.reshape(t, [1] * k + list(t.shape), what)
        return self.reshape_like(t, self.shape_tensor([1] * k + [self.shape_of(t)]), what)

    def align(self, *ts):
        """Prepend 1-dims so all tensors have the same rank (torch's right-aligned broadcasting)."""
        r = max(self.rank(t) for t in ts)
        return [self.unsqueeze_leading(t, r - self.rank(t), "broadcast") for t in ts]

    def with_dim(self, t, axis: int, size):
        """Shape of t with dim ``axis`` replaced by ``size`` (ints stay static when possible)."""
        r = self.rank(t)
        return [size if i == axis % r else self.dim(t, i) for i in range(r)]

    def slice(self, t, axis: int, start, size, what: str = "slice", fill: bool = False):
        """t[..., start:start+size, ...] along ``axis``; start/size are ints or int64 [1] tensors.

        With ``fill`` positions past the end read zero (used to pad to a multiple of a chunk).
        """
        r = self.rank(t)
        axis %= r
        dims = self.with_dim(t, axis, size)
        static = isinstance(start, int) and all(isinstance(d, int) for d in dims)
        starts = [0] * r
        if isinstance(start, int):
            starts[axis] = start
        start_t = size_t = None
        if not static:  # inputs first: layers are recorded (and interpreted) in dependency order
            if not isinstance(start, int):
                start_t = self.shape_tensor([start if i == axis else 0 for i in range(r)])
            size_t = self.shape_tensor(dims)
        layer = self.network.add_slice(t, tuple(starts), tuple(d if isinstance(d, int) else 1 for d in dims),
                                       (1,) * r)
        if start_t is not None:
            layer.set_input(1, start_t)
        if size_t is not None:
            layer.set_input(2, size_t)
        if fill:
            layer.mode = trt.SampleMode.FILL
        return self._out(layer, what)

    def pad_to(self, t, axis: int, size, what: str = "pad"):
        return self.slice(t, axis, 0, size, what, fill=True)

    def iota(self, n, dtype: torch.dtype = torch.int64, start: int = 0, what: str = "iota"):
        """[n] = start, start+1, ...; ``n`` an int or an int64 [1] tensor (a dynamic length)."""
        if isinstance(n, int):
            return self._constant(torch.arange(start, start + n, dtype=dtype), what)
        first = self._constant(torch.tensor(start, dtype=dtype), "iota_start")
        step = self._constant(torch.tensor([1], dtype=dtype), "iota_step")
        layer = self.network.add_fill(trt.Dims([0]), trt.FillOperation.LINSPACE, trt_dtype(dtype))
        layer.set_input(0, n)
        layer.set_input(1, first)
        layer.set_input(2, step)
        return self._out(layer, what)

    def zeros(self, dims, dtype: torch.dtype, what: str = "zeros"):
        """Zeros of a (possibly dynamic) shape given as a list of ints / int64 [1] tensors."""
        if all(isinstance(d, int) for d in dims):
            return self._constant(torch.zeros(dims, dtype=dtype), what)
        shape = self.shape_tensor(dims)
        start = self._constant(torch.tensor(0, dtype=dtype), "zero")
        step = self._constant(torch.zeros(len(dims), dtype=dtype), "zero_step")
        layer = self.network.add_fill(trt.Dims([0] * len(dims)), trt.FillOperation.LINSPACE, trt_dtype(dtype))
        layer.set_input(0, shape)
        layer.set_input(1, start)
        layer.set_input(2, step)
        return self._out(layer, what)

    # layers ---------------------------------------------------------------------------------------
    def cast(self, t, dtype: torch.dtype, what: str = "cast"):
        target = trt_dtype(dtype)
        if t.dtype == target:
            return t
        return self._out(self.network.add_cast(t, target), what)

    def ew(self, a, b, op, what: str):
        if a.dtype != b.dtype:
            raise TypeError(f"{what}: operand types differ ({a.dtype} vs {b.dtype})")
        a, b = self.align(a, b)
        return self._out(self.network.add_elementwise(a, b, op), what)

    def ew_scalar(self, a, value, op, what: str, reverse: bool = False):
        c = self.scalar(value, torch_dtype(a.dtype), self.rank(a), what + "_value")
        return self.ew(c, a, op, what) if reverse else self.ew(a, c, op, what)

    def unary(self, t, op, what: str):
        return self._out(self.network.add_unary(t, op), what)

    def activation_layer(self, t, kind, what: str, alpha=None, beta=None):
        layer = self.network.add_activation(t, kind)
        if alpha is not None:
            layer.alpha = alpha
        if beta is not None:
            layer.beta = beta
        return self._out(layer, what)

    def matmul(self, a, b, transpose_a=False, transpose_b=False, what="matmul"):
        a, b = self.align(a, b)
        op = trt.MatrixOperation
        return self._out(self.network.add_matrix_multiply(
            a, op.TRANSPOSE if transpose_a else op.NONE, b, op.TRANSPOSE if transpose_b else op.NONE), what)

    def reduce(self, t, op, axis: int, keep_dims: bool, what: str):
        axis %= self.rank(t)
        return self._out(self.network.add_reduce(t, op, 1 << axis, keep_dims), what)

    def select(self, cond, a, b, what: str = "select"):
        cond, a, b = self.align(cond, a, b)
        return self._out(self.network.add_select(cond, a, b), what)

    def cumsum(self, t, axis: int, what: str = "cumsum"):
        """Inclusive cumulative sum along ``axis`` (a cumulative layer; where the TensorRT version
        has none, a matrix multiply with a triangular ones matrix)."""
        axis %= self.rank(t)
        if self.has_cumulative:
            axis_t = self._constant(np.array(axis, dtype=np.int32), "cumsum_axis")
            return self._out(self.network.add_cumulative(t, axis_t, trt.CumulativeOperation.SUM, False, False), what)
        rank = self.rank(t)
        if axis not in (rank - 1, rank - 2):
            raise BuildError(f"cumsum fallback supports the last two axes only (axis {axis} of rank {rank})")
        size = t.shape[axis]
        dtype = torch_dtype(t.dtype)
        if size >= 0:
            i = torch.arange(size)
            lower = self._constant((i[None, :] <= i[:, None]).to(dtype), what + "_triangle")  # [i, k]: k <= i
        else:
            idx = self.iota(self.dim(t, axis), torch.int64, what=what + "_index")
            later = self.ew(self.reshape(idx, [1, -1], "cols"), self.reshape(idx, [-1, 1], "rows"), EW.GREATER, "later")
            lower = self.cast(self.unary(later, UN.NOT, "lower_mask"), dtype, what + "_triangle")
        if axis == rank - 2:  # out[..., i, j] = sum_k L[i, k] t[..., k, j]
            return self.matmul(lower, t, what=what)
        return self.matmul(t, lower, transpose_b=True, what=what)  # out[..., i] = sum_k t[..., k] L[i, k]

    def concat(self, ts, axis: int, what: str = "concat"):
        layer = self.network.add_concatenation(list(ts))
        layer.axis = axis % self.rank(ts[0])
        return self._out(layer, what)

    def gather(self, data, index, axis: int, what: str = "gather"):
        layer = self.network.add_gather(data, index, axis % self.rank(data))
        return self._out(layer, what)

    def gather_elements(self, data, index, axis: int, what: str = "gather_elements"):
        layer = self.network.add_gather_v2(data, index, trt.GatherMode.ELEMENT)
        layer.axis = axis % self.rank(data)
        return self._out(layer, what)

    def gather_nd(self, data, index, batch_dims: int, what: str = "gather_nd"):
        layer = self.network.add_gather_v2(data, index, trt.GatherMode.ND)
        layer.num_elementwise_dims = batch_dims
        return self._out(layer, what)

    def topk(self, t, k: int, axis: int, what: str = "topk"):
        layer = self._named(self.network.add_topk(t, trt.TopKOperation.MAX, int(k), 1 << (axis % self.rank(t))), what)
        return layer.get_output(0), layer.get_output(1)

    def softmax(self, t, axis: int, what: str = "softmax"):
        layer = self.network.add_softmax(t)
        layer.axes = 1 << (axis % self.rank(t))
        return self._out(layer, what)

    def exp(self, t, what="exp"):
        return self.unary(t, UN.EXP, what)
