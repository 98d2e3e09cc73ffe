"""DSpark's Markov head as one fused op: gather W1 rows for the previous tokens, an NVFP4 GEMM with W2,
added to the draft logits.

DSpark (speculators 0.9.0, ``MarkovHead`` with ``markov_head_type: "vanilla"``) biases the logits of
each block position by a low-rank function of the token chosen before it:
``out[n, v] = logits[n, v] + sum_j W2[v, j] * W1[p_n, j]`` with ``W1 = markov_w1.weight [V_prev, r]``
(an embedding table over the verifier vocabulary, kept in high precision) and
``W2 = markov_w2.weight [V, r]`` (a linear layer over the draft vocabulary, NVFP4-quantized in the
ModelOpt W4A16 layout: ``w2_packed`` uint8 ``[V, r/2]`` with element 2i in the low nibble,
``w2_scale`` float8_e4m3fn ``[V, r/16]``, ``w2_scale_2`` float32 scalar; see builder/nvfp4_format.py).
Everything is computed in fp32: the gathered W1 rows, the dequantized W2 (``e2m1 * (fp8 scale *
scale_2)``), their product and the sum with the fp32 logits.

The four faces of the plugin (see ARCHITECTURE.md, "Plugins"):

* **spec** -- :data:`PLUGIN_NAME` / :data:`PLUGIN_VERSION` / :data:`PLUGIN_NAMESPACE`, the attributes
  (:class:`MarkovHeadSpec`: ``vocab_size``, ``rank``, ``prev_vocab_size``, ``scale_2``) and output
  shape and dtype (:func:`output_shapes`, :func:`output_dtypes`): the logits' shape, float32.
* **torch reference** -- :func:`fp4_markov_head_reference` (and :func:`dequantize_w2`).
* **Triton-lang kernel** -- :func:`fp4_markov_head_triton`: the NVFP4 row kernel that ``linear_nvfp4``
  uses on the GPU path (``plugins/nvfp4_rows.py``), each program a block of vocabulary for all rows of
  its row block (W2 streamed once per 16 rows, one byte load per two FP4 codes, one FP8 scale decode
  per 16), the W1 rows gathered by the previous ids in the kernel, the logits added after the fp32
  sums. A previous id outside W1 gives a NaN row. On a CPU it runs under ``TRITON_INTERPRET=1``.
* **TensorRT lowering** -- :func:`lower`. Where the flavour offers plugin layers (full ``tensorrt``
  >= 10.7 with ``tensorrt.plugin``) a plugin layer that launches the Triton kernel; otherwise
  (``tensorrt_rtx``) native layers: gather of the W1 constant, an FP4 constant + FP8 block scales
  dequantized by the global scale (the recorder's ``nvfp4_weight``), a matrix multiply and an add.
  The lowering it got is recorded in ``recorder.lowerings["fp4_markov_head"]``.

This module imports neither ``builder`` nor ``runtime``; :func:`lower` takes the recorder and the
TensorRT module as arguments (duck typed). Annotations must stay real objects (no ``from __future__
import annotations``): ``tensorrt.plugin`` inspects them.
"""
import dataclasses
from typing import Sequence

import torch
from plugins import nvfp4_rows
from plugins.triton_jit import jit
from plugins.plugin_layers import NATIVE_ENV, native_requested, plugin_layers_available  # noqa: F401

PLUGIN_NAME = "nemospec_fp4_markov_head"
PLUGIN_VERSION = "1"  # TensorRT's Python (quickly deployable) plugins always have version "1"
PLUGIN_NAMESPACE = "nemospec"
PLUGIN_ID = f"{PLUGIN_NAMESPACE}::{PLUGIN_NAME}"
OP_NAME = "fp4_markov_head"
BLOCK_SIZE = 16  # NVFP4: one FP8 scale per 16 elements along the rank

#: plugin attributes, in the order the plugin declares them
ATTRIBUTES = ("vocab_size", "rank", "prev_vocab_size", "scale_2")

#: set to 1 to lower to native layers even where plugin layers exist (e.g. to interpret the network)

PLUGIN_LOWERING = (f"plugin: {PLUGIN_NAME} v{PLUGIN_VERSION} (Triton kernel: gather + in-kernel FP4 dequantize + "
                   "GEMM + add)")
