"""EAGLE-1/2 (and HASS) draft: the original EAGLE (SafeAILab ``cnets.py``), SGLang's
``LlamaForCausalLMEagle``, vLLM's ``llama_eagle`` and speculators' ``eagle`` type.

Written once against ``builder.functional``; weights bound at construction; KV cache as state.

Network, for one chunk of rows::

    e = embed_tokens[input_ids]          (the draft's own table, else the target's)
    e = embedding_norm(e)                (speculators ``layernorms``: embedding_layernorm)
    x = fc(concat(e, hidden))            2H -> H, bias when the checkpoint has one
    N Llama decoder layers; layer 0 skips its input RMSNorm (as the original EAGLE does) unless the
    checkpoint ships one (speculators ``layernorms``)
    hidden_out = x                       (before any final norm), or norm(x) with ``norm_hidden_out``
                                         (vLLM's EagleMistralForCausalLM returns its normed hidden twice)
    logits     = lm_head(norm(x))        at rows logit_index; ``norm`` only when the checkpoint has
                                         one (speculators ``pre_lm_head_layernorm``); the LM head is
                                         the draft's own if shipped, else the target's

``hidden`` is the target's final hidden state after its final norm (the input of its LM head) for
rows that come from the target, and the draft's own ``hidden_out`` for draft steps (the original
EAGLE, SGLang and vLLM all feed the draft's output hidden back).

Row convention: as EAGLE-3 (see ``builder/models/eagle3.py``): row p pairs the target feature of
position p with the token at position p + 1, uses position p for RoPE and writes KV slot p; draft
step j of a chain ending at row n-1 uses position n - 1 + j.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from builder import functional as F
from builder.models.draft_layers import DecoderLayer, bind, kv_state_spec

if TYPE_CHECKING:
    from builder.models.draft_configs import EagleConfig


class EagleDraft:
    kind = "eagle"

    def __init__(self, cfg: "EagleConfig", weights: dict, target_embedding, target_lm_head, dtype=torch.float32):
        self.cfg, self.dtype = cfg, dtype
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.d2t = None
        own = weights.get("embed_tokens.weight")
        table = own if own is not None else target_embedding
        head = weights.get("lm_head.weight")
        head = head if head is not None else target_lm_head
        if table is None or head is None:
            raise ValueError("EagleDraft: pass the target's embedding and LM head (the draft ships "
                             f"{'no embedding' if table is None else 'no LM head'})")
        self.embedding, self.lm_head = table.to(dtype), head.to(dtype)
        self.embedding_norm = bind(weights, "embedding_norm.weight", dtype) if cfg.embedding_norm else None
        self.fc, self.fc_bias = weights["fc.weight"].to(dtype), bind(weights, "fc.bias", dtype)
        self.layers = [DecoderLayer(cfg, weights, i, dtype, input_norm=i > 0 or cfg.first_input_norm)
                       for i in range(cfg.num_hidden_layers)]
        self.norm = weights["norm.weight"].to(dtype) if cfg.final_norm else None

    def state_spec(self, batch: int, capacity: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """KV cache per draft layer: ``layers.{i}.key_cache`` / ``value_cache`` [batch, capacity, Hkv, D]."""
        return kv_state_spec(self.cfg, batch, capacity, self.dtype)

    def forward(self, input_ids, hidden, positions, lengths, logit_index, state: dict, tree=None):
        """input_ids [B, T] int32; hidden [B, T, H] (target feature or recycled hidden_out);
        positions [B, T] int32; lengths [B] int32; logit_index [B, G] int32; ``tree`` (slots,
        visible): a tree step (``draft_layers``).

        Returns (logits [B, G, V] fp32, hidden_out [B, T, H] (zero at padding), new state).
        """
        c = self.cfg
        e = F.embedding(input_ids, self.embedding)
        if self.embedding_norm is not None:
            e = F.rms_norm(e, self.embedding_norm, c.rms_norm_eps)
        x = F.linear(F.concat([e, hidden]), self.fc, self.fc_bias)
        new_state = {}
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            x, new_state[p + "key_cache"], new_state[p + "value_cache"] = layer(
                x, state[p + "key_cache"], state[p + "value_cache"], positions, tree)
        if c.norm_hidden_out:
            x = F.rms_norm(x, self.norm, c.rms_norm_eps)
        rows = F.gather_rows(x, logit_index)
        if self.norm is not None and not c.norm_hidden_out:
            rows = F.rms_norm(rows, self.norm, c.rms_norm_eps)
        return F.to_float32(F.linear(rows, self.lm_head)), F.mask_padding(x, lengths), new_state
