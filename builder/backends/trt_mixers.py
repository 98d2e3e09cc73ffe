"""TensorRT lowerings of the sequence mixers: the Mamba-2 causal conv and SSM (chunked SSD scan, the
state after a chunk), the KV-cache update, attention (GQA, sliding window, sinks) and rotary
embeddings. Same names and signatures as their ``torch_backend`` twins; native layers only, no loops,
every batch/time/cache dim dynamic (shapes that depend on them are computed in the network).
"""
from __future__ import annotations

import numpy as np
import torch

from builder.rope_frequencies import rope_attention_scale as _rope_attention_scale
from builder.rope_frequencies import rope_inv_freq as _rope_inv_freq
from builder.backends.trt_dense import _act, _gather_rows
from builder.backends.trt_dtypes import torch_dtype
from builder.backends.trt_import import trt
from builder.backends.trt_layers import EW, UN
from builder.backends.trt_recorder import Recorder, _int_dtype, _recorder
from builder.errors import BuildError

_HALF = (torch.float16, torch.bfloat16)


def _segment_sums(r: Recorder, a, size):
    """a [..., m] fp32 -> [..., m, m]: out[i, j] = a[j+1] + ... + a[i] for i >= j, -inf above.

    Mirrors torch_backend._segment_sums: a cumulative sum down the columns of a masked expansion.
    ``size`` is m when known at build time (constant masks), else None (masks from iotas).
    """
    rank = r.rank(a)
    col = r.reshape(a, [0] * rank + [1], "segsum_column")  # [..., m, 1]: element (i, j) = a[i]
    if isinstance(size, int):
        i = np.arange(size)
        below = r._constant(i[None, :] < i[:, None], "below_mask")
        causal = r._constant(i[None, :] <= i[:, None], "causal_mask")
    else:
        m = r.dim(a, rank - 1)
        idx = r.iota(m, torch.int64, what="index")
        rows, cols = r.reshape(idx, [-1, 1], "rows"), r.reshape(idx, [1, -1], "cols")
        below = r.ew(cols, rows, EW.LESS, "below_mask")
        causal = r.unary(r.ew(cols, rows, EW.GREATER, "above_mask"), UN.NOT, "causal_mask")
    zero = r.scalar(0.0, torch.float32, rank + 1, "zero")
    sums = r.cumsum(r.select(below, col, zero, "strict_lower"), rank - 1, "cumsum")
    return r.select(causal, sums, r.scalar(float("-inf"), torch.float32, rank + 1, "neg_inf"), "segsum")


# --- sequence mixers ------------------------------------------------------------------------------
def _conv_window(r, padded, lens, width: int):
    """Rows lengths[b] .. lengths[b] + K-2 of padded [B, K-1+T, C] (gather ND)."""
    offsets = r._constant(torch.arange(width - 1, dtype=_int_dtype(lens)).reshape(1, -1), "window")
    rows = r.ew(r.reshape(lens, [0, 1], "lengths_column"), offsets, EW.SUM, "state_rows")
    return _gather_rows(r, padded, rows)


def conv_window(conv_state, x, lengths):
    r = _recorder(conv_state, x, lengths)
    with r.op("conv_window", "native: concatenation + gather of the K-1 rows ending at lengths - 1"):
        t, state, lens = r.itensor(x), r.itensor(conv_state, "conv_state"), r.itensor(lengths, "lengths")
        padded = r.concat([r.cast(state, torch_dtype(t.dtype), "state_cast"), t], 1, "padded")
        return r.wrap(_conv_window(r, padded, lens, int(state.shape[1]) + 1))


