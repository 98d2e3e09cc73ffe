"""Fused residual add + capture of a hidden state into one slot of a capture buffer.

Speculative drafts (EAGLE-3, DFlash) read the target's hidden states entering some layers (``x``
after the previous block's residual add) for every token, side by side in one buffer
``[..., n_slots * H]``. At a capture point this op computes ``x_new = residual + delta`` and writes
``x_new`` into slot ``slot`` of the buffer (columns ``slot*H : (slot+1)*H``), so no concatenation is
needed at the end of the network. ``delta`` may be ``None``: a pure capture of ``residual`` (e.g. the
embeddings entering layer 0).

The four faces of the plugin (see ARCHITECTURE.md, "Plugins"):

* **spec** -- :data:`PLUGIN_NAME` / :data:`PLUGIN_VERSION` / :data:`PLUGIN_NAMESPACE`, the attributes
  (:class:`HiddenCaptureSpec`: ``slot``, ``n_slots``, ``hidden_size``, ``has_delta``) and the output
  shapes and dtypes as functions of the input ones (:func:`output_shapes`, :func:`output_dtypes`).
* **torch reference** -- :func:`hidden_capture_reference` (functional, never mutates its inputs).
* **Triton-lang kernel** -- one pass over rows: add, store ``x_new``, store it into the slot (and,
  out of place, copy the other slots). :func:`hidden_capture_triton` launches it in place on a
  buffer. On a CPU it runs under ``TRITON_INTERPRET=1`` (the kernel is jitted lazily, when first
  launched, so setting the variable before the first launch is enough).
* **TensorRT lowering** -- :func:`lower`. Where the TensorRT flavour offers plugin layers (full
  ``tensorrt`` >= 10.7 with ``tensorrt.plugin``), a real plugin layer whose implementation launches
  the Triton kernel; otherwise (``tensorrt_rtx``) native layers: an elementwise add and a
  slice/concatenate write into the slot. The lowering it got is recorded in
  ``recorder.lowerings["hidden_capture"]`` for the build report.

This module imports neither ``builder`` nor ``runtime``; :func:`lower` takes the recorder and the
TensorRT module as arguments (duck typed). Annotations here must stay real objects (no
``from __future__ import annotations``): ``tensorrt.plugin`` inspects them.
"""
import dataclasses
from typing import Optional, Sequence, Tuple

import torch
from plugins.triton_jit import jit
from plugins.plugin_layers import NATIVE_ENV, native_requested, plugin_layers_available  # noqa: F401

try:  # the kernel's language module; Triton itself is only needed to launch the kernel
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but keep the spec importable
    tl = None

PLUGIN_NAME = "nemospec_hidden_capture"
PLUGIN_VERSION = "1"  # TensorRT's Python (quickly deployable) plugins always have version "1"
PLUGIN_NAMESPACE = "nemospec"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
OP_NAME = "hidden_capture"

#: plugin attributes, in the order the plugin declares them
ATTRIBUTES = ("slot", "n_slots", "hidden_size", "has_delta")

#: set to 1 to lower to native layers even where plugin layers exist (e.g. to interpret the network)

PLUGIN_LOWERING = f"plugin: {PLUGIN_NAME} v{PLUGIN_VERSION} (Triton kernel)"
NATIVE_LOWERING = "native: elementwise add + slice/concat write into the slot"