NATIVE_LOWERING = ("native: gather W1 rows + FP4 W2 constant with FP8 block scales dequantized by the FP32 "
                   "global scale -> block dequantize -> matmul + add")

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# --- spec -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MarkovHeadSpec:
    """Attributes of one Markov head: W2 is ``[vocab_size, rank]``, W1 ``[prev_vocab_size, rank]``."""

    vocab_size: int
    rank: int
    prev_vocab_size: int
    scale_2: float

    def __post_init__(self):
        if self.vocab_size <= 0 or self.prev_vocab_size <= 0:
            raise ValueError(f"fp4_markov_head: vocabulary sizes must be positive, got {self.vocab_size} "
                             f"(W2) and {self.prev_vocab_size} (W1)")
        if self.rank <= 0 or self.rank % BLOCK_SIZE:
            raise ValueError(f"fp4_markov_head: rank {self.rank} must be a positive multiple of the NVFP4 block "
                             f"size {BLOCK_SIZE}")
        if not (self.scale_2 > 0 and self.scale_2 < float("inf")):
            raise ValueError(f"fp4_markov_head: global scale (w2_scale_2) must be finite and positive, got "
                             f"{self.scale_2}")

    def attributes(self) -> dict:
        """Plugin fields (ints, and the global scale as a float)."""
        return {"vocab_size": int(self.vocab_size), "rank": int(self.rank),
                "prev_vocab_size": int(self.prev_vocab_size), "scale_2": float(self.scale_2)}


def _static(d) -> bool:
    return d is not None and d >= 0


def make_spec(logits_shape: Sequence[int], ids_shape: Sequence[int], w1_shape: Sequence[int],
              w2_packed_shape: Sequence[int], w2_scale_shape: Sequence[int], scale_2: float) -> MarkovHeadSpec:
    """Validate shapes and derive the attributes: logits ``[..., V]`` and ids ``[...]`` (same leading
    dims, -1 for dynamic ones), W1 ``[V_prev, r]``, W2 packed ``[V, r/2]``, W2 scales ``[V, r/16]``."""
    logits_shape, ids_shape = tuple(logits_shape), tuple(ids_shape)
    w1_shape, w2_packed_shape, w2_scale_shape = tuple(w1_shape), tuple(w2_packed_shape), tuple(w2_scale_shape)
    if len(w1_shape) != 2 or len(w2_packed_shape) != 2 or len(w2_scale_shape) != 2:
        raise ValueError(f"fp4_markov_head: W1 {list(w1_shape)}, W2 packed {list(w2_packed_shape)} and W2 scales "
                         f"{list(w2_scale_shape)} must be 2-D")
    prev_vocab, rank = w1_shape
    vocab = w2_packed_shape[0]
    if w2_packed_shape[1] * 2 != rank:
        raise ValueError(f"fp4_markov_head: W2 packed {list(w2_packed_shape)} does not hold rank {rank} (W1 "
                         f"{list(w1_shape)}) as two FP4 values per byte")
    if w2_scale_shape != (vocab, rank // BLOCK_SIZE):
        raise ValueError(f"fp4_markov_head: W2 scales {list(w2_scale_shape)}, expected {[vocab, rank // BLOCK_SIZE]} "
                         f"(one per {BLOCK_SIZE} of rank {rank})")
    if len(logits_shape) < 1 or not _static(logits_shape[-1]):
        raise ValueError(f"fp4_markov_head: logits {list(logits_shape)} need a static vocabulary (last) dim")
    if logits_shape[-1] != vocab:
        raise ValueError(f"fp4_markov_head: logits vocabulary {logits_shape[-1]} differs from W2's {vocab}")
    lead = logits_shape[:-1]
    if len(ids_shape) != len(lead) or not all(
            not _static(a) or not _static(b) or a == b for a, b in zip(ids_shape, lead)):
        raise ValueError(f"fp4_markov_head: previous ids {list(ids_shape)} must match the leading dims of "
                         f"logits {list(logits_shape)}")
    return MarkovHeadSpec(int(vocab), int(rank), int(prev_vocab), float(scale_2))


def output_shapes(logits_shape, ids_shape, w1_shape, w2_packed_shape, w2_scale_shape, scale_2):
    """The output has the logits' shape."""
    make_spec(logits_shape, ids_shape, w1_shape, w2_packed_shape, w2_scale_shape, scale_2)
    return tuple(logits_shape)


def output_dtypes(logits_dtype, ids_dtype, w1_dtype, w2_packed_dtype, w2_scale_dtype):
    """float32 (torch dtypes): logits float32, ids int32/int64, W1 a float type, W2 uint8 + float8_e4m3fn."""
    if logits_dtype != torch.float32:
        raise TypeError(f"fp4_markov_head: logits must be float32, got {logits_dtype}")
    if ids_dtype not in (torch.int32, torch.int64):
        raise TypeError(f"fp4_markov_head: previous ids must be int32 or int64, got {ids_dtype}")
    if w1_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"fp4_markov_head: W1 must be float32, float16 or bfloat16, got {w1_dtype}")
    if w2_packed_dtype != torch.uint8 or w2_scale_dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise TypeError(f"fp4_markov_head: W2 must be uint8 packed FP4 with float8_e4m3fn scales, got "
                        f"{w2_packed_dtype} and {w2_scale_dtype}")
    return torch.float32


