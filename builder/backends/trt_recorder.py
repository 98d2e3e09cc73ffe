"""Recording a TensorRT network: a :class:`Recorder` owns the builder and one network, and a
:class:`SymbolicTensor` (an ``ITensor`` plus its recorder) is what model code holds while a network is
recorded.

The recorder names layers after the op recording them (``op``, ``scope``), adds the network's inputs
and outputs, turns torch tensors into constants (one layer per bound weight; under ``--strip_plan``
refittable constants or engine inputs, see ``builder.refit``), records NVFP4 weights as FP4 codes and
FP8 block scales dequantized in the network (``nvfp4_weight``), and records Python's arithmetic
operators on symbolic tensors (``binary``). Shapes and single layers come from its base,
:class:`builder.backends.trt_layers.LayerHelpers`. Networks are strongly typed (``tensorrt_rtx``
requires it, and it keeps full TensorRT from changing precisions behind our back), so every
precision change of the torch reference is an explicit cast layer.
"""
from __future__ import annotations

import collections
import contextlib
from typing import Sequence

import numpy as np
import torch

from builder.backends.trt_dtypes import _TORCH_TO_TRT, torch_dtype, trt_dtype
from builder.backends.trt_import import FLAVOUR, trt
from builder.backends.trt_layers import EW, LayerHelpers
from builder.errors import BuildError


# --- symbolic tensors ----------------------------------------------------------------------------
class SymbolicTensor:
    """A TensorRT ``ITensor`` plus the recorder that owns it; what model code holds in a recording."""

    __slots__ = ("tensor", "recorder")
    __array_priority__ = 1000  # numpy arrays defer to our reflected operators

    def __init__(self, tensor, recorder: "Recorder"):
        self.tensor = tensor
        self.recorder = recorder

    @property
    def backend(self):
        """The op surface ``builder.functional`` dispatches this tensor's ops to: its recorder's."""
        return self.recorder.backend

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
class Recorder(LayerHelpers):
    """Owns a TensorRT builder and one network, and the helpers every lowering uses.

    Usable as a context manager (``with NetworkRecorder() as rec: ...``) or a plain object.
    ``lowerings`` maps each op name recorded to a description of the lowering it got. Networks are
    recorded with its subclass :class:`builder.backends.trt_backend.NetworkRecorder`, which names the
    op surface (``backend``) its symbolic tensors dispatch to.
    """

    @property
    def backend(self):
        raise TypeError("a bare Recorder has no op surface: record with builder.backends.trt_backend.NetworkRecorder")

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

    # low-precision constants (NVFP4 weights, builder/nvfp4_format.py) ---------------------------------
    def low_precision(self, t: torch.Tensor, kind: str, shape, what: str):
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

    def nvfp4_weight(self, packed, scale, scale_2, shape, dtype: torch.dtype, what: str = "weight"):
        """``[out, in]`` (or a stack ``[E, out, in]``, one global scale per matrix) ITensor in ``dtype`` of an
        NVFP4 weight (ModelOpt layout): FP4 codes, FP8 block scales dequantized by the FP32 global scale
        (:func:`builder.nvfp4_format.dequantize_nvfp4`'s two steps), and a block dequantize of the codes
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
        from builder.nvfp4_format import BLOCK_SIZE, _check_layout, global_scale_shape
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


def _recorder(*xs) -> Recorder:
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
