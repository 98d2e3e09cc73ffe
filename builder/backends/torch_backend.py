"""Eager lowering of the op surface: the reference path, the CPU runtime and the test baseline.

Numerics follow Hugging Face transformers' NemotronH where it defines them (fp32 norms, fp32 scan
and router, softmax in fp32), so the eager path can be compared against it token for token.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as tf

from builder.backends import gpu as _gpu

_ACTIVATIONS = {
    "relu2": lambda x: torch.square(torch.relu(x)),
    "relu": torch.relu,
    "silu": tf.silu,
    "gelu": tf.gelu,
    "softplus": tf.softplus,
    "sigmoid": torch.sigmoid,
}


# products of at most this many rows go to the small-row kernel: its packed layout beat MKL at every
# row count measured up to 48 (target weights, 1 thread: 17 rows 0.56 / 1.56 ms, 48 rows 1.44 / 3.43)
SMALL_LINEAR_ROWS = 48
MOE_ROUTED_ACTIVATIONS = ("relu2", "relu", "silu", "gelu")   # nemospec::moe_routed's, in its order
EXPERT_LOOP_MAX = 16     # a batch-1 dense MoE runs one small-row product per expert up to this many
_small_linear = None
_small_linear_bf16w = None
_small_linear_bf16 = None
_moe_routed = None
_small_linear_dtypes = (torch.float32,)
PRODUCT_FORMS = ("float32", "bf16_weights", "bf16")
_product_form = "float32"


def use_small_linear(kernel, bf16_weights_kernel=None, bf16: bool = False, bf16_products_kernel=None,
                     moe_kernel=None) -> None:
    """Sets the kernel (x [..., K], w [N, K] -> x @ w^T) that compiled graphs use for fp32
    products of few rows (``runtime.compiled.small_linear``), its form with w rounded to bf16 and its form
    with x and w rounded to bf16 (for graphs traced under ``product_form``); ``bf16``: the kernel
    also multiplies bf16 x by bf16 w (a bf16 model; bf16 dot products, fp32 sums); ``moe_kernel``:
    the routed experts of a few-row MoE step on the same products (``nemospec::moe_routed``).
    ``None`` restores torch's own."""
    global _small_linear, _small_linear_bf16w, _small_linear_bf16, _small_linear_dtypes, _moe_routed
    _small_linear, _small_linear_bf16w, _small_linear_bf16 = kernel, bf16_weights_kernel, bf16_products_kernel
    _small_linear_dtypes = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)
    _moe_routed = moe_kernel if kernel is not None else None


def small_linear_kernels() -> tuple:
    """What ``use_small_linear`` was given, as its arguments (to restore it)."""
    return _small_linear, _small_linear_bf16w, torch.bfloat16 in _small_linear_dtypes, _small_linear_bf16, _moe_routed


@contextlib.contextmanager
def product_form(form: str = "float32"):
    """How fp32 ``linear`` products multiply inside: ``float32`` as given; ``bf16_weights`` by weights
    rounded to bf16 (the compiled path's draft, ``--draft_weight_dtype bfloat16``; activations stay
    fp32); ``bf16`` with x and w rounded to bf16, fp32 sums (``--matmul_precision medium``). Traced
    few-row products run the small-row kernel's form; other products round their inputs and call
    torch's linear (the same numbers, summed in another order)."""
    global _product_form
    if form not in PRODUCT_FORMS:
        raise ValueError(f"product form: expected one of {', '.join(PRODUCT_FORMS)}, got {form}")
    previous, _product_form = _product_form, form
    try:
        yield
    finally:
        _product_form = previous


def _few_rows(shape) -> bool:
    """[B, T, K] with T <= SMALL_LINEAR_ROWS: a step's rows per sequence, at any batch (a batch-2+
    graph's dynamic batch included: the kernel beat torch's GEMM at every row count measured, 16 to 256
    rows of the wide model's matrices at 1 and 2 threads, 0.44-0.89x its time, and a row's sums do not
    depend on the call's rows, so a sequence's products are the same batched or alone). Decided without
    a guard: T is a static dim of every step and the batch is not compared; other ranks, such as
    [N, K] whose N may hide the batch, keep torch's GEMM."""
    return len(shape) == 3 and isinstance(shape[1], int) and shape[1] <= SMALL_LINEAR_ROWS


