"""Tiny random NemotronH checkpoints written by ``transformers`` (the reference) for tests.

Every ``make_*`` function builds ``transformers.NemotronHForCausalLM`` from a tiny fp32 config with a
fixed seed, re-initialises its weights so the model is not degenerate (transformers' std 0.02 init
gives nearly flat logits), and writes it with ``save_pretrained``. All configs have GQA
(num_key_value_heads < num_attention_heads) and ``time_step_min = 0.0`` (transformers clamps dt at
``time_step_min`` in its prefill path only; with 0.0 prefill and decode agree).

``tiny_checkpoint(kind, tmp_path_factory)`` caches one directory per (kind, options) per session.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable


from builder import random_checkpoint

__all__ = [
    "KINDS",
    "DENSE",
    "MOE",
    "TWO_ATTENTION",
    "make_dense",
    "make_moe",
    "make_two_attention",
    "make_sharded",
    "make_checkpoint",
    "tiny_checkpoint",
]

# Shared tiny Mamba-2 / attention settings.
_COMMON: dict[str, Any] = dict(
    conv_kernel=4,
    chunk_size=8,
    n_groups=2,
    mamba_head_dim=8,
    num_attention_heads=4,
    layer_norm_epsilon=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# Config kwargs (transformers.NemotronHConfig) of each kind, without time_step_min (set to 0.0 after init).
DENSE: dict[str, Any] = dict(
    _COMMON,
    hybrid_override_pattern="M-M*-M-",
    vocab_size=128,
    hidden_size=64,
    num_key_value_heads=2,  # GQA ratio 2
    head_dim=16,
    intermediate_size=128,
    mamba_num_heads=8,
    ssm_state_size=16,
)
MOE: dict[str, Any] = dict(
    _COMMON,
    hybrid_override_pattern="ME*EM-",
    vocab_size=96,
    hidden_size=32,
    num_key_value_heads=2,  # GQA ratio 2
    head_dim=8,
    intermediate_size=64,
    mamba_num_heads=4,
    ssm_state_size=8,
    n_routed_experts=8,
    n_shared_experts=1,
    moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=32,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=1.0,
)
TWO_ATTENTION: dict[str, Any] = dict(
    _COMMON,
    hybrid_override_pattern="M*M-*M",
    vocab_size=112,
    hidden_size=48,
    num_key_value_heads=1,  # GQA ratio 4
    head_dim=12,
    intermediate_size=96,
    mamba_num_heads=6,
    ssm_state_size=8,
)


def build_model(kwargs: dict[str, Any], seed: int, tie_word_embeddings: bool = False, **overrides: Any):
    """A transformers NemotronHForCausalLM (fp32, eval mode) with non-degenerate random weights."""
    return random_checkpoint.build_model({**kwargs, **overrides}, seed, tie_word_embeddings)


def make_checkpoint(directory: str | Path, kwargs: dict[str, Any], seed: int, tie_word_embeddings: bool = False,
                    max_shard_size: int | str | None = None, **overrides: Any) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = build_model(kwargs, seed, tie_word_embeddings, **overrides)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(directory), **save_kwargs)
    return directory


def make_dense(directory: str | Path, tie_word_embeddings: bool = False, **overrides: Any) -> Path:
    """Mamba + MLP + one attention layer: pattern "M-M*-M-", GQA 4:2."""
    return make_checkpoint(directory, DENSE, 0, tie_word_embeddings, **overrides)


def make_moe(directory: str | Path, tie_word_embeddings: bool = False, **overrides: Any) -> Path:
    """Two MoE layers (8 routed experts, top-2, one shared expert): pattern "ME*EM-", GQA 4:2."""
    return make_checkpoint(directory, MOE, 1, tie_word_embeddings, **overrides)


def make_two_attention(directory: str | Path, tie_word_embeddings: bool = False, **overrides: Any) -> Path:
    """Two attention layers with GQA 4:1: pattern "M*M-*M"."""
    return make_checkpoint(directory, TWO_ATTENTION, 2, tie_word_embeddings, **overrides)


def make_sharded(directory: str | Path, tie_word_embeddings: bool = False, **overrides: Any) -> Path:
    """The dense model (same weights as make_dense) written as exactly 2 shards + index."""
    model = build_model(DENSE, 0, tie_word_embeddings, **overrides)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), max_shard_size=int(total * 0.6))
    shards = sorted(directory.glob("model-*.safetensors"))
    if len(shards) != 2:
        raise AssertionError(f"make_sharded: expected 2 shards, got {[s.name for s in shards]}")
    return directory


KINDS: dict[str, Callable[..., Path]] = {
    "dense": make_dense,
    "moe": make_moe,
    "two_attention": make_two_attention,
    "sharded": make_sharded,
}

_CACHE: dict[tuple, Path] = {}


def tiny_checkpoint(kind: str, tmp_path_factory: Any, tie_word_embeddings: bool = False,
                    **overrides: Any) -> Path:
    """Directory of a tiny checkpoint of ``kind`` (see KINDS), written once per session and options.

    ``tmp_path_factory`` is pytest's session fixture. Treat the directory as read-only; copy it
    before modifying files.
    """
    key = (kind, tie_word_embeddings, repr(sorted(overrides.items())))
    path = _CACHE.get(key)
    if path is None or not path.is_dir():
        name = f"tiny_{kind}" + ("_tied" if tie_word_embeddings else "") + ("_custom" if overrides else "")
        path = KINDS[kind](tmp_path_factory.mktemp(name), tie_word_embeddings, **overrides)
        _CACHE[key] = path
    return path
