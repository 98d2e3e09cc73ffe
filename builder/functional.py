"""The op surface every network is written against.

An op called with torch tensors runs eagerly (``backends/torch_backend.py``); called with symbolic
tensors it records TensorRT layers (``backends/trt_backend.py``). Model code calls only these ops and
Python operators on tensors, so one definition serves both the reference path and the engine.

Conventions: activations are ``[B, T, ...]`` (batch of sequences, T tokens of this chunk, right
padded); ``lengths`` is ``[B]`` int (valid tokens per sequence in the chunk); ``positions`` is
``[B, T]`` int (absolute position of each token, past + t). Weights are torch tensors bound at build
time; a symbolic backend turns them into constants.
"""
from __future__ import annotations

import torch

from builder.backends import torch_backend


def _backend(*xs):
    for x in xs:
        if isinstance(x, torch.Tensor):
            continue
        backend = getattr(x, "backend", None)
        if backend is not None:
            return backend
    return torch_backend


# --- dense algebra -------------------------------------------------------------------------------
def linear(x, weight, bias=None):
    """x [..., in] @ weight[out, in].T + bias. An NVFP4 weight (builder.nvfp4_format.NVFP4Weight) goes
    to :func:`linear_nvfp4`."""
    if getattr(weight, "is_nvfp4", False):
        return linear_nvfp4(x, weight.packed, weight.scale, weight.scale_2, weight.shape, bias)
    return _backend(x).linear(x, weight, bias)


def embedding(ids, table):
    """Rows of table [V, H] for integer ids [B, T] -> [B, T, H]."""
    return _backend(ids).embedding(ids, table)


def rms_norm(x, weight, eps):
    """RMSNorm over the last dim, computed in fp32, cast back to x's dtype, then scaled by weight."""
    return _backend(x).rms_norm(x, weight, eps)


def gated_rms_norm(x, gate, weight, eps, group_size):
    """Mamba-2 norm: x * silu(gate), RMS-normalised per group of ``group_size`` channels, * weight."""
    return _backend(x, gate).gated_rms_norm(x, gate, weight, eps, group_size)


def activation(x, name):
    """Elementwise activation by config name: 'relu2', 'silu', 'relu', 'gelu', 'softplus', 'sigmoid'."""
    return _backend(x).activation(x, name)


def clamp(x, lo, hi):
    """Elementwise clamp to [lo, hi]; an infinite bound is skipped."""
    return _backend(x).clamp(x, lo, hi)


def to_float32(x):
    return _backend(x).to_float32(x)


# --- shapes ---------------------------------------------------------------------------------------
def split(x, sizes, dim=-1):
    """Split along ``dim`` into pieces of the given static sizes."""
    return _backend(x).split(x, list(sizes), dim)


def concat(xs, dim=-1):
    return _backend(*xs).concat(list(xs), dim)


def reshape(x, shape):
    """Reshape; an entry 0 copies the input's dim at that index, -1 is inferred (TensorRT rules)."""
    return _backend(x).reshape(x, list(shape))


def permute(x, dims):
    return _backend(x).permute(x, list(dims))


def gather_rows(x, index):
    """x [B, L, ...], index [B, G] int -> [B, G, ...]: row index[b, g] of sequence b."""
    return _backend(x, index).gather_rows(x, index)


def mask_padding(x, lengths):
    """Zero x [B, T, ...] at chunk positions t >= lengths[b]."""
    return _backend(x, lengths).mask_padding(x, lengths)


# --- sequence mixers ------------------------------------------------------------------------------
def causal_conv1d(x, conv_state, weight, bias, lengths, activation=None):
    """Depthwise causal conv over time.

    x [B, T, C]; conv_state [B, K-1, C] holds the K-1 inputs before this chunk; weight [C, K];
    bias [C] or None. Returns (y [B, T, C], new_state [B, K-1, C]) where new_state holds the K-1
    inputs ending at the last valid token (t = lengths[b] - 1), as :func:`conv_window` gives.
    ``activation`` (a name :func:`activation` takes) is applied to y (Mamba-2's conv is followed by
    one: the GPU path applies it inside the conv's launch).
    """
    return _backend(x, conv_state, lengths).causal_conv1d(x, conv_state, weight, bias, lengths, activation)


def conv_window(conv_state, x, lengths):
    """The conv state after the first lengths[b] rows of x [B, T, C]: the K-1 rows of
    concat(conv_state [B, K-1, C], x) that end at row lengths[b] - 1 of x. A speculative rollback
    keeps the verify chunk's conv inputs and takes this window at the accepted length."""
    return _backend(conv_state, x, lengths).conv_window(conv_state, x, lengths)


