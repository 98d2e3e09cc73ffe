"""Symbolic lowering of the op surface: each op records native layers into a TensorRT network.

``builder.functional`` dispatches on ``tensor.backend``; a :class:`SymbolicTensor` answers with this
module, whose op functions have the names and signatures of ``torch_backend`` (the spec of every
op's semantics). A :class:`NetworkRecorder` owns the builder and the network; networks are strongly
typed (``tensorrt_rtx`` requires it, and it keeps full TensorRT from changing precisions behind our
back), so every precision change of the torch reference is an explicit cast layer here.

Every op lowers to native layers only (no plugins, no loops), with all batch/time/cache/gather dims
dynamic: shapes that depend on them are computed in the network (shape layers, fill, shape
arithmetic), never in Python.
"""
from __future__ import annotations

import collections
import contextlib
import sys
from typing import Iterable, Sequence

import numpy as np
import torch

from builder.backends.trt_build import build_engine_bytes
from builder.backends.trt_dtypes import _TORCH_TO_TRT, torch_dtype, trt_dtype  # noqa: F401 (re-exported)
from builder.backends.trt_import import FLAVOUR, trt
from builder.errors import BuildError

__all__ = [
    "SymbolicTensor", "NetworkRecorder", "build_engine_bytes", "trt_dtype", "torch_dtype",
    # the op surface (same names and signatures as torch_backend)
    "linear", "embedding", "rms_norm", "gated_rms_norm", "activation", "clamp", "to_float32", "split",
    "concat", "reshape", "permute", "gather_rows", "mask_padding", "causal_conv1d", "ssm_scan",
    "kv_cache_update", "attention", "moe",
]

EW = trt.ElementWiseOperation
UN = trt.UnaryOperation
ACT = trt.ActivationType

_HALF = (torch.float16, torch.bfloat16)


# --- symbolic tensors ----------------------------------------------------------------------------
class SymbolicTensor:
    """A TensorRT ``ITensor`` plus the recorder that owns it; what model code holds in a recording."""

    __slots__ = ("tensor", "recorder")
    __array_priority__ = 1000  # numpy arrays defer to our reflected operators

    def __init__(self, tensor, recorder: "NetworkRecorder"):
        self.tensor = tensor
        self.recorder = recorder

    @property
    def backend(self):
        return _MODULE

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.tensor.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        """Build-time shape; -1 marks a dynamic dim."""
        return tuple(self.tensor.shape)

    @property
    def ndim(self) -> int:
        return len(self.tensor.shape)

    def dim(self) -> int:
        return self.ndim

    @property
    def name(self) -> str:
        return self.tensor.name

    def __repr__(self) -> str:
        return f"SymbolicTensor({self.tensor.name!r}, shape={self.shape}, dtype={self.dtype})"

    def __bool__(self):
        raise TypeError("a symbolic tensor has no truth value at record time")

    # Python operators (torch semantics: type promotion, right-aligned broadcasting)
    def __add__(self, other):
        return self.recorder.binary(self, other, EW.SUM, "add")

    def __radd__(self, other):
        return self.recorder.binary(other, self, EW.SUM, "add")

    def __sub__(self, other):
        return self.recorder.binary(self, other, EW.SUB, "sub")

    def __rsub__(self, other):
        return self.recorder.binary(other, self, EW.SUB, "sub")

    def __mul__(self, other):
        return self.recorder.binary(self, other, EW.PROD, "mul")

    def __rmul__(self, other):
        return self.recorder.binary(other, self, EW.PROD, "mul")

    def __truediv__(self, other):
        return self.recorder.binary(self, other, EW.DIV, "div")

    def __rtruediv__(self, other):
        return self.recorder.binary(other, self, EW.DIV, "div")

    def __neg__(self):
        return self.recorder.binary(self, -1, EW.PROD, "neg")


_LOGGER = None


def _default_logger():
    """One logger per process (TensorRT keeps the first one a builder registered anyway)."""
    global _LOGGER
    if _LOGGER is None:
        _LOGGER = trt.Logger(trt.Logger.WARNING)
    return _LOGGER


