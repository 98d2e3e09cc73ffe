"""Configs of the draft modules in ``builder/models`` (frozen, JSON round-trippable).

Checkpoint layouts (``builder/formats``) map their config keys onto these; the engine directory
records ``cfg.to_dict()`` and :func:`draft_config_from_dict` reads it back. No checkpoint reading here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from builder.errors import DraftError

__all__ = ["DraftLayers", "Eagle3Config", "EagleConfig", "DFlashConfig", "DSparkConfig", "PEagleConfig",
           "draft_config_from_dict", "FEATURE_CLASSES", "BLOCK_CLASSES"]


@dataclass(frozen=True)
class DraftLayers:
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
class Eagle3Config(DraftLayers):
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
class EagleConfig(DraftLayers):
    """An EAGLE-1/2 (or HASS) draft (speculators ``eagle`` / ``LlamaForCausalLMEagle``)."""

    vocab_size: int = 0               # the target's vocabulary (embedding and LM head rows)
    fc_bias: bool = False
    embedding_norm: bool = False      # RMSNorm of the token embedding before fc (speculators layernorms)
    first_input_norm: bool = False    # layer 0 keeps its input_layernorm (the original EAGLE drops it)
    final_norm: bool = False          # RMSNorm before the LM head
    norm_hidden_out: bool = False     # the recycled hidden is the final-normed one (EagleMistral)
    has_lm_head: bool = False

    kind = "eagle"

@dataclass(frozen=True)
class DFlashConfig(DraftLayers):
    """A DFlash block-diffusion draft (speculators ``dflash`` / z-lab ``DFlashDraftModel``).

    Decoder layers are Qwen3 layers (per-head q/k RMSNorm) whatever ``layer_type`` says: the DFlash
    attention always has them.
    """

    target_hidden_size: int = 0
    target_vocab_size: int = 0          # the target's vocabulary (W1 rows, embedding rows by default)
    draft_vocab_size: int = 0           # rows of the LM head
    target_layer_ids: tuple[int, ...] = ()  # HF hidden_states ids (NemotronH capture_layers)
    block_size: int = 8                 # block length the draft was trained with
    mask_token_id: int = 0
    sample_from_anchor: bool = False
    num_speculative_tokens: int | None = None  # the checkpoint's default proposal length
    embedding_rows: int = 0             # rows of the draft's own embed_tokens (0: none)
    has_lm_head: bool = False
    has_d2t: bool = False
    layer_ids_field: str = "aux_hidden_state_layer_ids"  # where the checkpoint names them
    layer_ids_offset: int = 0           # 1 when the checkpoint counts layer outputs (z-lab)
    causal: bool = False                # block row j sees the context and block rows 0..j only
    sliding_window: int | None = None   # Hugging Face's inclusive window (a row sees `window` slots)
    attention_sinks: bool = False       # per-head fp32 sink logits (layers.N.self_attn.attention_sink_bias)

    kind = "dflash"

    @property
    def num_aux(self) -> int:
        return len(self.target_layer_ids)


@dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    """A DSpark draft: the DFlash backbone plus a vanilla Markov head (and a confidence head)."""

    sample_from_anchor: bool = True
    markov_rank: int = 0                # 0: no Markov head (pure DFlash drafting)
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_head_with_markov: bool = False

    kind = "dspark"


@dataclass(frozen=True)
class PEagleConfig(Eagle3Config):
    """A P-EAGLE draft (speculators ``peagle``): EAGLE-3 layers, parallel placeholder rows."""

    mask_token_id: int = 0
    num_speculative_tokens: int | None = None

    kind = "peagle"


FEATURE_CLASSES = {"eagle3": Eagle3Config, "eagle": EagleConfig}
BLOCK_CLASSES = {"dflash": DFlashConfig, "dspark": DSparkConfig, "peagle": PEagleConfig}


def draft_config_from_dict(data: Mapping[str, Any], classes: Mapping[str, type] | None = None):
    """Inverse of ``cfg.to_dict()`` (for an engine directory's config.json); ``classes`` limits the
    kinds accepted (default: every draft kind)."""
    classes = dict(FEATURE_CLASSES, **BLOCK_CLASSES) if classes is None else classes
    data = dict(data)
    kind = data.pop("kind", None)
    cls = classes.get(kind)
    if cls is None:
        raise DraftError(f"draft config: unknown kind {kind!r} (expected one of {', '.join(classes)})")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise DraftError(f"draft config: unknown field {unknown[0]!r} for kind {kind}")
    if data.get("rope_scaling") is not None:
        data["rope_scaling"] = tuple(sorted(data["rope_scaling"].items()))
    for key in ("aux_layer_ids", "target_layer_ids", "verifier_architectures"):
        if data.get(key) is not None:
            data[key] = tuple(data[key])
    return cls(**data)