def mamba_dt(dt, dt_bias, lo, hi, lengths):
    """Mamba-2's time step from its projection dt [B, T, H]: softplus(dt + dt_bias), clamped to
    [lo, hi] (None or an infinite bound skipped), 0 at t >= lengths[b] so that padding leaves the
    state untouched. One op so that the GPU path runs it as one launch (the composition is seven)."""
    return _backend(dt, lengths).mamba_dt(dt, dt_bias, lo, hi, lengths)


def ssm_scan(x, dt, A, B, C, D, state, chunk_size):
    """Mamba-2 selective scan (SSD) over a chunk of T tokens.

    x [B, T, H, P]; dt [B, T, H] (after softplus/limits; 0 at padding so state does not move);
    A [H] (negative); B, C [B, T, G, N]; D [H]; state [B, H, P, N] fp32. Returns
    (y [B, T, H, P] in x's dtype, new_state fp32). ``chunk_size`` is the SSD chunk (the math does
    not depend on it; a chunk shorter than it is one chunk).
    """
    return _backend(x, dt, B, C, state).ssm_scan(x, dt, A, B, C, D, state, chunk_size)


def ssm_state(x, dt, A, B, state):
    """The SSM state after a chunk, without its outputs: h = exp(sum_t dt_t A) h0 +
    sum_t exp(sum_{s>t} dt_s A) dt_t x_t B_t^T (fp32 [B, H, P, N]); rows with dt = 0 leave it
    unchanged. A speculative rollback keeps the verify chunk's x, dt and B and computes only the
    accepted position's state (dt masked past it) once acceptance is known."""
    return _backend(x, dt, B, state).ssm_state(x, dt, A, B, state)


def kv_cache_update(cache, new, positions):
    """cache [B, S, Hkv, D] with rows positions[b, t] replaced by new [B, T, Hkv, D]."""
    return _backend(cache, new, positions).kv_cache_update(cache, new, positions)


def attention(q, k_cache, v_cache, positions, scale, window=None, sinks=None):
    """Causal GQA over a KV cache.

    q [B, T, Hq, D]; k_cache, v_cache [B, S, Hkv, D] already holding this chunk; query (b, t) sees
    cache rows j <= positions[b, t], and with a sliding ``window`` (Hugging Face's inclusive one) only
    j > positions[b, t] - window. ``sinks`` [Hq] (fp32): per-head logits joining the softmax
    denominator with no value (GPT-OSS attention sinks). Softmax in fp32. Returns [B, T, Hq, D].
    """
    extra = {} if window is None and sinks is None else {"window": window, "sinks": sinks}
    return _backend(q, k_cache, positions).attention(q, k_cache, v_cache, positions, scale, **extra)


def moe(router_input, x, router_weight, router_bias, up, down, top_k, n_group, topk_group,
        norm_topk_prob, routed_scaling_factor, act):
    """NemotronH routed experts (shared experts and latent projections live in the model).

    Leading dims are free: router_input [..., H], x [..., Hin]. router_input is scored in fp32 by sigmoid(router_input @ router_weight[E, H].T); the
    correction bias router_bias [E] is added for the choice only; group-limited top-k (groups
    ranked by the sum of their two best scores); the chosen scores are optionally normalised, then
    scaled. x [N, Hin] is the experts' input (the latent projection when the model has one).
    Expert e: down[e] [Hin, I] @ act(up[e] [I, Hin] @ x). Returns [..., Hin] in x's dtype.
    """
    return _backend(x, router_input).moe(router_input, x, router_weight, router_bias, up, down,
                                         top_k, n_group, topk_group, norm_topk_prob,
                                         routed_scaling_factor, act)


# --- hidden-state capture (plugins/hidden_capture.py) ---------------------------------------------------
def capture_buffer(x, n_slots):
    """Zeros [..., n_slots * H] in x's dtype (x [..., H]; leading dims as x's, dynamic in a network):
    the buffer ``hidden_capture`` writes captured hidden states into."""
    return _backend(x).capture_buffer(x, n_slots)


def hidden_capture(residual, delta, buffer, slot):
    """Fused residual add + capture: ``x_new = residual + delta`` (``residual`` when delta is None)
    and ``buffer_new`` = buffer with columns ``slot*H : (slot+1)*H`` replaced by x_new.

    residual, delta [..., H]; buffer [..., n_slots*H], all one dtype. Returns (x_new, buffer_new).
    Lowers to the ``nemospec_hidden_capture`` plugin layer where TensorRT has plugin layers, else to
    native layers (add + slice/concat write).
    """
    return _backend(residual, delta, buffer).hidden_capture(residual, delta, buffer, slot)


