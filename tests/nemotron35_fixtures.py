"""Nemotron 3.5 Lightning drafts (``DFlashDraftModel``, ``Qwen3DSparkModel``) written by our own code
in the published key layout (../shared/FORMATS.md), scaled down; optionally NVFP4-packed as ModelOpt
packs them (``hf_quant_config.json`` + ``quantization_config``, ``exclude_modules`` wildcards).

Scaled down: 2 layers, 4 heads x head_dim 16 (q width 64 != hidden), 2 KV heads; yarn with factor 4
over an original context of 16 (DFlash) or plain RoPE (DSpark); the DSpark sliding window is 6 and
its Markov rank 16.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

EXCLUDE = ["*self_attn*", "*embed_tokens*", "*markov_w1*", "lm_head", "*norm*"]


def draft_config(kind: str, hidden: int, vocab: int, target_layers, *, mask: int = 3, window: int = 6,
                 rank: int = 16, layers: int = 2, heads: int = 4, head_dim: int = 16) -> dict:
    """config.json of a Nemotron 3.5 draft (``target_layers``: target layer OUTPUT ids)."""
    target_layers = list(target_layers)
    aux = [i + 1 for i in target_layers]
    dspark = kind == "dspark"
    dflash_config = {"causal": dspark, "use_swa": dspark, "attention_sink_bias": dspark,
                     "target_layer_ids": target_layers, "eagle_aux_hidden_state_layer_ids": aux,
                     "mask_token_id": mask, "sample_from_anchor": False}
    if dspark:
        dflash_config["swa_window_size"] = window
    config = {
        "architectures": ["Qwen3DSparkModel" if dspark else "DFlashDraftModel"], "model_type": "qwen3",
        "num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_attention_heads": heads, "num_key_value_heads": 2, "head_dim": head_dim, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "vocab_size": vocab, "max_position_embeddings": 1048576, "mask_token_id": mask,
        "pard_token": mask, "target_layer_ids": target_layers, "eagle_aux_hidden_state_layer_ids": aux,
        "num_aux_layers": len(aux), "has_embed_tokens": True, "has_lm_head": False, "train_embed_tokens": False,
        "draft_vocab_size": None, "sample_from_anchor": False, "dflash_config": dflash_config,
        "tie_word_embeddings": False, "attention_bias": False, "dtype": "bfloat16",
    }
    if dspark:
        config.update({"block_size": 8, "sliding_window": window, "layer_types": ["sliding_attention"] * layers,
                       "rope_parameters": None, "rope_theta": 10000.0, "dspark_bonus_anchor": True,
                       "dspark_fixup_head_type": "markov", "markov_head_type": "vanilla", "markov_rank": rank,
                       "dspark_markov_rank": rank})
    else:
        config.update({"layer_types": ["full_attention"] * layers,
                       "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                           "rope_theta": 10000.0}})
    return config


def draft_weights(config: dict, target_hidden: int, seed: int = 0) -> dict:
    """Canonical name -> fp32 random tensor (norms away from 1, sinks of both signs)."""
    g = torch.Generator().manual_seed(seed)
    H, V, L = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    D, heads, kv, inter = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"], \
        config["intermediate_size"]
    width = len(config["target_layer_ids"]) * target_hidden

    def rand(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    def norm(n):
        return 1 + 0.2 * torch.randn(n, generator=g)
    w = {"embed_tokens.weight": torch.randn(V, H, generator=g), "fc.weight": rand(H, width),
         "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(L):
        p = f"layers.{i}."
        w.update({p + "self_attn.q_proj.weight": rand(heads * D, H), p + "self_attn.k_proj.weight": rand(kv * D, H),
                  p + "self_attn.v_proj.weight": rand(kv * D, H), p + "self_attn.o_proj.weight": rand(H, heads * D),
                  p + "self_attn.q_norm.weight": norm(D), p + "self_attn.k_norm.weight": norm(D),
                  p + "mlp.gate_proj.weight": rand(inter, H), p + "mlp.up_proj.weight": rand(inter, H),
                  p + "mlp.down_proj.weight": rand(H, inter), p + "input_layernorm.weight": norm(H),
                  p + "post_attention_layernorm.weight": norm(H)})
        if config["dflash_config"]["attention_sink_bias"]:
            w[p + "self_attn.attention_sink_bias"] = torch.randn(heads, generator=g)
    if config["architectures"] == ["Qwen3DSparkModel"]:
        r = config["markov_rank"]
        w["markov_head.markov_w1.weight"] = torch.randn(V, r, generator=g) * 0.5
        w["markov_head.markov_w2.weight"] = rand(V, r)
    return w


def stored_names(config: dict, weights: dict) -> dict:
    """Canonical -> stored names as shipped: a ``model.`` prefix, and (DSpark) the ``encoder.`` aliases."""
    dspark = config["architectures"] == ["Qwen3DSparkModel"]
    out = {}
    for name, t in weights.items():
        if dspark and name.startswith("fc."):
            name = "encoder." + name
        elif dspark and name.startswith("hidden_norm."):
            name = "encoder.output_norm_enc." + name[len("hidden_norm."):]
        out[name if dspark else "model." + name] = t
    return out


def write(directory: Path, config: dict, weights: dict, quantize: bool = False, dtype=torch.bfloat16) -> Path:
    """The checkpoint directory; with ``quantize`` the linear weights outside EXCLUDE are NVFP4."""
    from builder.quantization import HF_QUANT_CONFIG, QUANT_ALGO, QuantConfig, quantize_tensors
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.to(dtype) if "attention_sink_bias" not in n else t.float() for n, t in weights.items()}
    config = dict(config)
    if quantize:
        import fnmatch
        qc = QuantConfig(QUANT_ALGO, 16, tuple(EXCLUDE))
        names = [n for n, t in tensors.items() if n.endswith(".weight") and t.dim() == 2
                 and not any(fnmatch.fnmatchcase(n[:-len(".weight")], p) for p in EXCLUDE)]
        tensors = quantize_tensors({n: (t.float() if n in names else t) for n, t in tensors.items()}, names)
        config["quantization_config"] = qc.quantization_config()
        (directory / HF_QUANT_CONFIG).write_text(json.dumps(qc.hf_quant_config(), indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file({n: t.contiguous() for n, t in stored_names(config, tensors).items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