def _scale_2(w2_scale_2) -> float:
    t = torch.as_tensor(w2_scale_2)
    if t.numel() != 1 or t.dim() > 1:
        raise ValueError(f"fp4_markov_head: w2_scale_2 must be a scalar, got shape {list(t.shape)}")
    return float(t.float().reshape(()))


def _device_scale(w2_scale_2, device):
    """The global scale as a one-element fp32 tensor already on ``device`` (read there by the kernel:
    no host sync), or None where it is a Python number or lives elsewhere."""
    if isinstance(w2_scale_2, torch.Tensor) and w2_scale_2.device == device and w2_scale_2.numel() == 1:
        return w2_scale_2.reshape(1).to(torch.float32)
    return None


def _check(logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2, read_scale: bool = True) -> MarkovHeadSpec:
    """The spec; with ``read_scale=False`` the global scale is not read to the host (1.0 stands in)."""
    output_dtypes(logits.dtype, prev_ids.dtype, w1.dtype, w2_packed.dtype, w2_scale.dtype)
    return make_spec(logits.shape, prev_ids.shape, w1.shape, w2_packed.shape, w2_scale.shape,
                     _scale_2(w2_scale_2) if read_scale else 1.0)


# --- torch reference ------------------------------------------------------------------------------------
def dequantize_w2(w2_packed: torch.Tensor, w2_scale: torch.Tensor, w2_scale_2) -> torch.Tensor:
    """fp32 ``[V, r]``: E2M1 code (element 2i in the low nibble) * (FP8 block scale * global scale)."""
    codes = torch.stack([w2_packed & 0x0F, w2_packed >> 4], dim=-1).flatten(-2).long()
    values = torch.tensor(_E2M1, device=codes.device)[codes & 7]
    values = torch.where(codes >= 8, -values, values)
    scale = w2_scale.view(torch.float8_e4m3fn) if w2_scale.dtype == torch.uint8 else w2_scale
    block = scale.float() * torch.as_tensor(w2_scale_2, dtype=torch.float32, device=scale.device).reshape(())
    return (values.unflatten(-1, (-1, BLOCK_SIZE)) * block[..., None]).flatten(-2)


def fp4_markov_head_reference(logits: torch.Tensor, prev_ids: torch.Tensor, w1: torch.Tensor,
                              w2_packed: torch.Tensor, w2_scale: torch.Tensor, w2_scale_2) -> torch.Tensor:
    """``logits + W1[prev_ids] @ dequantize(W2).T`` in fp32 (a new tensor; inputs untouched)."""
    _check(logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2)
    rows = w1[prev_ids.long()].float()                      # [..., r]
    w2 = dequantize_w2(w2_packed, w2_scale, w2_scale_2)     # [V, r]
    return logits + torch.matmul(rows, w2.t())


# --- Triton-lang kernel ---------------------------------------------------------------------------------
def _run(kernel, grid, *args, **meta):
    jit(kernel)[grid](*args, **meta)