# --- draft-model ops (EAGLE / EAGLE-3) --------------------------------------------------------------
def rope(x, positions, theta, rotary_dim=None, scaling=None):
    """Llama rotary position embedding (rotate_half / NeoX convention) of x [B, T, H, D].

    positions [B, T] int. The first ``rotary_dim`` channels (default D) are rotated, the rest pass
    through. Angles ``positions * inv_freq`` and the rotation are computed in fp32; the result is
    cast back to x's dtype. ``scaling`` is a Hugging Face ``rope_scaling`` / ``rope_parameters``
    dict: None, ``default``, ``linear`` (factor), ``llama3`` (factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings) or ``yarn`` (factor,
    original_max_position_embeddings, beta_fast, beta_slow, attention_factor / mscale, truncate:
    transformers' NTK-by-parts frequencies, cos and sin scaled by the attention factor); other types
    raise ValueError.
    """
    return _backend(x, positions).rope(x, positions, theta, rotary_dim, scaling)


def where(cond, a, b):
    """Elementwise select, torch.where semantics with broadcasting: cond (bool, or int: nonzero is
    true) picks a, else b. a and b are tensors or Python numbers (result dtype as torch promotes)."""
    return _backend(cond, a, b).where(cond, a, b)


# --- NVFP4 weights (builder/nvfp4_format.py) and the DSpark Markov head (plugins/fp4_markov_head.py) ---
def linear_nvfp4(x, packed, scale, scale_2, shape, bias=None):
    """x [..., in] @ W.T + bias for an NVFP4 weight W of logical ``shape`` [out, in] in ModelOpt's
    layout: ``packed`` uint8 [out, in/2] (E2M1 codes, element 2i in the low nibble), ``scale``
    float8_e4m3fn [out, in/16], ``scale_2`` float32 scalar. W is dequantized in x's dtype (block scale
    ``fp8 * scale_2`` then ``e2m1 * block scale``). TensorRT: FP4 constant + FP8 block scales + global
    scale -> dequantize -> matmul. ``linear`` routes an :class:`~builder.nvfp4_format.NVFP4Weight` here."""
    return _backend(x).linear_nvfp4(x, packed, scale, scale_2, tuple(int(d) for d in shape), bias)


def fp4_markov_head(logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2):
    """DSpark Markov bias: ``logits [..., V] fp32 + W1[prev_ids] @ W2.T`` with W1 [V_prev, r] (high
    precision, gathered by prev_ids [...] int) and W2 [V, r] NVFP4 (``w2_packed`` uint8 [V, r/2],
    ``w2_scale`` float8_e4m3fn [V, r/16], ``w2_scale_2`` float32 scalar); fp32 throughout. Lowers to
    the ``nemospec_fp4_markov_head`` plugin layer where TensorRT has plugin layers, else to native
    layers (gather + FP4 block dequantize + matmul + add)."""
    return _backend(logits, prev_ids).fp4_markov_head(logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2)


# --- token trees (tree speculation) -------------------------------------------------------------
# (lowered by backends/torch_tree.py and backends/trt_tree.py)
def _tree_backend(*xs):
    if _backend(*xs) is torch_backend:
        from builder.backends import torch_tree
        return torch_tree
    from builder.backends import trt_tree
    return trt_tree


# A verify chunk may hold a token tree instead of a chain: row 0 is the last accepted token (the
# root), every other row r has ``parents[b, r]`` < r, and ``ancestors[b, i, j]`` is true when row j
# is row i or one of its ancestors. A chain is parents = r - 1, ancestors = lower triangle.
def tree_conv1d(x, conv_state, weight, bias, parents, activation=None):
    """Depthwise causal conv along each row's ancestor path: row i's window is its K-1 nearest
    ancestors (then the conv state before the root) and itself. Returns y [B, T, C], with
    ``activation`` applied as :func:`causal_conv1d` does."""
    return _tree_backend(x, conv_state, parents).tree_conv1d(x, conv_state, weight, bias, parents, activation)


def tree_ssm_scan(x, dt, A, B, C, D, state, ancestors):
    """Mamba-2's scan along each row's ancestor path (the SSD quadratic form with the causal mask
    replaced by ``ancestors`` and the decay summed along the path). Returns y [B, T, H, P]; the state
    of an accepted path comes from :func:`ssm_state` over that path's rows."""
    return _tree_backend(x, dt, B, C, state, ancestors).tree_ssm_scan(x, dt, A, B, C, D, state, ancestors)


def tree_attention(q, k_cache, v_cache, positions, ancestors, scale):
    """GQA for a tree chunk written at cache rows positions[b, t] (= base + t): query (b, t) sees the
    rows before the chunk's first one and the rows of its own ancestors. Returns [B, T, Hq, D]."""
    return _tree_backend(q, k_cache, positions, ancestors).tree_attention(q, k_cache, v_cache, positions, ancestors, scale)


def masked_attention(q, k_cache, v_cache, visible, scale):
    """GQA where query (b, t) sees the cache rows j with ``visible[b, t, j]`` (bool [B, T, S]): a
    draft's tree step, whose rows see the committed context plus their own ancestors' slots, written
    by earlier steps. Softmax in fp32. Returns [B, T, Hq, D]."""
    return _tree_backend(q, k_cache, visible).masked_attention(q, k_cache, v_cache, visible, scale)