def _kernel_for(x):
    """The small-row kernel of x's dtype and the product form (None: this form has none installed)."""
    if x.dtype != torch.float32:
        return _small_linear
    return {"float32": _small_linear, "bf16_weights": _small_linear_bf16w, "bf16": _small_linear_bf16}[_product_form]


def _kernel_runs(x, weight, shape) -> bool:
    """Whether a traced product of x by weight (x's step shape ``shape``) runs the small-row kernel."""
    return (_small_linear is not None and _kernel_for(x) is not None and torch.compiler.is_compiling()
            and x.dtype in _small_linear_dtypes and weight.dtype == x.dtype and not getattr(weight, "is_nvfp4", False)
            and x.device.type == "cpu" and _few_rows(shape))


def linear(x, weight, bias=None):
    if weight.dim() == 2 and _kernel_runs(x, weight, x.shape):
        y = _kernel_for(x)(x, weight)
        return y if bias is None else y + bias
    if _product_form != "float32" and x.dtype == weight.dtype == torch.float32 and not getattr(weight, "is_nvfp4", False):
        # the form's semantics where the kernel does not run (eager calls, no kernel form for this CPU):
        # bf16 numbers multiplied and summed in fp32
        weight = weight.bfloat16().float()
        x = x.bfloat16().float() if _product_form == "bf16" else x
    return tf.linear(x, weight, bias)


def embedding(ids, table):
    return tf.embedding(ids.long(), table)