def causal_conv1d(x, conv_state, weight, bias, lengths, activation=None):
    r = _recorder(x, conv_state, lengths)
    with r.op("causal_conv1d", "native: K shifted slices multiply-added (in fp32 for half types), state by gather"):
        t, state, lens = r.itensor(x), r.itensor(conv_state, "conv_state"), r.itensor(lengths, "lengths")
        dtype = torch_dtype(t.dtype)
        width = int(weight.shape[1])
        padded = r.concat([r.cast(state, dtype, "state_cast"), t], 1, "padded")  # [B, K-1+T, C]
        seq = r.dim(t, 1)
        acc_dtype = torch.float32 if dtype in _HALF else dtype
        pf = r.cast(padded, acc_dtype, "upcast")
        w = r.cast(r.weight(weight), acc_dtype, "weight_cast")  # [C, K]
        y = None
        for k in range(width):
            tap = r.reshape(r.slice(w, 1, k, 1, f"tap{k}"), [1, 1, -1], f"tap{k}_row")
            term = r.ew(r.slice(pf, 1, k, seq, f"shift{k}"), tap, EW.PROD, f"mul{k}")
            y = term if y is None else r.ew(y, term, EW.SUM, f"acc{k}")
        if bias is not None:
            y = r.ew(y, r.reshape(r.cast(r.weight(bias, "bias"), acc_dtype), [1, 1, -1], "bias_row"),
                     EW.SUM, "add_bias")
        y = r.cast(y, dtype, "downcast")
        if activation is not None:
            y = _act(r, y, activation)
        return r.wrap(y), r.wrap(_conv_window(r, padded, lens, width))