def _launch(logits, prev_ids, w1, w2_packed, w2_scale_bytes, out, spec: MarkovHeadSpec, scale_2=None,
            blocks=None) -> None:
    """The NVFP4 row kernel (plugins/nvfp4_rows.py) with each row gathered from W1 by its previous id
    and the logits added; contiguous inputs, ``out`` like ``logits``; ``scale_2`` a device tensor to
    read the global scale from (else the spec's)."""
    rows = logits.numel() // spec.vocab_size
    if rows == 0:
        return
    nvfp4_rows.launch(_run, w1, w2_packed, w2_scale_bytes, spec.scale_2 if scale_2 is None else scale_2, out.view(rows, spec.vocab_size), rows,
                      spec.vocab_size, spec.rank, ids=prev_ids.reshape(rows), table=spec.prev_vocab_size,
                      add=logits.view(rows, spec.vocab_size), blocks=blocks)


def fp4_markov_head_triton(logits: torch.Tensor, prev_ids: torch.Tensor, w1: torch.Tensor, w2_packed: torch.Tensor,
                           w2_scale: torch.Tensor, w2_scale_2, blocks=None) -> torch.Tensor:
    """Triton launch of the fused op; returns a new fp32 tensor shaped like ``logits``.

    CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``. Inputs are read as contiguous. A global
    scale given as a one-element tensor on the logits' device is read by the kernel (no host sync, so
    the call can be captured in a CUDA graph; its value is then not checked on the host). ``blocks``:
    the kernel's (BLOCK_N, BLOCK_K) instead of its default (gpu_check sweeps them on a device).
    """
    device_scale = _device_scale(w2_scale_2, logits.device)
    spec = _check(logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2, read_scale=device_scale is None)
    out = torch.empty_like(logits)
    scale_bytes = (w2_scale if w2_scale.dtype == torch.uint8 else w2_scale.view(torch.uint8)).contiguous()
    _launch(logits.contiguous(), prev_ids.contiguous(), w1.contiguous(), w2_packed.contiguous(), scale_bytes, out,
            spec, device_scale, blocks)
    return out


# --- TensorRT lowering ------------------------------------------------------------------------------------
def _torch_type(trt, dtype):
    names = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT32": torch.int32,
             "INT64": torch.int64}
    return names.get(getattr(dtype, "name", str(dtype)), dtype)


def lower(recorder, trt, logits, prev_ids, w1: torch.Tensor, w2_packed: torch.Tensor, w2_scale: torch.Tensor,
          w2_scale_2):
    """Record the op into ``recorder.network``; returns the output ITensor (fp32, logits' shape).

    ``recorder`` is builder's NetworkRecorder (duck typed: ``network``, ``flavour``, ``op``, ``weight``,
    ``gather``, ``cast``, ``matmul``, ``ew``, ``nvfp4_weight``); ``trt`` the TensorRT module it records
    with; ``logits`` / ``prev_ids`` ITensors; the weights torch tensors (build-time constants). A plugin
    layer where the flavour has plugin layers (unless ``recorder.native_plugins`` or
    ``NEMOSPEC_NATIVE_PLUGINS=1``), else native layers.
    """
    output_dtypes(_torch_type(trt, logits.dtype), _torch_type(trt, prev_ids.dtype), w1.dtype, w2_packed.dtype,
                  w2_scale.dtype)
    spec = make_spec(tuple(logits.shape), tuple(prev_ids.shape), tuple(w1.shape), tuple(w2_packed.shape),
                     tuple(w2_scale.shape), _scale_2(w2_scale_2))
    flavour = getattr(recorder, "flavour", getattr(trt, "__name__", "tensorrt"))
    has_plugins = plugin_layers_available(recorder.network)
    if has_plugins and not native_requested(recorder):
        return _lower_plugin(recorder, logits, prev_ids, w1, w2_packed, w2_scale, spec)
    reason = "plugin layers disabled" if has_plugins else f"{flavour} has no plugin layers"
    return _lower_native(recorder, trt, logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2, spec, reason)


def _lower_native(r, trt, logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2, spec: MarkovHeadSpec, reason: str):
    with r.op(OP_NAME, f"{NATIVE_LOWERING} ({reason})"):
        rows = r.gather(r.weight(w1, "w1"), prev_ids, 0, "gather_w1")              # [..., r]
        rows = r.cast(rows, torch.float32, "w1_fp32")
        w2 = r.nvfp4_weight(w2_packed, w2_scale, torch.as_tensor(w2_scale_2, dtype=torch.float32),
                            (spec.vocab_size, spec.rank), torch.float32, "w2")      # [V, r] fp32
        bias = r.matmul(rows, w2, transpose_b=True, what="w2_gemm")                 # [..., V]
        return r.ew(logits, bias, trt.ElementWiseOperation.SUM, "add")


