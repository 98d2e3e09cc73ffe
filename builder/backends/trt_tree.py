"""TensorRT lowerings of the token-tree ops (``builder.functional.tree_*``): native layers only
(gathers along each row's ancestor links, masked matrix products), checked by the CPU interpreter."""
from __future__ import annotations

import torch

from builder.backends.trt_dense import _act, _gather_rows
from builder.backends.trt_dtypes import torch_dtype
from builder.backends.trt_layers import EW, UN
from builder.backends.trt_mixers import _HALF, _heads, _ssm_inputs
from builder.backends.trt_recorder import _int_dtype, _recorder


def _broadcast_rows(r, row, like, dtype, what):
    """A constant row [1, L] repeated for every sequence of ``like`` [B, ...] -> [B, L]."""
    zeros = r.zeros([r.dim(like, 0), 1], dtype, what + "_zeros")
    return r.ew(r._constant(row, what), zeros, EW.SUM, what)


def tree_conv1d(x, conv_state, weight, bias, parents, activation=None):
    r = _recorder(x, conv_state, parents)
    with r.op("tree_conv1d", "native: K-1 gathers along ancestor links, K taps multiply-added"):
        t, state, par = r.itensor(x), r.itensor(conv_state, "conv_state"), r.itensor(parents, "parents")
        dtype = torch_dtype(t.dtype)
        idt = _int_dtype(par)
        width = int(weight.shape[1])
        padded = r.concat([r.cast(state, dtype, "state_cast"), t], 1, "padded")     # [B, K-1+T, C]
        seq = r.dim(t, 1)
        # each padded row's predecessor: conv-state rows the previous one, the root the last conv-state
        # row, a tree row its parent
        before = _broadcast_rows(r, torch.arange(-1, width - 2, dtype=idt)[None], t, idt, "state_links")
        tree_links = r.ew_scalar(par, width - 1, EW.SUM, "tree_links")
        is_root = r.ew(r.reshape(r.iota(seq, idt, what="rows"), [1, -1], "rows_row"),
                       r.scalar(0, idt, 2, "root_row"), EW.EQUAL, "is_root")
        tree_links = r.select(is_root, r.scalar(width - 2, idt, 2, "root_link"), tree_links, "root_linked")
        up = r.concat([before, tree_links], 1, "links")                              # [B, K-1+T]
        index = r.ew(r.reshape(r.iota(seq, idt, start=width - 1, what="self_rows"), [1, -1], "self_row"),
                     r.zeros([r.dim(t, 0), 1], idt, "batch_zeros"), EW.SUM, "self_index")  # [B, T]
        acc = torch.float32 if dtype in _HALF else dtype
        w = r.cast(r.weight(weight), acc, "weight_cast")                              # [C, K]
        padded = r.cast(padded, acc, "upcast")
        y = None
        for back in range(width):                       # tap ``back`` rows up the path: weight column K-1-back
            rows = _gather_rows(r, padded, index)                                  # [B, T, C]
            tap = r.reshape(r.slice(w, 1, width - 1 - back, 1, f"tap{back}"), [1, 1, -1], f"tap{back}_row")
            term = r.ew(rows, tap, EW.PROD, f"mul{back}")
            y = term if y is None else r.ew(y, term, EW.SUM, f"acc{back}")
            if back < width - 1:
                index = r.ew_scalar(_gather_rows(r, up, index), 0, EW.MAX, f"up{back}")
        if bias is not None:
            y = r.ew(y, r.reshape(r.cast(r.weight(bias, "bias"), acc), [1, 1, -1], "bias_row"), EW.SUM, "add_bias")
        y = r.cast(y, dtype, "downcast")
        return r.wrap(y if activation is None else _act(r, y, activation))


def tree_ssm_scan(x, dt, A, B, C, D, state, ancestors):
    r = _recorder(x, dt, B, C, state, ancestors)
    with r.op("tree_ssm_scan", "native: path-summed log decay, ancestor-masked quadratic form"):
        tx = r.itensor(x)
        dtype = torch_dtype(tx.dtype)
        heads = int(A.shape[0])
        f32 = torch.float32
        xf, a, u, Bf, h0 = _ssm_inputs(r, x, dt, A, B, state)
        Cf = _heads(r, r.cast(r.itensor(C, "C"), f32, "C_fp32"), heads, "C_heads")
        mask = r.itensor(ancestors, "ancestors")                                      # [B, T, T] bool
        path = r.matmul(r.cast(mask, f32, "ancestors_fp32"), a, what="path_log_decay")  # [B, T, H]
        ph = r.transpose(path, [0, 2, 1], "path_heads_first")                         # [B, H, T]
        gap = r.ew(r.reshape(ph, [0, 0, -1, 1], "path_i"), r.reshape(ph, [0, 0, 1, -1], "path_j"), EW.SUB, "gap")
        ninf = r.scalar(float("-inf"), f32, 4, "neg_inf")
        decay = r.exp(r.select(r.transpose(r.reshape(mask, [0, 0, 0, 1], "mask_column"), [0, 3, 1, 2], "mask_heads"), gap, ninf, "masked_gap"), "decay")
        Ch = r.transpose(Cf, [0, 2, 1, 3], "C_heads_first")                           # [B, H, T, N]
        scores = r.ew(r.matmul(Ch, r.transpose(Bf, [0, 2, 1, 3], "B_heads_first"), transpose_b=True, what="CB"),
                      decay, EW.PROD, "scores")                                        # [B, H, T, T]
        y = r.matmul(scores, r.transpose(u, [0, 2, 1, 3], "u_heads_first"), what="y_tree")   # [B, H, T, P]
        y_in = r.ew(r.matmul(Ch, h0, transpose_b=True, what="y_state"),              # [B, H, T, P]
                    r.reshape(r.exp(ph, "path_decay"), [0, 0, 0, 1], "path_decay_column"), EW.PROD, "y_state_decay")
        y = r.transpose(r.ew(y, y_in, EW.SUM, "y_heads_first"), [0, 2, 1, 3], "y")   # [B, T, H, P]
        d = r.reshape(r.cast(r.weight(D, "D"), f32), [1, 1, -1, 1], "D_column")
        return r.wrap(r.cast(r.ew(y, r.ew(xf, d, EW.PROD, "skip"), EW.SUM, "add_skip"), dtype, "downcast"))


