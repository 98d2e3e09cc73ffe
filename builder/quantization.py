"""NVFP4 weight-only quantization (W4A16) in NVIDIA ModelOpt's Hugging Face checkpoint layout.

The format (checked against ``nvidia-modelopt`` 0.47.0: ``torch/quantization/qtensor/nvfp4_tensor.py``,
``torch/export/unified_export_hf.py``, ``torch/export/quant_utils.py``, ``torch/export/convert_hf_config.py``,
and vLLM's ``ModelOptNvFp4W4A16LinearMethod``). For a linear module ``X`` with a weight of logical
shape ``[out, in]`` (``in`` a multiple of 16):

* ``X.weight`` -- uint8 ``[out, in/2]``: FP4 E2M1 codes, two per byte along ``in``; element ``2i`` in
  the **low** nibble, ``2i+1`` in the high nibble. A code is sign bit (8) + magnitude index into
  ``0, 0.5, 1, 1.5, 2, 3, 4, 6``. TensorRT's FP4 constants use the same byte order, so the bytes go
  into the engine as they are.
* ``X.weight_scale`` -- float8_e4m3fn ``[out, in/16]``: one scale per block of 16 input elements.
* ``X.weight_scale_2`` -- float32 scalar: the global scale, ``amax(|W|) / (6 * 448)``.
* ``X.input_scale`` -- float32 scalar, only in W4A4 (``NVFP4``) checkpoints; W4A16 ignores it.

``W = e2m1(X.weight) * (float(X.weight_scale) * X.weight_scale_2)`` block by block. Quantizing
follows ModelOpt: ``scale = fp8(clamp(block_amax / (6 * scale_2), 2**-9, 448))`` (an all-zero block
gets scale 1), then each element is ``w / (scale * scale_2)`` rounded to the nearest E2M1 value
(ties to the even code, saturating at 6).

The quantization config is ``hf_quant_config.json`` (``{"producer": {...}, "quantization":
{"quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": null, "group_size": 16, "exclude_modules":
[...]}}``) and, in compressed-tensors form, ``quantization_config`` in ``config.json``
(``quant_method: "modelopt"``, ``quant_algo``, ``config_groups.group_0.weights.group_size``,
``ignore``). ModelOpt writes ``W4A16_NVFP4`` for weight-only NVFP4 (``NVFP4`` is its W4A4 format);
both are read, and both run here as W4A16. ``exclude_modules`` / ``ignore`` hold module names or
ModelOpt prefix wildcards (``fnmatch``).

The logical shape of a packed weight always comes from the model config (the expected-tensor spec);
the packed bytes and scales are validated against it, never used to invent it.

Default exclusions follow ModelOpt's ``w4a16_nvfp4`` preset (``default_disabled_quantizers``): only
linear layers are quantized (Mamba ``in_proj``/``out_proj``, attention ``q/k/v/o_proj``, MLP and
expert ``up_proj``/``down_proj``, shared experts, the MoE latent projections); ``lm_head``,
``mixer.conv1d``, routers (``mixer.gate``), embeddings, norms, ``A_log``/``D``/``dt_bias`` and
``mtp.*`` stay in high precision.

Use: :func:`builder.checkpoint.load_checkpoint` reads an NVFP4 NemotronH checkpoint dequantized to
its config's dtype (the eager reference); :func:`builder.checkpoint.load_nvfp4_checkpoint` with ``keep_quantized`` binds
:class:`NVFP4Weight` objects instead, which ``functional.linear`` lowers to FP4 constants in
TensorRT. Drafts (any tensor dict, quantized independently of their target) use
:func:`quantize_tensors` / :func:`dequantize_tensors` / :func:`nvfp4_weights`;
:func:`builder.quantize_checkpoint.quantize_checkpoint` is ``nemospec quantize``.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from builder.errors import CheckpointError

__all__ = [
    "BLOCK_SIZE", "E2M1_MAX", "E4M3_MAX", "E2M1_VALUES", "QUANT_ALGO", "READABLE_ALGOS", "HF_QUANT_CONFIG",
    "FORMAT_NAME", "DEFAULT_EXCLUDE_MODULES",
    "fp4_encode", "fp4_decode", "pack_fp4", "unpack_fp4", "quantize_nvfp4", "dequantize_nvfp4",
    "quantization_error_bound", "NVFP4Weight", "QuantConfig", "read_quant_config", "is_nvfp4_checkpoint",
    "validate_nvfp4", "quantize_tensors", "dequantize_tensors", "nvfp4_file_tensors", "nvfp4_weights", "dequantize_weights",
    "quantizable_weight_names", "choose_quantized", "dequantized_module",
]

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
QUANT_ALGO = "W4A16_NVFP4"          # what ModelOpt writes for weight-only NVFP4
READABLE_ALGOS = ("W4A16_NVFP4", "NVFP4")
HF_QUANT_CONFIG = "hf_quant_config.json"
CONFIG_FILE = "config.json"
FORMAT_NAME = "nvfp4_w4a16"         # the CLI's --format
PRODUCER = {"name": "nemospec", "version": "0.1"}

#: E2M1 value of each 4-bit code (bit 3 is the sign)
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)
# midpoints between neighbouring magnitudes; a value exactly on one rounds to the even code
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_ODD_MIDPOINTS = torch.tensor([0.75, 1.75, 3.5], dtype=torch.float32)  # ties whose lower code is odd

#: ModelOpt's default disabled quantizers that can match NemotronH module names (fnmatch patterns)
DEFAULT_EXCLUDE_MODULES = ("*lm_head*", "*mixer.conv1d*", "*router*", "*mlp.gate.*", "mtp.*", "*output_layer*",
                           "output.*", "*proj_out.*")

# linear modules of NemotronH (and of drafts, which pass their names explicitly)
_LINEAR_SUFFIXES = ("_proj", "lm_head")
_SCALE_SUFFIXES = (".weight_scale_2", ".weight_scale", ".input_scale")
_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")  # ModelOpt's FP8 KV-cache scales (k_proj.k_scale, v_proj.v_scale)


# --- the number format ------------------------------------------------------------------------------
def fp4_encode(x: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes of fp32 values (round to nearest, ties to the even code, saturating at +-6)."""
    x = x.float()
    mag = x.abs()
    # midpoints strictly below |x| (bucketize with right=False), plus one on a tie whose lower code is
    # odd; written as comparisons, which run ~3x faster than bucketize + isin on large weights
    code = sum((mag > m).to(torch.uint8) for m in _MIDPOINTS.tolist())
    code = code + sum((mag == m).to(torch.uint8) for m in _ODD_MIDPOINTS.tolist())
    return (code + 8 * (x < 0)).to(torch.uint8)