def rms_norm(x, weight, eps):
    if _gpu.active(x):
        out = _gpu.dispatch("rms_norm", x, weight, eps)
        if out is not None:
            return out
    return tf.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def gated_rms_norm(x, gate, weight, eps, group_size):
    if _gpu.active(x):
        out = _gpu.dispatch("gated_rms_norm", x, gate, weight, eps, group_size)
        if out is not None:
            return out
    dtype = x.dtype
    h = x.float() * tf.silu(gate.float())
    groups = h.unflatten(-1, (h.shape[-1] // group_size, group_size))
    groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    return weight * groups.flatten(-2).to(dtype)


def activation(x, name):
    return _ACTIVATIONS[name](x)


def clamp(x, lo, hi):
    lo = None if lo is None or lo == float("-inf") else lo
    hi = None if hi is None or hi == float("inf") else hi
    if lo is None and hi is None:
        return x
    return torch.clamp(x, min=lo, max=hi)


def to_float32(x):
    return x.float()


def split(x, sizes, dim):
    return list(torch.split(x, sizes, dim=dim))


def concat(xs, dim):
    return torch.cat(xs, dim=dim)


def reshape(x, shape):
    return x.reshape([x.shape[i] if s == 0 else s for i, s in enumerate(shape)])


def permute(x, dims):
    return x.permute(dims)


def gather_rows(x, index):
    rows = torch.arange(x.shape[0], device=x.device)[:, None]
    return x[rows, index.long()]


def _all_valid(x, lengths):
    """Every sequence fills the chunk (decode steps): padding work can be skipped.

    Under ``torch.compile`` the answer is always False: reading ``lengths`` would be a
    data-dependent branch (a graph break); the masked path computes the same values, exactly. On a GPU
    too: reading it would stall the host until the device caught up (and no step could be captured
    as a CUDA graph)."""
    if torch.compiler.is_compiling() or x.device.type != "cpu":
        return False
    return bool((lengths == x.shape[1]).all())


def mask_padding(x, lengths):
    if _all_valid(x, lengths):
        return x
    t = torch.arange(x.shape[1], device=x.device)
    keep = (t[None, :] < lengths.to(x.device)[:, None]).to(x.dtype)
    return x * keep.reshape(keep.shape + (1,) * (x.dim() - 2))


def _window(padded, lengths, seq):
    """Rows lengths[b] .. lengths[b] + K-2 of padded [B, K-1+T, C]: the K-1 inputs ending at row
    lengths[b] - 1 of the chunk."""
    width = padded.shape[1] - seq
    if _all_valid(padded[:, width:], lengths):
        return padded[:, seq:]
    window = lengths.long().to(padded.device)[:, None] + torch.arange(width, device=padded.device)
    return gather_rows(padded, window)


def conv_window(conv_state, x, lengths):
    return _window(torch.cat([conv_state.to(x.dtype), x], dim=1), lengths, x.shape[1])


def causal_conv1d(x, conv_state, weight, bias, lengths, activation=None):
    if _gpu.active(x):
        out = _gpu.dispatch("causal_conv1d", x, conv_state, weight, bias, lengths, activation)
        if out is not None:
            return out
    width = weight.shape[1]
    seq = x.shape[1]
    padded = torch.cat([conv_state.to(x.dtype), x], dim=1)  # [B, K-1+T, C]
    if seq <= 16:  # short chunks: a windowed product beats conv1d's setup cost
        y = torch.einsum("btck,ck->btc", padded.unfold(1, width, 1), weight)
        y = y if bias is None else y + bias
    else:
        y = tf.conv1d(padded.transpose(1, 2), weight.unsqueeze(1), bias, groups=weight.shape[0])
        y = y.transpose(1, 2)
    return (y if activation is None else _ACTIVATIONS[activation](y)), _window(padded, lengths, seq)


def mamba_dt(dt, dt_bias, lo, hi, lengths):
    if _gpu.active(dt):
        out = _gpu.dispatch("mamba_dt", dt, dt_bias, lo, hi, lengths)
        if out is not None:
            return out
    return mask_padding(clamp(activation(dt + dt_bias, "softplus"), lo, hi), lengths)


def _heads(t, num_heads):
    """[B, T, G, N] -> [B, T, H, N], group g serving heads g*H/G ... (g+1)*H/G - 1."""
    return t.repeat_interleave(num_heads // t.shape[2], dim=2)


def _segment_sums(a):
    """a [..., Q] -> [..., Q, Q] with out[i, j] = a[j+1] + ... + a[i] for i >= j, -inf above."""
    q = a.shape[-1]
    below = torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = torch.cumsum(a[..., None, :].expand(*a.shape, q).transpose(-1, -2).masked_fill(~below, 0), dim=-2)
    causal = torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~causal, float("-inf"))


def _ssm_chunked(x, dt, A, B, C, state, chunk_size):
    """SSD: quadratic attention-like form inside chunks, a linear recurrence across chunks."""
    batch, seq, heads, _ = x.shape
    chunk_size = min(chunk_size, seq)  # a short (verify) chunk is one chunk: no padding work
    pad = (-seq) % chunk_size
    if pad:
        x, dt, B, C = (tf.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    n = (seq + pad) // chunk_size
    xs = (x * dt[..., None]).unflatten(1, (n, chunk_size))          # [b, c, q, h, p]
    Bc, Cc = B.unflatten(1, (n, chunk_size)), C.unflatten(1, (n, chunk_size))  # [b, c, q, h, n]
    a = (dt * A).unflatten(1, (n, chunk_size)).permute(0, 3, 1, 2)  # [b, h, c, q]
    a_cum = torch.cumsum(a, dim=-1)
    decay_in = torch.exp(_segment_sums(a))                          # [b, h, c, q, q]
    scores = torch.einsum("bcihn,bcjhn->bhcij", Cc, Bc) * decay_in
    y_diag = torch.einsum("bhcij,bcjhp->bcihp", scores, xs)
    to_end = torch.exp(a_cum[..., -1:] - a_cum)                     # [b, h, c, q]
    chunk_states = torch.einsum("bcjhn,bhcj,bcjhp->bchpn", Bc, to_end, xs)
    chunk_decay = torch.exp(a_cum[..., -1])                         # [b, h, c]
    entering, h = [], state
    for c in range(n):
        entering.append(h)
        h = h * chunk_decay[:, :, c, None, None] + chunk_states[:, c]
    entering = torch.stack(entering, 1)                             # [b, c, h, p, n]
    y_off = torch.einsum("bcihn,bchpn->bcihp", Cc, entering) * torch.exp(a_cum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).flatten(1, 2)[:, :seq]
    return y, h


# Chunks of up to this many tokens (decode, verify, a short draft_target chunk) run the recurrence
# token by token, as decode does: no [T, T] decay matrix and no batched products, which a compiled
# graph would call out to BLAS for (~5 us each, 18 per verify of the embedded target); and the state
# after each row is the one a decode of that row computes.
RECURRENT_TOKENS = 8


def _ssm_update(h, x, dt, A, B):
    """The state after one token: h [b, h, p, n] decayed by exp(dt A), plus dt x (outer) B."""
    return h * torch.exp(dt * A)[..., None, None] + (dt[..., None] * x)[..., None] * B[:, :, None, :]


def _ssm_states(h, x, dt, A, B):
    """The state after each row of a chunk (x [b, t, h, p], dt [b, t, h], B [b, t, h, n]), in order."""
    for t in range(x.shape[1]):
        h = _ssm_update(h, x[:, t], dt[:, t], A, B[:, t])
        yield h


def ssm_scan(x, dt, A, B, C, D, state, chunk_size):
    if _gpu.active(x):
        out = _gpu.dispatch("ssm_scan", x, dt, A, B, C, D, state, chunk_size)
        if out is not None:
            return out
    dtype = x.dtype
    heads = x.shape[2]
    xf, dtf, Af = x.float(), dt.float(), A.float()
    Bf, Cf = _heads(B.float(), heads), _heads(C.float(), heads)
    if x.shape[1] <= RECURRENT_TOKENS:
        states = list(_ssm_states(state.float(), xf, dtf, Af, Bf))
        y = torch.stack([(h * Cf[:, t, :, None, :]).sum(-1) for t, h in enumerate(states)], 1)
        return (y + xf * D.float()[:, None]).to(dtype), states[-1]
    y, new_state = _ssm_chunked(xf, dtf, Af, Bf, Cf, state.float(), chunk_size)
    return (y + xf * D.float()[:, None]).to(dtype), new_state


def ssm_state(x, dt, A, B, state):
    if _gpu.active(x):
        out = _gpu.dispatch("ssm_state", x, dt, A, B, state)
        if out is not None:
            return out
    xf, dtf = x.float(), dt.float()
    Bf = _heads(B.float(), x.shape[2])
    if x.shape[1] <= RECURRENT_TOKENS:   # a verify chunk's rollback: decode's recurrence, row by row
        return list(_ssm_states(state.float(), xf, dtf, A.float(), Bf))[-1]
    a_cum = torch.cumsum(dtf * A.float(), dim=1)                              # [b, t, h]
    to_end = torch.exp(a_cum[:, -1:] - a_cum) * dtf                          # decay to the chunk end x dt
    h = state.float() * torch.exp(a_cum[:, -1])[..., None, None]
    return h + torch.einsum("bth,bthp,bthn->bhpn", to_end, xf, Bf)


def kv_cache_update(cache, new, positions):
    """Writes in place (the runtime donates its buffer) and returns the cache. ``index_put_``, not
    ``scatter_``: inductor writes it into the input buffer, where a scatter became a copy of the
    whole cache, the rows written into it, and the copy written back (each step, each cache)."""
    rows = torch.arange(cache.shape[0], device=cache.device)[:, None].expand(positions.shape)
    return cache.index_put_((rows, positions.long()), new.to(cache.dtype))


def gqa_scores(q, k_cache, scale):
    """q [B, T, Hq, D] against every cache slot: scale * q.k as [B, Hkv, g, T, S] (g = Hq / Hkv).
    Several rows: a KV head's query heads as rows of one product ([g*T, D] x [D, S]), no copy of the
    cache per query head (broadcasting k over g makes one). One row: the broadcast form, which
    torch.compile turns into one pointwise-and-sum kernel (compiled decode 0.51 ms, 0.72 with a bmm)."""
    batch, seq, q_heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    qg = q.reshape(batch, seq, kv_heads, group, dim).permute(0, 2, 3, 1, 4)     # [B, Hkv, g, T, D]
    k = k_cache.permute(0, 2, 3, 1)                                             # [B, Hkv, D, S]
    if seq > 1:
        scores = torch.matmul(qg.reshape(batch, kv_heads, group * seq, dim), k).reshape(batch, kv_heads, group, seq, -1)
    else:
        scores = torch.matmul(qg, k[:, :, None])
    return scores * scale


def gqa_mix(probs, v_cache):
    """probs [B, Hkv, g, T, S] over the cache's values: [B, T, Hq, D] (grouped as ``gqa_scores``)."""
    batch, kv_heads, group, seq, _ = probs.shape
    v = v_cache.permute(0, 2, 1, 3)                                             # [B, Hkv, S, D]
    if seq > 1:
        out = torch.matmul(probs.reshape(batch, kv_heads, group * seq, -1), v).reshape(batch, kv_heads, group, seq, -1)
    else:
        out = torch.matmul(probs, v[:, :, None])                                # [B, Hkv, g, T, D]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, seq, kv_heads * group, -1)


def attention(q, k_cache, v_cache, positions, scale, window=None, sinks=None):
    if _gpu.active(q):
        out = _gpu.dispatch("attention", q, k_cache, v_cache, positions, scale, window, sinks)
        if out is not None:
            return out
    batch, seq, q_heads, _ = q.shape
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    scores = gqa_scores(q, k_cache, scale)
    keys = torch.arange(k_cache.shape[1], device=q.device)
    visible = keys[None, None, :] <= positions.long()[:, :, None]              # [B, T, S]
    if window is not None:
        visible = visible & (keys[None, None, :] > positions.long()[:, :, None] - int(window))
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:  # one more logit per head in the denominator, attending to nothing
        sink = sinks.float().reshape(1, kv_heads, group, 1, 1).expand(batch, -1, -1, seq, 1)
        probs = torch.softmax(torch.cat([scores.float(), sink], -1), dim=-1)[..., :-1].to(q.dtype)
    return gqa_mix(probs, v_cache)


def route(router_input, router_weight, router_bias, top_k, n_group, topk_group, norm_topk_prob,
          routed_scaling_factor):
    """Expert choice and weights: [N, k] indices and fp32 weights (the MoE router's math)."""
    scores = torch.sigmoid(tf.linear(router_input.float(), router_weight.float()))
    choice = scores + router_bias.float()
    experts = scores.shape[-1]
    grouped = choice.view(-1, n_group, experts // n_group)
    group_scores = grouped.topk(min(2, experts // n_group), dim=-1)[0].sum(-1)
    best_groups = group_scores.topk(topk_group, dim=-1)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, best_groups, 1.0).bool()
    keep = keep[:, :, None].expand_as(grouped).reshape(-1, experts)
    index = choice.masked_fill(~keep, float("-inf")).topk(top_k, dim=-1)[1]
    weights = scores.gather(1, index)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return index, weights * routed_scaling_factor


def _moe_branch_free(x, index, weights, up, down, act, few_rows=False):
    """Routed experts for x [N, H] with no loop over the chosen experts (the ``torch.compile`` form):
    where 3x the chosen (token, expert) pairs are fewer than the experts, gather the chosen experts'
    weights (a gather reads, writes and re-reads each chosen matrix); else run every expert densely
    and weight it by the router weights scattered over all experts (0 for the ones not chosen).
    Both sum the same products as the eager loop. Measured on the embedded target (4 experts, top
    2, CPU, compiled decode step): dense 1.3 ms, gather 2.4 ms."""
    if 3 * index.numel() < up.shape[0]:
        h = _ACTIVATIONS[act](torch.einsum("nkih,nh->nki", up[index], x))
        h = torch.einsum("nkhi,nki->nkh", down[index], h)
        return (h.float() * weights[..., None]).sum(1).to(x.dtype)
    dense = torch.zeros(x.shape[0], up.shape[0], dtype=torch.float32, device=x.device).scatter_(1, index, weights)
    rows = x[None] if few_rows else x    # [1, n, h]: the small-row kernel's shape (``linear``)
    h = _ACTIVATIONS[act](linear(rows, up.reshape(-1, up.shape[-1])).reshape(x.shape[0], *up.shape[:2]))
    if few_rows and _small_linear is not None and up.shape[0] <= EXPERT_LOOP_MAX:  # one product per expert
        h = torch.stack([linear(h[None, :, e], down[e])[0] for e in range(down.shape[0])], 1)
    else:
        h = torch.einsum("ehi,nei->neh", down, h)
    return (h.float() * dense[..., None]).sum(1).to(x.dtype)


def moe(router_input, x, router_weight, router_bias, up, down, top_k, n_group, topk_group,
        norm_topk_prob, routed_scaling_factor, act):
    if _gpu.active(x):
        out = _gpu.dispatch("moe", router_input, x, router_weight, router_bias, up, down, top_k, n_group, topk_group,
                            norm_topk_prob, routed_scaling_factor, act)
        if out is not None:
            return out
    shape = x.shape
    up, down = (w.dequantize() if getattr(w, "is_nvfp4", False) else w for w in (up, down))  # NVFP4 stacks
    router_input, x = router_input.reshape(-1, router_input.shape[-1]), x.reshape(-1, shape[-1])
    index, weights = route(router_input, router_weight, router_bias, top_k, n_group, topk_group,
                           norm_topk_prob, routed_scaling_factor)
    if _moe_routed is not None and act in MOE_ROUTED_ACTIVATIONS and _kernel_runs(x, up, shape):
        # a few rows on the compiled path: only the chosen experts' products, in the kernel
        form = PRODUCT_FORMS.index(_product_form) if x.dtype == torch.float32 else 0
        return _moe_routed(x, index, weights, up, down, MOE_ROUTED_ACTIVATIONS.index(act), form).reshape(shape)
    if torch.compiler.is_compiling():  # no data-dependent loop over the chosen experts
        return _moe_branch_free(x, index, weights, up, down, act, _few_rows((1, *x.shape))).reshape(shape)
    if index.numel() <= 16 and x.is_cuda:  # a few tokens on a GPU: gather the chosen experts' weights
        # (on the CPU the per-expert loop below is 2-3x faster: the gather copies whole weight matrices)
        h = _ACTIVATIONS[act](torch.einsum("nkih,nh->nki", up[index], x))
        h = torch.einsum("nkhi,nki->nkh", down[index], h)
        return (h.float() * weights[..., None]).sum(1).to(x.dtype).reshape(shape)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(index).tolist():
        token, slot = torch.where(index == expert)
        h = _ACTIVATIONS[act](tf.linear(x[token], up[expert]))
        h = tf.linear(h, down[expert]) * weights[token, slot, None]
        out.index_add_(0, token, h.float())
    return out.to(x.dtype).reshape(shape)


# --- hidden-state capture ----------------------------------------------------------------------------
from plugins.hidden_capture import hidden_capture_reference as _hidden_capture_reference  # noqa: E402


def capture_buffer(x, n_slots):
    return torch.zeros(*x.shape[:-1], int(n_slots) * x.shape[-1], dtype=x.dtype, device=x.device)


def hidden_capture(residual, delta, buffer, slot):
    """The plugin's torch reference (functional: buffer_new is a new tensor); its Triton kernel, one
    launch, for CUDA tensors."""
    if _gpu.active(residual):
        out = _gpu.dispatch("hidden_capture", residual, delta, buffer, slot)
        if out is not None:
            return out
    return _hidden_capture_reference(residual, delta, buffer, slot)


# --- draft-model ops (EAGLE / EAGLE-3) --------------------------------------------------------------
from builder.rope_frequencies import rope_attention_scale, rope_inv_freq  # noqa: E402


def rope(x, positions, theta, rotary_dim=None, scaling=None):
    dim = x.shape[-1]
    rotary_dim = dim if rotary_dim is None else int(rotary_dim)
    if rotary_dim > dim:
        raise ValueError(f"rope: rotary_dim {rotary_dim} exceeds the head dim {dim}")
    inv_freq = rope_inv_freq(theta, rotary_dim, scaling).to(x.device)
    freqs = positions.to(torch.float32)[..., None] * inv_freq               # [B, T, rd/2]
    angles = torch.cat([freqs, freqs], dim=-1)[:, :, None, :]             # [B, T, 1, rd]
    xf = x.float()
    xr, rest = xf[..., :rotary_dim], xf[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    gain = rope_attention_scale(scaling)
    out = xr * (torch.cos(angles) * gain) + rotated * (torch.sin(angles) * gain)
    if rotary_dim < dim:
        out = torch.cat([out, rest], dim=-1)
    return out.to(x.dtype)


def where(cond, a, b):
    if not isinstance(cond, torch.Tensor):
        cond = torch.as_tensor(cond)
    return torch.where(cond if cond.dtype == torch.bool else cond != 0, a, b)


# --- NVFP4 weights (builder/nvfp4_format.py) and the FP4 Markov head (plugins/fp4_markov_head.py) -----
from builder.nvfp4_format import dequantize_nvfp4 as _dequantize_nvfp4  # noqa: E402
from plugins.fp4_markov_head import fp4_markov_head_reference as _fp4_markov_head_reference  # noqa: E402


def linear_nvfp4(x, packed, scale, scale_2, shape, bias=None):
    """Dequantize on the fly, in x's dtype (block scales, then weights, each rounded to it, as the
    TensorRT lowering does), then a plain linear."""
    if _gpu.active(x):
        out = _gpu.dispatch("linear_nvfp4", x, packed, scale, scale_2, shape, bias)
        if out is not None:
            return out
    w = _dequantize_nvfp4(packed, scale, scale_2, shape, x.dtype)
    return tf.linear(x, w.to(x.device), bias)


def fp4_markov_head(logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2):
    """The plugin's torch reference (its Triton kernel for CUDA tensors)."""
    if _gpu.active(logits):
        out = _gpu.dispatch("fp4_markov_head", logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2)
        if out is not None:
            return out
    return _fp4_markov_head_reference(logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2)
