"""Canonical tensor names and shapes of each draft module (what a layout must provide).

``draft_tensors(cfg)`` gives (required, optional) canonical name -> shape for any draft config of
``builder.models.draft_configs``. Canonical decoder-layer names: ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``
(+ ``.bias`` with ``attention_bias``), ``layers.{i}.self_attn.{q,k}_norm.weight`` (qwen3),
``layers.{i}.mlp.{gate,up,down}_proj.weight`` (+ ``.bias`` with ``mlp_bias``),
``layers.{i}.input_layernorm.weight``, ``layers.{i}.post_attention_layernorm.weight``, EAGLE-3
``layers.0.hidden_norm.weight``.
"""
from __future__ import annotations

from builder.models.draft_configs import DFlashConfig, DSparkConfig, Eagle3Config, PEagleConfig

Shape = tuple[int, ...]


def fmt(shape: Shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def layer_tensors(cfg, i: int, in_size: int, qk_norm: bool) -> dict[str, Shape]:
    """One decoder layer's tensors; ``in_size`` is the width q/k/v project from."""
    H, D = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    p = f"layers.{i}."
    t: dict[str, Shape] = {}
    for name, out, inp in (("q", q, in_size), ("k", kv, in_size), ("v", kv, in_size), ("o", H, q)):
        t[f"{p}self_attn.{name}_proj.weight"] = (out, inp)
        if cfg.attention_bias:
            t[f"{p}self_attn.{name}_proj.bias"] = (out,)
    if qk_norm:
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


def draft_tensors(cfg) -> tuple[dict[str, Shape], dict[str, Shape]]:
    """(required, optional) canonical tensor name -> shape of a draft checkpoint."""
    if isinstance(cfg, PEagleConfig):
        required, optional = _eagle3_tensors(cfg)
        required["mask_hidden"] = (1, 1, cfg.num_aux * cfg.target_hidden_size)
        return required, optional
    if isinstance(cfg, Eagle3Config):
        return _eagle3_tensors(cfg)
    if isinstance(cfg, DFlashConfig):
        return _dflash_tensors(cfg)
    H = cfg.hidden_size
    required: dict[str, Shape] = {"fc.weight": (H, 2 * H)}
    optional: dict[str, Shape] = {}
    if cfg.fc_bias:
        required["fc.bias"] = (H,)
    if cfg.embedding_norm:
        required["embedding_norm.weight"] = (H,)
    for i in range(cfg.num_hidden_layers):
        required.update(layer_tensors(cfg, i, H, cfg.qk_norm))
    if not cfg.first_input_norm:
        del required["layers.0.input_layernorm.weight"]
    if cfg.final_norm:
        required["norm.weight"] = (H,)
    optional["embed_tokens.weight"] = (cfg.vocab_size, H)
    optional["lm_head.weight"] = (cfg.vocab_size, H)
    return required, optional


def _eagle3_tensors(cfg: Eagle3Config) -> tuple[dict[str, Shape], dict[str, Shape]]:
    H = cfg.hidden_size
    width = cfg.num_aux * cfg.target_hidden_size
    required: dict[str, Shape] = {"fc.weight": (H, width)}
    optional: dict[str, Shape] = {}
    if cfg.norm_before_fc:
        required["input_norm.weight"] = (width,)
    if cfg.fc_norm:
        for i in range(cfg.num_aux):
            required[f"fc_norm.{i}.weight"] = (cfg.target_hidden_size,)
    for i in range(cfg.num_hidden_layers):
        required.update(layer_tensors(cfg, i, 2 * H if i == 0 else H, cfg.qk_norm))
    required["layers.0.hidden_norm.weight"] = (H,)
    required["norm.weight"] = (H,)
    required["lm_head.weight"] = (cfg.draft_vocab_size, H)
    if cfg.draft_vocab_size != cfg.target_vocab_size:
        required["d2t"] = (cfg.draft_vocab_size,)
    else:
        optional["d2t"] = (cfg.draft_vocab_size,)
    optional["embed_tokens.weight"] = (cfg.target_vocab_size, H)
    return required, optional


def _dflash_tensors(cfg: DFlashConfig) -> tuple[dict[str, Shape], dict[str, Shape]]:
    H = cfg.hidden_size
    required: dict[str, Shape] = {"fc.weight": (H, cfg.num_aux * cfg.target_hidden_size),
                                  "hidden_norm.weight": (H,), "norm.weight": (H,)}
    optional: dict[str, Shape] = {}
    for i in range(cfg.num_hidden_layers):
        required.update(layer_tensors(cfg, i, H, qk_norm=True))  # DFlash attention always has q/k norms
        if cfg.attention_sinks:
            required[f"layers.{i}.self_attn.attention_sink_bias"] = (cfg.num_attention_heads,)
    head = (cfg.draft_vocab_size, H)
    if cfg.draft_vocab_size != cfg.target_vocab_size:
        required["lm_head.weight"] = head
        required["d2t"] = (cfg.draft_vocab_size,)
    else:
        optional["lm_head.weight"] = head
        optional["d2t"] = (cfg.draft_vocab_size,)
    optional["embed_tokens.weight"] = (cfg.embedding_rows or cfg.target_vocab_size, H)
    if isinstance(cfg, DSparkConfig):
        r = cfg.markov_rank
        if r > 0:
            required["markov_head.markov_w1.weight"] = (cfg.target_vocab_size, r)
            required["markov_head.markov_w2.weight"] = (cfg.draft_vocab_size, r)
        if cfg.confidence_head:
            width = H + (r if cfg.confidence_head_with_markov else 0)
            required["confidence_head.proj.weight"] = (1, width)
            required["confidence_head.proj.bias"] = (1,)
    return required, optional

