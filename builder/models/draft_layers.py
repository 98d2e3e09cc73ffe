"""Llama / Qwen3 decoder-layer pieces shared by the EAGLE and EAGLE-3 drafts.

Math only, written against ``builder.functional``; weights are bound at construction (canonical
names of ``builder.formats.tensors``). The KV cache is explicit state: each attention takes and
returns its key and value caches ``[B, S, Hkv, D]``; row (b, t) writes slot ``positions[b, t]`` and
attends to slots ``<= positions[b, t]``. A tree step (``tree`` = (slots [B, T], visible [B, T, S]))
writes row (b, t) at ``slots[b, t]`` instead and attends to the slots ``visible`` marks; ``positions``
then only places the row for RoPE (its depth in the token tree).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from builder import functional as F

if TYPE_CHECKING:
    from builder.models.draft_configs import DraftLayers


def bind(weights: dict, name: str, dtype):
    w = weights.get(name)
    return None if w is None else w.to(dtype)


class DraftAttention:
    """GQA self-attention with RoPE (and Qwen3's per-head q/k RMSNorm before RoPE)."""

    def __init__(self, cfg: "DraftLayers", w: dict, p: str, dtype):
        self.cfg = cfg
        self.q, self.k, self.v, self.o = (w[f"{p}{n}_proj.weight"].to(dtype) for n in "qkvo")
        self.q_bias, self.k_bias, self.v_bias, self.o_bias = (bind(w, f"{p}{n}_proj.bias", dtype) for n in "qkvo")
        self.q_norm = bind(w, p + "q_norm.weight", dtype) if cfg.qk_norm else None
        self.k_norm = bind(w, p + "k_norm.weight", dtype) if cfg.qk_norm else None
        self.scaling = cfg.rope_scaling_dict

    def __call__(self, x, key_cache, value_cache, positions, tree=None):
        c = self.cfg
        q = F.reshape(F.linear(x, self.q, self.q_bias), [0, 0, c.num_attention_heads, c.head_dim])
        k = F.reshape(F.linear(x, self.k, self.k_bias), [0, 0, c.num_key_value_heads, c.head_dim])
        v = F.reshape(F.linear(x, self.v, self.v_bias), [0, 0, c.num_key_value_heads, c.head_dim])
        if self.q_norm is not None:
            q = F.rms_norm(q, self.q_norm, c.rms_norm_eps)
            k = F.rms_norm(k, self.k_norm, c.rms_norm_eps)
        q = F.rope(q, positions, c.rope_theta, c.rotary_dim, self.scaling)
        k = F.rope(k, positions, c.rope_theta, c.rotary_dim, self.scaling)
        slots = positions if tree is None else tree[0]
        key_cache = F.kv_cache_update(key_cache, k, slots)
        value_cache = F.kv_cache_update(value_cache, v, slots)
        if tree is None:
            y = F.attention(q, key_cache, value_cache, positions, c.head_dim ** -0.5)
        else:
            y = F.masked_attention(q, key_cache, value_cache, tree[1], c.head_dim ** -0.5)
        y = F.reshape(y, [0, 0, c.num_attention_heads * c.head_dim])
        return F.linear(y, self.o, self.o_bias), key_cache, value_cache


class GatedMLP:
    """down(act(gate(x)) * up(x))."""

    def __init__(self, cfg: "DraftLayers", w: dict, p: str, dtype):
        self.act = cfg.hidden_act
        self.gate, self.up, self.down = (w[f"{p}{n}_proj.weight"].to(dtype) for n in ("gate", "up", "down"))
        self.gate_bias, self.up_bias, self.down_bias = (bind(w, f"{p}{n}_proj.bias", dtype) for n in ("gate", "up", "down"))

    def __call__(self, x):
        h = F.activation(F.linear(x, self.gate, self.gate_bias), self.act) * F.linear(x, self.up, self.up_bias)
        return F.linear(h, self.down, self.down_bias)


class DecoderLayer:
    """A pre-norm Llama/Qwen3 decoder layer; ``input_norm=False`` skips the input RMSNorm (layer 0
    of the original EAGLE)."""

    def __init__(self, cfg: "DraftLayers", w: dict, i: int, dtype, input_norm: bool = True):
        p = f"layers.{i}."
        self.eps = cfg.rms_norm_eps
        self.input_norm = w[p + "input_layernorm.weight"].to(dtype) if input_norm else None
        self.post_norm = w[p + "post_attention_layernorm.weight"].to(dtype)
        self.attn = DraftAttention(cfg, w, p + "self_attn.", dtype)
        self.mlp = GatedMLP(cfg, w, p + "mlp.", dtype)

    def __call__(self, x, key_cache, value_cache, positions, tree=None):
        h = x if self.input_norm is None else F.rms_norm(x, self.input_norm, self.eps)
        h, key_cache, value_cache = self.attn(h, key_cache, value_cache, positions, tree)
        x = x + h
        x = x + self.mlp(F.rms_norm(x, self.post_norm, self.eps))
        return x, key_cache, value_cache


def kv_state_spec(cfg: "DraftLayers", batch: int, capacity: int, dtype) -> dict:
    shape = (batch, capacity, cfg.num_key_value_heads, cfg.head_dim)
    return {f"layers.{i}.{n}": (shape, dtype) for i in range(cfg.num_hidden_layers)
            for n in ("key_cache", "value_cache")}
