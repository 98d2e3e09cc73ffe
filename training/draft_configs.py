"""speculators-format ``config.json`` of each trained draft kind, and where its tensors are stored.

The drafts are written in the layout speculators 0.9 saves (``speculators_model_type``,
``transformer_layer_config``, ``speculators_config``) so vLLM, SGLang and our own loader read them.
The shapes come from the same parser the builder uses, so a written draft always loads.
"""
from __future__ import annotations

from builder import draft_checkpoint, draft_checkpoint_block

DRAFT_LAYER = dict(hidden_act="silu", intermediate_size=512, num_attention_heads=6, num_key_value_heads=2,
                   head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=4096, attention_bias=False,
                   mlp_bias=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                   tie_word_embeddings=False)
EAGLE3_LAYERS = (2, 4, 5)     # vLLM's default for an 8-layer target: (2, L // 2, L - 3)
DFLASH_LAYERS = (1, 4, 7)     # spread over the target, as DFlash drafts read them
NUM_SPECULATIVE_TOKENS = 4
MASK_TOKEN_ID = 0             # <pad>: never in the corpus, so free to mean "to be drafted"
MARKOV_RANK = 32

# speculators' EAGLE-1 class stores its tensors under other names than ours
_EAGLE_STORED = {"fc.": "fusion_fc.", "embedding_norm.": "embedding_layernorm.", "layers.0.": "transformer.",
                 "norm.": "pre_lm_head_layernorm."}


def _common(algorithm: str, tokens: int) -> dict:
    return {"dtype": "bfloat16", "speculators_version": "0.9.0", "speculators_model_type": algorithm,
            "speculators_config": {
                "algorithm": algorithm, "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens,
                                      "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                "verifier": {"architectures": ["NemotronHForCausalLM"], "name_or_path": "nemospec-embedded/target"}}}


def _layer(target, model_type: str, layers: int = 1) -> dict:
    return dict(DRAFT_LAYER, model_type=model_type, hidden_size=target.hidden_size, num_hidden_layers=layers,
                vocab_size=target.vocab_size)


def draft_config(kind: str, target) -> dict:
    """The config.json of a ``kind`` draft for target config ``target`` (builder.config.NemotronHConfig)."""
    if kind == "eagle":
        return {**_common("eagle", NUM_SPECULATIVE_TOKENS), "architectures": ["EagleSpeculator"],
                "transformer_layer_architecture": "LlamaDecoderLayer", "layernorms": True, "fusion_bias": True,
                "transformer_layer_config": _layer(target, "llama")}
    if kind in ("eagle3", "peagle"):
        out = {**_common(kind, NUM_SPECULATIVE_TOKENS),
               "architectures": ["Eagle3DraftModel" if kind == "eagle3" else "PEagleDraftModel"],
               "draft_vocab_size": target.vocab_size, "target_hidden_size": target.hidden_size,
               "eagle_aux_hidden_state_layer_ids": list(EAGLE3_LAYERS), "norm_before_residual": False,
               "norm_before_fc": False, "fc_norm": False, "norm_output": False,
               "transformer_layer_config": _layer(target, "llama")}
        if kind == "peagle":
            out["mask_token_id"] = MASK_TOKEN_ID
        return out
    if kind in ("dflash", "dspark"):
        anchor = kind == "dspark"
        out = {**_common(kind, NUM_SPECULATIVE_TOKENS),
               "architectures": ["DFlashDraftModel" if kind == "dflash" else "DSparkDraftModel"],
               "draft_vocab_size": target.vocab_size, "target_hidden_size": target.hidden_size,
               "aux_hidden_state_layer_ids": list(DFLASH_LAYERS), "mask_token_id": MASK_TOKEN_ID,
               "block_size": NUM_SPECULATIVE_TOKENS + (0 if anchor else 1), "sample_from_anchor": anchor,
               "sliding_window_non_causal": False, "transformer_layer_config": _layer(target, "qwen3", 2)}
        if kind == "dspark":
            out.update(markov_head_type="vanilla", markov_rank=MARKOV_RANK, enable_confidence_head=False,
                       confidence_head_with_markov=False)
        return out
    raise ValueError(f"draft_config: unknown draft kind {kind}")


def draft_shapes(kind: str, config: dict) -> tuple[object, dict]:
    """(parsed draft config, canonical tensor name -> shape) the builder expects for ``config``."""
    if kind in ("eagle", "eagle3"):
        cfg = draft_checkpoint._parse(config, "config.json", set())
        required, _ = draft_checkpoint.draft_tensors(cfg)
    else:
        cfg = draft_checkpoint_block._parse(config, "config.json", set(), {})
        required, _ = draft_checkpoint_block.block_draft_tensors(cfg)
    return cfg, required


def stored_name(kind: str, canonical: str) -> str:
    """The name speculators stores a canonical tensor under."""
    if kind == "eagle":
        for ours, theirs in _EAGLE_STORED.items():
            if canonical.startswith(ours):
                return theirs + canonical[len(ours):]
    return canonical
