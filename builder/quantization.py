"""NVFP4 weight-only quantization (W4A16) of checkpoints in NVIDIA ModelOpt's Hugging Face layout: the
quantization config, which tensors are quantized, and tensor dicts <-> NVFP4 weights. The number
format itself (E2M1 codes, packing, FP8 block scales, quantize/dequantize, :class:`NVFP4Weight`) is
:mod:`builder.nvfp4_format`.

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
:class:`~builder.nvfp4_format.NVFP4Weight` objects instead, which ``functional.linear`` lowers to FP4 constants in
TensorRT. Drafts (any tensor dict, quantized independently of their target) use
:func:`quantize_tensors` / :func:`dequantize_tensors` / :func:`nvfp4_weights`;
:func:`builder.quantize_checkpoint.quantize_checkpoint` is ``nemospec quantize``.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from builder.errors import CheckpointError
from builder.nvfp4_format import BLOCK_SIZE, NVFP4Weight, _check_layout, _dtype_name, quantize_nvfp4

__all__ = [
    "QUANT_ALGO", "READABLE_ALGOS", "HF_QUANT_CONFIG", "FORMAT_NAME", "DEFAULT_EXCLUDE_MODULES",
    "QuantConfig", "read_quant_config", "is_nvfp4_checkpoint",
    "validate_nvfp4", "quantize_tensors", "dequantize_tensors", "nvfp4_file_tensors", "nvfp4_weights", "dequantize_weights",
    "quantizable_weight_names", "choose_quantized", "dequantized_module",
]

QUANT_ALGO = "W4A16_NVFP4"          # what ModelOpt writes for weight-only NVFP4
READABLE_ALGOS = ("W4A16_NVFP4", "NVFP4")
HF_QUANT_CONFIG = "hf_quant_config.json"
CONFIG_FILE = "config.json"
FORMAT_NAME = "nvfp4_w4a16"         # the CLI's --format
PRODUCER = {"name": "nemospec", "version": "0.1"}

#: ModelOpt's default disabled quantizers that can match NemotronH module names (fnmatch patterns)
DEFAULT_EXCLUDE_MODULES = ("*lm_head*", "*mixer.conv1d*", "*router*", "*mlp.gate.*", "mtp.*", "*output_layer*",
                           "output.*", "*proj_out.*")

# linear modules of NemotronH (and of drafts, which pass their names explicitly)
_LINEAR_SUFFIXES = ("_proj", "lm_head")
_SCALE_SUFFIXES = (".weight_scale_2", ".weight_scale", ".input_scale")
_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")  # ModelOpt's FP8 KV-cache scales (k_proj.k_scale, v_proj.v_scale)


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
    modules = [_module(n) for n in quantizable_weight_names(shapes, shapes)]
    for p in exclude_modules:   # a typo would quantize the very layer it meant to keep
        if p and not any(m == p or fnmatch.fnmatchcase(m, p) for m in modules):
            raise CheckpointError(f"--exclude_modules {p!r}: matches no linear module (they are named like "
                                  f"{modules[0] if modules else 'backbone.layers.0.mixer.in_proj'}; wildcards: *)")
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
