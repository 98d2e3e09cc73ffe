"""EAGLE-1/2 and EAGLE-3 draft checkpoints: reading, name mapping and validation.

``load_draft_checkpoint(dir)`` reads ``config.json`` plus ``model.safetensors`` (or shards with an
index) and returns ``(cfg, weights)``: a frozen :class:`Eagle3Config` or :class:`EagleConfig` and
canonical name -> tensor (dtype as stored; ``d2t`` int64). Every error is a one-line
:class:`~builder.errors.DraftError` naming the file and the field or tensor at fault.

Accepted layouts (detected from ``config.json``):

* speculators 0.9.0, ``speculators_model_type: "eagle3"`` (``Eagle3DraftModel``): fields
  ``transformer_layer_config`` (``model_type`` ``llama`` or ``qwen3``; ``hidden_size``,
  ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
  ``head_dim``, ``rms_norm_eps``, ``hidden_act``, ``attention_bias``, ``mlp_bias``, ``vocab_size`` =
  the target's vocabulary, ``rope_parameters`` or ``rope_theta``/``rope_scaling``,
  ``partial_rotary_factor``), ``draft_vocab_size``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids``, ``norm_before_residual``, ``norm_before_fc``, ``fc_norm``,
  ``norm_output``, ``speculators_config.verifier.{name_or_path, architectures}``. Tensors
  ``embed_tokens.weight`` (optional), ``fc.weight``, ``input_norm.weight`` (norm_before_fc),
  ``fc_norm.{i}.weight`` (fc_norm), ``layers.{i}.*``, ``norm.weight``, ``lm_head.weight``, ``d2t``,
  ``t2d``.
* the original EAGLE-3 / SpecForge layout, ``architectures: ["LlamaForCausalLMEagle3"]`` (also
  ``Eagle3LlamaForCausalLM``): Llama fields at the top level, ``vocab_size`` (target),
  ``draft_vocab_size``, ``target_hidden_size``, aux layer ids in ``eagle_aux_hidden_state_layer_ids``
  or ``eagle_config.eagle_aux_hidden_state_layer_ids``, optional ``norm_before_residual``; tensors
  ``midlayer.*`` (read as ``layers.0.*``), ``fc.weight``, ``norm.weight``, ``lm_head.weight``,
  ``d2t``, ``t2d``, optional ``embed_tokens.weight``.
* speculators ``speculators_model_type: "eagle"`` (EAGLE-1/2 and HASS; the format of speculators
  before 0.9.0, which dropped the class): ``transformer_layer_config`` (llama), ``layernorms``,
  ``fusion_bias``; tensors ``fusion_fc.weight``/``.bias``, ``embedding_layernorm.weight``,
  ``transformer.*`` (one Llama decoder layer), ``pre_lm_head_layernorm.weight``. Canonical names:
  ``fc.*``, ``embedding_norm.weight``, ``layers.0.*``, ``norm.weight``.
* the original EAGLE / SGLang layout, ``architectures: ["LlamaForCausalLMEagle"]`` (also
  ``EagleLlamaForCausalLM``, or ``LlamaForCausalLM`` when the tensors hold ``fc.weight``
  [H, 2H]): ``fc.weight`` (+ ``fc.bias`` when stored), ``layers.{i}.*`` with no
  ``input_layernorm`` in layer 0, optional ``norm.weight``, ``embed_tokens.weight``,
  ``lm_head.weight``; a ``model.`` prefix is dropped.

Canonical decoder-layer names: ``layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (+ ``.bias`` with
``attention_bias``), ``layers.{i}.self_attn.{q,k}_norm.weight`` (qwen3), ``layers.{i}.mlp.{gate,up,
down}_proj.weight`` (+ ``.bias`` with ``mlp_bias``), ``layers.{i}.input_layernorm.weight``,
``layers.{i}.post_attention_layernorm.weight``, EAGLE-3 ``layers.0.hidden_norm.weight``.

``validate_against_target(draft_cfg, target_cfg)`` checks a draft against its NemotronH target and
returns the draft config with its aux layer ids resolved: vLLM's default ``(2, L // 2, L - 3)`` when
the checkpoint pins none, and sorted ascending (vLLM captures them walking the layers, so ``fc``'s
input columns are in layer order).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open

from builder.checkpoint import checkpoint_files
from builder.errors import DraftError

__all__ = [
    "Eagle3Config",
    "EagleConfig",
    "load_draft_checkpoint",
    "load_draft_config",
    "draft_config_from_dict",
    "draft_tensors",
    "validate_against_target",
    "default_aux_layer_ids",
    "ROPE_TYPES",
]

CONFIG_FILE = "config.json"
ROPE_TYPES = ("default", "linear", "llama3")
_ACTIVATIONS = ("silu", "gelu", "relu", "relu2", "sigmoid")
_LAYER_TYPES = ("llama", "qwen3")
_FLOAT_DTYPES = ("F32", "F16", "BF16")
_INT_DTYPES = ("I64", "I32")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")
SPECULATORS_TYPES = ("eagle", "eagle3")
#: tensors a checkpoint may carry that inference does not use
_IGNORED = ("t2d", "verifier_norm.weight", "verifier_lm_head.weight")

Shape = tuple[int, ...]


# --- configs -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _DraftLayers:
    """Decoder-layer hyperparameters shared by EAGLE and EAGLE-3 drafts."""

    source: str = ""                  # speculators | eagle3_hf | eagle_hf
    architecture: str = ""
    layer_type: str = "llama"         # llama | qwen3 (per-head q/k RMSNorm before RoPE)
    hidden_size: int = 0
    intermediate_size: int = 0
    num_hidden_layers: int = 1
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # sorted (key, value) pairs
    rotary_dim: int = 0
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int | None = None
    has_embedding: bool = False       # the draft ships embed_tokens.weight
    verifier: str | None = None
    verifier_architectures: tuple[str, ...] = ()

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def qk_norm(self) -> bool:
        return self.layer_type == "qwen3"

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["kind"] = self.kind  # type: ignore[attr-defined]
        data["rope_scaling"] = self.rope_scaling_dict
        for key, value in data.items():
            if isinstance(value, tuple):
                data[key] = list(value)
        return data


@dataclass(frozen=True)
class Eagle3Config(_DraftLayers):
    """An EAGLE-3 draft (speculators ``eagle3`` / ``LlamaForCausalLMEagle3``)."""

    target_hidden_size: int = 0
    target_vocab_size: int = 0
    draft_vocab_size: int = 0
    aux_layer_ids: tuple[int, ...] | None = None  # HF hidden_states indices; None: target default
    num_aux: int = 3
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    has_d2t: bool = False

    kind = "eagle3"


@dataclass(frozen=True)
class EagleConfig(_DraftLayers):
    """An EAGLE-1/2 (or HASS) draft (speculators ``eagle`` / ``LlamaForCausalLMEagle``)."""

    vocab_size: int = 0               # the target's vocabulary (embedding and LM head rows)
    fc_bias: bool = False
    embedding_norm: bool = False      # RMSNorm of the token embedding before fc (speculators layernorms)
    first_input_norm: bool = False    # layer 0 keeps its input_layernorm (the original EAGLE drops it)
    final_norm: bool = False          # RMSNorm before the LM head
    has_lm_head: bool = False

    kind = "eagle"


def draft_config_from_dict(data: Mapping[str, Any]) -> Eagle3Config | EagleConfig:
    """Inverse of ``cfg.to_dict()`` (for an engine directory's config.json)."""
    data = dict(data)
    kind = data.pop("kind", None)
    cls = {"eagle3": Eagle3Config, "eagle": EagleConfig}.get(kind)
    if cls is None:
        raise DraftError(f"draft config: unknown kind {kind!r} (expected eagle or eagle3)")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise DraftError(f"draft config: unknown field {unknown[0]!r} for kind {kind}")
    if data.get("rope_scaling") is not None:
        data["rope_scaling"] = tuple(sorted(data["rope_scaling"].items()))
    for key in ("aux_layer_ids", "verifier_architectures"):
        if data.get(key) is not None:
            data[key] = tuple(data[key])
    return cls(**data)


# --- config.json parsing -------------------------------------------------------------------------
class _Fields:
    """Typed reads from one JSON object, errors naming the file and the dotted field."""

    def __init__(self, data: Mapping[str, Any], where: str, prefix: str = ""):
        self.data, self.where, self.prefix = data, where, prefix

    def fail(self, field: str, message: str) -> DraftError:
        return DraftError(f"{self.where}: field {self.prefix + field!r} {message}")

    def has(self, field: str) -> bool:
        return self.data.get(field) is not None

    def get(self, field: str, default: Any = None) -> Any:
        value = self.data.get(field)
        return default if value is None else value

    def int(self, field: str, default: Any = ..., minimum: int = 1) -> Any:
        value = self.data.get(field)
        if value is None:
            if default is ...:
                raise self.fail(field, "is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(field, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.fail(field, f"must be >= {minimum}, got {value}")
        return value

    def float(self, field: str, default: Any = ...) -> float:
        value = self.data.get(field)
        if value is None:
            if default is ...:
                raise self.fail(field, "is missing")
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(field, f"must be a number, got {value!r}")
        return float(value)

    def bool(self, field: str, default: bool = False) -> bool:
        value = self.data.get(field)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(field, f"must be true or false, got {value!r}")
        return value

    def str(self, field: str, default: Any = ...) -> Any:
        value = self.data.get(field)
        if value is None:
            if default is ...:
                raise self.fail(field, "is missing")
            return default
        if not isinstance(value, str):
            raise self.fail(field, f"must be a string, got {value!r}")
        return value

    def obj(self, field: str, required: bool = True) -> "_Fields | None":
        value = self.data.get(field)
        if value is None:
            if required:
                raise self.fail(field, "is missing")
            return None
        if not isinstance(value, Mapping):
            raise self.fail(field, f"must be an object, got {type(value).__name__}")
        return _Fields(value, self.where, f"{self.prefix}{field}.")

    def int_list(self, field: str) -> tuple[int, ...] | None:
        value = self.data.get(field)
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or not value or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise self.fail(field, f"must be a non-empty list of integers, got {value!r}")
        return tuple(value)


def _rope(f: _Fields) -> tuple[float, tuple[tuple[str, Any], ...] | None]:
    """(theta, scaling) from ``rope_parameters`` (transformers >= 5) or ``rope_theta``/``rope_scaling``."""
    params = f.obj("rope_parameters", required=False)
    if params is not None and params.has("sliding_attention"):
        raise params.fail("sliding_attention", "(per-layer-type rope parameters) is not supported")
    theta = f.float("rope_theta", None)
    scaling = f.obj("rope_scaling", required=False)
    source = scaling
    if params is not None:
        theta = params.float("rope_theta", theta)
        source = params
    if theta is None:
        theta = 10000.0
    if source is None:
        return theta, None
    kind = source.get("rope_type", source.get("type", "default"))
    field = "rope_type" if source.has("rope_type") else "type"
    if kind not in ROPE_TYPES:
        raise source.fail(field, f"is {kind!r}: unsupported rope scaling (supported: {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return theta, None
    out = {"rope_type": kind, "factor": source.float("factor")}
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            out[key] = source.float(key)
        out["original_max_position_embeddings"] = source.int("original_max_position_embeddings")
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise source.fail("high_freq_factor", "must be greater than low_freq_factor")
    return theta, tuple(sorted(out.items()))


def _layers(f: _Fields, layer_type: str) -> dict[str, Any]:
    """Decoder-layer fields from a Llama/Qwen3-style config object."""
    if layer_type not in _LAYER_TYPES:
        raise f.fail("model_type", f"is {layer_type!r}: unsupported draft decoder layer "
                                   f"(supported: {', '.join(_LAYER_TYPES)})")
    hidden = f.int("hidden_size")
    heads = f.int("num_attention_heads")
    kv_heads = f.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise f.fail("num_key_value_heads", f"({kv_heads}) must divide num_attention_heads ({heads})")
    head_dim = f.int("head_dim", None)
    if head_dim is None:
        if hidden % heads:
            raise f.fail("head_dim", f"is missing and hidden_size {hidden} is not a multiple of {heads} heads")
        head_dim = hidden // heads
    # vLLM rotates the first head_dim * partial_rotary_factor channels (so does speculators' training
    # patch); transformers' default rope ignores the factor
    params = f.obj("rope_parameters", required=False)
    factor = f.float("partial_rotary_factor", 1.0 if params is None else params.float("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise f.fail("partial_rotary_factor", f"gives rotary dim {rotary_dim} for head_dim {head_dim}")
    act = f.str("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise f.fail("hidden_act", f"is {act!r}: unsupported (supported: {', '.join(_ACTIVATIONS)})")
    theta, scaling = _rope(f)
    if layer_type == "qwen3" and f.bool("use_sliding_window"):
        raise f.fail("use_sliding_window", "is true: sliding-window draft attention is not supported")
    return dict(
        layer_type=layer_type, hidden_size=hidden, intermediate_size=f.int("intermediate_size"),
        num_hidden_layers=f.int("num_hidden_layers", 1), num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=f.float("rms_norm_eps", 1e-6),
        hidden_act=act, rope_theta=theta, rope_scaling=scaling, rotary_dim=rotary_dim,
        attention_bias=f.bool("attention_bias"), mlp_bias=f.bool("mlp_bias"),
        max_position_embeddings=f.int("max_position_embeddings", None))


def _verifier(f: _Fields) -> dict[str, Any]:
    spec = f.obj("speculators_config", required=False)
    verifier = None if spec is None else spec.obj("verifier", required=False)
    if verifier is None:
        return {}
    archs = verifier.get("architectures", [])
    return dict(verifier=verifier.get("name_or_path"), verifier_architectures=tuple(str(a) for a in archs))


def _aux_ids(f: _Fields) -> tuple[int, ...] | None:
    ids = f.int_list("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        eagle = f.obj("eagle_config", required=False)
        if eagle is not None:
            ids = eagle.int_list("eagle_aux_hidden_state_layer_ids")
    return ids


def _parse_speculators_eagle3(f: _Fields, names: set[str]) -> Eagle3Config:
    layer = f.obj("transformer_layer_config")
    layers = _layers(layer, layer.str("model_type", "llama"))
    target_vocab = layer.int("vocab_size")
    aux = _aux_ids(f)
    norm_before_fc, fc_norm = f.bool("norm_before_fc"), f.bool("fc_norm")
    if norm_before_fc and fc_norm:
        raise f.fail("fc_norm", "and norm_before_fc are mutually exclusive")
    return Eagle3Config(
        source="speculators", architecture="Eagle3DraftModel", **layers, **_verifier(f),
        target_hidden_size=f.int("target_hidden_size", layers["hidden_size"]),
        target_vocab_size=target_vocab, draft_vocab_size=f.int("draft_vocab_size", target_vocab),
        aux_layer_ids=aux, num_aux=3 if aux is None else len(aux),
        norm_before_residual=f.bool("norm_before_residual"), norm_before_fc=norm_before_fc,
        fc_norm=fc_norm, norm_output=f.bool("norm_output"),
        has_embedding="embed_tokens.weight" in names, has_d2t="d2t" in names)


def _parse_eagle3_hf(f: _Fields, arch: str, names: set[str]) -> Eagle3Config:
    layers = _layers(f, "llama")
    target_vocab = f.int("vocab_size")
    aux = _aux_ids(f)
    eagle = f.obj("eagle_config", required=False)
    if eagle is not None and eagle.get("use_aux_hidden_state", True) is False:
        raise eagle.fail("use_aux_hidden_state", "is false: EAGLE-3 drafts without aux hidden states are not supported")
    return Eagle3Config(
        source="eagle3_hf", architecture=arch, **layers,
        target_hidden_size=f.int("target_hidden_size", layers["hidden_size"]),
        target_vocab_size=target_vocab, draft_vocab_size=f.int("draft_vocab_size", target_vocab),
        aux_layer_ids=aux, num_aux=3 if aux is None else len(aux),
        norm_before_residual=f.bool("norm_before_residual"), norm_before_fc=f.bool("norm_before_fc"),
        fc_norm=f.bool("fc_norm"), norm_output=f.bool("norm_output"),
        has_embedding="embed_tokens.weight" in names, has_d2t="d2t" in names)


def _parse_speculators_eagle(f: _Fields, names: set[str]) -> EagleConfig:
    arch = f.str("transformer_layer_architecture", "LlamaDecoderLayer")
    if arch != "LlamaDecoderLayer":
        raise f.fail("transformer_layer_architecture", f"is {arch!r}: only LlamaDecoderLayer is supported")
    layer = f.obj("transformer_layer_config")
    layers = _layers(layer, layer.str("model_type", "llama"))
    if layers["num_hidden_layers"] != 1:
        # the speculators eagle class builds exactly one decoder layer whatever the config says
        layers["num_hidden_layers"] = 1
    norms = f.bool("layernorms")
    return EagleConfig(
        source="speculators", architecture="EagleSpeculator", **layers, **_verifier(f),
        vocab_size=layer.int("vocab_size"), fc_bias=f.bool("fusion_bias"), embedding_norm=norms,
        first_input_norm=norms, final_norm=norms, has_embedding="embed_tokens.weight" in names,
        has_lm_head="lm_head.weight" in names)


def _parse_eagle_hf(f: _Fields, arch: str, names: set[str]) -> EagleConfig:
    layers = _layers(f, "llama")
    return EagleConfig(
        source="eagle_hf", architecture=arch, **layers, vocab_size=f.int("vocab_size"),
        fc_bias="fc.bias" in names, embedding_norm=False, first_input_norm="layers.0.input_layernorm.weight" in names,
        final_norm="norm.weight" in names, has_embedding="embed_tokens.weight" in names,
        has_lm_head="lm_head.weight" in names)


# --- tensor names --------------------------------------------------------------------------------
_SPECULATORS_EAGLE_NAMES = {"fusion_fc.": "fc.", "embedding_layernorm.": "embedding_norm.",
                            "transformer.": "layers.0.", "pre_lm_head_layernorm.": "norm."}


def _canonical(stored: str, source: str, kind: str) -> str:
    if kind == "eagle3":
        return "layers.0." + stored[len("midlayer."):] if stored.startswith("midlayer.") else stored
    if source == "speculators":
        for old, new in _SPECULATORS_EAGLE_NAMES.items():
            if stored.startswith(old):
                return new + stored[len(old):]
        return stored
    return stored[len("model."):] if stored.startswith("model.") and not stored.startswith("model.lm_head") else stored


def _layer_tensors(cfg, i: int, in_size: int) -> dict[str, Shape]:
    H, D = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    p = f"layers.{i}."
    t: dict[str, Shape] = {}
    for name, out, inp in (("q", q, in_size), ("k", kv, in_size), ("v", kv, in_size), ("o", H, q)):
        t[f"{p}self_attn.{name}_proj.weight"] = (out, inp)
        if cfg.attention_bias:
            t[f"{p}self_attn.{name}_proj.bias"] = (out,)
    if cfg.qk_norm:
        t[f"{p}self_attn.q_norm.weight"] = (D,)
        t[f"{p}self_attn.k_norm.weight"] = (D,)
    inter = cfg.intermediate_size
    for name, shape in (("gate", (inter, H)), ("up", (inter, H)), ("down", (H, inter))):
        t[f"{p}mlp.{name}_proj.weight"] = shape
        if cfg.mlp_bias:
            t[f"{p}mlp.{name}_proj.bias"] = (shape[0],)
    t[f"{p}input_layernorm.weight"] = (H,)
    t[f"{p}post_attention_layernorm.weight"] = (H,)
    return t


def draft_tensors(cfg: Eagle3Config | EagleConfig) -> tuple[dict[str, Shape], dict[str, Shape]]:
    """(required, optional) canonical tensor name -> shape of a draft checkpoint."""
    H = cfg.hidden_size
    required: dict[str, Shape] = {}
    optional: dict[str, Shape] = {}
    if isinstance(cfg, Eagle3Config):
        width = cfg.num_aux * cfg.target_hidden_size
        required["fc.weight"] = (H, width)
        if cfg.norm_before_fc:
            required["input_norm.weight"] = (width,)
        if cfg.fc_norm:
            for i in range(cfg.num_aux):
                required[f"fc_norm.{i}.weight"] = (cfg.target_hidden_size,)
        for i in range(cfg.num_hidden_layers):
            required.update(_layer_tensors(cfg, i, 2 * H if i == 0 else H))
        required["layers.0.hidden_norm.weight"] = (H,)
        required["norm.weight"] = (H,)
        required["lm_head.weight"] = (cfg.draft_vocab_size, H)
        if cfg.draft_vocab_size != cfg.target_vocab_size:
            required["d2t"] = (cfg.draft_vocab_size,)
        else:
            optional["d2t"] = (cfg.draft_vocab_size,)
        optional["embed_tokens.weight"] = (cfg.target_vocab_size, H)
        return required, optional
    required["fc.weight"] = (H, 2 * H)
    if cfg.fc_bias:
        required["fc.bias"] = (H,)
    if cfg.embedding_norm:
        required["embedding_norm.weight"] = (H,)
    for i in range(cfg.num_hidden_layers):
        required.update(_layer_tensors(cfg, i, H))
    if not cfg.first_input_norm:
        del required["layers.0.input_layernorm.weight"]
    if cfg.final_norm:
        required["norm.weight"] = (H,)
    optional["embed_tokens.weight"] = (cfg.vocab_size, H)
    optional["lm_head.weight"] = (cfg.vocab_size, H)
    return required, optional


# --- loading -------------------------------------------------------------------------------------
def _read_config(directory: Path) -> tuple[dict, str]:
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise DraftError(f"{directory}: draft checkpoint directory not found")
    if not path.is_file():
        raise DraftError(f"{path}: missing; a draft checkpoint needs a config.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DraftError(f"{path}: invalid JSON ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise DraftError(f"{path}: expected a JSON object")
    return data, str(path)


def _headers(directory: Path) -> dict[str, tuple[Path, str, Shape, str]]:
    """stored name -> (file, stored name, shape, safetensors dtype) over all files."""
    entries: dict[str, tuple[Path, str, Shape, str]] = {}
    for path in checkpoint_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                if name in entries:
                    raise DraftError(f"{path}: tensor {name!r} is stored twice (also in {entries[name][0].name})")
                entries[name] = (path, name, tuple(sl.get_shape()), sl.get_dtype())
    return entries


def _parse(data: dict, where: str, names: set[str]) -> Eagle3Config | EagleConfig:
    f = _Fields(data, where)
    if "speculators_model_type" in data:
        kind = data["speculators_model_type"]
        if kind == "eagle3":
            return _parse_speculators_eagle3(f, names)
        if kind == "eagle":
            return _parse_speculators_eagle(f, names)
        raise f.fail("speculators_model_type", f"is {kind!r}: unsupported draft type "
                                              f"(supported: {', '.join(SPECULATORS_TYPES)})")
    archs = data.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise f.fail("architectures", f"must name the draft architecture, got {archs!r} "
                                      f"(and no speculators_model_type is set)")
    arch = archs[0]
    if arch in EAGLE3_ARCHITECTURES:
        return _parse_eagle3_hf(f, arch, names)
    if arch in EAGLE_ARCHITECTURES or (arch == "LlamaForCausalLM" and "fc.weight" in names):
        return _parse_eagle_hf(f, arch, names)
    supported = ", ".join(EAGLE3_ARCHITECTURES + EAGLE_ARCHITECTURES)
    raise f.fail("architectures", f"is {arch!r}: unknown draft architecture (supported: {supported}, "
                                  f"or a speculators config with speculators_model_type eagle/eagle3)")


def load_draft_config(checkpoint_dir: str | os.PathLike) -> Eagle3Config | EagleConfig:
    """The draft's config (reads tensor headers to tell optional tensors apart; no tensor data)."""
    return _load(checkpoint_dir, read=False)[0]


def load_draft_checkpoint(checkpoint_dir: str | os.PathLike) -> tuple[Eagle3Config | EagleConfig, dict[str, torch.Tensor]]:
    """Read and validate an EAGLE / EAGLE-3 draft checkpoint: (cfg, canonical name -> tensor)."""
    return _load(checkpoint_dir, read=True)


def _load(checkpoint_dir, read: bool):
    directory = Path(checkpoint_dir)
    data, where = _read_config(directory)
    headers = _headers(directory)
    kind_hint = "eagle3" if data.get("speculators_model_type") == "eagle3" or (
        isinstance(data.get("architectures"), list) and data["architectures"][:1] and
        data["architectures"][0] in EAGLE3_ARCHITECTURES) else "eagle"
    source_hint = "speculators" if "speculators_model_type" in data else "hf"
    entries: dict[str, tuple[Path, str, Shape, str]] = {}
    for stored, entry in headers.items():
        name = _canonical(stored, source_hint, kind_hint)
        if name in entries:
            raise DraftError(f"{entry[0]}: tensor {stored!r} duplicates {entries[name][1]!r} (both are {name!r})")
        entries[name] = entry
    cfg = _parse(data, where, set(entries))
    required, optional = draft_tensors(cfg)
    missing = [n for n in required if n not in entries]
    if missing:
        files = sorted({e[0].name for e in headers.values()}) or ["(no tensors)"]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        hint = ""
        if missing[0] == "d2t":
            hint = (f"; draft_vocab_size {cfg.draft_vocab_size} != target vocab_size {cfg.target_vocab_size} "
                    f"needs the d2t draft->target id map")
        raise DraftError(f"{directory / files[0]}: missing tensor {missing[0]!r}, expected shape "
                         f"{_fmt(required[missing[0]])}{hint}{more}")
    for name, (path, stored, shape, dtype) in entries.items():
        if name in _IGNORED:
            continue
        want = required.get(name, optional.get(name))
        if want is None:
            raise DraftError(f"{path}: unexpected tensor {stored!r} for an {cfg.kind} draft "
                             f"({cfg.architecture}, {cfg.num_hidden_layers} layer(s))")
        if shape != want:
            raise DraftError(f"{path}: tensor {stored!r} has shape {_fmt(shape)}, expected {_fmt(want)}")
        allowed = _INT_DTYPES if name == "d2t" else _FLOAT_DTYPES
        if dtype not in allowed:
            raise DraftError(f"{path}: tensor {stored!r} has dtype {dtype}, expected one of {', '.join(allowed)}")
    if not read:
        return cfg, {}
    weights: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, entry in entries.items():
        if name not in _IGNORED:
            by_file.setdefault(entry[0], []).append(name)
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                weights[name] = f.get_tensor(entries[name][1])
    if "d2t" in weights:
        d2t = weights["d2t"] = weights["d2t"].long()
        target_ids = torch.arange(d2t.shape[0]) + d2t
        vocab = cfg.target_vocab_size
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab:
            path = entries["d2t"][0]
            raise DraftError(f"{path}: tensor 'd2t' maps draft ids outside the target vocabulary [0, {vocab})")
    return cfg, weights


def _fmt(shape: Shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# --- against the target --------------------------------------------------------------------------
def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 capture layers for a target of ``num_layers`` layers."""
    return (2, num_layers // 2, num_layers - 3)


def validate_against_target(draft_cfg: Eagle3Config | EagleConfig, target_cfg) -> Eagle3Config | EagleConfig:
    """Check a draft against its target (a NemotronHConfig, or any config with ``hidden_size``,
    ``vocab_size`` and ``num_layers`` / ``num_hidden_layers``). Returns the draft config with
    ``aux_layer_ids`` resolved (EAGLE-3). Raises :class:`DraftError` naming the field."""
    c = draft_cfg
    target_hidden = int(target_cfg.hidden_size)
    target_vocab = int(target_cfg.vocab_size)
    layers = getattr(target_cfg, "num_layers", None)
    if layers is None:
        layers = getattr(target_cfg, "num_hidden_layers")
    layers = int(layers)
    if isinstance(c, Eagle3Config):
        if c.target_hidden_size != target_hidden:
            field = "target_hidden_size" if c.target_hidden_size != c.hidden_size else "hidden_size"
            raise DraftError(f"eagle3 draft: {field} {c.target_hidden_size} does not match the target's "
                             f"hidden_size {target_hidden}")
        if not c.has_embedding and c.hidden_size != target_hidden:
            raise DraftError(f"eagle3 draft: hidden_size {c.hidden_size} differs from the target's hidden_size "
                             f"{target_hidden} and the draft ships no embed_tokens.weight to use instead")
        if c.target_vocab_size != target_vocab:
            raise DraftError(f"eagle3 draft: vocab_size (target vocabulary) {c.target_vocab_size} does not match "
                             f"the target's vocab_size {target_vocab}")
        if c.draft_vocab_size != target_vocab and not c.has_d2t:
            raise DraftError(f"eagle3 draft: draft_vocab_size {c.draft_vocab_size} != target vocab_size "
                             f"{target_vocab} but the checkpoint has no d2t tensor")
        if c.draft_vocab_size > target_vocab:
            raise DraftError(f"eagle3 draft: draft_vocab_size {c.draft_vocab_size} exceeds the target's "
                             f"vocab_size {target_vocab}")
        ids = c.aux_layer_ids if c.aux_layer_ids is not None else default_aux_layer_ids(layers)
        if len(ids) != c.num_aux:
            raise DraftError(f"eagle3 draft: eagle_aux_hidden_state_layer_ids has {len(ids)} ids but fc.weight "
                             f"expects {c.num_aux}")
        bad = [i for i in ids if not 0 <= i <= layers]
        if bad:
            origin = "" if c.aux_layer_ids is not None else " (vLLM's default for this target)"
            raise DraftError(f"eagle3 draft: eagle_aux_hidden_state_layer_ids {list(ids)}{origin} has id {bad[0]} "
                             f"outside [0, {layers}] for a target of {layers} layers")
        if len(set(ids)) != len(ids):
            raise DraftError(f"eagle3 draft: eagle_aux_hidden_state_layer_ids {list(ids)} repeats a layer id")
        # vLLM (and speculators' datagen through it) appends captured states while walking the layers,
        # so fc's input columns are in ascending layer order whatever order the config lists
        return dataclasses.replace(c, aux_layer_ids=tuple(sorted(ids)))
    if c.hidden_size != target_hidden:
        raise DraftError(f"eagle draft: hidden_size {c.hidden_size} does not match the target's hidden_size "
                         f"{target_hidden}")
    if c.vocab_size != target_vocab:
        raise DraftError(f"eagle draft: vocab_size {c.vocab_size} does not match the target's vocab_size "
                         f"{target_vocab}")
    return c