# --- the recorder ----------------------------------------------------------------------------------
class NetworkRecorder:
    """Owns a TensorRT builder and one network, and the helpers every lowering uses.

    Usable as a context manager (``with NetworkRecorder() as rec: ...``) or a plain object.
    ``lowerings`` maps each op name recorded to a description of the lowering it got.
    """

    def __init__(self, name: str = "network", logger=None, strongly_typed: bool = True):
        self.logger = logger or _default_logger()
        self.builder = trt.Builder(self.logger)
        flags = 0
        creation = trt.NetworkDefinitionCreationFlag
        self.strongly_typed = bool(strongly_typed and hasattr(creation, "STRONGLY_TYPED"))
        if self.strongly_typed:
            flags |= 1 << int(creation.STRONGLY_TYPED)
        if hasattr(creation, "EXPLICIT_BATCH"):  # full TensorRT 8.x; deprecated no-op in 10
            flags |= 1 << int(creation.EXPLICIT_BATCH)
        self.network = self.builder.create_network(flags)
        with contextlib.suppress(Exception):
            self.network.name = name
        self.flavour = FLAVOUR
        self.lowerings: dict[str, str] = {}
        self.inputs: dict[str, SymbolicTensor] = {}
        self.outputs: dict[str, SymbolicTensor] = {}
        self._weights: dict[int, tuple[torch.Tensor, object]] = {}
        self._keep: list = []  # host memory TensorRT points at until the build
        self._scopes: list[str] = []
        self._prefix: list[str] = []
        self._op_counts: collections.Counter = collections.Counter()
        self._layer_names: collections.Counter = collections.Counter()
        #: --strip_plan: a builder.refit.Provenance; constants viewing its files become refittable
        self.refit = None
        #: "refit" (named refittable constants, STRIP_PLAN) or "inputs" (weights as static-shape inputs)
        self.refit_method = "refit"
        self.refit_weights: dict[str, dict] = {}   # refit name -> builder.refit.entry
        self.plan_bytes = 0                         # bytes of constants that stay in the plan
        #: whether to use the cumulative layer (TensorRT >= 10.4 and tensorrt_rtx have it)
        self.has_cumulative = hasattr(self.network, "add_cumulative")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    # naming ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self, name: str):
        """Prefix the names of layers recorded inside, e.g. ``with rec.scope("layers.3"):``."""
        self._scopes.append(str(name))
        try:
            yield self
        finally:
            self._scopes.pop()

    @contextlib.contextmanager
    def op(self, name: str, description: str | None = None):
        """Name the layers recorded inside after the op (and note its lowering)."""
        if description is not None:
            self.note_lowering(name, description)
        base = f"{self._prefix[-1]}.{name}" if self._prefix else ".".join(self._scopes + [name])
        count = self._op_counts[base]
        self._op_counts[base] += 1
        self._prefix.append(base if count == 0 else f"{base}_{count}")
        try:
            yield self
        finally:
            self._prefix.pop()

    def note_lowering(self, op: str, description: str) -> None:
        old = self.lowerings.get(op)
        if old is None:
            self.lowerings[op] = description
        elif description not in old.split("; "):
            self.lowerings[op] = f"{old}; {description}"

    def _named(self, layer, what: str):
        prefix = self._prefix[-1] if self._prefix else (".".join(self._scopes) or "network")
        name = f"{prefix}/{what}"
        count = self._layer_names[name]
        self._layer_names[name] += 1
        if count:
            name = f"{name}_{count}"
        layer.name = name
        n = layer.num_outputs
        for i in range(n):
            layer.get_output(i).name = name if n == 1 else f"{name}:{i}"
        return layer

    def _out(self, layer, what: str):
        return self._named(layer, what).get_output(0)

    # I/O ------------------------------------------------------------------------------------------
    def add_input(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> SymbolicTensor:
        """A network input; -1 in ``shape`` marks a dynamic dim (give it a range in the profile)."""
        if name in self.inputs:
            raise BuildError(f"network input {name!r} added twice")
        t = self.network.add_input(name, trt_dtype(dtype), tuple(int(s) for s in shape))
        sym = SymbolicTensor(t, self)
        self.inputs[name] = sym
        return sym

    def mark_output(self, name: str, tensor) -> SymbolicTensor:
        if name in self.outputs:
            raise BuildError(f"network output {name!r} marked twice")
        t = self.itensor(tensor)
        if t.is_network_input or t.is_network_output or t.name in self._constant_names():
            with self.op("output"):
                t = self._out(self.network.add_identity(t), name)
        t.name = name
        self.network.mark_output(t)
        sym = SymbolicTensor(t, self)
        self.outputs[name] = sym
        return sym

    def _constant_names(self) -> set:
        return {w.name for _, w in self._weights.values()}

    # constants ------------------------------------------------------------------------------------
    def _constant(self, value, what: str = "const"):
        """A constant layer from a numpy array or torch tensor (kept alive until the build)."""
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(np.array(value, copy=True))  # (ascontiguousarray makes 0-d 1-d)
        if getattr(value, "is_nvfp4", False):  # an NVFP4 weight used other than by a linear: its values
            value = value.dequantize()
        t = value.detach().to("cpu").contiguous()
        shape = tuple(t.shape)
        if self.refit is not None and self.refit_method == "inputs":
            from builder.refit import weight_input
            bound = weight_input(self, t)
            if bound is not None:
                return bound
        if t.dtype == torch.bfloat16:
            arr = t.view(torch.int16).numpy()
            weights = trt.Weights(trt.bfloat16, arr.ctypes.data, arr.size)
        else:
            if t.dtype not in _TORCH_TO_TRT:
                raise TypeError(f"cannot make a TensorRT constant of dtype {t.dtype}")
            arr = t.numpy()
            weights = trt.Weights(arr)
        self._keep.append((t, arr))
        layer = self.network.add_constant(shape, weights)
        out = self._out(layer, what)
        if self.refit is not None:
            from builder.refit import mark_refittable
            mark_refittable(self, t, weights, layer.name)
        return out

    def weight(self, tensor: torch.Tensor, what: str = "weight"):
        """The constant of a bound weight; the same tensor object always gives the same layer."""
        hit = self._weights.get(id(tensor))
        if hit is not None and hit[0] is tensor:
            return hit[1]
        c = self._constant(tensor, what)
        self._weights[id(tensor)] = (tensor, c)
        return c

    def scalar(self, value, dtype: torch.dtype, rank: int = 0, what: str = "scalar"):
        return self._constant(torch.tensor(value, dtype=dtype).reshape((1,) * rank), what)

    def itensor(self, x, what: str = "weight"):
        if isinstance(x, SymbolicTensor):
            if x.recorder is not self:
                raise BuildError("a symbolic tensor of another network was used")
            return x.tensor
        if isinstance(x, torch.Tensor):
            return self.weight(x, what)
        raise TypeError(f"expected a symbolic or torch tensor, got {type(x).__name__}")

    def wrap(self, t) -> SymbolicTensor:
        return SymbolicTensor(t, self)

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

    # Python operators -------------------------------------------------------------------------------
    def binary(self, a, b, op, name: str) -> SymbolicTensor:
        with self.op(name, f"native: elementwise {op.name}"):
            def probe(v):
                if isinstance(v, SymbolicTensor):
                    return torch.empty((1,) * max(v.ndim, 1), dtype=v.dtype)
                return v
            dtype = torch.result_type(probe(a), probe(b))
            if op == EW.DIV and not dtype.is_floating_point:
                dtype = torch.float32  # true division
            ranked = a if isinstance(a, (SymbolicTensor, torch.Tensor)) else b
            rank = ranked.ndim if isinstance(ranked, SymbolicTensor) else ranked.dim()

            def operand(v):
                if isinstance(v, (SymbolicTensor, torch.Tensor)):
                    return self.cast(self.itensor(v, "operand"), dtype, "promote")
                return self.scalar(v, dtype, rank, "operand")
            return self.wrap(self.ew(operand(a), operand(b), op, name))


def _recorder(*xs) -> NetworkRecorder:
    found = None
    for x in xs:
        items = x if isinstance(x, (list, tuple)) else (x,)
        for item in items:
            if isinstance(item, SymbolicTensor):
                if found is not None and item.recorder is not found:
                    raise BuildError("symbolic tensors of two different networks were mixed in one op")
                found = item.recorder
    if found is None:
        raise TypeError("trt_backend op called without any symbolic tensor")
    return found


def _int_dtype(t) -> torch.dtype:
    dt = torch_dtype(t.dtype)
    if dt not in (torch.int32, torch.int64):
        raise TypeError(f"expected an int32/int64 tensor, got {dt}")
    return dt


# --- elementwise helpers on ITensors -----------------------------------------------------------------
def _act(r: NetworkRecorder, t, name: str):
    """Activation by config name on an ITensor, in t's dtype (multi-step ones via fp32, like torch's
    CPU kernels compute half types)."""
    dtype = torch_dtype(t.dtype)
    if name == "relu":
        return r.activation_layer(t, ACT.RELU, "relu")
    if name == "relu2":
        h = r.activation_layer(t, ACT.RELU, "relu")
        return r.ew(h, h, EW.PROD, "square")
    if name == "sigmoid":
        return r.activation_layer(t, ACT.SIGMOID, "sigmoid")
    if name == "gelu":
        if hasattr(ACT, "GELU_ERF"):
            return r.activation_layer(t, ACT.GELU_ERF, "gelu_erf")
        f = r.cast(t, torch.float32, "upcast")
        e = r.unary(r.ew_scalar(f, 2 ** -0.5, EW.PROD, "gelu_scale"), UN.ERF, "erf")
        g = r.ew(r.ew_scalar(f, 0.5, EW.PROD, "gelu_half"), r.ew_scalar(e, 1.0, EW.SUM, "gelu_one"), EW.PROD, "gelu")
        return r.cast(g, dtype, "downcast")
    if name == "silu":
        f = r.cast(t, torch.float32, "upcast")
        s = r.ew(f, r.activation_layer(f, ACT.SIGMOID, "sigmoid"), EW.PROD, "silu")
        return r.cast(s, dtype, "downcast")
    if name == "softplus":
        # torch: x if x > 20 else log1p(exp(x)). max(x, 0) + log(1 + exp(-|x|)) never overflows and
        # equals x exactly in fp32 for x > 20 (the log term is < 2.1e-9, under half an ulp of x).
        f = r.cast(t, torch.float32, "upcast")
        neg_abs = r.unary(r.unary(f, UN.ABS, "abs"), UN.NEG, "neg_abs")
        log1p = r.unary(r.ew_scalar(r.exp(neg_abs, "exp"), 1.0, EW.SUM, "one_plus"), UN.LOG, "log")
        pos = r.ew_scalar(f, 0.0, EW.MAX, "relu")
        return r.cast(r.ew(pos, log1p, EW.SUM, "softplus"), dtype, "downcast")
    raise BuildError(f"unknown activation {name!r} (expected relu2, relu, silu, gelu, softplus, sigmoid)")


def _rms(r: NetworkRecorder, h, eps: float):
    """h * rsqrt(mean(h^2, -1) + eps) in fp32."""
    ms = r.reduce(r.ew(h, h, EW.PROD, "square"), trt.ReduceOperation.AVG, -1, True, "mean_square")
    inv = r.unary(r.unary(r.ew_scalar(ms, float(eps), EW.SUM, "add_eps"), UN.SQRT, "sqrt"), UN.RECIP, "rsqrt")
    return r.ew(h, inv, EW.PROD, "normalize")


def _segment_sums(r: NetworkRecorder, a, size):
    """a [..., m] fp32 -> [..., m, m]: out[i, j] = a[j+1] + ... + a[i] for i >= j, -inf above.

    Mirrors torch_backend._segment_sums: a cumulative sum down the columns of a masked expansion.
    ``size`` is m when known at build time (constant masks), else None (masks from iotas).
    """
    rank = r.rank(a)
    col = r.reshape(a, [0] * rank + [1], "segsum_column")  # [..., m, 1]: element (i, j) = a[i]
    if isinstance(size, int):
        i = np.arange(size)
        below = r._constant(i[None, :] < i[:, None], "below_mask")
        causal = r._constant(i[None, :] <= i[:, None], "causal_mask")
    else:
        m = r.dim(a, rank - 1)
        idx = r.iota(m, torch.int64, what="index")
        rows, cols = r.reshape(idx, [-1, 1], "rows"), r.reshape(idx, [1, -1], "cols")
        below = r.ew(cols, rows, EW.LESS, "below_mask")
        causal = r.unary(r.ew(cols, rows, EW.GREATER, "above_mask"), UN.NOT, "causal_mask")
    zero = r.scalar(0.0, torch.float32, rank + 1, "zero")
    sums = r.cumsum(r.select(below, col, zero, "strict_lower"), rank - 1, "cumsum")
    return r.select(causal, sums, r.scalar(float("-inf"), torch.float32, rank + 1, "neg_inf"), "segsum")


# --- dense algebra -------------------------------------------------------------------------------
def linear(x, weight, bias=None):
    r = _recorder(x)
    with r.op("linear", "native: matmul with a constant weight (transposed) + bias"):
        t = r.itensor(x)
        if torch_dtype(t.dtype) != weight.dtype:
            raise BuildError(f"linear: input is {torch_dtype(t.dtype)} but weight {tuple(weight.shape)} is "
                             f"{weight.dtype}; bind weights in the activation dtype")
        w = r.weight(weight)
        y = r.matmul(t, w, transpose_b=True)
        if bias is not None:
            y = r.ew(y, r.cast(r.weight(bias, "bias"), torch_dtype(y.dtype)), EW.SUM, "add_bias")
        return r.wrap(y)


def embedding(ids, table):
    r = _recorder(ids)
    with r.op("embedding", "native: gather rows of a constant table"):
        return r.wrap(r.gather(r.weight(table, "table"), r.itensor(ids), 0, "gather"))


def rms_norm(x, weight, eps):
    r = _recorder(x)
    with r.op("rms_norm", "native: fp32 reduce-mean of squares, rsqrt, scale, cast back"):
        t = r.itensor(x)
        h = _rms(r, r.cast(t, torch.float32, "upcast"), eps)
        w = r.cast(r.weight(weight), torch.float32, "weight_fp32")
        return r.wrap(r.cast(r.ew(w, h, EW.PROD, "scale"), torch_dtype(t.dtype), "downcast"))


def gated_rms_norm(x, gate, weight, eps, group_size):
    r = _recorder(x, gate)
    with r.op("gated_rms_norm", "native: fp32 x*silu(gate), per-group rms over a reshape, cast back"):
        t, g = r.itensor(x), r.itensor(gate)
        dtype = torch_dtype(t.dtype)
        gf = r.cast(g, torch.float32, "gate_fp32")
        h = r.ew(r.cast(t, torch.float32, "upcast"),
                 r.ew(gf, r.activation_layer(gf, ACT.SIGMOID, "sigmoid"), EW.PROD, "silu"), EW.PROD, "gate")
        rank, channels = r.rank(t), weight.shape[-1]
        groups = r.reshape(h, [0] * (rank - 1) + [channels // group_size, group_size], "groups")
        flat = r.reshape(_rms(r, groups, eps), [0] * (rank - 1) + [channels], "flatten")
        w = r.weight(weight)
        out_dtype = torch.promote_types(weight.dtype, dtype)
        y = r.ew(r.cast(w, out_dtype, "weight_cast"), r.cast(r.cast(flat, dtype, "downcast"), out_dtype),
                 EW.PROD, "scale")
        return r.wrap(y)


def activation(x, name):
    r = _recorder(x)
    with r.op("activation", "native: activation/unary/elementwise layers (silu and softplus via fp32 for half types)"):
        return r.wrap(_act(r, r.itensor(x), name))


def clamp(x, lo, hi):
    r = _recorder(x)
    with r.op("clamp", "native: elementwise max/min (infinite bounds skipped)"):
        t = r.itensor(x)
        if lo is not None and lo != float("-inf"):
            t = r.ew_scalar(t, lo, EW.MAX, "lower")
        if hi is not None and hi != float("inf"):
            t = r.ew_scalar(t, hi, EW.MIN, "upper")
        return r.wrap(t)


def to_float32(x):
    r = _recorder(x)
    with r.op("to_float32", "native: cast"):
        t = r.itensor(x)
        return x if t.dtype == trt.float32 else r.wrap(r.cast(t, torch.float32))


# --- shapes ---------------------------------------------------------------------------------------
def split(x, sizes, dim):
    r = _recorder(x)
    with r.op("split", "native: slices"):
        t = r.itensor(x)
        out, start = [], 0
        for i, size in enumerate(sizes):
            out.append(r.wrap(r.slice(t, dim, start, int(size), f"piece{i}")))
            start += int(size)
        if t.shape[dim] >= 0 and start != t.shape[dim]:
            raise BuildError(f"split: sizes {list(sizes)} do not add up to dim {dim} of {tuple(t.shape)}")
        return out


def concat(xs, dim):
    r = _recorder(*xs)
    with r.op("concat", "native: concatenation"):
        dtype = xs[0].dtype
        for x in xs[1:]:
            dtype = torch.promote_types(dtype, x.dtype)
        ts = [r.cast(r.itensor(x), dtype, "promote") for x in xs]
        return r.wrap(r.concat(ts, dim))


def reshape(x, shape):
    r = _recorder(x)
    with r.op("reshape", "native: shuffle (0 copies, -1 infers)"):
        return r.wrap(r.reshape(r.itensor(x), [int(s) for s in shape]))


def permute(x, dims):
    r = _recorder(x)
    with r.op("permute", "native: shuffle transpose"):
        t = r.itensor(x)
        return r.wrap(r.transpose(t, [d % r.rank(t) for d in dims]))


def _gather_rows(r, data, index):
    """data [B, L, ...], index [B, G] -> [B, G, ...] (gather ND with one elementwise dim)."""
    return r.gather_nd(data, r.reshape(index, [0, 0, 1], "index_column"), 1, "gather_nd")


def gather_rows(x, index):
    r = _recorder(x, index)
    with r.op("gather_rows", "native: gather ND with 1 elementwise dim"):
        return r.wrap(_gather_rows(r, r.itensor(x), r.itensor(index, "index")))


def _keep_mask(r, lengths, seq):
    """[B, T] bool: t < lengths[b]; ``seq`` is T (int or int64 [1] tensor)."""
    dt = _int_dtype(lengths)
    t = r.reshape(r.iota(seq, dt, what="positions"), [1, -1], "row")
    return r.ew(t, r.reshape(lengths, [0, 1], "lengths_column"), EW.LESS, "keep")


def mask_padding(x, lengths):
    r = _recorder(x, lengths)
    with r.op("mask_padding", "native: iota < lengths, cast, multiply"):
        t, lens = r.itensor(x), r.itensor(lengths, "lengths")
        keep = r.cast(_keep_mask(r, lens, r.dim(t, 1)), torch_dtype(t.dtype), "keep_cast")
        keep = r.reshape(keep, [0, 0] + [1] * (r.rank(t) - 2), "keep_reshape")
        return r.wrap(r.ew(t, keep, EW.PROD, "mask"))


# --- sequence mixers ------------------------------------------------------------------------------
def _conv_window(r, padded, lens, width: int):
    """Rows lengths[b] .. lengths[b] + K-2 of padded [B, K-1+T, C] (gather ND)."""
    offsets = r._constant(torch.arange(width - 1, dtype=_int_dtype(lens)).reshape(1, -1), "window")
    rows = r.ew(r.reshape(lens, [0, 1], "lengths_column"), offsets, EW.SUM, "state_rows")
    return _gather_rows(r, padded, rows)


def conv_window(conv_state, x, lengths):
    r = _recorder(conv_state, x, lengths)
    with r.op("conv_window", "native: concatenation + gather of the K-1 rows ending at lengths - 1"):
        t, state, lens = r.itensor(x), r.itensor(conv_state, "conv_state"), r.itensor(lengths, "lengths")
        padded = r.concat([r.cast(state, torch_dtype(t.dtype), "state_cast"), t], 1, "padded")
        return r.wrap(_conv_window(r, padded, lens, int(state.shape[1]) + 1))


def causal_conv1d(x, conv_state, weight, bias, lengths):
    r = _recorder(x, conv_state, lengths)
    with r.op("causal_conv1d", "native: K shifted slices multiply-added (in fp32 for half types), state by gather"):
        t, state, lens = r.itensor(x), r.itensor(conv_state, "conv_state"), r.itensor(lengths, "lengths")
        dtype = torch_dtype(t.dtype)
        width = int(weight.shape[1])
        padded = r.concat([r.cast(state, dtype, "state_cast"), t], 1, "padded")  # [B, K-1+T, C]
        seq = r.dim(t, 1)
        acc_dtype = torch.float32 if dtype in _HALF else dtype
        pf = r.cast(padded, acc_dtype, "upcast")
        w = r.cast(r.weight(weight), acc_dtype, "weight_cast")  # [C, K]
        y = None
        for k in range(width):
            tap = r.reshape(r.slice(w, 1, k, 1, f"tap{k}"), [1, 1, -1], f"tap{k}_row")
            term = r.ew(r.slice(pf, 1, k, seq, f"shift{k}"), tap, EW.PROD, f"mul{k}")
            y = term if y is None else r.ew(y, term, EW.SUM, f"acc{k}")
        if bias is not None:
            y = r.ew(y, r.reshape(r.cast(r.weight(bias, "bias"), acc_dtype), [1, 1, -1], "bias_row"),
                     EW.SUM, "add_bias")
        y = r.cast(y, dtype, "downcast")
        return r.wrap(y), r.wrap(_conv_window(r, padded, lens, width))


def _heads(r, t, heads: int, what: str):
    """[B, T, G, N] -> [B, T, H, N] (group g serves heads g*H/G ... (g+1)*H/G - 1)."""
    groups = t.shape[2]
    if groups == heads:
        return t
    idx = r._constant(torch.arange(heads, dtype=torch.int32) // (heads // groups), "head_groups")
    return r.gather(t, idx, 2, what)


def _ssm_inputs(r, x, dt, A, B, state):
    """fp32 pieces shared by the scan and the state: (x, a = dt*A [B,T,H], u = x*dt, B per head, h0)."""
    tx = r.itensor(x)
    heads = int(A.shape[0])
    f32 = torch.float32
    xf = r.cast(tx, f32, "x_fp32")
    dtf = r.cast(r.itensor(dt, "dt"), f32, "dt_fp32")
    Bf = _heads(r, r.cast(r.itensor(B, "B"), f32, "B_fp32"), heads, "B_heads")
    h0 = r.cast(r.itensor(state, "state"), f32, "state_fp32")
    a = r.ew(dtf, r.reshape(r.cast(r.weight(A, "A"), f32), [1, 1, -1], "A_row"), EW.PROD, "dtA")  # [B,T,H]
    u = r.ew(xf, r.reshape(dtf, [0, 0, 0, 1], "dt_column"), EW.PROD, "x_dt")  # [B,T,H,P]
    return xf, a, u, Bf, h0


def ssm_scan(x, dt, A, B, C, D, state, chunk_size):
    r = _recorder(x, dt, B, C, state)
    desc = ("native: chunked SSD (pad to chunk multiple, intra-chunk quadratic form, "
            "inter-chunk recurrence as a matrix over chunk decays, no loops)")
    with r.op("ssm_scan", desc):
        tx = r.itensor(x)
        dtype = torch_dtype(tx.dtype)
        heads, head_dim = int(A.shape[0]), tx.shape[3]
        state_size = r.itensor(B).shape[3]
        f32 = torch.float32
        xf, a, u, Bf, h0 = _ssm_inputs(r, x, dt, A, B, state)
        Cf = _heads(r, r.cast(r.itensor(C, "C"), f32, "C_fp32"), heads, "C_heads")
        y, new_state = _ssm_chunked(r, u, a, Bf, Cf, h0, int(chunk_size), head_dim, state_size)
        d = r.reshape(r.cast(r.weight(D, "D"), f32), [1, 1, -1, 1], "D_column")
        y = r.cast(r.ew(y, r.ew(xf, d, EW.PROD, "skip"), EW.SUM, "add_skip"), dtype, "downcast")
        return r.wrap(y), r.wrap(new_state)


def ssm_state(x, dt, A, B, state):
    r = _recorder(x, dt, B, state)
    with r.op("ssm_state", "native: cumulative log decay, decay-weighted inputs, one matmul over time"):
        _, a, u, Bf, h0 = _ssm_inputs(r, x, dt, A, B, state)
        seq = r.dim(a, 1)
        acum = r.cumsum(a, 1, "a_cumsum")                                              # [B,T,H]
        last = r.slice(acum, 1, r.dim_arith(seq, 1, EW.SUB), 1, "total_log_decay")     # [B,1,H]
        to_end = r.exp(r.ew(last, acum, EW.SUB, "to_end_log"), "to_end")               # [B,T,H]
        weighted = r.ew(u, r.reshape(to_end, [0, 0, 0, 1], "to_end_column"), EW.PROD, "u_to_end")
        update = r.matmul(r.transpose(weighted, [0, 2, 3, 1], "u_heads_first"),       # [B,H,P,T]
                          r.transpose(Bf, [0, 2, 1, 3], "B_heads_first"), what="update")  # [B,H,P,N]
        decay = r.reshape(r.exp(last, "total_decay"), [0, -1, 1, 1], "total_decay_column")  # [B,H,1,1]
        return r.wrap(r.ew(r.ew(h0, decay, EW.PROD, "decayed"), update, EW.SUM, "new_state"))


def _ssm_chunked(r, u, a, Bf, Cf, h0, Q, P, N):
    heads = a.shape[2]
    seq = r.dim(u, 1)
    padded = r.dim_arith(r.dim_arith(r.dim_arith(seq, Q - 1, EW.SUM), Q, EW.FLOOR_DIV), Q, EW.PROD,
                         "padded_length")
    u = r.pad_to(u, 1, padded, "u_pad")
    a = r.pad_to(a, 1, padded, "a_pad")
    Bf = r.pad_to(Bf, 1, padded, "B_pad")
    Cf = r.pad_to(Cf, 1, padded, "C_pad")

    def chunks(t, last, what):  # [B, Tp, H, last] -> [B, H, n, Q, last]
        return r.transpose(r.reshape(t, [0, -1, Q, heads, last], what + "_chunks"), [0, 3, 1, 2, 4], what)

    uc, Bc, Cc = chunks(u, P, "u"), chunks(Bf, N, "B"), chunks(Cf, N, "C")
    ac = r.transpose(r.reshape(a, [0, -1, Q, heads], "a_chunks"), [0, 3, 1, 2], "a")  # [B,H,n,Q]
    acum = r.cumsum(ac, 3, "a_cumsum")
    decay_in = r.exp(_segment_sums(r, ac, Q), "decay_in")  # [B,H,n,Q,Q]
    scores = r.ew(r.matmul(Cc, Bc, transpose_b=True, what="CB"), decay_in, EW.PROD, "scores")
    y_diag = r.matmul(scores, uc, what="y_diag")  # [B,H,n,Q,P]
    last = r.slice(acum, 3, Q - 1, 1, "chunk_log_decay")  # [B,H,n,1]
    to_end = r.exp(r.ew(last, acum, EW.SUB, "to_end_log"), "to_end")
    weighted = r.ew(uc, r.reshape(to_end, [0, 0, 0, 0, 1], "to_end_column"), EW.PROD, "u_to_end")
    chunk_states = r.matmul(weighted, Bc, transpose_a=True, what="chunk_states")  # [B,H,n,P,N]
    # inter-chunk recurrence h_{c+1} = h_c * exp(L_c) + S_c, solved at once:
    # [h_0 .. h_n] = exp(segsum([0, L_0 .. L_{n-1}])) @ [h0, S_0 .. S_{n-1}]
    log_decay = r.reshape(last, [0, 0, -1], "chunk_log_decay_flat")  # [B,H,n]
    n = r.dim(log_decay, 2)
    zero = r.zeros([r.dim(log_decay, 0), heads, 1], torch.float32, "zero_decay")
    lz = r.concat([zero, log_decay], 2, "chunk_log_decay_padded")  # [B,H,n+1]
    passing = r.exp(_segment_sums(r, lz, None), "state_passing")  # [B,H,n+1,n+1]
    items = r.concat([r.reshape(h0, [0, 0, 1, P * N], "state_row"),
                      r.reshape(chunk_states, [0, 0, 0, P * N], "chunk_states_flat")], 2, "states_in")
    states = r.matmul(passing, items, what="state_passing_matmul")  # [B,H,n+1,PN]
    entering = r.reshape(r.slice(states, 2, 0, n, "entering"), [0, 0, 0, P, N], "entering_split")
    new_state = r.reshape(r.slice(states, 2, n, 1, "final_state"), [0, 0, P, N], "new_state")
    y_off = r.ew(r.matmul(Cc, entering, transpose_b=True, what="y_off"),
                 r.reshape(r.exp(acum, "in_decay"), [0, 0, 0, 0, 1], "in_decay_column"), EW.PROD, "y_off_decay")
    y = r.ew(y_diag, y_off, EW.SUM, "y_chunks")  # [B,H,n,Q,P]
    y = r.reshape(r.transpose(y, [0, 2, 3, 1, 4], "y_time_first"), [0, -1, heads, P], "y_padded")
    return r.slice(y, 1, 0, seq, "y"), new_state


def kv_cache_update(cache, new, positions):
    r = _recorder(cache, new, positions)
    with r.op("kv_cache_update", "native: scatter ELEMENT along the sequence axis"):
        c, n, pos = r.itensor(cache, "cache"), r.itensor(new, "new"), r.itensor(positions, "positions")
        n = r.cast(n, torch_dtype(c.dtype), "new_cast")
        idx = r.reshape(pos, [0, 0, 1, 1], "positions_column")
        rows = [r.dim(n, i) for i in range(4)]
        zeros = r.zeros([1, 1] + rows[2:] if all(isinstance(d, int) for d in rows[2:]) else rows,
                        torch_dtype(pos.dtype), "index_zeros")
        idx = r.ew(idx, zeros, EW.SUM, "index")  # [B, T, Hkv, D]
        layer = r.network.add_scatter(c, idx, n, trt.ScatterMode.ELEMENT)
        layer.axis = 1
        return r.wrap(r._out(layer, "scatter"))


def attention(q, k_cache, v_cache, positions, scale, window=None, sinks=None):
    r = _recorder(q, k_cache, positions)
    how = "native: matmul + causal mask by positions + fp32 softmax + matmul (GQA by reshape)"
    if window is not None:
        how += "; sliding window as a second mask term"
    if sinks is not None:
        how += "; sinks as fp32 constants in a softmax written out (max, exp, sum + exp(sink))"
    with r.op("attention", how):
        tq, k, v = r.itensor(q), r.itensor(k_cache, "k_cache"), r.itensor(v_cache, "v_cache")
        pos = r.itensor(positions, "positions")
        dtype = torch_dtype(tq.dtype)
        q_heads, dim = tq.shape[2], tq.shape[3]
        kv_heads = k.shape[2]
        if q_heads < 0 or kv_heads < 0:
            raise BuildError("attention: head counts must be static")
        group = q_heads // kv_heads
        qg = r.transpose(r.reshape(tq, [0, 0, kv_heads, group, dim], "q_groups"), [0, 2, 3, 1, 4], "q")
        kt = r.reshape(r.transpose(k, [0, 2, 3, 1], "k_transposed"), [0, 0, 1, dim, -1], "k")  # [B,Hkv,1,D,S]
        vt = r.reshape(r.transpose(v, [0, 2, 1, 3], "v_heads_first"), [0, 0, 1, -1, dim], "v")  # [B,Hkv,1,S,D]
        scores = r.ew_scalar(r.matmul(qg, kt, what="qk"), float(scale), EW.PROD, "scale")  # [B,Hkv,g,T,S]
        pdt = _int_dtype(pos)
        keys = r.reshape(r.iota(r.dim(k, 1), pdt, what="keys"), [1, 1, 1, 1, -1], "keys_row")
        qpos = r.reshape(pos, [0, 1, 1, -1, 1], "query_positions")
        visible = r.unary(r.ew(keys, qpos, EW.GREATER, "future"), UN.NOT, "visible")  # [B,1,1,T,S]
        if window is not None:  # slot j is visible while j + window > position (HF's inclusive window)
            inside = r.ew(r.ew_scalar(keys, int(window), EW.SUM, "keys_plus_window"), qpos, EW.GREATER, "in_window")
            visible = r.ew(visible, inside, EW.AND, "visible_in_window")
        ninf = r.scalar(float("-inf"), dtype, 5, "neg_inf")
        scores = r.select(visible, scores, ninf, "mask")
        f32 = torch.float32
        if sinks is None:
            probs = r.cast(r.softmax(r.cast(scores, f32, "scores_fp32"), -1), dtype, "probs_cast")
        else:
            sink = r._constant(sinks.detach().float().reshape(1, kv_heads, group, 1, 1), "sinks")
            s32 = r.cast(scores, f32, "scores_fp32")
            top = r.ew(r.reduce(s32, trt.ReduceOperation.MAX, 4, True, "row_max"), sink, EW.MAX, "max_with_sink")
            e = r.exp(r.ew(s32, top, EW.SUB, "shifted"), "exp_scores")
            total = r.ew(r.reduce(e, trt.ReduceOperation.SUM, 4, True, "row_sum"),
                         r.exp(r.ew(sink, top, EW.SUB, "sink_shifted"), "exp_sink"), EW.SUM, "denominator")
            probs = r.cast(r.ew(e, total, EW.DIV, "probs"), dtype, "probs_cast")
        out = r.matmul(probs, vt, what="pv")  # [B,Hkv,g,T,D]
        out = r.reshape(r.transpose(out, [0, 3, 1, 2, 4], "out_time_first"), [0, 0, q_heads, dim], "out")
        return r.wrap(out)


def moe(router_input, x, router_weight, router_bias, up, down, top_k, n_group, topk_group,
        norm_topk_prob, routed_scaling_factor, act):
    r = _recorder(x, router_input)
    with r.op("moe", "native: fp32 sigmoid router + group-limited topk, dense experts weighted by a "
                     "[N, E] routing matrix (zero for unchosen experts)"):
        tx, ri = r.itensor(x, "x"), r.itensor(router_input, "router_input")
        dtype = torch_dtype(tx.dtype)
        f32 = torch.float32
        experts, hidden = int(router_weight.shape[0]), int(router_weight.shape[1])
        inner = int(up.shape[2])
        x_shape = r.shape_of(tx)
        ri = r.cast(r.reshape(ri, [-1, hidden], "router_tokens"), f32, "router_fp32")
        xt = r.reshape(tx, [-1, inner], "tokens")  # [N, Hin]
        logits = r.matmul(ri, r.cast(r.weight(router_weight, "router"), f32), transpose_b=True, what="router")
        scores = r.activation_layer(logits, ACT.SIGMOID, "scores")  # [N, E]
        choice = r.ew(scores, r.reshape(r.cast(r.weight(router_bias, "router_bias"), f32), [1, -1], "bias_row"),
                      EW.SUM, "choice")
        per_group = experts // n_group
        grouped = r.reshape(choice, [-1, n_group, per_group], "grouped")
        best2, _ = r.topk(grouped, min(2, per_group), 2, "group_top2")
        group_scores = r.reduce(best2, trt.ReduceOperation.SUM, 2, False, "group_scores")  # [N, ng]
        _, best_groups = r.topk(group_scores, topk_group, 1, "best_groups")  # [N, tg]
        group_ids = r._constant(torch.arange(n_group, dtype=torch.int32).reshape(1, 1, -1), "group_ids")
        hit = r.ew(r.reshape(best_groups, [0, 0, 1], "best_groups_column"),
                   r.cast(group_ids, torch_dtype(best_groups.dtype)), EW.EQUAL, "group_hit")
        keep_groups = r.reduce(r.cast(hit, f32, "group_hit_cast"), trt.ReduceOperation.MAX, 1, False, "keep_groups")
        expert_group = r._constant(torch.arange(experts, dtype=torch.int32) // per_group, "expert_group")
        keep = r.ew_scalar(r.gather(keep_groups, expert_group, 1, "keep_experts"), 0.5, EW.GREATER, "keep")
        masked = r.select(keep, choice, r.scalar(float("-inf"), f32, 2, "neg_inf"), "masked_choice")
        _, index = r.topk(masked, top_k, 1, "topk")  # [N, k]
        weights = r.gather_elements(scores, index, 1, "chosen_scores")
        if norm_topk_prob:
            total = r.ew_scalar(r.reduce(weights, trt.ReduceOperation.SUM, 1, True, "sum"), 1e-20, EW.SUM, "eps")
            weights = r.ew(weights, total, EW.DIV, "normalize")
        weights = r.ew_scalar(weights, float(routed_scaling_factor), EW.PROD, "scale")
        expert_ids = r._constant(torch.arange(experts, dtype=torch.int32).reshape(1, 1, -1), "expert_ids")
        onehot = r.cast(r.ew(r.reshape(index, [0, 0, 1], "index_column"),
                             r.cast(expert_ids, torch_dtype(index.dtype)), EW.EQUAL, "onehot"), f32, "onehot_cast")
        routing = r.reduce(r.ew(onehot, r.reshape(weights, [0, 0, 1], "weights_column"), EW.PROD, "spread"),
                           trt.ReduceOperation.SUM, 1, False, "routing")  # [N, E]
        xin = r.reshape(xt, [1, -1, inner], "expert_input")  # [1, N, Hin]
        h = _act(r, r.matmul(xin, _expert_weights(r, up, dtype, "up"), transpose_b=True, what="up"), act)  # [E, N, I]
        y = r.cast(r.matmul(h, _expert_weights(r, down, dtype, "down"), transpose_b=True, what="down"), f32,
                   "down_fp32")
        gate = r.reshape(r.transpose(routing, [1, 0], "routing_t"), [0, 0, 1], "routing_column")  # [E, N, 1]
        out = r.reduce(r.ew(y, gate, EW.PROD, "weighted"), trt.ReduceOperation.SUM, 0, False, "combine")
        return r.wrap(r.reshape_like(r.cast(out, dtype, "downcast"), x_shape, "restore_shape"))


def _expert_weights(r, w, dtype, what):
    """A MoE layer's stacked expert weights [E, out, in]: NVFP4 stacks stay FP4 (dequantized in the network)."""
    if getattr(w, "is_nvfp4", False):
        return r.nvfp4_weight(w.packed, w.scale, w.scale_2, w.shape, dtype, what)
    return r.weight(w, what)


_MODULE = sys.modules[__name__]


# --- hidden-state capture (plugins/hidden_capture.py) ---------------------------------------------------
from plugins import hidden_capture as _hidden_capture_plugin  # noqa: E402

__all__ += ["capture_buffer", "hidden_capture"]


def capture_buffer(x, n_slots):
    r = _recorder(x)
    with r.op("capture_buffer", "native: fill zeros [..., n_slots*H] (fp32 fill, cast)"):
        t = r.itensor(x)
        if t.shape[-1] < 0:
            raise BuildError("capture_buffer: the hidden size (last dim) must be static")
        dims = [r.dim(t, i) for i in range(r.rank(t) - 1)] + [int(n_slots) * t.shape[-1]]
        return r.wrap(r.cast(r.zeros(dims, torch.float32, "zeros"), torch_dtype(t.dtype), "cast"))


def hidden_capture(residual, delta, buffer, slot):
    """Lowered by the plugin module: a plugin layer where TensorRT has plugin layers, else native
    layers; ``r.lowerings["hidden_capture"]`` says which."""
    r = _recorder(residual, delta, buffer)
    res, buf = r.itensor(residual, "residual"), r.itensor(buffer, "buffer")
    d = None if delta is None else r.itensor(delta, "delta")
    try:
        x, b = _hidden_capture_plugin.lower(r, trt, res, d, buf, int(slot))
    except (TypeError, ValueError) as exc:
        raise BuildError(str(exc)) from exc
    return r.wrap(x), r.wrap(b)


# --- draft-model ops (EAGLE / EAGLE-3) --------------------------------------------------------------
from builder.backends.torch_backend import rope_attention_scale as _rope_attention_scale  # noqa: E402
from builder.backends.torch_backend import rope_inv_freq as _rope_inv_freq  # noqa: E402

__all__ += ["rope", "where"]


def rope(x, positions, theta, rotary_dim=None, scaling=None):
    r = _recorder(x, positions)
    with r.op("rope", "native: fp32 angles positions*inv_freq (inv_freq precomputed at build: default, linear, "
                      "llama3 or yarn), cos/sin unary, rotate_half by slices + concat"):
        t, pos = r.itensor(x), r.itensor(positions, "positions")
        _int_dtype(pos)
        dim = t.shape[3]
        if dim < 0:
            raise BuildError("rope: the head dim (last dim) must be static")
        rd = dim if rotary_dim is None else int(rotary_dim)
        if rd > dim:
            raise ValueError(f"rope: rotary_dim {rd} exceeds the head dim {dim}")
        inv = _rope_inv_freq(theta, rd, scaling)
        f32 = torch.float32
        freq = r._constant(torch.cat([inv, inv]).reshape(1, 1, 1, rd), "inv_freq")
        angles = r.ew(r.reshape(r.cast(pos, f32, "positions_fp32"), [0, 0, 1, 1], "positions_column"), freq,
                      EW.PROD, "angles")  # [B, T, 1, rd]
        cos, sin = r.unary(angles, UN.COS, "cos"), r.unary(angles, UN.SIN, "sin")
        gain = _rope_attention_scale(scaling)  # YaRN's attention factor (1 otherwise)
        if gain != 1.0:
            cos, sin = r.ew_scalar(cos, gain, EW.PROD, "cos_gain"), r.ew_scalar(sin, gain, EW.PROD, "sin_gain")
        xf = r.cast(t, f32, "upcast")
        xr = xf if rd == dim else r.slice(xf, 3, 0, rd, "rotary_part")
        half = rd // 2
        first, second = r.slice(xr, 3, 0, half, "first_half"), r.slice(xr, 3, half, half, "second_half")
        rotated = r.concat([r.unary(second, UN.NEG, "neg_second_half"), first], 3, "rotate_half")
        out = r.ew(r.ew(xr, cos, EW.PROD, "x_cos"), r.ew(rotated, sin, EW.PROD, "rotated_sin"), EW.SUM, "rotate")
        if rd < dim:
            out = r.concat([out, r.slice(xf, 3, rd, dim - rd, "pass_part")], 3, "with_pass")
        return r.wrap(r.cast(out, torch_dtype(t.dtype), "downcast"))


def where(cond, a, b):
    r = _recorder(cond, a, b)
    with r.op("where", "native: select (int conditions compared with zero)"):
        def probe(v):
            if isinstance(v, SymbolicTensor):
                return torch.empty((1,) * max(v.ndim, 1), dtype=v.dtype)
            return v
        dtype = torch.result_type(probe(a), probe(b))
        rank = max(v.ndim if isinstance(v, SymbolicTensor) else v.dim() if isinstance(v, torch.Tensor) else 0
                   for v in (cond, a, b))
        c = r.itensor(cond, "cond")
        if c.dtype != trt.bool:
            zero = r.scalar(0, torch_dtype(c.dtype), r.rank(c), "zero")
            c = r.unary(r.ew(c, zero, EW.EQUAL, "is_zero"), UN.NOT, "nonzero")

        def operand(v, what):
            if isinstance(v, (SymbolicTensor, torch.Tensor)):
                return r.cast(r.itensor(v, what), dtype, what + "_cast")
            return r.scalar(v, dtype, rank, what)
        return r.wrap(r.select(c, operand(a, "a"), operand(b, "b"), "select"))


# --- NVFP4 weights (builder/quantization.py) and the FP4 Markov head (plugins/fp4_markov_head.py) -----
from plugins import fp4_markov_head as _markov_head_plugin  # noqa: E402

__all__ += ["linear_nvfp4", "fp4_markov_head", "NVFP4_LOWERING"]

NVFP4_LOWERING = ("native: FP4 weight + FP8 block scales dequantized by the FP32 global scale -> block "
                  "dequantize (16 along the input dim) -> matmul (with --strip_plan the three are engine inputs "
                  "or refittable constants viewing the weights file)")


def _low_precision(self, t: torch.Tensor, kind: str, shape, what: str):
    """FP4 or FP8 (``kind``) ITensor of logical ``shape`` over the bytes of ``t`` as they are (FP4: two
    values a byte, element 2i in the low nibble, as ModelOpt packs them): under ``--strip_plan`` an engine
    input (method "inputs") or a named refittable constant ("refit") when ``t`` views the weights file."""
    network = {"dtype": kind, "shape": [int(d) for d in shape]}
    if self.refit is not None and self.refit_method == "inputs":
        from builder.refit import weight_input
        bound = weight_input(self, t, network)
        if bound is not None:
            return bound
    arr = t.view(torch.uint8).numpy()
    self._keep.append((t, arr))
    weights = trt.Weights(getattr(trt.DataType, kind), arr.ctypes.data, int(np.prod(network["shape"])))
    layer = self.network.add_constant(tuple(network["shape"]), weights)
    out = self._out(layer, what)
    if self.refit is not None:
        from builder.refit import mark_refittable
        mark_refittable(self, t, weights, layer.name, network)
    return out


NetworkRecorder.low_precision = _low_precision


def _nvfp4_weight(self, packed, scale, scale_2, shape, dtype: torch.dtype, what: str = "weight"):
    """``[out, in]`` (or a stack ``[E, out, in]``, one global scale per matrix) ITensor in ``dtype`` of an
    NVFP4 weight (ModelOpt layout): FP4 codes, FP8 block scales dequantized by the FP32 global scale
    (:func:`builder.quantization.dequantize_nvfp4`'s two steps), and a block dequantize of the codes
    (last axis, blocks of 16). One set of layers per (packed tensor, dtype)."""
    cache = self.__dict__.setdefault("_nvfp4_layers", {})
    key = (id(packed), dtype)
    hit = cache.get(key)
    if hit is not None and hit[0] is packed:
        return hit[1]
    shape = tuple(int(d) for d in shape)
    if len(shape) not in (2, 3):
        raise BuildError(f"NVFP4 weight {what}: expected a 2-D logical shape (3-D for stacked experts), got {list(shape)}")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise BuildError(f"NVFP4 weight {what}: cannot dequantize to {dtype}")
    from builder.quantization import BLOCK_SIZE, _check_layout, global_scale_shape
    try:
        _check_layout(packed, scale, scale_2, shape, BLOCK_SIZE, what)
    except ValueError as exc:
        raise BuildError(f"NVFP4 weight {exc}") from exc
    fp4 = self.low_precision(packed.detach().to("cpu").contiguous(), "FP4", shape, what + "_fp4")
    blocks = shape[:-1] + (shape[-1] // BLOCK_SIZE,)
    fp8 = self.low_precision(scale.detach().to("cpu").contiguous(), "FP8", blocks, what + "_block_scale_fp8")
    per_matrix = global_scale_shape(scale_2, shape)
    global_scale = self._constant(scale_2.detach().to("cpu", torch.float32).reshape(per_matrix), what + "_global_scale")
    scales = self.network.add_dequantize(fp8, global_scale, trt_dtype(dtype))
    if per_matrix:
        scales.axis = 0  # one global scale per stacked matrix
    block_scale = self._out(scales, what + "_block_scale")
    layer = self.network.add_dequantize(fp4, block_scale, trt_dtype(dtype))
    layer.axis = len(shape) - 1
    w = self._out(layer, what + "_dequantize")
    cache[key] = (packed, w)
    return w


NetworkRecorder.nvfp4_weight = _nvfp4_weight


def linear_nvfp4(x, packed, scale, scale_2, shape, bias=None):
    r = _recorder(x)
    with r.op("linear_nvfp4", NVFP4_LOWERING):
        t = r.itensor(x)
        dtype = torch_dtype(t.dtype)
        w = r.nvfp4_weight(packed, scale, scale_2, shape, dtype)
        y = r.matmul(t, w, transpose_b=True)
        if bias is not None:
            y = r.ew(y, r.cast(r.weight(bias, "bias"), dtype), EW.SUM, "add_bias")
        return r.wrap(y)


def fp4_markov_head(logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2):
    """Lowered by the plugin module: a plugin layer where TensorRT has plugin layers, else native
    layers (gather + FP4 block dequantize + matmul + add); ``r.lowerings["fp4_markov_head"]`` says which."""
    r = _recorder(logits, prev_ids)
    lg, ids = r.itensor(logits, "logits"), r.itensor(prev_ids, "prev_ids")
    try:
        out = _markov_head_plugin.lower(r, trt, lg, ids, w1, w2_packed, w2_scale, w2_scale_2)
    except (TypeError, ValueError) as exc:
        raise BuildError(str(exc)) from exc
    return r.wrap(out)