# --- spec -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HiddenCaptureSpec:
    """Attributes of one capture point."""

    slot: int
    n_slots: int
    hidden_size: int
    has_delta: bool = True

    def __post_init__(self):
        if self.hidden_size <= 0:
            raise ValueError(f"hidden_capture: hidden size must be positive, got {self.hidden_size}")
        if self.n_slots <= 0:
            raise ValueError(f"hidden_capture: n_slots must be positive, got {self.n_slots}")
        if not 0 <= self.slot < self.n_slots:
            raise ValueError(f"hidden_capture: slot {self.slot} out of range for {self.n_slots} slots")

    def attributes(self) -> dict:
        """Plugin fields (all int, as TensorRT serialises them)."""
        return {"slot": int(self.slot), "n_slots": int(self.n_slots), "hidden_size": int(self.hidden_size),
                "has_delta": int(bool(self.has_delta))}

    @property
    def columns(self) -> Tuple[int, int]:
        """[start, stop) of the slot in the buffer's last dim."""
        return self.slot * self.hidden_size, (self.slot + 1) * self.hidden_size


def _same(a: int, b: int) -> bool:
    """Dims agree (-1 or None marks a dim only known at run time)."""
    return a is None or b is None or a < 0 or b < 0 or a == b


def make_spec(residual_shape: Sequence[int], delta_shape: Optional[Sequence[int]],
              buffer_shape: Sequence[int], slot: int) -> HiddenCaptureSpec:
    """Validate input shapes ([..., H], same or None, [..., n_slots*H]) and derive the attributes.

    Dims may be -1 (dynamic) except the last ones, which must be known.
    """
    residual_shape, buffer_shape = tuple(residual_shape), tuple(buffer_shape)
    if len(residual_shape) < 1 or len(buffer_shape) != len(residual_shape):
        raise ValueError(f"hidden_capture: residual {residual_shape} and buffer {buffer_shape} "
                         "must have the same rank >= 1")
    hidden, width = residual_shape[-1], buffer_shape[-1]
    if hidden is None or hidden < 0 or width is None or width < 0:
        raise ValueError(f"hidden_capture: the last dims must be static (residual {residual_shape}, "
                         f"buffer {buffer_shape})")
    if hidden == 0 or width % hidden:
        raise ValueError(f"hidden_capture: buffer width {width} is not a multiple of hidden size {hidden}")
    if not all(_same(a, b) for a, b in zip(residual_shape[:-1], buffer_shape[:-1])):
        raise ValueError(f"hidden_capture: leading dims of residual {residual_shape} and buffer "
                         f"{buffer_shape} differ")
    if delta_shape is not None:
        delta_shape = tuple(delta_shape)
        if len(delta_shape) != len(residual_shape) or not all(
                _same(a, b) for a, b in zip(delta_shape, residual_shape)):
            raise ValueError(f"hidden_capture: delta {delta_shape} and residual {residual_shape} differ")
    return HiddenCaptureSpec(int(slot), width // hidden, hidden, delta_shape is not None)


def output_shapes(residual_shape, delta_shape, buffer_shape, slot):
    """(x_new shape, buffer_new shape): the residual's and the buffer's."""
    make_spec(residual_shape, delta_shape, buffer_shape, slot)
    return tuple(residual_shape), tuple(buffer_shape)


def output_dtypes(residual_dtype, delta_dtype, buffer_dtype):
    """(x_new dtype, buffer_new dtype). All inputs must share one dtype (torch or TensorRT types)."""
    if (delta_dtype is not None and delta_dtype != residual_dtype) or buffer_dtype != residual_dtype:
        raise TypeError(f"hidden_capture: residual, delta and buffer must share one dtype "
                        f"(got {residual_dtype}, {delta_dtype}, {buffer_dtype})")
    return residual_dtype, buffer_dtype


def _check(residual, delta, buffer, slot) -> HiddenCaptureSpec:
    output_dtypes(residual.dtype, None if delta is None else delta.dtype, buffer.dtype)
    return make_spec(residual.shape, None if delta is None else delta.shape, buffer.shape, slot)


# --- torch reference ------------------------------------------------------------------------------------
def hidden_capture_reference(residual: torch.Tensor, delta: Optional[torch.Tensor], buffer: torch.Tensor,
                             slot: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x_new, buffer_new): ``x_new = residual + delta`` (``residual`` when delta is None) and a copy
    of ``buffer`` whose slot ``slot`` holds x_new. The inputs are not modified."""
    spec = _check(residual, delta, buffer, slot)
    x_new = residual if delta is None else residual + delta
    start, stop = spec.columns
    buffer_new = buffer.clone()
    buffer_new[..., start:stop] = x_new
    return x_new, buffer_new


# --- Triton-lang kernel ---------------------------------------------------------------------------------
if tl is not None:  # defined only where Triton is installed (annotations must be real objects)

    def _hidden_capture_kernel(residual_ptr, delta_ptr, buffer_in_ptr, x_out_ptr, buffer_out_ptr,
                               hidden, slot, n_slots,
                               HAS_DELTA: tl.constexpr, WRITE_X: tl.constexpr, COPY_BUFFER: tl.constexpr,
                               BF16: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row, column block): x = residual (+ delta) in fp32, rounded once to the row's dtype;
        x is stored to x_out (WRITE_X) and to the slot of buffer_out; with COPY_BUFFER the other slots of
        buffer_in are copied to buffer_out (the out-of-place form a TensorRT plugin needs)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        offsets = row * hidden + cols
        x = tl.load(residual_ptr + offsets, mask=mask)
        if HAS_DELTA:
            d = tl.load(delta_ptr + offsets, mask=mask)
            total = x.to(tl.float32) + d.to(tl.float32)
            if BF16:  # round to nearest even by hand: the interpreter's fp32 -> bf16 cast truncates
                bits = total.to(tl.uint32, bitcast=True)
                rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                rounded = tl.where(total != total, (bits >> 16) | 0x40, rounded)  # NaN stays NaN
                x = rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
            else:
                x = total.to(x_out_ptr.dtype.element_ty)
        if WRITE_X:
            tl.store(x_out_ptr + offsets, x, mask=mask)
        base = row * hidden * n_slots + cols
        tl.store(buffer_out_ptr + base + slot * hidden, x, mask=mask)
        if COPY_BUFFER:
            for s in range(0, n_slots):
                if s != slot:
                    v = tl.load(buffer_in_ptr + base + s * hidden, mask=mask)
                    tl.store(buffer_out_ptr + base + s * hidden, v, mask=mask)
else:  # pragma: no cover
    _hidden_capture_kernel = None


def _block(hidden: int) -> int:
    block = 16
    while block < hidden and block < 1024:
        block *= 2
    return block


def _launch(residual, delta, buffer_in, x_out, buffer_out, spec: HiddenCaptureSpec, write_x: bool,
            copy_buffer: bool) -> None:
    rows = residual.numel() // spec.hidden_size
    if rows == 0:
        return
    block = _block(spec.hidden_size)
    grid = (rows, -(-spec.hidden_size // block))
    jit(_hidden_capture_kernel)[grid](residual, residual if delta is None else delta, buffer_in, x_out, buffer_out,
                    spec.hidden_size, spec.slot, spec.n_slots,
                    HAS_DELTA=delta is not None, WRITE_X=write_x, COPY_BUFFER=copy_buffer,
                    BF16=residual.dtype == torch.bfloat16, BLOCK=block)


def hidden_capture_triton(residual: torch.Tensor, delta: Optional[torch.Tensor], buffer: torch.Tensor,
                          slot: int) -> torch.Tensor:
    """Triton launch of the fused op, **in place on ``buffer``**: slot ``slot`` of ``buffer`` is
    overwritten with x_new, which is returned (a new tensor; ``residual`` itself when delta is None).

    ``buffer`` must be contiguous (it is written through); residual and delta are read as contiguous.
    CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``.
    """
    spec = _check(residual, delta, buffer, slot)
    if not buffer.is_contiguous():
        raise ValueError("hidden_capture_triton writes into buffer in place: it must be contiguous")
    residual = residual.contiguous()
    delta = None if delta is None else delta.contiguous()
    x_new = residual if delta is None else torch.empty_like(residual)
    _launch(residual, delta, buffer, x_new, buffer, spec, write_x=delta is not None, copy_buffer=False)
    return x_new


def hidden_capture_triton_functional(residual: torch.Tensor, delta: Optional[torch.Tensor], buffer: torch.Tensor,
                                     slot: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The reference's functional form, (x_new, buffer_new), in one launch: the residual add that the
    layer needs anyway also writes the slot of a new buffer and copies the other slots into it, so the
    capture costs no launch of its own (the GPU path's ``hidden_capture``)."""
    spec = _check(residual, delta, buffer, slot)
    residual = residual.contiguous()
    delta = None if delta is None else delta.contiguous()
    x_new = residual if delta is None else torch.empty_like(residual)
    buffer_new = torch.empty(buffer.shape, dtype=buffer.dtype, device=buffer.device)
    _launch(residual, delta, buffer.contiguous(), x_new, buffer_new, spec, write_x=delta is not None,
            copy_buffer=True)
    return x_new, buffer_new


# --- TensorRT lowering ------------------------------------------------------------------------------------
def lower(recorder, trt, residual, delta, buffer, slot: int):
    """Record the op into ``recorder.network``; returns (x_new, buffer_new) ITensors.

    ``recorder`` is builder's NetworkRecorder (duck typed: ``network``, ``flavour``, ``op``,
    ``slice``, ``concat``, ``ew``); ``trt`` the TensorRT module it records with; residual / delta
    (or None) / buffer are ITensors. A plugin layer where the flavour has plugin layers (unless
    ``recorder.native_plugins`` or ``NEMOSPEC_NATIVE_PLUGINS=1`` asks for native layers), else
    native layers.
    """
    output_dtypes(residual.dtype, None if delta is None else delta.dtype, buffer.dtype)
    spec = make_spec(tuple(residual.shape), None if delta is None else tuple(delta.shape),
                     tuple(buffer.shape), slot)
    flavour = getattr(recorder, "flavour", getattr(trt, "__name__", "tensorrt"))
    has_plugins = plugin_layers_available(recorder.network)
    if has_plugins and not native_requested(recorder):
        return _lower_plugin(recorder, residual, delta, buffer, spec)
    reason = "plugin layers disabled" if has_plugins else f"{flavour} has no plugin layers"
    return _lower_native(recorder, trt, residual, delta, buffer, spec, reason)


def _lower_native(r, trt, residual, delta, buffer, spec: HiddenCaptureSpec, reason: str):
    with r.op(OP_NAME, f"{NATIVE_LOWERING} ({reason})"):
        x = residual if delta is None else r.ew(residual, delta, trt.ElementWiseOperation.SUM, "add")
        if spec.n_slots == 1:
            return x, x
        h, last = spec.hidden_size, spec.n_slots - 1
        pieces = []
        if spec.slot > 0:
            pieces.append(r.slice(buffer, -1, 0, spec.slot * h, "before"))
        pieces.append(x)
        if spec.slot < last:
            pieces.append(r.slice(buffer, -1, (spec.slot + 1) * h, (last - spec.slot) * h, "after"))
        return x, r.concat(pieces, -1, "write")


_REGISTERED = False


def register_tensorrt_plugin() -> None:
    """Register the plugin with full TensorRT's Python plugin registry (``tensorrt.plugin``), once
    per process. Building a network with the plugin layer does it; a process that deserialises an
    engine holding the layer must call it before deserialising. Needs full ``tensorrt`` >= 10.7;
    running the layer needs torch with CUDA and Triton."""
    global _REGISTERED
    if _REGISTERED:
        return
    import tensorrt as trt  # full TensorRT only: tensorrt_rtx has no plugin layers
    import tensorrt.plugin as trtp

    namespace = getattr(trtp.op, PLUGIN_NAMESPACE, None)  # registered already (e.g. by another copy)
    if namespace is not None and hasattr(namespace, PLUGIN_NAME):
        _REGISTERED = True
        return

    # Shapes and types: x_new like residual, buffer_new like buffer (shape expressions carry the
    # dynamic dims). Attribute names and int types are the plugin's serialised fields.
    @trtp.register(PLUGIN_ID)
    def _describe(residual: trtp.TensorDesc, delta: trtp.TensorDesc, buffer: trtp.TensorDesc, slot: int,
                  n_slots: int, hidden_size: int, has_delta: int) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
        return residual.like(), buffer.like()

    # Enqueue: TensorRT hands device pointers (trtp.Tensor) and its CUDA stream; launch the Triton
    # kernel out of place (buffer_new is its own output, so the other slots are copied through).
    @trtp.impl(PLUGIN_ID)
    def _enqueue(residual, delta, buffer, slot: int, n_slots: int, hidden_size: int, has_delta: int,
                 outputs, stream: int) -> None:
        spec = HiddenCaptureSpec(slot, n_slots, hidden_size, bool(has_delta))
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            res, dlt, buf = (_device_tensor(trt, t) for t in (residual, delta, buffer))
            x_out, buf_out = (_device_tensor(trt, t) for t in outputs)
            _launch(res, dlt if spec.has_delta else None, buf, x_out, buf_out, spec, write_x=True,
                    copy_buffer=True)

    _REGISTERED = True


def _device_tensor(trt, t) -> torch.Tensor:
    """A torch view of a ``tensorrt.plugin.Tensor`` (device pointer, shape, strides in elements).

    Built from our own ``__cuda_array_interface__``: the plugin tensor's own one refuses bf16, which
    goes through as int16 and is viewed back as bf16."""
    types = {trt.float32: ("<f4", None), trt.float16: ("<f2", None), trt.bfloat16: ("<i2", torch.bfloat16)}
    if t.dtype not in types:
        raise TypeError(f"{PLUGIN_NAME}: unsupported data type {t.dtype}")
    typestr, view = types[t.dtype]
    itemsize = 4 if typestr == "<f4" else 2

    class _Array:
        __cuda_array_interface__ = {
            "shape": tuple(int(d) for d in t.shape),
            "typestr": typestr,
            "data": (int(t.data_ptr), False),
            "strides": tuple(int(s) * itemsize for s in t.strides),
            "version": 3,
            "stream": None,  # already on TensorRT's stream
        }

    out = torch.as_tensor(_Array(), device="cuda")
    return out if view is None else out.view(view)


def _lower_plugin(r, residual, delta, buffer, spec: HiddenCaptureSpec):
    register_tensorrt_plugin()
    import tensorrt.plugin as trtp

    with r.op(OP_NAME, PLUGIN_LOWERING):
        make = getattr(getattr(trtp.op, PLUGIN_NAMESPACE), PLUGIN_NAME)
        # a plugin's inputs are fixed: without delta, residual stands in and has_delta=0 skips the add
        layer = r.network.add_plugin(make(residual, residual if delta is None else delta, buffer,
                                          **spec.attributes()))
        if layer is None:
            raise RuntimeError(f"TensorRT refused the {PLUGIN_ID} plugin layer")
        named = getattr(r, "_named", None)
        if named is not None:
            named(layer, "plugin")
        return layer.get_output(0), layer.get_output(1)


__all__ = [
    "PLUGIN_NAME", "PLUGIN_VERSION", "PLUGIN_NAMESPACE", "PLUGIN_ID", "ATTRIBUTES", "NATIVE_ENV",
    "PLUGIN_LOWERING", "NATIVE_LOWERING", "HiddenCaptureSpec", "make_spec", "output_shapes", "output_dtypes",
    "hidden_capture_reference", "hidden_capture_triton", "hidden_capture_triton_functional", "plugin_layers_available", "lower",
    "register_tensorrt_plugin",
]
