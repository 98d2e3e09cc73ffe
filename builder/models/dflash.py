"""DFlash block-diffusion draft, as speculators 0.9.0 (``DFlashDraftModel``) and vLLM
(``qwen3_dflash`` + ``v1/spec_decode/dflash.py``) define it.

Written once against ``builder.functional`` (runs eagerly, records TensorRT networks); weights are
bound at construction; the KV cache is explicit state.

What the draft reads
--------------------
``aux`` = the target's hidden states entering layers ``target_layer_ids`` (HF ``hidden_states``
ids, ascending), concatenated per token: exactly what ``NemotronH(capture_layers=target_layer_ids)``
returns as ``features["aux_hidden"]`` — pass ``module.target_layer_ids`` straight through.
(speculators' ``aux_hidden_state_layer_ids`` already use this convention; z-lab / DeepSpec
checkpoints list layer OUTPUTS, ``dflash_config.target_layer_ids`` = ids - 1, and
``builder.draft_checkpoint_block`` adds 1 when it reads them, as vLLM does.) The aux row of
position p is the target's feature of token x_p itself (no shift, unlike EAGLE-3).

Network
-------
Context rows (positions p, features g_p)::

    c        = hidden_norm(fc(aux))                              [B, Tc, H]
    per layer i:  K_i = rope(k_norm(k_proj_i(c)), p),  V_i = v_proj_i(c)  -> KV cache slot p

The context never goes through the decoder layers: each layer's K/V of slot p is a function of
g_p only (speculators ``Qwen3DFlashAttention`` concatenates ``k_proj(target_hidden)`` in front of
the block's keys; vLLM ``precompute_and_store_context_kv`` writes them into the cache), so they are
computed once and kept across steps.

Block rows (the anchor = the last accepted token x_a at position a, then mask tokens at a+1, ...)::

    x = embed[input_ids]                     (the draft's embed_tokens, else the target's)
    per layer: Qwen3 pre-norm layer; q/k per-head RMSNorm then RoPE at the row's position; the
               block's K/V are written to slots a .. a+L-1; every block row attends to slots
               0 .. a+L-1 = all context before the anchor + the whole block (bidirectional)
    logits = lm_head(norm(x))                (the draft's lm_head, else the target's)

This is speculators' ``create_anchor_block_mask_mod``: block queries see base tokens at positions
< anchor and every row of their own block; vLLM's DFlash proposer runs the same non-causal query
block over ``seq_len = context + 1 + K``. Slots < a must hold context; slots >= a+L are never read.

Nemotron 3.5 DSpark variants (``cfg.causal``, ``cfg.sliding_window``, ``cfg.attention_sinks``): a
causal block (row j sees the context and block rows 0..j: limit = its own position), a sliding
window over the cache (a row at position p sees slots p - window + 1 .. p, Hugging Face's inclusive
window), and one fp32 sink logit per head in the softmax denominator (GPT-OSS sinks).

Which rows are drafts (``sample_from_anchor``)
----------------------------------------------
* false (speculators' DFlash default, vLLM): the block is the anchor + K mask rows (L = K+1); row
  j >= 1 predicts x_{a+j}; row 0 (the anchor) is dropped -> ``logit_index = [1 .. K]``.
* true (DSpark default): the block is the anchor + K-1 mask rows (L = K); row j predicts
  x_{a+j+1} -> ``logit_index = [0 .. K-1]``.
``block_rows(K)`` and ``first_draft_row`` encode this.

Module contract (what the loop drives)
--------------------------------------
``DFlashDraft(cfg, weights, target_embedding=None, target_lm_head=None, dtype=torch.float32)``
with ``kind = "dflash"``, ``target_layer_ids``, ``aux_width`` (= len(ids) * target hidden),
``block_size`` (trained block length), ``hidden_size``, ``vocab_size`` (draft vocabulary),
``target_vocab_size``, ``d2t`` (LongTensor [Vd] or None; target id = draft id + d2t[draft id]),
``mask_token_id``, ``sample_from_anchor``, ``first_draft_row``, ``num_speculative_tokens``.

* ``state_spec(batch, capacity)`` -> ``layers.{i}.key_cache`` / ``value_cache``
  [batch, capacity, Hkv, D] (capacity >= max position + block rows).
* ``append_context(aux, positions, lengths, state) -> new_state``: writes context rows (chunk
  [B, Tc, k*Ht] with their absolute positions, right padded by ``lengths``).
* ``block(input_ids, positions, lengths, logit_index, state) -> (logits [B, G, Vd] fp32,
  new_state)``: one block forward from the anchor. ``input_ids`` [B, L] = anchor then
  ``mask_token_id``s (``block_inputs`` builds them), ``positions`` = anchor position + 0..L-1,
  ``lengths`` [B] valid block rows (normally L for all), ``logit_index`` [B, G] block rows to return.
* ``forward(aux, context_positions, context_lengths, input_ids, positions, lengths, logit_index,
  state) -> (logits, new_state)``: both in one call (what vLLM does each step: the verified rows'
  features become context, then the block runs). This is the draft engine's network.

Padding rows of a context chunk are written at their (continued) positions, which must be >= the
sequence's anchor position: those slots are either overwritten by the block (written after the
context) or lie beyond a+L-1 and are never read. ``runtime.state.chunk_inputs``-style positions
(start + t) satisfy this.

State and rollback
------------------
After a verify that accepted m of K drafts (the target scored [x_a, d_1 .. d_K]): the target's
features of positions a .. a+m become context rows (append at positions a .. a+m, overwriting the
block's rows there), and the new anchor is the bonus token at a+m+1. Nothing is rolled back: slots
past the new anchor are never read before the next block overwrites them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from builder import functional as F
from builder.models.draft_layers import bind

if TYPE_CHECKING:
    from builder.models.draft_configs import DFlashConfig


class DFlashLayer:
    """One Qwen3 DFlash decoder layer (per-head q/k RMSNorm; context K/V from the target features)."""

    def __init__(self, cfg: "DFlashConfig", w: dict, i: int, dtype):
        p = f"layers.{i}."
        a = p + "self_attn."
        self.cfg = cfg
        self.q, self.k, self.v, self.o = (w[f"{a}{n}_proj.weight"].to(dtype) for n in "qkvo")
        self.q_bias, self.k_bias, self.v_bias, self.o_bias = (bind(w, f"{a}{n}_proj.bias", dtype) for n in "qkvo")
        self.q_norm = w[a + "q_norm.weight"].to(dtype)
        self.k_norm = w[a + "k_norm.weight"].to(dtype)
        sinks = w.get(a + "attention_sink_bias") if cfg.attention_sinks else None
        self.sinks = None if sinks is None else sinks.float()  # fp32 whatever the dtype
        self.input_norm = w[p + "input_layernorm.weight"].to(dtype)
        self.post_norm = w[p + "post_attention_layernorm.weight"].to(dtype)
        m = p + "mlp."
        self.gate, self.up, self.down = (w[f"{m}{n}_proj.weight"].to(dtype) for n in ("gate", "up", "down"))
        self.gate_bias, self.up_bias, self.down_bias = (bind(w, f"{m}{n}_proj.bias", dtype)
                                                        for n in ("gate", "up", "down"))
        self.scaling = cfg.rope_scaling_dict

    def _rope(self, x, positions):
        c = self.cfg
        return F.rope(x, positions, c.rope_theta, c.rotary_dim, self.scaling)

    def _kv(self, h, positions):
        c = self.cfg
        k = F.reshape(F.linear(h, self.k, self.k_bias), [0, 0, c.num_key_value_heads, c.head_dim])
        v = F.reshape(F.linear(h, self.v, self.v_bias), [0, 0, c.num_key_value_heads, c.head_dim])
        return self._rope(F.rms_norm(k, self.k_norm, c.rms_norm_eps), positions), v

    def context(self, c, positions, key_cache, value_cache):
        """Write the K/V of context rows ``c`` (= hidden_norm(fc(aux))) at ``positions``."""
        k, v = self._kv(c, positions)
        return F.kv_cache_update(key_cache, k, positions), F.kv_cache_update(value_cache, v, positions)

    def __call__(self, x, positions, limit, key_cache, value_cache):
        """Block rows: write their K/V at ``positions``; each row sees slots <= ``limit`` [B, L] (and,
        with a sliding window, the last ``sliding_window`` slots up to its limit only; sinks join the
        softmax denominator)."""
        c = self.cfg
        h = F.rms_norm(x, self.input_norm, c.rms_norm_eps)
        q = F.reshape(F.linear(h, self.q, self.q_bias), [0, 0, c.num_attention_heads, c.head_dim])
        q = self._rope(F.rms_norm(q, self.q_norm, c.rms_norm_eps), positions)
        k, v = self._kv(h, positions)
        key_cache = F.kv_cache_update(key_cache, k, positions)
        value_cache = F.kv_cache_update(value_cache, v, positions)
        y = F.attention(q, key_cache, value_cache, limit, c.head_dim ** -0.5, c.sliding_window, self.sinks)
        y = F.linear(F.reshape(y, [0, 0, c.num_attention_heads * c.head_dim]), self.o, self.o_bias)
        x = x + y
        h = F.rms_norm(x, self.post_norm, c.rms_norm_eps)
        h = F.activation(F.linear(h, self.gate, self.gate_bias), c.hidden_act) * F.linear(h, self.up, self.up_bias)
        return x + F.linear(h, self.down, self.down_bias), key_cache, value_cache


def block_limit(positions, lengths):
    """[B, L]: the last valid block position of each sequence, repeated on every row (a block row
    sees every cache slot up to it: the context before the anchor and its whole block)."""
    last = F.gather_rows(positions, F.reshape(lengths - 1, [-1, 1]))  # [B, 1]
    return positions * 0 + last


class DFlashDraft:
    kind = "dflash"

    def __init__(self, cfg: "DFlashConfig", weights: dict, target_embedding=None, target_lm_head=None,
                 dtype=torch.float32):
        self.cfg, self.dtype = cfg, dtype
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.draft_vocab_size
        self.target_vocab_size = cfg.target_vocab_size
        self.target_layer_ids = tuple(cfg.target_layer_ids)
        self.block_size = cfg.block_size
        self.mask_token_id = int(cfg.mask_token_id)
        self.sample_from_anchor = bool(cfg.sample_from_anchor)
        self.first_draft_row = 0 if self.sample_from_anchor else 1
        self.num_speculative_tokens = cfg.num_speculative_tokens or (
            cfg.block_size if self.sample_from_anchor else cfg.block_size - 1)
        own = weights.get("embed_tokens.weight")
        table = own if own is not None else target_embedding
        if table is None:
            raise ValueError(f"{type(self).__name__}: the draft ships no embed_tokens.weight; pass the target's embedding")
        self.embedding = table.to(dtype)
        head = weights.get("lm_head.weight")
        head = head if head is not None else target_lm_head
        if head is None:
            raise ValueError(f"{type(self).__name__}: the draft ships no lm_head.weight; pass the target's LM head")
        if head.shape[0] != cfg.draft_vocab_size:
            raise ValueError(f"{type(self).__name__}: LM head has {head.shape[0]} rows, the draft vocabulary "
                             f"{cfg.draft_vocab_size}")
        self.lm_head = head.to(dtype)
        d2t = weights.get("d2t")
        self.d2t = None if d2t is None or (cfg.draft_vocab_size == cfg.target_vocab_size and not d2t.any()) \
            else d2t.long()
        self.fc = weights["fc.weight"].to(dtype)
        self.hidden_norm = weights["hidden_norm.weight"].to(dtype)
        self.norm = weights["norm.weight"].to(dtype)
        self.layers = [DFlashLayer(cfg, weights, i, dtype) for i in range(cfg.num_hidden_layers)]

    @property
    def aux_width(self) -> int:
        return len(self.target_layer_ids) * self.cfg.target_hidden_size

    def state_spec(self, batch: int, capacity: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """KV cache per draft layer: ``layers.{i}.key_cache`` / ``value_cache`` [batch, capacity, Hkv, D]."""
        c = self.cfg
        shape = (batch, capacity, c.num_key_value_heads, c.head_dim)
        return {f"layers.{i}.{n}": (shape, self.dtype) for i in range(c.num_hidden_layers)
                for n in ("key_cache", "value_cache")}

    # --- helpers for the loop (torch only) -------------------------------------------------------------
    def block_rows(self, num_draft_tokens: int) -> int:
        """Rows of a block proposing ``num_draft_tokens`` tokens: K+1 (anchor dropped) or K."""
        return int(num_draft_tokens) + self.first_draft_row

    def block_inputs(self, anchor_ids, anchor_positions, num_draft_tokens: int):
        """(input_ids [B, L], positions [B, L], lengths [B], logit_index [B, K]) int32 of one block:
        the anchor then mask tokens, positions anchor_position + 0..L-1, the K draft rows."""
        anchor_ids = torch.as_tensor(anchor_ids).reshape(-1)
        anchor_positions = torch.as_tensor(anchor_positions).reshape(-1)
        batch, rows = anchor_ids.shape[0], self.block_rows(num_draft_tokens)
        dev = anchor_ids.device
        ids = torch.full((batch, rows), self.mask_token_id, dtype=torch.int32, device=dev)
        ids[:, 0] = anchor_ids.to(torch.int32)
        positions = (anchor_positions.to(torch.int32)[:, None]
                     + torch.arange(rows, dtype=torch.int32, device=dev)[None, :])
        lengths = torch.full((batch,), rows, dtype=torch.int32, device=dev)
        index = torch.arange(self.first_draft_row, rows, dtype=torch.int32, device=dev).repeat(batch, 1)
        return ids, positions, lengths, index

    # --- the network -------------------------------------------------------------------------------------
    def context_features(self, aux):
        """hidden_norm(fc(aux)): what every layer projects to its context K/V."""
        return F.rms_norm(F.linear(aux, self.fc), self.hidden_norm, self.cfg.rms_norm_eps)

    def append_context(self, aux, positions, lengths, state: dict) -> dict:
        """Writes context rows into every layer's KV cache; returns the new state. ``lengths`` is
        part of the contract (right padding) but padding rows are written too (see the module doc)."""
        del lengths
        c = self.context_features(aux)
        new_state = {}
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            new_state[p + "key_cache"], new_state[p + "value_cache"] = layer.context(
                c, positions, state[p + "key_cache"], state[p + "value_cache"])
        return new_state

    def block_hidden(self, input_ids, positions, lengths, state: dict):
        """(normed hidden [B, L, H], new state) of one block (the backbone before the LM head)."""
        limit = positions if self.cfg.causal else block_limit(positions, lengths)
        x = F.embedding(input_ids, self.embedding)
        new_state = {}
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            x, new_state[p + "key_cache"], new_state[p + "value_cache"] = layer(
                x, positions, limit, state[p + "key_cache"], state[p + "value_cache"])
        return F.rms_norm(x, self.norm, self.cfg.rms_norm_eps), new_state

    def logits(self, hidden, logit_index):
        """fp32 draft-vocabulary logits of block rows ``logit_index`` [B, G]."""
        return F.to_float32(F.linear(F.gather_rows(hidden, logit_index), self.lm_head))

    def block(self, input_ids, positions, lengths, logit_index, state: dict):
        """One block forward from the anchor: (logits [B, G, Vd] fp32, new state)."""
        hidden, new_state = self.block_hidden(input_ids, positions, lengths, state)
        return self.logits(hidden, logit_index), new_state

    def forward(self, aux, context_positions, context_lengths, input_ids, positions, lengths, logit_index,
                state: dict):
        """Context rows then one block in one call: (logits [B, G, Vd] fp32, new state)."""
        state = {**state, **self.append_context(aux, context_positions, context_lengths, state)}
        return self.block(input_ids, positions, lengths, logit_index, state)
