"""NemotronH multi-token prediction (MTP) draft: the target checkpoint's own ``mtp.*`` layers.

A row pairs the token at position p+1 with the target's post-final-norm hidden state at position
p (the draft predicts token p+2) and uses position p for its KV slot:

    x = eh_proj(concat(enorm(embed(token)), hnorm(hidden)))
    x = x + mixer_i(norm_i(x))            for each layer of mtp_hybrid_override_pattern
    out = final_layernorm(x)              -> shared LM head; and recycled as the next step's hidden

Recycling the post-norm hidden (not the pre-norm residual stream) is what vLLM PR #47448 fixed.
Embedding and LM head are the target's.
"""
from __future__ import annotations

import torch

from builder import functional as F
from builder.models.nemotron_h import MIXERS, block_state_spec, run_block


class MTPDraft:
    kind = "mtp"

    def __init__(self, cfg, weights: dict, dtype=torch.float32):
        self.cfg, self.dtype, self.hidden_size = cfg, dtype, cfg.hidden_size
        p = "mtp.layers."
        self.embeddings = weights["backbone.embeddings.weight"].to(dtype)
        head = weights.get("lm_head.weight")
        self.lm_head = self.embeddings if head is None else head.to(dtype)
        self.enorm = weights[p + "0.enorm.weight"].to(dtype)
        self.hnorm = weights[p + "0.hnorm.weight"].to(dtype)
        self.eh_proj = weights[p + "0.eh_proj.weight"].to(dtype)
        last = len(cfg.mtp_layer_types) - 1
        self.final_norm = weights[f"{p}{last}.final_layernorm.weight"].to(dtype)
        self.layers = [(kind, weights[f"{p}{i}.norm.weight"].to(dtype), MIXERS[kind](cfg, weights, f"{p}{i}.mixer.", dtype))
                       for i, kind in enumerate(cfg.mtp_layer_types)]

    def state_spec(self, batch, capacity):
        spec = {}
        for i, kind in enumerate(self.cfg.mtp_layer_types):
            spec.update(block_state_spec(self.cfg, kind, f"mtp.{i}.", batch, capacity, self.dtype))
        return spec

    def forward(self, input_ids, hidden, positions, lengths, logit_index, state, visible=None):
        """-> (logits [B, G, V] fp32, hidden_out [B, T, H] post-norm, new state). ``visible``
        [B, T, S]: a tree step, rows written at cache rows ``positions`` (no RoPE here)."""
        eps = self.cfg.layer_norm_epsilon
        e = F.rms_norm(F.embedding(input_ids, self.embeddings), self.enorm, eps)
        x = F.linear(F.concat([e, F.rms_norm(hidden, self.hnorm, eps)], -1), self.eh_proj)
        new_state = {}
        for i, (kind, norm, mixer) in enumerate(self.layers):
            x = x + run_block(kind, mixer, F.rms_norm(x, norm, eps), lengths, positions, state, new_state, f"mtp.{i}.",
                              visible=visible)
        out = F.rms_norm(x, self.final_norm, eps)
        logits = F.to_float32(F.linear(F.gather_rows(out, logit_index), self.lm_head))
        return logits, out, new_state