_REGISTERED = False


def register_tensorrt_plugin() -> None:
    """Register the plugin with full TensorRT's Python plugin registry (``tensorrt.plugin``), once per
    process (building a network with the layer does it; deserialising an engine holding it needs it
    first). Needs full ``tensorrt`` >= 10.7; running the layer needs torch with CUDA and Triton."""
    global _REGISTERED
    if _REGISTERED:
        return
    import tensorrt as trt  # full TensorRT only: tensorrt_rtx has no plugin layers
    import tensorrt.plugin as trtp

    namespace = getattr(trtp.op, PLUGIN_NAMESPACE, None)
    if namespace is not None and hasattr(namespace, PLUGIN_NAME):
        _REGISTERED = True
        return

    # Inputs: logits [..., V] fp32, ids [...] int32/int64, W1 [V_prev, r], W2 bytes [V, r/2] uint8 and
    # W2 block scales [V, r/16] (FP8 bytes, uint8); the global scale is a float attribute.
    @trtp.register(PLUGIN_ID)
    def _describe(logits: trtp.TensorDesc, prev_ids: trtp.TensorDesc, w1: trtp.TensorDesc,
                  w2_packed: trtp.TensorDesc, w2_scale: trtp.TensorDesc, vocab_size: int, rank: int,
                  prev_vocab_size: int, scale_2: float) -> trtp.TensorDesc:
        return logits.like()

    @trtp.impl(PLUGIN_ID)
    def _enqueue(logits, prev_ids, w1, w2_packed, w2_scale, vocab_size: int, rank: int, prev_vocab_size: int,
                 scale_2: float, outputs, stream: int) -> None:
        spec = MarkovHeadSpec(vocab_size, rank, prev_vocab_size, scale_2)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            args = [_device_tensor(trt, t) for t in (logits, prev_ids, w1, w2_packed, w2_scale)]
            _launch(*args, _device_tensor(trt, outputs[0]), spec)

    _REGISTERED = True


def _device_tensor(trt, t) -> torch.Tensor:
    """A torch view of a ``tensorrt.plugin.Tensor`` (device pointer, shape, strides in elements), made
    from our own ``__cuda_array_interface__`` (bf16 goes through as int16 and is viewed back)."""
    types = {trt.float32: ("<f4", 4, None), trt.float16: ("<f2", 2, None), trt.bfloat16: ("<i2", 2, torch.bfloat16),
             trt.int32: ("<i4", 4, None), trt.int64: ("<i8", 8, None), trt.uint8: ("|u1", 1, None)}
    if t.dtype not in types:
        raise TypeError(f"{PLUGIN_NAME}: unsupported data type {t.dtype}")
    typestr, itemsize, view = types[t.dtype]

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


def _lower_plugin(r, logits, prev_ids, w1, w2_packed, w2_scale, spec: MarkovHeadSpec):
    register_tensorrt_plugin()
    import tensorrt.plugin as trtp

    with r.op(OP_NAME, PLUGIN_LOWERING):
        scale_bytes = w2_scale if w2_scale.dtype == torch.uint8 else w2_scale.view(torch.uint8)
        make = getattr(getattr(trtp.op, PLUGIN_NAMESPACE), PLUGIN_NAME)
        layer = r.network.add_plugin(make(logits, prev_ids, r.weight(w1, "w1"), r.weight(w2_packed, "w2_fp4_bytes"),
                                          r.weight(scale_bytes, "w2_block_scale_bytes"), **spec.attributes()))
        if layer is None:
            raise RuntimeError(f"TensorRT refused the {PLUGIN_ID} plugin layer")
        named = getattr(r, "_named", None)
        if named is not None:
            named(layer, "plugin")
        return layer.get_output(0)


__all__ = [
    "PLUGIN_NAME", "PLUGIN_VERSION", "PLUGIN_NAMESPACE", "PLUGIN_ID", "OP_NAME", "ATTRIBUTES", "NATIVE_ENV",
    "PLUGIN_LOWERING", "NATIVE_LOWERING", "BLOCK_SIZE", "MarkovHeadSpec", "make_spec", "output_shapes",
    "output_dtypes", "dequantize_w2", "fp4_markov_head_reference", "fp4_markov_head_triton",
    "plugin_layers_available", "lower", "register_tensorrt_plugin",
]
