"""NemotronH: a hybrid stack of Mamba-2, attention, MLP and MoE blocks.

Written once against ``builder.functional``: the same code runs eagerly on torch tensors and records
a TensorRT network on symbolic ones. Weights are bound when the module is built; all state is
explicit input and output of ``forward``.

The Mamba-2 time step is clamped to the config's ``time_step_limit`` (default (0, inf): no clamp)
in every path, as vLLM does; transformers 5.24 clamps at ``time_step_min`` in prefill only, which
would make a verify chunk disagree with single-token decode.
"""
from __future__ import annotations

import torch

from builder import functional as F
from builder.safetensors_io import stack
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from builder.config import NemotronHConfig


def _bind(weights, name, dtype):
    w = weights.get(name)
    return None if w is None else w.to(dtype)


class Mamba2Mixer:
    def __init__(self, cfg: NemotronHConfig, w: dict, p: str, dtype):
        self.cfg = cfg
        self.in_proj = _bind(w, p + "in_proj.weight", dtype)
        self.in_proj_bias = _bind(w, p + "in_proj.bias", dtype)
        self.conv_weight = w[p + "conv1d.weight"].to(dtype)[:, 0, :]
        self.conv_bias = _bind(w, p + "conv1d.bias", dtype)
        self.dt_bias = w[p + "dt_bias"].to(dtype)
        self.A = -torch.exp(w[p + "A_log"].float())
        self.D = w[p + "D"].float()
        self.norm = w[p + "norm.weight"].to(dtype)
        self.out_proj = w[p + "out_proj.weight"].to(dtype)
        self.out_proj_bias = _bind(w, p + "out_proj.bias", dtype)

    def __call__(self, x, conv_state, ssm_state, lengths, verify=False, tree=None):
        """(out, conv_state, ssm_state) after the chunk; with ``verify`` (out, kept) instead, where
        ``kept`` holds the chunk's conv inputs and SSM inputs, from which :meth:`rollback` computes
        the state at whichever position acceptance keeps (no per-position states are formed).
        ``tree`` (parents, ancestors): a token-tree verify chunk, each row along its ancestor path."""
        c = self.cfg
        inner, heads, state_size = c.mamba_intermediate_size, c.mamba_num_heads, c.ssm_state_size
        gn = c.n_groups * state_size
        z, xbc_in, dt = F.split(F.linear(x, self.in_proj, self.in_proj_bias), [inner, c.conv_dim, heads])
        act = c.mamba_hidden_act
        if tree is not None:
            conv = (F.tree_conv1d(xbc_in, conv_state, self.conv_weight, self.conv_bias, tree[0], act),)
        else:
            conv = F.causal_conv1d(xbc_in, conv_state, self.conv_weight, self.conv_bias, lengths, act)
        xs, B, C = F.split(conv[0], [inner, gn, gn])
        dt = F.mamba_dt(dt, self.dt_bias, *c.time_step_limit, lengths)   # 0 at padding: the state stays
        xs = F.reshape(xs, [0, 0, heads, c.mamba_head_dim])
        B = F.reshape(B, [0, 0, c.n_groups, state_size])
        C = F.reshape(C, [0, 0, c.n_groups, state_size])
        if tree is not None:
            scan = (F.tree_ssm_scan(xs, dt, self.A, B, C, self.D, ssm_state, tree[1]),)
        else:
            scan = F.ssm_scan(xs, dt, self.A, B, C, self.D, ssm_state, c.chunk_size)
        y = F.gated_rms_norm(F.reshape(scan[0], [0, 0, inner]), z, self.norm, c.layer_norm_epsilon,
                             inner // c.n_groups)
        out = F.linear(y, self.out_proj, self.out_proj_bias)
        if verify or tree is not None:
            return out, {"conv_inputs": xbc_in, "ssm_x": xs, "ssm_B": B, "ssm_dt": dt}
        return out, conv[1], scan[1]

    def rollback(self, conv_state, ssm_state, kept, lengths):
        """The (conv, SSM) state after the first lengths[b] rows of a verify chunk that began from
        ``conv_state``/``ssm_state``: the same inputs a decode step would have consumed."""
        conv = F.conv_window(conv_state, kept["conv_inputs"], lengths)
        ssm = F.ssm_state(kept["ssm_x"], F.mask_padding(kept["ssm_dt"], lengths), self.A, kept["ssm_B"], ssm_state)
        return conv, ssm


KEPT_FOR_ROLLBACK = ("conv_inputs", "ssm_x", "ssm_B", "ssm_dt")


class Attention:
    def __init__(self, cfg: NemotronHConfig, w: dict, p: str, dtype):
        self.cfg = cfg
        self.q, self.k, self.v, self.o = (w[p + n + "_proj.weight"].to(dtype) for n in "qkvo")
        self.q_bias, self.k_bias, self.v_bias, self.o_bias = (
            _bind(w, p + n + "_proj.bias", dtype) for n in "qkvo")

    def __call__(self, x, key_cache, value_cache, positions, tree=None, visible=None):
        """``tree``: a tree verify chunk; ``visible`` [B, T, S]: a draft's tree step (rows written at
        cache rows ``positions``, each seeing the rows its mask marks)."""
        c = self.cfg
        q = F.reshape(F.linear(x, self.q, self.q_bias), [0, 0, c.num_attention_heads, c.head_dim])
        k = F.reshape(F.linear(x, self.k, self.k_bias), [0, 0, c.num_key_value_heads, c.head_dim])
        v = F.reshape(F.linear(x, self.v, self.v_bias), [0, 0, c.num_key_value_heads, c.head_dim])
        key_cache = F.kv_cache_update(key_cache, k, positions)
        value_cache = F.kv_cache_update(value_cache, v, positions)
        if visible is not None:
            y = F.masked_attention(q, key_cache, value_cache, visible, c.head_dim ** -0.5)
        elif tree is not None:  # no positional encoding: a node's cache row is all that places it
            y = F.tree_attention(q, key_cache, value_cache, positions, tree[1], c.head_dim ** -0.5)
        else:
            y = F.attention(q, key_cache, value_cache, positions, c.head_dim ** -0.5)
        y = F.reshape(y, [0, 0, c.num_attention_heads * c.head_dim])
        return F.linear(y, self.o, self.o_bias), key_cache, value_cache


class MLP:
    def __init__(self, cfg: NemotronHConfig, w: dict, p: str, dtype):
        self.act = cfg.mlp_hidden_act
        self.up, self.down = w[p + "up_proj.weight"].to(dtype), w[p + "down_proj.weight"].to(dtype)
        self.up_bias, self.down_bias = _bind(w, p + "up_proj.bias", dtype), _bind(w, p + "down_proj.bias", dtype)

    def __call__(self, x):
        return F.linear(F.activation(F.linear(x, self.up, self.up_bias), self.act), self.down, self.down_bias)


class MoE:
    def __init__(self, cfg: NemotronHConfig, w: dict, p: str, dtype):
        self.cfg = cfg
        experts = range(cfg.n_routed_experts)
        # a view, not a copy, when the experts lie back to back in a memory-mapped file
        self.up = stack([w[f"{p}experts.{e}.up_proj.weight"] for e in experts]).to(dtype)
        self.down = stack([w[f"{p}experts.{e}.down_proj.weight"] for e in experts]).to(dtype)
        self.router = w[p + "gate.weight"].float()
        self.router_bias = w[p + "gate.e_score_correction_bias"].float()
        shared = p + "shared_experts."
        self.shared = MLP(cfg, w, shared, dtype) if shared + "up_proj.weight" in w else None
        self.fc1_latent = _bind(w, p + "fc1_latent_proj.weight", dtype)
        self.fc1_latent_bias = _bind(w, p + "fc1_latent_proj.bias", dtype)
        self.fc2_latent = _bind(w, p + "fc2_latent_proj.weight", dtype)
        self.fc2_latent_bias = _bind(w, p + "fc2_latent_proj.bias", dtype)

    def __call__(self, x):
        c = self.cfg
        expert_in = x if self.fc1_latent is None else F.linear(x, self.fc1_latent, self.fc1_latent_bias)
        routed = F.moe(x, expert_in, self.router, self.router_bias, self.up, self.down,
                       c.num_experts_per_tok, c.n_group, c.topk_group, c.norm_topk_prob,
                       c.routed_scaling_factor, c.mlp_hidden_act)
        if self.fc2_latent is not None:
            routed = F.linear(routed, self.fc2_latent, self.fc2_latent_bias)
        return routed if self.shared is None else routed + self.shared(x)


MIXERS = {"mamba": Mamba2Mixer, "attention": Attention, "mlp": MLP, "moe": MoE}


def run_block(kind, mixer, x, lengths, positions, state, new_state, p, verify=False, tree=None, visible=None):
    """One mixer on the normed stream; state names under prefix ``p``. Returns the mixer output.
    ``visible``: a draft's tree step (attention only: a Mamba layer keeps one state per sequence)."""
    if kind == "mamba":
        if visible is not None:
            raise ValueError(f"{p}: a Mamba layer cannot run a draft tree step (one state per sequence)")
        out = mixer(x, state[p + "conv_state"], state[p + "ssm_state"], lengths, verify, tree)
        if verify or tree is not None:
            new_state.update({p + k: v for k, v in out[1].items()})
        else:
            new_state[p + "conv_state"], new_state[p + "ssm_state"] = out[1:]
        return out[0]
    if kind == "attention":
        h, new_state[p + "key_cache"], new_state[p + "value_cache"] = mixer(
            x, state[p + "key_cache"], state[p + "value_cache"], positions, tree, visible)
        return h
    return mixer(x)


def block_state_spec(cfg, kind, p, batch, capacity, dtype):
    """State tensors of one block: Mamba conv + SSM state, or an attention KV cache."""
    if kind == "mamba":
        return {p + "conv_state": ((batch, cfg.conv_kernel - 1, cfg.conv_dim), dtype),
                p + "ssm_state": ((batch, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size), torch.float32)}
    if kind == "attention":
        shape = (batch, capacity, cfg.num_key_value_heads, cfg.head_dim)
        return {p + "key_cache": (shape, dtype), p + "value_cache": (shape, dtype)}
    return {}


class NemotronH:
    """The target model. ``forward`` runs one chunk of T tokens for a batch of sequences."""

    def __init__(self, cfg: NemotronHConfig, weights: dict, dtype=torch.float32, capture_layers=(),
                 final_hidden=False):
        """``capture_layers``: ids of layers whose entering hidden state a draft reads (0 = the
        embeddings, L = the pre-norm output of the last layer), returned as ``aux_hidden``
        [B, T, len*H] in that order; ``final_hidden``: also return the post-norm hidden [B, T, H]."""
        self.cfg, self.dtype = cfg, dtype
        self.capture_layers, self.final_hidden = tuple(capture_layers), final_hidden
        self.embeddings = weights["backbone.embeddings.weight"].to(dtype)
        # transformers writes and uses lm_head even when tie_word_embeddings is set
        head = weights.get("lm_head.weight")
        self.lm_head = self.embeddings if head is None else head.to(dtype)
        self.norm_f = weights["backbone.norm_f.weight"].to(dtype)
        self.layers = []
        for i, kind in enumerate(cfg.layer_types):
            p = f"backbone.layers.{i}."
            self.layers.append((kind, weights[p + "norm.weight"].to(dtype), MIXERS[kind](cfg, weights, p + "mixer.", dtype)))

    def state_spec(self, batch: int, capacity: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every state tensor for ``batch`` sequences of ``capacity`` tokens."""
        spec = {}
        for i, kind in enumerate(self.cfg.layer_types):
            spec.update(block_state_spec(self.cfg, kind, f"layers.{i}.", batch, capacity, self.dtype))
        return spec

    def forward(self, input_ids, positions, lengths, logit_index, state: dict, verify=False, tree=None):
        """Returns (logits [B, G, V] fp32 at chunk rows logit_index [B, G], new state, features).

        A ``verify`` pass (a speculative chunk) returns, for each Mamba layer, what :meth:`rollback`
        needs (``KEPT_FOR_ROLLBACK``) instead of its conv and SSM state; attention caches as usual.
        ``tree`` = (parents [B, T], ancestors [B, T, T]) makes the chunk a token tree (a verify:
        every row valid, written at cache rows ``positions``; :meth:`tree_rollback` keeps one path).
        ``features`` holds ``aux_hidden`` and ``hidden`` for every row when the module captures them.
        """
        c = self.cfg
        x = F.embedding(input_ids, self.embeddings)
        slots = {layer: i for i, layer in enumerate(self.capture_layers)}
        aux = F.capture_buffer(x, len(slots)) if slots else None
        if 0 in slots:
            x, aux = F.hidden_capture(x, None, aux, slots[0])
        new_state = {}
        for i, (kind, norm, mixer) in enumerate(self.layers):
            h = run_block(kind, mixer, F.rms_norm(x, norm, c.layer_norm_epsilon), lengths, positions, state,
                          new_state, f"layers.{i}.", verify, tree)
            if i + 1 in slots:  # fused: residual add + write into the capture buffer
                x, aux = F.hidden_capture(x, h, aux, slots[i + 1])
            else:
                x = x + h
        features = {}
        if aux is not None:
            features["aux_hidden"] = aux
        if self.final_hidden:
            x = F.rms_norm(x, self.norm_f, c.layer_norm_epsilon)
            features["hidden"] = x
            x = F.gather_rows(x, logit_index)
        else:
            x = F.rms_norm(F.gather_rows(x, logit_index), self.norm_f, c.layer_norm_epsilon)
        return F.to_float32(F.linear(x, self.lm_head)), new_state, features

    def rollback(self, state: dict, verified: dict, accepted_rows):
        """The state after rows 0..accepted_rows[b] of a verify chunk: ``state`` is the state the
        verify began from, ``verified`` its new state. Mamba layers compute that one position's state
        from what the verify kept; attention rows past it are masked by positions and overwritten."""
        lengths = accepted_rows + 1
        out = {}
        for i, (kind, _, mixer) in enumerate(self.layers):
            p = f"layers.{i}."
            if kind == "mamba":
                kept = {k: verified[p + k] for k in KEPT_FOR_ROLLBACK}
                out[p + "conv_state"], out[p + "ssm_state"] = mixer.rollback(
                    state[p + "conv_state"], state[p + "ssm_state"], kept, lengths)
            elif kind == "attention":
                out[p + "key_cache"], out[p + "value_cache"] = verified[p + "key_cache"], verified[p + "value_cache"]
        return out

    def tree_rollback(self, state: dict, verified: dict, paths, lengths, base):
        """The state after the root path ``paths[b, :lengths[b]]`` (tree rows, root first) of a tree
        verify that began from ``state`` at cache row ``base[b]``: Mamba layers run the chain
        rollback over the path's kept rows; attention rows of the path move to base .. base+len-1
        (rows past them are stale and masked by later positions)."""
        paths = paths.long()
        out = {}
        for i, (kind, _, mixer) in enumerate(self.layers):
            p = f"layers.{i}."
            if kind == "mamba":
                kept = {k: F.gather_rows(verified[p + k], paths) for k in KEPT_FOR_ROLLBACK}
                out[p + "conv_state"], out[p + "ssm_state"] = mixer.rollback(
                    state[p + "conv_state"], state[p + "ssm_state"], kept, lengths)
            elif kind == "attention":
                rows = base.long()[:, None] + paths
                for name in ("key_cache", "value_cache"):
                    cache = verified[p + name]
                    moved = F.gather_rows(cache, rows)
                    out[p + name] = F.kv_cache_update(cache, moved, base.long()[:, None] + torch.arange(
                        paths.shape[1], device=rows.device))
        return out