def fp4_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of uint8 E2M1 codes."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes: element 2i in the low nibble, 2i+1 in the high one."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: the last dim ({codes.shape[-1]}) must be even")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes (inverse of :func:`pack_fp4`)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def quantize_nvfp4(w: torch.Tensor, block_size: int = BLOCK_SIZE, scale_2: torch.Tensor | None = None):
    """NVFP4-quantize ``w [..., out, in]`` as ModelOpt does.

    Returns ``(packed uint8 [..., out, in/2], scale float8_e4m3fn [..., out, in/block_size],
    scale_2 float32 0-d)``. Raises ValueError for a last dim that is not a multiple of the block size
    or non-finite values.
    """
    if w.dim() < 1 or w.shape[-1] % block_size or w.shape[-1] == 0 or block_size % 2:
        raise ValueError(f"NVFP4 needs the input dim (last, {w.shape[-1] if w.dim() else None}) to be a "
                         f"positive multiple of the block size {block_size}")
    w32 = w.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(w32).all()):
        raise ValueError("NVFP4 quantization of non-finite values")
    if scale_2 is None:
        amax = w32.abs().amax()
        scale_2 = amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else torch.tensor(1.0)
    scale_2 = torch.as_tensor(scale_2, dtype=torch.float32).reshape(())
    blocks = w32.unflatten(-1, (w32.shape[-1] // block_size, block_size))
    per_block = blocks.abs().amax(-1) / (E2M1_MAX * scale_2)
    per_block = torch.where(per_block == 0, torch.ones_like(per_block), per_block)
    scale = per_block.clamp(2.0 ** -9, E4M3_MAX).to(torch.float8_e4m3fn)
    scaled = blocks / (scale.float() * scale_2)[..., None]
    packed = pack_fp4(fp4_encode(scaled).flatten(-2))
    return packed.contiguous(), scale.contiguous(), scale_2


def _check_layout(packed, scale, scale_2, shape, block_size=BLOCK_SIZE, name="weight"):
    """One-line ValueError naming the tensor when packed/scale/scale_2 do not fit ``shape``."""
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2 or shape[-1] <= 0 or shape[-1] % block_size:
        raise ValueError(f"{name}: logical shape {list(shape)} has an input dim that is not a multiple of the "
                         f"NVFP4 block size {block_size}")
    if packed.dtype != torch.uint8:
        raise ValueError(f"{name}: packed FP4 weight has dtype {_dtype_name(packed.dtype)}, expected uint8 "
                         "(two E2M1 values per byte)")
    want = shape[:-1] + (shape[-1] // 2,)
    if tuple(packed.shape) != want:
        raise ValueError(f"{name}: packed FP4 weight has shape {list(packed.shape)}, expected {list(want)} for "
                         f"logical shape {list(shape)} (two values per byte along the input dim; odd or "
                         "wrong packed length)")
    if scale is None:
        raise ValueError(f"{name}_scale: missing FP8 block scales of the NVFP4 weight {name}")
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}_scale: block scales have dtype {_dtype_name(scale.dtype)}, expected float8_e4m3fn")
    want = shape[:-1] + (shape[-1] // block_size,)
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}_scale: block scales have shape {list(scale.shape)}, expected {list(want)}: one "
                         f"scale per {block_size} input elements of logical shape {list(shape)} (the scale shape "
                         "does not match the block size)")
    if scale_2 is None:
        raise ValueError(f"{name}_scale_2: missing FP32 global scale of the NVFP4 weight {name}")
    lead = shape[:-2]  # a stack of weights (a MoE layer's experts): one global scale, or one per matrix
    if scale_2.dtype != torch.float32 or not (global_scale_shape(scale_2, shape) or
                                              (scale_2.numel() == 1 and scale_2.dim() <= 1)):
        raise ValueError(f"{name}_scale_2: global scale has dtype {_dtype_name(scale_2.dtype)} and shape "
                         f"{list(scale_2.shape)}, expected a float32 scalar"
                         f"{' or shape ' + str(list(lead)) + ' (one per stacked matrix)' if lead else ''}")
    bad = ~(torch.isfinite(scale_2) & (scale_2 > 0)).reshape(-1)
    if bool(bad.any()):
        at = int(bad.nonzero()[0])
        raise ValueError(f"{name}_scale_2: global scale{f' {at}' if lead else ''} is {float(scale_2.reshape(-1)[at])}, "
                         "expected a finite positive number")


def global_scale_shape(scale_2: torch.Tensor, shape: Sequence[int]) -> tuple:
    """``shape[:-2]`` when ``scale_2`` holds one global scale per stacked matrix of logical ``shape``,
    else ``()`` (one for the whole tensor)."""
    lead = tuple(int(d) for d in shape[:-2])
    return lead if lead and tuple(scale_2.shape) == lead else ()


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                     shape: Sequence[int], dtype: torch.dtype = torch.float32,
                     block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """The weight of logical ``shape`` in ``dtype``.

    Two steps, as the TensorRT lowering computes it: block scales ``fp8 * scale_2`` (fp32, rounded to
    ``dtype``), then ``e2m1 * block scale`` (fp32, rounded to ``dtype``). In fp32 this is exactly
    ModelOpt's ``NVFP4QTensor.dequantize``. Raises ValueError when the tensors do not fit ``shape``.
    """
    shape = tuple(int(d) for d in shape)
    _check_layout(packed, scale, scale_2, shape, block_size)
    block_scale = (scale.float() * scale_2.float().reshape(global_scale_shape(scale_2, shape) + (1, 1))).to(dtype)
    values = fp4_decode(unpack_fp4(packed)).unflatten(-1, (shape[-1] // block_size, block_size))
    return (values * block_scale.float()[..., None]).flatten(-2).to(dtype).reshape(shape)


def quantization_error_bound(w: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                             block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Per-element bound on ``|w - dequantize(quantize(w))|`` (fp32 dequantization).

    With the block's effective scale ``s = fp8(scale) * scale_2`` and ``y = |w| / s``: rounding to
    E2M1 errs by at most half the E2M1 step at ``y`` (0.25 below 2, 0.5 in [2, 4), 1 in [4, 6]), times
    ``s``. The FP8 rounding of the scale can push ``y`` above 6 (by at most 1/16 relative, E4M3's
    half ulp); such values saturate and err by ``|w| - 6 s`` more. Plus one fp32 rounding.
    """
    w32 = w.detach().float()
    s = (scale.float() * scale_2.float().reshape(()))
    s = s.repeat_interleave(block_size, dim=-1)
    y = w32.abs() / s
    half_step = torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0))
    overflow = (w32.abs() - E2M1_MAX * s).clamp(min=0)
    return half_step * s + overflow + w32.abs() * 2.0 ** -23


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


# --- a bound NVFP4 weight ----------------------------------------------------------------------------
class NVFP4Weight:
    """An NVFP4 weight bound to a model in place of a torch tensor.

    ``functional.linear`` recognises it (``is_nvfp4``) and lowers to ``linear_nvfp4``: in TensorRT an
    FP4 constant + FP8 block scales + FP32 global scale -> dequantize -> matmul; eagerly a dequantize
    (on the fly, in the activation dtype) then matmul. ``.to(dtype)`` sets the compute dtype and keeps
    the packed data. Any other torch function given one (``torch.stack`` of expert weights, ``F.linear``)
    sees the dequantized tensor.
    """

    is_nvfp4 = True

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, shape: Sequence[int],
                 dtype: torch.dtype = torch.float32, name: str = "weight"):
        shape = tuple(int(d) for d in shape)
        _check_layout(packed, scale, scale_2, shape, BLOCK_SIZE, name)
        self.packed, self.scale = packed, scale
        self.scale_2 = scale_2.to(torch.float32).reshape(global_scale_shape(scale_2, shape))
        self.logical_shape, self._dtype, self.name = shape, dtype, name

    @classmethod
    def quantize(cls, w: torch.Tensor, name: str = "weight", dtype: torch.dtype | None = None) -> "NVFP4Weight":
        packed, scale, scale_2 = quantize_nvfp4(w)
        return cls(packed, scale, scale_2, w.shape, w.dtype if dtype is None else dtype, name)

    @classmethod
    def stack(cls, weights: Sequence["NVFP4Weight"]) -> "NVFP4Weight":
        """E weights of one shape as one ``[E, out, in]`` weight (a MoE layer's experts): packed bytes,
        block scales and global scales each stacked, as views when they lie back to back in a mapped
        file (:func:`builder.checkpoint.storage_order`), so the stack stays FP4."""
        from builder.safetensors_io import stack
        first = weights[0]
        if any(w.logical_shape != first.logical_shape or w.ndim != 2 for w in weights):
            raise ValueError(f"{first.name}: cannot stack NVFP4 weights of shapes "
                             f"{sorted({tuple(w.logical_shape) for w in weights})} (expected one 2-D shape)")
        return cls(stack([w.packed for w in weights]), stack([w.scale for w in weights]),
                   stack([w.scale_2.reshape(()) for w in weights]), (len(weights), *first.logical_shape),
                   first.dtype, first.name)

    # tensor-like surface used by model code (``.to(dtype)``, ``.shape``) and builders
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.logical_shape)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def ndim(self) -> int:
        return len(self.logical_shape)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        n = 1
        for d in self.logical_shape:
            n *= d
        return n

    def is_floating_point(self) -> bool:
        return True

    def contiguous(self) -> "NVFP4Weight":
        return self

    def detach(self) -> "NVFP4Weight":
        return self

    def to(self, *args, **kwargs) -> "NVFP4Weight":
        dtype = kwargs.get("dtype")
        for a in args:
            if isinstance(a, torch.dtype):
                dtype = a
        if dtype is None or dtype == self._dtype:
            return self
        if not dtype.is_floating_point:
            raise TypeError(f"{self.name}: an NVFP4 weight computes in a floating dtype, not {dtype}")
        return NVFP4Weight(self.packed, self.scale, self.scale_2, self.logical_shape, dtype, self.name)

    def float(self) -> "NVFP4Weight":
        return self.to(torch.float32)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_nvfp4(self.packed, self.scale, self.scale_2, self.logical_shape,
                                self._dtype if dtype is None else dtype)

    def tensors(self, name: str | None = None) -> dict[str, torch.Tensor]:
        """The ModelOpt tensors of this weight under ``name`` (``X.weight``)."""
        name = self.name if name is None else name
        return {name: self.packed, name + "_scale": self.scale, name + "_scale_2": self.scale_2}

    def __repr__(self) -> str:
        return f"NVFP4Weight({self.name!r}, shape={list(self.logical_shape)}, dtype={_dtype_name(self._dtype)})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def plain(a):
            if isinstance(a, NVFP4Weight):
                return a.dequantize()
            if isinstance(a, (list, tuple)):
                return type(a)(plain(b) for b in a)
            return a
        return func(*plain(args), **{k: plain(v) for k, v in (kwargs or {}).items()})


# --- the quantization config ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """The quantization section of a ModelOpt checkpoint."""

    quant_algo: str = QUANT_ALGO
    group_size: int = BLOCK_SIZE
    exclude_modules: tuple[str, ...] = ()
    kv_cache_quant_algo: str | None = None
    producer: Mapping[str, Any] | None = None

    def excludes(self, module: str) -> bool:
        """Whether ``module`` (e.g. ``backbone.layers.0.mixer.conv1d``) is kept in high precision."""
        return any(module == p or fnmatch.fnmatchcase(module, p) for p in self.exclude_modules)

    def hf_quant_config(self) -> dict:
        """``hf_quant_config.json`` as ModelOpt writes it."""
        return {"producer": dict(self.producer or PRODUCER),
                "quantization": {"quant_algo": self.quant_algo, "kv_cache_quant_algo": self.kv_cache_quant_algo,
                                 "group_size": self.group_size, "exclude_modules": list(self.exclude_modules)}}

    def quantization_config(self) -> dict:
        """``config.json``'s ``quantization_config``: ModelOpt's compressed-tensors style form."""
        weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": self.group_size}
        group: dict[str, Any] = {"weights": weights, "targets": ["Linear"]}
        if self.quant_algo == "NVFP4":
            group = {"input_activations": dict(weights), **group}
        out: dict[str, Any] = {"config_groups": {"group_0": group}, "ignore": list(self.exclude_modules),
                               "quant_algo": self.quant_algo}
        if self.kv_cache_quant_algo:
            out["kv_cache_scheme"] = self.kv_cache_quant_algo
        out["producer"] = dict(self.producer or PRODUCER)
        out["quant_method"] = "modelopt"
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "QuantConfig":
        """Parse either form (``hf_quant_config.json`` or ``quantization_config``)."""
        if not isinstance(data, Mapping):
            raise CheckpointError(f"{where}: expected a JSON object, got {type(data).__name__}")
        if "quantization" in data:
            q = data["quantization"]
            if not isinstance(q, Mapping):
                raise CheckpointError(f"{where}: field 'quantization' must be an object")
            algo, group, exclude = q.get("quant_algo"), q.get("group_size"), q.get("exclude_modules", [])
            kv, field = q.get("kv_cache_quant_algo"), "quantization.exclude_modules"
        else:
            method = str(data.get("quant_method", "")).lower()
            if not method.startswith("modelopt"):
                raise CheckpointError(f"{where}: field 'quant_method' is {data.get('quant_method')!r}; only ModelOpt "
                                      f"NVFP4 checkpoints (quant_method \"modelopt\") are supported")
            algo, exclude, field = data.get("quant_algo"), data.get("ignore", []), "ignore"
            group = data.get("group_size")
            if group is None:
                groups = data.get("config_groups") or {}
                for g in groups.values() if isinstance(groups, Mapping) else ():
                    weights = g.get("weights") if isinstance(g, Mapping) else None
                    if isinstance(weights, Mapping) and weights.get("group_size") is not None:
                        group = weights["group_size"]
                        break
            kv = data.get("kv_cache_scheme")
        algo = str(algo).upper() if algo is not None else None
        if algo not in READABLE_ALGOS:
            raise CheckpointError(f"{where}: field 'quant_algo' is {algo!r}; supported: {', '.join(READABLE_ALGOS)} "
                                  "(NVFP4 weights, run as W4A16)")
        group = BLOCK_SIZE if group is None else group
        if group != BLOCK_SIZE or isinstance(group, bool):
            raise CheckpointError(f"{where}: field 'group_size' is {group!r}; NVFP4 uses blocks of {BLOCK_SIZE}")
        if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
            raise CheckpointError(f"{where}: field '{field}' must be a list of module names or wildcards")
        producer = data.get("producer") if isinstance(data.get("producer"), Mapping) else None
        return cls(algo, int(group), tuple(exclude), kv if isinstance(kv, str) else None, producer)


def read_quant_config(checkpoint_dir: str | os.PathLike) -> QuantConfig | None:
    """The checkpoint's quantization config (``hf_quant_config.json`` first, then ``config.json``'s
    ``quantization_config``), or None for an unquantized checkpoint. Raises :class:`CheckpointError`."""
    directory = Path(checkpoint_dir)
    hf = directory / HF_QUANT_CONFIG
    if hf.is_file():
        data = _read_json(hf)
        q = data.get("quantization") if isinstance(data, Mapping) else None
        if isinstance(q, Mapping) and q.get("quant_algo") is None:  # e.g. KV-cache-only quantization
            raise CheckpointError(f"{hf}: field 'quantization.quant_algo' is null; no NVFP4 weights to load")
        return QuantConfig.from_dict(data, str(hf))
    config = directory / CONFIG_FILE
    if config.is_file():
        data = _read_json(config)
        q = data.get("quantization_config") if isinstance(data, Mapping) else None
        if q is not None:
            return QuantConfig.from_dict(q, f"{config} (quantization_config)")
    return None


def is_nvfp4_checkpoint(checkpoint_dir: str | os.PathLike) -> bool:
    return read_quant_config(checkpoint_dir) is not None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: invalid JSON ({' '.join(str(e).split())})") from None


# --- tensors <-> NVFP4 --------------------------------------------------------------------------------
def _module(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def validate_nvfp4(name: str, packed, scale, scale_2, shape: Sequence[int], where: str = "") -> None:
    """Raise a one-line :class:`CheckpointError` naming the tensor when a packed weight ``name``
    (``X.weight``), its ``X.weight_scale`` and ``X.weight_scale_2`` do not make an NVFP4 weight of
    logical ``shape``."""
    try:
        _check_layout(packed, scale, scale_2, shape, BLOCK_SIZE, name)
    except ValueError as e:
        raise CheckpointError(f"{where}: tensor {e}" if where else f"tensor {e}") from None


def nvfp4_weights(tensors: Mapping[str, torch.Tensor], quant_config: QuantConfig | Mapping | None = None,
                  shapes: Mapping[str, Sequence[int]] | None = None, dtype: torch.dtype | None = None,
                  where: str = "") -> dict:
    """``tensors`` with every packed weight (uint8 ``X.weight`` + ``X.weight_scale`` +
    ``X.weight_scale_2``) replaced by an :class:`NVFP4Weight` under ``X.weight`` and the scale tensors
    (and W4A4 ``X.input_scale``) dropped; other tensors pass through.

    ``shapes`` (name -> logical shape, from the model config) is authoritative: a packed weight it does
    not list is an error. Without ``shapes`` a packed weight gets ``[*scale.shape[:-1],
    scale.shape[-1] * group_size]``, which must agree with the packed bytes. ``dtype`` is the compute
    dtype of the weights (default float32). FP8 KV-cache scales (``*.k_scale``, ``*.v_scale``) are
    dropped: the KV cache stays in the activation dtype.
    """
    qc = _as_config(quant_config, where)
    group = qc.group_size if qc is not None else BLOCK_SIZE
    out: dict = {}
    consumed: set = set()
    for name, t in tensors.items():
        if name.endswith(_SCALE_SUFFIXES) or name.endswith(_KV_SCALE_SUFFIXES):
            continue
        if t.dtype != torch.uint8 or not name.endswith(".weight"):
            if (name + "_scale") in tensors and name.endswith(".weight"):
                raise CheckpointError(_at(where, f"tensor {name}_scale belongs to NVFP4 weight {name}, but {name} has "
                                                 f"dtype {_dtype_name(t.dtype)}, expected uint8 (packed FP4)"))
            out[name] = t
            continue
        module = _module(name)
        if qc is not None and qc.excludes(module):
            raise CheckpointError(_at(where, f"tensor {name} is packed FP4 but module {module} is excluded from "
                                             "quantization by the checkpoint's exclude_modules"))
        scale, scale_2 = tensors.get(name + "_scale"), tensors.get(name + "_scale_2")
        if shapes is not None:
            if name not in shapes:
                raise CheckpointError(_at(where, f"unexpected packed FP4 tensor {name}: the model has no such weight"))
            shape = tuple(int(d) for d in shapes[name])
        elif scale is not None and scale.dim() >= 2:
            shape = tuple(scale.shape[:-1]) + (int(scale.shape[-1]) * group,)
        else:  # validation below reports the missing or malformed scale
            shape = tuple(t.shape[:-1]) + (int(t.shape[-1]) * 2,)
        validate_nvfp4(name, t, scale, scale_2, shape, where)
        out[name] = NVFP4Weight(t, scale, scale_2, shape, dtype or torch.float32, name)
        consumed.update((name + "_scale", name + "_scale_2", _module(name) + ".input_scale"))
    for name in tensors:
        if name.endswith(_SCALE_SUFFIXES) and name not in consumed:
            base = name[: name.rfind(".")] + ".weight"
            if name.endswith(".input_scale") and base in out:
                continue  # an unquantized module's activation scale: nothing to apply in W4A16
            raise CheckpointError(_at(where, f"tensor {name} has no packed FP4 weight {base} (expected uint8)"))
    return out


def _at(where: str, message: str) -> str:
    return f"{where}: {message}" if where else message


def _as_config(qc, where) -> QuantConfig | None:
    if qc is None or isinstance(qc, QuantConfig):
        return qc
    return QuantConfig.from_dict(qc, where or "quantization config")


def dequantize_weights(weights: Mapping[str, Any], dtype: torch.dtype | None = None) -> dict:
    """``weights`` with every :class:`NVFP4Weight` dequantized (to its compute dtype, or ``dtype``)."""
    return {n: (w.dequantize(dtype) if isinstance(w, NVFP4Weight) else w) for n, w in weights.items()}


def dequantized_module(module):
    """A copy of a model object (``builder.models``: plain objects, lists and dicts of tensors) whose
    every :class:`NVFP4Weight` is dequantized once, to its compute dtype. For the CPU torch paths,
    which otherwise dequantize each FP4 weight on every call (and cannot compile through the FP4
    subclass); the values are those a per-call dequantization gives. ``module`` itself is untouched."""
    def walk(obj):
        if isinstance(obj, NVFP4Weight):
            return obj.dequantize()
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(walk(v) for v in obj)
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if type(obj).__module__.startswith("builder.models") and hasattr(obj, "__dict__"):
            copy = object.__new__(type(obj))
            copy.__dict__.update({k: walk(v) for k, v in vars(obj).items()})
            return copy
        return obj
    return walk(module)


def nvfp4_file_tensors(weights: Mapping[str, Any]) -> dict:
    """``weights`` with every :class:`NVFP4Weight` as its ModelOpt tensors (packed, block scales, global
    scale): what an engine directory stores when its engines read the FP4 bytes from the file."""
    out: dict = {}
    for n, w in weights.items():
        out.update(w.tensors(n) if isinstance(w, NVFP4Weight) else {n: w})
    return out


def dequantize_tensors(tensors: Mapping[str, torch.Tensor], quant_config: QuantConfig | Mapping | None = None,
                       shapes: Mapping[str, Sequence[int]] | None = None, dtype: torch.dtype = torch.float32,
                       where: str = "") -> dict:
    """A ModelOpt NVFP4 tensor dict (e.g. a draft checkpoint's) -> plain tensors: every packed weight
    dequantized to ``dtype``, scale tensors dropped, the rest unchanged. See :func:`nvfp4_weights`."""
    return dequantize_weights(nvfp4_weights(tensors, quant_config, shapes, dtype, where))


def quantize_tensors(tensors: Mapping[str, torch.Tensor], names: Iterable[str]) -> dict:
    """NVFP4-quantize the weights ``names`` (``X.weight``, 2-D or more, input dim a multiple of 16) of
    ``tensors`` into ModelOpt's layout: ``X.weight`` (packed), ``X.weight_scale``, ``X.weight_scale_2``.
    Other tensors pass through unchanged, in order. Raises :class:`CheckpointError` naming a tensor."""
    names = list(dict.fromkeys(names))
    wanted = set(names)
    for name in names:
        if name not in tensors:
            raise CheckpointError(f"tensor {name} to quantize is not among the tensors")
        if not name.endswith(".weight"):
            raise CheckpointError(f"tensor {name}: only module weights (X.weight) are NVFP4-quantized")
        t = tensors[name]
        if not t.is_floating_point() or t.dim() < 2:
            raise CheckpointError(f"tensor {name}: expected a floating weight of rank >= 2, got "
                                  f"{_dtype_name(t.dtype)} {list(t.shape)}")
    out: dict = {}
    for name, t in tensors.items():
        if name not in wanted:
            out[name] = t
            continue
        try:
            packed, scale, scale_2 = quantize_nvfp4(t)
        except ValueError as e:
            raise CheckpointError(f"tensor {name} {list(t.shape)}: {e}") from None
        out[name], out[name + "_scale"], out[name + "_scale_2"] = packed, scale, scale_2
    return out


def quantizable_weight_names(names: Iterable[str], shapes: Mapping[str, Sequence[int]] | None = None) -> list[str]:
    """Weights of linear modules (``*_proj.weight``, experts, ``lm_head.weight``) among ``names``
    -- the modules ModelOpt puts weight quantizers on, before exclusions."""
    out = []
    for name in names:
        if not name.endswith(".weight"):
            continue
        leaf = _module(name).rsplit(".", 1)[-1]
        if leaf.endswith(_LINEAR_SUFFIXES) and (shapes is None or len(shapes[name]) >= 2):
            out.append(name)
    return out


def choose_quantized(shapes: Mapping[str, Sequence[int]], exclude_modules: Sequence[str] = (),
                     log=lambda message: None) -> tuple[list[str], list[str]]:
    """(weights to pack as NVFP4, module names kept in high precision) of a tensor name -> shape map:
    linear weights minus ModelOpt's default exclusions, ``exclude_modules`` and input dims that are
    not a multiple of the block size; conv1d modules are listed as kept (ModelOpt's default)."""
    patterns = tuple(DEFAULT_EXCLUDE_MODULES) + tuple(p for p in exclude_modules if p)
    chosen, excluded = [], []
    for name in quantizable_weight_names(shapes, shapes):
        module = _module(name)
        if any(module == p or fnmatch.fnmatchcase(module, p) for p in patterns):
            excluded.append(module)
        elif shapes[name][-1] % BLOCK_SIZE:
            log(f"keeping {module} in high precision: input dim {shapes[name][-1]} is not a multiple of {BLOCK_SIZE}")
            excluded.append(module)
        else:
            chosen.append(name)
    # modules with weights ModelOpt would give quantizers (conv1d) but leaves alone by default
    excluded += [_module(n) for n in shapes if n.endswith(".conv1d.weight")]
    return chosen, excluded
