"""EAGLE-3 draft, as speculators 0.9.0 (``Eagle3DraftModel``) and vLLM (``llama_eagle3``) define it.

Written once against ``builder.functional`` (runs eagerly, records TensorRT networks); weights are
bound at construction; the KV cache is explicit state.

Network, for one chunk of rows::

    e      = embed_tokens[input_ids]                 (the draft's own table, else the target's)
    f      = fc(aux)                                 aux = concat of k target hidden states [.., k*Ht]
                                                     (optionally RMSNorm'd first: norm_before_fc /
                                                     fc_norm)
    h      = f where from_target == 1, else hidden   (hidden: the draft's own previous hidden_out)
    # layer 0 (attention input is 2H wide)
    res    = h                   (hidden_norm(h) with norm_before_residual)
    x      = res + o_proj(attn(concat(input_layernorm(e), hidden_norm(h))))    q/k/v: 2H -> heads
    x      = x + mlp(post_attention_layernorm(x))
    # layers 1.. : ordinary pre-norm decoder layers over x
    hidden_out = x               (norm(x) with norm_output)
    logits     = lm_head(norm(x)) at rows logit_index  (lm_head(hidden_out) with norm_output)

``hidden_out`` is what the next draft step takes as ``hidden`` (speculators
``Eagle3DraftModel.forward`` feeds the decoder output back across TTT steps without fc; vLLM's
``llama_eagle3.LlamaModel.forward`` returns ``(norm(x), x)`` and the proposer recycles the second,
the pre-norm x). Logits are over the draft vocabulary; ``d2t`` maps a draft id to a target id:
``target_id = draft_id + d2t[draft_id]``.

Row convention (vLLM's EAGLE proposer: draft ``input_ids`` = target ids shifted left by one,
draft positions = target positions). The target has run tokens x_0 .. x_{n-1}, producing features
g_p (the aux hidden states captured while it processed x_p) and the next token x_n:

* catch-up (prefill) row p, for p = 0 .. n-1: ``input_ids = x_{p+1}``, ``aux = g_p``,
  ``from_target = 1``, ``positions = p``; it writes KV slot p and its logits predict x_{p+2}. The
  last row (x_n, g_{n-1}, position n-1) gives the first draft token d_1.
* draft step j = 1, 2, ... (a chain): ``input_ids = d_j``, ``hidden = hidden_out`` of the previous
  row of the chain (row n-1 for j = 1), ``from_target = 0``, ``positions = n - 1 + j``; it writes
  KV slot n - 1 + j and its logits give d_{j+1}.
* after verification the target has features for positions n, n+1, ...; they are fed as catch-up
  rows continuing at position n (pairing g_p with the token at p + 1), overwriting the KV slots
  the draft steps wrote. Slots past a row's position are never read (the attention mask is
  ``slot <= position``), so rejected draft rows need no rollback.

speculators' trainer pairs the same (g_p, x_{p+1}) but gives that row position p + 1
(``shift_batch`` drops position 0). RoPE makes attention depend on position differences only, so the
two conventions give the same outputs up to rounding; we follow vLLM.

Aux layer ids follow Hugging Face ``hidden_states`` indexing: id i is the hidden state entering
target layer i (0 = embeddings, L = the output of the last layer, before the final norm). ``aux``
concatenates them in ascending layer order (``aux_layer_ids`` is sorted), as vLLM captures them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from builder import functional as F
from builder.models.draft_layers import DecoderLayer, DraftAttention, GatedMLP, bind, kv_state_spec

if TYPE_CHECKING:
    from builder.models.draft_configs import Eagle3Config


class Eagle3Draft:
    kind = "eagle3"

    def __init__(self, cfg: "Eagle3Config", weights: dict, target_embedding, dtype=torch.float32):
        if cfg.aux_layer_ids is None:
            raise ValueError("Eagle3Draft: cfg.aux_layer_ids is unresolved; pass the config through "
                             "builder.draft_checkpoint.validate_against_target first")
        self.cfg, self.dtype = cfg, dtype
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.draft_vocab_size
        self.target_vocab_size = cfg.target_vocab_size
        self.aux_layer_ids = tuple(cfg.aux_layer_ids)
        own = weights.get("embed_tokens.weight")
        table = own if own is not None else target_embedding
        if table is None:
            raise ValueError("Eagle3Draft: the draft ships no embed_tokens.weight; pass the target's embedding")
        self.embedding = table.to(dtype)
        d2t = weights.get("d2t")
        self.d2t = None if d2t is None or (cfg.draft_vocab_size == cfg.target_vocab_size and not d2t.any()) \
            else d2t.long()
        eps = cfg.rms_norm_eps
        self.eps = eps
        self.fc = weights["fc.weight"].to(dtype)
        self.input_norm = bind(weights, "input_norm.weight", dtype) if cfg.norm_before_fc else None
        self.fc_norms = [weights[f"fc_norm.{i}.weight"].to(dtype) for i in range(cfg.num_aux)] if cfg.fc_norm else None
        p = "layers.0."
        self.embed_norm = weights[p + "input_layernorm.weight"].to(dtype)
        self.hidden_norm = weights[p + "hidden_norm.weight"].to(dtype)
        self.post_norm = weights[p + "post_attention_layernorm.weight"].to(dtype)
        self.attn = DraftAttention(cfg, weights, p + "self_attn.", dtype)
        self.mlp = GatedMLP(cfg, weights, p + "mlp.", dtype)
        self.layers = [DecoderLayer(cfg, weights, i, dtype) for i in range(1, cfg.num_hidden_layers)]
        self.norm = weights["norm.weight"].to(dtype)
        self.lm_head = weights["lm_head.weight"].to(dtype)

    @property
    def aux_width(self) -> int:
        return len(self.aux_layer_ids) * self.cfg.target_hidden_size

    def state_spec(self, batch: int, capacity: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """KV cache per draft layer: ``layers.{i}.key_cache`` / ``value_cache`` [batch, capacity, Hkv, D]."""
        return kv_state_spec(self.cfg, batch, capacity, self.dtype)

    def forward(self, input_ids, aux, hidden, from_target, positions, lengths, logit_index, state: dict, tree=None):
        """input_ids [B, T] int32; aux [B, T, k*Ht] target features; hidden [B, T, H] recycled
        hidden; from_target [B, T] int32 (1: use fc(aux), 0: use hidden); positions [B, T] int32;
        lengths [B] int32 (right padding); logit_index [B, G] int32.

        ``tree`` (slots, visible): a tree step over recycled hidden only (``draft_layers``; aux and
        from_target are then unused).

        Returns (logits [B, G, draft_vocab] fp32, hidden_out [B, T, H] (zero at padding), new state).
        """
        h = hidden if tree is not None else F.where(F.reshape(from_target, [0, 0, 1]), self.fused_features(aux), hidden)
        logits, x, new_state = self.decode(input_ids, h, positions, logit_index, state, tree)
        return logits, F.mask_padding(x, lengths), new_state

    def fused_features(self, aux):
        """fc over the (optionally normed) concatenated target features: [.., k*Ht] -> [.., H]."""
        c, eps, a = self.cfg, self.eps, aux
        if self.input_norm is not None:
            a = F.rms_norm(a, self.input_norm, eps)
        if self.fc_norms is not None:
            parts = F.split(a, [c.target_hidden_size] * len(self.fc_norms))
            a = F.concat([F.rms_norm(x, w, eps) for x, w in zip(parts, self.fc_norms)])
        return F.linear(a, self.fc)

    def decode(self, input_ids, h, positions, logit_index, state: dict, tree=None):
        """The decoder over rows (token, hidden h): (logits at logit_index fp32, hidden_out, new state)."""
        c, eps = self.cfg, self.eps
        new_state = {}
        e = F.rms_norm(F.embedding(input_ids, self.embedding), self.embed_norm, eps)
        hn = F.rms_norm(h, self.hidden_norm, eps)
        residual = hn if c.norm_before_residual else h
        y, new_state["layers.0.key_cache"], new_state["layers.0.value_cache"] = self.attn(
            F.concat([e, hn]), state["layers.0.key_cache"], state["layers.0.value_cache"], positions, tree)
        x = residual + y
        x = x + self.mlp(F.rms_norm(x, self.post_norm, eps))
        for i, layer in enumerate(self.layers, start=1):
            p = f"layers.{i}."
            x, new_state[p + "key_cache"], new_state[p + "value_cache"] = layer(
                x, state[p + "key_cache"], state[p + "value_cache"], positions, tree)
        if c.norm_output:
            x = F.rms_norm(x, self.norm, eps)
            rows = F.gather_rows(x, logit_index)
        else:
            rows = F.rms_norm(F.gather_rows(x, logit_index), self.norm, eps)
        return F.to_float32(F.linear(rows, self.lm_head)), x, new_state