def tree_attention(q, k_cache, v_cache, positions, ancestors, scale):
    r = _recorder(q, k_cache, positions, ancestors)
    with r.op("tree_attention", "native: matmul + (rows before the chunk | ancestor rows) mask + fp32 softmax + matmul"):
        tq, k, vt, scores, dtype, q_heads, dim = _scores(r, q, k_cache, v_cache, scale)
        pos, mask = r.itensor(positions, "positions"), r.itensor(ancestors, "ancestors")
        pdt = _int_dtype(pos)
        seq = r.dim(tq, 1)
        keys = r.reshape(r.iota(r.dim(k, 1), pdt, what="keys"), [1, -1], "keys_row")       # [1, S]
        rel = r.ew(keys, r.slice(pos, 1, 0, 1, "base"), EW.SUB, "rel")                    # [B, S]: key - base
        before = r.ew(rel, r.scalar(0, pdt, 2, "zero"), EW.LESS, "before_chunk")
        end = r.scalar(seq, pdt, 2, "chunk_end") if isinstance(seq, int) else r.reshape(r.cast(seq, pdt, "seq_cast"),
                                                                                         [1, 1], "chunk_end")
        inside = r.ew(rel, end, EW.LESS, "below_end")
        inside = r.ew(r.unary(before, UN.NOT, "not_before"), inside, EW.AND, "in_chunk")
        column = r.select(inside, rel, r.scalar(0, pdt, 2, "zero_column"), "chunk_column")
        by_key = _gather_rows(r, r.transpose(r.cast(mask, torch.int32, "mask_int"), [0, 2, 1], "mask_by_row"),
                                 column)                                                     # [B, S, T]
        ancestor = r.ew(r.transpose(by_key, [0, 2, 1], "mask_by_query"), r.scalar(0, torch.int32, 3, "zero_int"),
                        EW.GREATER, "is_ancestor")                                          # [B, T, S]
        visible = r.ew(r.reshape(before, [0, 1, -1], "before_row"),
                       r.ew(ancestor, r.reshape(inside, [0, 1, -1], "inside_row"), EW.AND, "ancestor_in_chunk"),
                       EW.OR, "visible")
        return r.wrap(_masked(r, vt, scores, visible, dtype, q_heads, dim))


def masked_attention(q, k_cache, v_cache, visible, scale):
    r = _recorder(q, k_cache, visible)
    with r.op("masked_attention", "native: matmul + given visibility mask + fp32 softmax + matmul"):
        _, _, vt, scores, dtype, q_heads, dim = _scores(r, q, k_cache, v_cache, scale)
        mask = r.itensor(visible, "visible")
        visible = r.ew(r.cast(mask, torch.int32, "visible_int"), r.scalar(0, torch.int32, 3, "zero_int"),
                       EW.GREATER, "is_visible")                                         # [B, T, S] bool
        return r.wrap(_masked(r, vt, scores, visible, dtype, q_heads, dim))


def _scores(r, q, k_cache, v_cache, scale):
    """GQA's scaled q.k [B, Hkv, g, T, S] and the values [B, Hkv, 1, S, D] it will weigh."""
    tq, k, v = r.itensor(q), r.itensor(k_cache, "k_cache"), r.itensor(v_cache, "v_cache")
    dtype = torch_dtype(tq.dtype)
    q_heads, dim, kv_heads = tq.shape[2], tq.shape[3], k.shape[2]
    group = q_heads // kv_heads
    qg = r.transpose(r.reshape(tq, [0, 0, kv_heads, group, dim], "q_groups"), [0, 2, 3, 1, 4], "q")
    kt = r.reshape(r.transpose(k, [0, 2, 3, 1], "k_transposed"), [0, 0, 1, dim, -1], "k")
    vt = r.reshape(r.transpose(v, [0, 2, 1, 3], "v_heads_first"), [0, 0, 1, -1, dim], "v")
    scores = r.ew_scalar(r.matmul(qg, kt, what="qk"), float(scale), EW.PROD, "scale")
    return tq, k, vt, scores, dtype, q_heads, dim


def _masked(r, vt, scores, visible, dtype, q_heads, dim):
    """Scores [B, Hkv, g, T, S] masked by visible [B, T, S], softmax in fp32, times values."""
    visible = r.transpose(r.reshape(visible, [0, 0, 0, 1, 1], "visible_columns"), [0, 3, 4, 1, 2], "visible_heads")
    scores = r.select(visible, scores, r.scalar(float("-inf"), dtype, 5, "neg_inf"), "mask")
    probs = r.cast(r.softmax(r.cast(scores, torch.float32, "scores_fp32"), -1), dtype, "probs_cast")
    out = r.matmul(probs, vt, what="pv")
    return r.reshape(r.transpose(out, [0, 3, 1, 2, 4], "out_time_first"), [0, 0, q_heads, dim], "out")
