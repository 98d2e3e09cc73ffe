"""NemotronH model configuration, read from a Hugging Face checkpoint's ``config.json``.

:func:`load_config` accepts what ``transformers`` 5.24 accepts for ``model_type: nemotron_h``
(current and legacy key names, ``hybrid_override_pattern`` strings and ``layers_block_type`` lists,
``{"__float__": "Infinity"}`` float encodings) and applies the same defaults as
``transformers.NemotronHConfig`` for missing keys. The result is a frozen, validated
:class:`NemotronHConfig` whose :meth:`~NemotronHConfig.to_dict` / :meth:`~NemotronHConfig.from_dict`
round-trip exactly through JSON (for an engine directory's ``config.json``).

Layer kinds are named ``mamba`` (Mamba-2 mixer), ``attention``, ``mlp`` and ``moe``.

Notes on transformers 5.24 behaviour the model code must mirror (the config only records values):

* attention q/k/v/o projections never have biases, whatever ``attention_bias`` says;
* the Mamba-2 dt clamp is ``(time_step_min, inf)``; ``time_step_limit`` is recorded but unused;
* MoE layers always build shared experts, whatever ``n_shared_experts`` says.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from builder.config_values import (
    ACTIVATIONS, BLOCK_TYPE_NAMES, DTYPES, PATTERN_LETTERS, SOURCE as _SOURCE, check_float, check_int, fail,
    parse_activation, parse_bool, parse_dtype, parse_eos, parse_float, parse_int, parse_kind_list,
    parse_optional_int, parse_pattern, parse_time_step_limit, show, to_json)
from builder.errors import CheckpointError
from builder.generation_config import with_generation_eos

__all__ = [
    "NemotronHConfig",
    "load_config",
    "parse_hf_config",
    "LAYER_KINDS",
    "PATTERN_LETTERS",
    "BLOCK_TYPE_NAMES",
    "DTYPES",
    "ACTIVATIONS",
]

LAYER_KINDS = ("mamba", "attention", "mlp", "moe")
_KIND_TO_LETTER = {v: k for k, v in PATTERN_LETTERS.items()}
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class NemotronHConfig:
    """A NemotronH target model. Defaults equal ``transformers.NemotronHConfig`` 5.24 defaults."""

    vocab_size: int = 131072
    hidden_size: int = 4096
    layer_types: tuple[str, ...] = ("mamba", "moe", "attention", "mlp")
    # attention
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    # MLP (also the activation and bias flag of MoE experts and shared experts)
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    # Mamba-2
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    use_conv_bias: bool = True
    chunk_size: int = 128
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    mamba_hidden_act: str = "silu"
    use_bias: bool = False
    # MoE
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    num_experts_per_tok: int = 2
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    # general
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    mtp_layer_types: tuple[str, ...] = ("attention", "moe")
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    pad_token_id: int | None = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        # Normalise sequences to tuples so the config is hashable and compares equal after JSON.
        for name in ("layer_types", "mtp_layer_types", "time_step_limit"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self._validate()

    # --- derived sizes ---------------------------------------------------------------------------
    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate_size + 2 * self.n_groups * self.ssm_state_size

    @property
    def mamba_in_proj_size(self) -> int:
        """Rows of ``in_proj``: gate z, then conv input (x, B, C), then dt."""
        return self.mamba_intermediate_size + self.conv_dim + self.mamba_num_heads

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def moe_input_size(self) -> int:
        """Input (and output) width of routed experts: moe_latent_size if set, else hidden_size."""
        return self.moe_latent_size if self.moe_latent_size is not None else self.hidden_size

    @property
    def hybrid_override_pattern(self) -> str:
        return "".join(_KIND_TO_LETTER[k] for k in self.layer_types)

    @property
    def mtp_hybrid_override_pattern(self) -> str:
        return "".join(_KIND_TO_LETTER[k] for k in self.mtp_layer_types)

    def layer_indices(self, kind: str) -> tuple[int, ...]:
        """Indices of the layers of one kind ('mamba', 'attention', 'mlp', 'moe')."""
        if kind not in LAYER_KINDS:
            raise ValueError(f"unknown layer kind {kind!r}; expected one of {LAYER_KINDS}")
        return tuple(i for i, k in enumerate(self.layer_types) if k == kind)

    # --- serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict of every field (tuples as lists, inf as {"__float__": "Infinity"})."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            out[f.name] = to_json(getattr(self, f.name))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> "NemotronHConfig":
        """Inverse of :meth:`to_dict`. Every field must be present and no other key."""
        token = _SOURCE.set(source)
        try:
            if not isinstance(data, Mapping):
                raise fail(f"expected a JSON object, got {type(data).__name__}")
            names = [f.name for f in dataclasses.fields(cls)]
            missing = [n for n in names if n not in data]
            if missing:
                raise fail(f"missing field(s) {', '.join(repr(m) for m in missing)}")
            extra = sorted(set(data) - set(names))
            if extra:
                raise fail(f"unknown field(s) {', '.join(repr(e) for e in extra)}")
            return cls(**{n: _parse_field(n, data[n]) for n in names})
        finally:
            _SOURCE.reset(token)

    # --- validation ------------------------------------------------------------------------------
    def _validate(self) -> None:
        for name in _INT_FIELDS:
            check_int(name, getattr(self, name))
        for name in _FLOAT_FIELDS:
            check_float(name, getattr(self, name))
            if not math.isfinite(getattr(self, name)):   # an infinite one built a model that gives token 0 only
                raise fail(f"field '{name}': expected a finite number, got {getattr(self, name)}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise fail(f"field '{name}': expected true or false, got {getattr(self, name)!r}")
        for name in _STR_FIELDS:
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise fail(f"field '{name}': expected a non-empty string, got {getattr(self, name)!r}")
        for name in ("bos_token_id", "pad_token_id", "moe_latent_size"):
            value = getattr(self, name)
            if value is not None:
                check_int(name, value)
        eos = self.eos_token_id
        if eos is not None:
            ids = eos if isinstance(eos, tuple) else (eos,)
            for v in ids:
                check_int("eos_token_id", v)
            # none inside the vocabulary: never generated, so generation never stops (one of a set
            # outside it is inert, as transformers treats it)
            if isinstance(self.vocab_size, int) and self.vocab_size > 0 and ids and \
                    not any(0 <= v < self.vocab_size for v in ids):
                raise fail(f"field 'eos_token_id': {ids[0]} is outside the vocabulary [0, {self.vocab_size})")
        if self.dtype not in DTYPES:
            raise fail(f"field 'dtype': expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("layer_types", "mtp_layer_types"):
            kinds = getattr(self, name)
            if not isinstance(kinds, tuple):
                raise fail(f"field '{name}': expected a list of layer kinds, got {kinds!r}")
            for i, kind in enumerate(kinds):
                if kind not in LAYER_KINDS:
                    raise fail(f"field '{name}': unknown layer kind {kind!r} at position {i}; "
                                f"expected one of {', '.join(LAYER_KINDS)}")
        if not self.layer_types:
            raise fail("field 'layer_types': expected at least one layer, got none")
        tsl = self.time_step_limit
        if not (isinstance(tsl, tuple) and len(tsl) == 2):
            raise fail(f"field 'time_step_limit': expected two numbers [min, max], got {tsl!r}")
        for v in tsl:
            check_float("time_step_limit", v)
        if math.isnan(tsl[0]) or math.isnan(tsl[1]) or tsl[0] > tsl[1] or not math.isfinite(tsl[0]):
            raise fail(f"field 'time_step_limit': expected [min, max] with a finite min <= max (max may be "
                       f"infinity: no upper clamp), got {list(tsl)}")

        used = set(self.layer_types)
        if self.num_nextn_predict_layers > 0:
            used |= set(self.mtp_layer_types)
        positive = ["vocab_size", "hidden_size", "max_position_embeddings"]
        if "attention" in used:
            positive += ["num_attention_heads", "num_key_value_heads", "head_dim"]
        if "mlp" in used:
            positive += ["intermediate_size"]
        if "mamba" in used:
            positive += ["mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
                         "chunk_size"]
        if "moe" in used:
            positive += ["n_routed_experts", "moe_intermediate_size", "num_experts_per_tok", "n_group",
                         "topk_group", "moe_shared_expert_intermediate_size"]
            if self.moe_latent_size is not None:
                positive.append("moe_latent_size")
        for name in positive:
            if getattr(self, name) <= 0:
                raise fail(f"field '{name}': expected a positive integer, got {getattr(self, name)}")
        for name in ("n_shared_experts", "num_nextn_predict_layers"):
            if getattr(self, name) < 0:
                raise fail(f"field '{name}': expected an integer >= 0, got {getattr(self, name)}")
        if not 0 < self.layer_norm_epsilon < math.inf:   # an infinite one gave a model of token 0 only
            raise fail(f"field 'layer_norm_epsilon': expected a finite positive number, got {self.layer_norm_epsilon}")

        if "attention" in used and self.num_attention_heads % self.num_key_value_heads:
            raise fail(f"field 'num_attention_heads': expected a multiple of num_key_value_heads="
                        f"{self.num_key_value_heads}, got {self.num_attention_heads}")
        if "mamba" in used and self.mamba_num_heads % self.n_groups:
            raise fail(f"field 'mamba_num_heads': expected a multiple of n_groups={self.n_groups}, "
                        f"got {self.mamba_num_heads}")
        if "moe" in used:
            e = self.n_routed_experts
            if e % self.n_group:
                raise fail(f"field 'n_routed_experts': expected a multiple of n_group={self.n_group}, got {e}")
            if e // self.n_group < 2:
                raise fail(f"field 'n_group': expected at most n_routed_experts/2={e // 2} groups "
                            f"(routing takes the top 2 scores of each group), got {self.n_group}")
            if self.topk_group > self.n_group:
                raise fail(f"field 'topk_group': expected at most n_group={self.n_group}, got {self.topk_group}")
            reachable = self.topk_group * (e // self.n_group)
            if self.num_experts_per_tok > reachable:
                raise fail(f"field 'num_experts_per_tok': expected at most topk_group*n_routed_experts/n_group="
                            f"{reachable}, got {self.num_experts_per_tok}")
            if not 0 < self.routed_scaling_factor < math.inf:
                raise fail(f"field 'routed_scaling_factor': expected a finite positive number, "
                            f"got {self.routed_scaling_factor}")


_INT_FIELDS = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "intermediate_size", "mamba_num_heads", "mamba_head_dim", "ssm_state_size",
    "n_groups", "conv_kernel", "chunk_size", "n_routed_experts", "n_shared_experts", "moe_intermediate_size",
    "moe_shared_expert_intermediate_size", "num_experts_per_tok", "n_group", "topk_group",
    "num_nextn_predict_layers",
)
# the fields that size tensors: one a config.json leaves out takes transformers' default, and the
# shape errors that follow say so (``defaulted_sizes``)
_SIZE_FIELDS = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
    "n_routed_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
)
_FLOAT_FIELDS = ("time_step_min", "time_step_max", "routed_scaling_factor", "layer_norm_epsilon")
_BOOL_FIELDS = (
    "attention_bias", "mlp_bias", "use_conv_bias", "use_bias", "norm_topk_prob", "tie_word_embeddings",
)
_STR_FIELDS = ("mlp_hidden_act", "mamba_hidden_act", "dtype")
_OPTIONAL_INT_FIELDS = ("moe_latent_size", "bos_token_id", "pad_token_id")


_FIELD_PARSERS = {
    **{n: parse_int for n in _INT_FIELDS},
    **{n: parse_float for n in _FLOAT_FIELDS},
    **{n: parse_bool for n in _BOOL_FIELDS},
    **{n: parse_optional_int for n in _OPTIONAL_INT_FIELDS},
    "mlp_hidden_act": parse_activation,
    "mamba_hidden_act": parse_activation,
    "eos_token_id": parse_eos,
    "time_step_limit": parse_time_step_limit,
    "dtype": parse_dtype,
    "layer_types": parse_kind_list,
    "mtp_layer_types": parse_kind_list,
}


def _parse_field(name: str, value: Any) -> Any:
    return _FIELD_PARSERS[name](value, name)


# Legacy config keys transformers still accepts; when present they win over the current name.
_LEGACY_ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}


def parse_hf_config(raw: Mapping[str, Any], source: str = CONFIG_FILE) -> NemotronHConfig:
    """Build a :class:`NemotronHConfig` from a Hugging Face config dict (errors name ``source``)."""
    token = _SOURCE.set(source)
    try:
        if not isinstance(raw, Mapping):
            raise fail(f"expected a JSON object at the top level, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type != "nemotron_h":
            got = "no model_type" if "model_type" not in raw else f"{show(model_type)}"
            raise fail(f"field 'model_type': expected \"nemotron_h\", got {got}")

        values: dict[str, Any] = {}
        simple = [f.name for f in dataclasses.fields(NemotronHConfig)
                  if f.name not in ("layer_types", "mtp_layer_types", "dtype")]
        for name in simple:
            if name in raw and not (name in ("head_dim", "num_key_value_heads") and raw[name] is None):
                values[name] = _parse_field(name, raw[name])
        for legacy, name in _LEGACY_ALIASES.items():
            if legacy in raw:
                values[name] = _parse_field(name, raw[legacy])
        heads = values.get("num_attention_heads", NemotronHConfig.num_attention_heads)
        if raw.get("num_key_value_heads", 0) is None:  # transformers: None means plain multi-head attention
            values["num_key_value_heads"] = heads
        if raw.get("head_dim", 0) is None and heads > 0:
            values["head_dim"] = values.get("hidden_size", NemotronHConfig.hidden_size) // heads

        # Layer pattern: an explicit list wins over the pattern string (as in transformers).
        block_list_key = next((k for k in ("layers_block_type", "layer_types") if raw.get(k) is not None), None)
        if block_list_key is not None:
            values["layer_types"] = parse_kind_list(raw[block_list_key], block_list_key)
        elif raw.get("hybrid_override_pattern") is not None:
            values["layer_types"] = parse_pattern(raw["hybrid_override_pattern"], "hybrid_override_pattern")
        layers = raw.get("num_hidden_layers")
        pattern_key = block_list_key or ("hybrid_override_pattern" if "layer_types" in values else None)
        if pattern_key and isinstance(layers, int) and not isinstance(layers, bool) and layers != len(values["layer_types"]):
            # transformers warns and follows the pattern: a config whose two counts disagree was cut by hand
            raise fail(f"field 'num_hidden_layers': {layers}, but '{pattern_key}' has {len(values['layer_types'])} "
                        "layers (one per layer: they must agree)")

        default_mtp = NemotronHConfig.mtp_layer_types
        mtp = default_mtp
        mtp_key = next((k for k in ("mtp_layers_block_type", "mtp_layer_types") if raw.get(k) is not None), None)
        if mtp_key is not None:
            mtp = parse_kind_list(raw[mtp_key], mtp_key)
        if raw.get("mtp_hybrid_override_pattern") is not None and mtp == default_mtp:
            mtp = parse_pattern(raw["mtp_hybrid_override_pattern"], "mtp_hybrid_override_pattern")
        values["mtp_layer_types"] = mtp

        dtype_key = next((k for k in ("dtype", "torch_dtype") if raw.get(k) is not None), None)
        values["dtype"] = parse_dtype(raw[dtype_key], dtype_key) if dtype_key else "float32"
        config = NemotronHConfig(**values)
        object.__setattr__(config, "_defaulted", tuple(n for n in _SIZE_FIELDS if n not in values))
        object.__setattr__(config, "_dtype_given", dtype_key is not None)   # else the tensors' (load_checkpoint)
        return config
    finally:
        _SOURCE.reset(token)


def defaulted_sizes(config: NemotronHConfig) -> str:
    """"" or a clause naming the tensor-sizing fields config.json left out (their defaults were used),
    for a shape error: a missing hidden_size otherwise reads as a wrong tensor."""
    names = getattr(config, "_defaulted", ())
    if not names:
        return ""
    shown = ", ".join(f"{n} (default {getattr(config, n)})" for n in names)
    return f"; {CONFIG_FILE} has no {shown}"


def load_config(checkpoint_dir: str | os.PathLike) -> NemotronHConfig:
    """Read and validate ``<checkpoint_dir>/config.json`` (and the eos ids of ``generation_config.json``).
    Raises :class:`CheckpointError`."""
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory not found")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; a Hugging Face checkpoint needs a config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    return with_generation_eos(parse_hf_config(raw, str(path)), directory)