def _heads(r, t, heads: int, what: str):
    """[B, T, G, N] -> [B, T, H, N] (group g serves heads g*H/G ... (g+1)*H/G - 1)."""
    groups = t.shape[2]
    if groups == heads:
        return t
    idx = r._constant(torch.arange(heads, dtype=torch.int32) // (heads // groups), "head_groups")
    return r.gather(t, idx, 2, what)


def _ssm_inputs(r, x, dt, A, B, state):
    """fp32 pieces shared by the scan and the state: (x, a = dt*A [B,T,H], u = x*dt, B per head, h0)."""
    tx = r.itensor(x)
    heads = int(A.shape[0])
    f32 = torch.float32
    xf = r.cast(tx, f32, "x_fp32")
    dtf = r.cast(r.itensor(dt, "dt"), f32, "dt_fp32")
    Bf = _heads(r, r.cast(r.itensor(B, "B"), f32, "B_fp32"), heads, "B_heads")
    h0 = r.cast(r.itensor(state, "state"), f32, "state_fp32")
    a = r.ew(dtf, r.reshape(r.cast(r.weight(A, "A"), f32), [1, 1, -1], "A_row"), EW.PROD, "dtA")  # [B,T,H]
    u = r.ew(xf, r.reshape(dtf, [0, 0, 0, 1], "dt_column"), EW.PROD, "x_dt")  # [B,T,H,P]
    return xf, a, u, Bf, h0


def ssm_scan(x, dt, A, B, C, D, state, chunk_size):
    r = _recorder(x, dt, B, C, state)
    desc = ("native: chunked SSD (pad to chunk multiple, intra-chunk quadratic form, "
            "inter-chunk recurrence as a matrix over chunk decays, no loops)")
    with r.op("ssm_scan", desc):
        tx = r.itensor(x)
        dtype = torch_dtype(tx.dtype)
        heads, head_dim = int(A.shape[0]), tx.shape[3]
        state_size = r.itensor(B).shape[3]
        f32 = torch.float32
        xf, a, u, Bf, h0 = _ssm_inputs(r, x, dt, A, B, state)
        Cf = _heads(r, r.cast(r.itensor(C, "C"), f32, "C_fp32"), heads, "C_heads")
        y, new_state = _ssm_chunked(r, u, a, Bf, Cf, h0, int(chunk_size), head_dim, state_size)
        d = r.reshape(r.cast(r.weight(D, "D"), f32), [1, 1, -1, 1], "D_column")
        y = r.cast(r.ew(y, r.ew(xf, d, EW.PROD, "skip"), EW.SUM, "add_skip"), dtype, "downcast")
        return r.wrap(y), r.wrap(new_state)


def ssm_state(x, dt, A, B, state):
    r = _recorder(x, dt, B, state)
    with r.op("ssm_state", "native: cumulative log decay, decay-weighted inputs, one matmul over time"):
        _, a, u, Bf, h0 = _ssm_inputs(r, x, dt, A, B, state)
        seq = r.dim(a, 1)
        acum = r.cumsum(a, 1, "a_cumsum")                                              # [B,T,H]
        last = r.slice(acum, 1, r.dim_arith(seq, 1, EW.SUB), 1, "total_log_decay")     # [B,1,H]
        to_end = r.exp(r.ew(last, acum, EW.SUB, "to_end_log"), "to_end")               # [B,T,H]
        weighted = r.ew(u, r.reshape(to_end, [0, 0, 0, 1], "to_end_column"), EW.PROD, "u_to_end")
        update = r.matmul(r.transpose(weighted, [0, 2, 3, 1], "u_heads_first"),       # [B,H,P,T]
                          r.transpose(Bf, [0, 2, 1, 3], "B_heads_first"), what="update")  # [B,H,P,N]
        decay = r.reshape(r.exp(last, "total_decay"), [0, -1, 1, 1], "total_decay_column")  # [B,H,1,1]
        return r.wrap(r.ew(r.ew(h0, decay, EW.PROD, "decayed"), update, EW.SUM, "new_state"))


def _ssm_chunked(r, u, a, Bf, Cf, h0, Q, P, N):
    heads = a.shape[2]
    seq = r.dim(u, 1)
    padded = r.dim_arith(r.dim_arith(r.dim_arith(seq, Q - 1, EW.SUM), Q, EW.FLOOR_DIV), Q, EW.PROD,
                         "padded_length")
    u = r.pad_to(u, 1, padded, "u_pad")
    a = r.pad_to(a, 1, padded, "a_pad")
    Bf = r.pad_to(Bf, 1, padded, "B_pad")
    Cf = r.pad_to(Cf, 1, padded, "C_pad")

    def chunks(t, last, what):  # [B, Tp, H, last] -> [B, H, n, Q, last]
        return r.transpose(r.reshape(t, [0, -1, Q, heads, last], what + "_chunks"), [0, 3, 1, 2, 4], what)

    uc, Bc, Cc = chunks(u, P, "u"), chunks(Bf, N, "B"), chunks(Cf, N, "C")
    ac = r.transpose(r.reshape(a, [0, -1, Q, heads], "a_chunks"), [0, 3, 1, 2], "a")  # [B,H,n,Q]
    acum = r.cumsum(ac, 3, "a_cumsum")
    decay_in = r.exp(_segment_sums(r, ac, Q), "decay_in")  # [B,H,n,Q,Q]
    scores = r.ew(r.matmul(Cc, Bc, transpose_b=True, what="CB"), decay_in, EW.PROD, "scores")
    y_diag = r.matmul(scores, uc, what="y_diag")  # [B,H,n,Q,P]
    last = r.slice(acum, 3, Q - 1, 1, "chunk_log_decay")  # [B,H,n,1]
    to_end = r.exp(r.ew(last, acum, EW.SUB, "to_end_log"), "to_end")
    weighted = r.ew(uc, r.reshape(to_end, [0, 0, 0, 0, 1], "to_end_column"), EW.PROD, "u_to_end")
    chunk_states = r.matmul(weighted, Bc, transpose_a=True, what="chunk_states")  # [B,H,n,P,N]
    # inter-chunk recurrence h_{c+1} = h_c * exp(L_c) + S_c, solved at once:
    # [h_0 .. h_n] = exp(segsum([0, L_0 .. L_{n-1}])) @ [h0, S_0 .. S_{n-1}]
    log_decay = r.reshape(last, [0, 0, -1], "chunk_log_decay_flat")  # [B,H,n]
    n = r.dim(log_decay, 2)
    zero = r.zeros([r.dim(log_decay, 0), heads, 1], torch.float32, "zero_decay")
    lz = r.concat([zero, log_decay], 2, "chunk_log_decay_padded")  # [B,H,n+1]
    passing = r.exp(_segment_sums(r, lz, None), "state_passing")  # [B,H,n+1,n+1]
    items = r.concat([r.reshape(h0, [0, 0, 1, P * N], "state_row"),
                      r.reshape(chunk_states, [0, 0, 0, P * N], "chunk_states_flat")], 2, "states_in")
    states = r.matmul(passing, items, what="state_passing_matmul")  # [B,H,n+1,PN]
    entering = r.reshape(r.slice(states, 2, 0, n, "entering"), [0, 0, 0, P, N], "entering_split")
    new_state = r.reshape(r.slice(states, 2, n, 1, "final_state"), [0, 0, P, N], "new_state")
    y_off = r.ew(r.matmul(Cc, entering, transpose_b=True, what="y_off"),
                 r.reshape(r.exp(acum, "in_decay"), [0, 0, 0, 0, 1], "in_decay_column"), EW.PROD, "y_off_decay")
    y = r.ew(y_diag, y_off, EW.SUM, "y_chunks")  # [B,H,n,Q,P]
    y = r.reshape(r.transpose(y, [0, 2, 3, 1, 4], "y_time_first"), [0, -1, heads, P], "y_padded")
    return r.slice(y, 1, 0, seq, "y"), new_state


def kv_cache_update(cache, new, positions):
    r = _recorder(cache, new, positions)
    with r.op("kv_cache_update", "native: scatter ELEMENT along the sequence axis"):
        c, n, pos = r.itensor(cache, "cache"), r.itensor(new, "new"), r.itensor(positions, "positions")
        n = r.cast(n, torch_dtype(c.dtype), "new_cast")
        idx = r.reshape(pos, [0, 0, 1, 1], "positions_column")
        rows = [r.dim(n, i) for i in range(4)]
        zeros = r.zeros([1, 1] + rows[2:] if all(isinstance(d, int) for d in rows[2:]) else rows,
                        torch_dtype(pos.dtype), "index_zeros")
        idx = r.ew(idx, zeros, EW.SUM, "index")  # [B, T, Hkv, D]
        layer = r.network.add_scatter(c, idx, n, trt.ScatterMode.ELEMENT)
        layer.axis = 1
        return r.wrap(r._out(layer, "scatter"))


def attention(q, k_cache, v_cache, positions, scale, window=None, sinks=None):
    r = _recorder(q, k_cache, positions)
    how = "native: matmul + causal mask by positions + fp32 softmax + matmul (GQA by reshape)"
    if window is not None:
        how += "; sliding window as a second mask term"
    if sinks is not None:
        how += "; sinks as fp32 constants in a softmax written out (max, exp, sum + exp(sink))"
    with r.op("attention", how):
        tq, k, v = r.itensor(q), r.itensor(k_cache, "k_cache"), r.itensor(v_cache, "v_cache")
        pos = r.itensor(positions, "positions")
        dtype = torch_dtype(tq.dtype)
        q_heads, dim = tq.shape[2], tq.shape[3]
        kv_heads = k.shape[2]
        if q_heads < 0 or kv_heads < 0:
            raise BuildError("attention: head counts must be static")
        group = q_heads // kv_heads
        qg = r.transpose(r.reshape(tq, [0, 0, kv_heads, group, dim], "q_groups"), [0, 2, 3, 1, 4], "q")
        kt = r.reshape(r.transpose(k, [0, 2, 3, 1], "k_transposed"), [0, 0, 1, dim, -1], "k")  # [B,Hkv,1,D,S]
        vt = r.reshape(r.transpose(v, [0, 2, 1, 3], "v_heads_first"), [0, 0, 1, -1, dim], "v")  # [B,Hkv,1,S,D]
        scores = r.ew_scalar(r.matmul(qg, kt, what="qk"), float(scale), EW.PROD, "scale")  # [B,Hkv,g,T,S]
        pdt = _int_dtype(pos)
        keys = r.reshape(r.iota(r.dim(k, 1), pdt, what="keys"), [1, 1, 1, 1, -1], "keys_row")
        qpos = r.reshape(pos, [0, 1, 1, -1, 1], "query_positions")
        visible = r.unary(r.ew(keys, qpos, EW.GREATER, "future"), UN.NOT, "visible")  # [B,1,1,T,S]
        if window is not None:  # slot j is visible while j + window > position (HF's inclusive window)
            inside = r.ew(r.ew_scalar(keys, int(window), EW.SUM, "keys_plus_window"), qpos, EW.GREATER, "in_window")
            visible = r.ew(visible, inside, EW.AND, "visible_in_window")
        ninf = r.scalar(float("-inf"), dtype, 5, "neg_inf")
        scores = r.select(visible, scores, ninf, "mask")
        f32 = torch.float32
        if sinks is None:
            probs = r.cast(r.softmax(r.cast(scores, f32, "scores_fp32"), -1), dtype, "probs_cast")
        else:
            sink = r._constant(sinks.detach().float().reshape(1, kv_heads, group, 1, 1), "sinks")
            s32 = r.cast(scores, f32, "scores_fp32")
            top = r.ew(r.reduce(s32, trt.ReduceOperation.MAX, 4, True, "row_max"), sink, EW.MAX, "max_with_sink")
            e = r.exp(r.ew(s32, top, EW.SUB, "shifted"), "exp_scores")
            total = r.ew(r.reduce(e, trt.ReduceOperation.SUM, 4, True, "row_sum"),
                         r.exp(r.ew(sink, top, EW.SUB, "sink_shifted"), "exp_sink"), EW.SUM, "denominator")
            probs = r.cast(r.ew(e, total, EW.DIV, "probs"), dtype, "probs_cast")
        out = r.matmul(probs, vt, what="pv")  # [B,Hkv,g,T,D]
        out = r.reshape(r.transpose(out, [0, 3, 1, 2, 4], "out_time_first"), [0, 0, q_heads, dim], "out")
        return r.wrap(out)


# --- rotary embeddings (draft models) ------------------------------------------------------------------
def rope(x, positions, theta, rotary_dim=None, scaling=None):
    r = _recorder(x, positions)
    with r.op("rope", "native: fp32 angles positions*inv_freq (inv_freq precomputed at build: default, linear, "
                      "llama3 or yarn), cos/sin unary, rotate_half by slices + concat"):
        t, pos = r.itensor(x), r.itensor(positions, "positions")
        _int_dtype(pos)
        dim = t.shape[3]
        if dim < 0:
            raise BuildError("rope: the head dim (last dim) must be static")
        rd = dim if rotary_dim is None else int(rotary_dim)
        if rd > dim:
            raise ValueError(f"rope: rotary_dim {rd} exceeds the head dim {dim}")
        inv = _rope_inv_freq(theta, rd, scaling)
        f32 = torch.float32
        freq = r._constant(torch.cat([inv, inv]).reshape(1, 1, 1, rd), "inv_freq")
        angles = r.ew(r.reshape(r.cast(pos, f32, "positions_fp32"), [0, 0, 1, 1], "positions_column"), freq,
                      EW.PROD, "angles")  # [B, T, 1, rd]
        cos, sin = r.unary(angles, UN.COS, "cos"), r.unary(angles, UN.SIN, "sin")
        gain = _rope_attention_scale(scaling)  # YaRN's attention factor (1 otherwise)
        if gain != 1.0:
            cos, sin = r.ew_scalar(cos, gain, EW.PROD, "cos_gain"), r.ew_scalar(sin, gain, EW.PROD, "sin_gain")
        xf = r.cast(t, f32, "upcast")
        xr = xf if rd == dim else r.slice(xf, 3, 0, rd, "rotary_part")
        half = rd // 2
        first, second = r.slice(xr, 3, 0, half, "first_half"), r.slice(xr, 3, half, half, "second_half")
        rotated = r.concat([r.unary(second, UN.NEG, "neg_second_half"), first], 3, "rotate_half")
        out = r.ew(r.ew(xr, cos, EW.PROD, "x_cos"), r.ew(rotated, sin, EW.PROD, "rotated_sin"), EW.SUM, "rotate")
        if rd < dim:
            out = r.concat([out, r.slice(xf, 3, rd, dim - rd, "pass_part")], 3, "with_pass")
        return r.wrap(r.cast(out, torch_dtype(t.dtype), "downcast"))
