"""TensorRT lowerings of the dense ops: linear maps (NVFP4 weights included), embedding, norms,
activations, elementwise and shape ops, masks, ``where`` and the MoE layer. Each op has the name and
signature of its ``torch_backend`` twin (the spec of its semantics) and records native layers only,
with all batch/time dims dynamic; ``builder.backends.trt_backend`` gathers them into the op surface.
"""
from __future__ import annotations

import torch

from builder.backends.trt_dtypes import torch_dtype
from builder.backends.trt_import import trt
from builder.backends.trt_layers import ACT, EW, UN
from builder.backends.trt_recorder import Recorder, SymbolicTensor, _int_dtype, _recorder
from builder.errors import BuildError

NVFP4_LOWERING = ("native: FP4 weight + FP8 block scales dequantized by the FP32 global scale -> block "
                  "dequantize (16 along the input dim) -> matmul (with --strip_plan the three are engine inputs "
                  "or refittable constants viewing the weights file)")


# --- elementwise helpers on ITensors -----------------------------------------------------------------
def _act(r: Recorder, t, name: str):
    """Activation by config name on an ITensor, in t's dtype (multi-step ones via fp32, like torch's
    CPU kernels compute half types)."""
    dtype = torch_dtype(t.dtype)
    if name == "relu":
        return r.activation_layer(t, ACT.RELU, "relu")
    if name == "relu2":
        h = r.activation_layer(t, ACT.RELU, "relu")
        return r.ew(h, h, EW.PROD, "square")
    if name == "sigmoid":
        return r.activation_layer(t, ACT.SIGMOID, "sigmoid")
    if name == "gelu":
        if hasattr(ACT, "GELU_ERF"):
            return r.activation_layer(t, ACT.GELU_ERF, "gelu_erf")
        f = r.cast(t, torch.float32, "upcast")
        e = r.unary(r.ew_scalar(f, 2 ** -0.5, EW.PROD, "gelu_scale"), UN.ERF, "erf")
        g = r.ew(r.ew_scalar(f, 0.5, EW.PROD, "gelu_half"), r.ew_scalar(e, 1.0, EW.SUM, "gelu_one"), EW.PROD, "gelu")
        return r.cast(g, dtype, "downcast")
    if name == "silu":
        f = r.cast(t, torch.float32, "upcast")
        s = r.ew(f, r.activation_layer(f, ACT.SIGMOID, "sigmoid"), EW.PROD, "silu")
        return r.cast(s, dtype, "downcast")
    if name == "softplus":
        # torch: x if x > 20 else log1p(exp(x)). max(x, 0) + log(1 + exp(-|x|)) never overflows and
        # equals x exactly in fp32 for x > 20 (the log term is < 2.1e-9, under half an ulp of x).
        f = r.cast(t, torch.float32, "upcast")
        neg_abs = r.unary(r.unary(f, UN.ABS, "abs"), UN.NEG, "neg_abs")
        log1p = r.unary(r.ew_scalar(r.exp(neg_abs, "exp"), 1.0, EW.SUM, "one_plus"), UN.LOG, "log")
        pos = r.ew_scalar(f, 0.0, EW.MAX, "relu")
        return r.cast(r.ew(pos, log1p, EW.SUM, "softplus"), dtype, "downcast")
    raise BuildError(f"unknown activation {name!r} (expected relu2, relu, silu, gelu, softplus, sigmoid)")


def _rms(r: Recorder, h, eps: float):
    """h * rsqrt(mean(h^2, -1) + eps) in fp32."""
    ms = r.reduce(r.ew(h, h, EW.PROD, "square"), trt.ReduceOperation.AVG, -1, True, "mean_square")
    inv = r.unary(r.unary(r.ew_scalar(ms, float(eps), EW.SUM, "add_eps"), UN.SQRT, "sqrt"), UN.RECIP, "rsqrt")
    return r.ew(h, inv, EW.PROD, "normalize")


# --- dense algebra -------------------------------------------------------------------------------
def linear(x, weight, bias=None):
    r = _recorder(x)
    with r.op("linear", "native: matmul with a constant weight (transposed) + bias"):
        t = r.itensor(x)
        if torch_dtype(t.dtype) != weight.dtype:
            raise BuildError(f"linear: input is {torch_dtype(t.dtype)} but weight {tuple(weight.shape)} is "
                             f"{weight.dtype}; bind weights in the activation dtype")
        w = r.weight(weight)
        y = r.matmul(t, w, transpose_b=True)
        if bias is not None:
            y = r.ew(y, r.cast(r.weight(bias, "bias"), torch_dtype(y.dtype)), EW.SUM, "add_bias")
        return r.wrap(y)


def linear_nvfp4(x, packed, scale, scale_2, shape, bias=None):
    r = _recorder(x)
    with r.op("linear_nvfp4", NVFP4_LOWERING):
        t = r.itensor(x)
        dtype = torch_dtype(t.dtype)
        w = r.nvfp4_weight(packed, scale, scale_2, shape, dtype)
        y = r.matmul(t, w, transpose_b=True)
        if bias is not None:
            y = r.ew(y, r.cast(r.weight(bias, "bias"), dtype), EW.SUM, "add_bias")
        return r.wrap(y)


def embedding(ids, table):
    r = _recorder(ids)
    with r.op("embedding", "native: gather rows of a constant table"):
        return r.wrap(r.gather(r.weight(table, "table"), r.itensor(ids), 0, "gather"))


def rms_norm(x, weight, eps):
    r = _recorder(x)
    with r.op("rms_norm", "native: fp32 reduce-mean of squares, rsqrt, scale, cast back"):
        t = r.itensor(x)
        h = _rms(r, r.cast(t, torch.float32, "upcast"), eps)
        w = r.cast(r.weight(weight), torch.float32, "weight_fp32")
        return r.wrap(r.cast(r.ew(w, h, EW.PROD, "scale"), torch_dtype(t.dtype), "downcast"))


def gated_rms_norm(x, gate, weight, eps, group_size):
    r = _recorder(x, gate)
    with r.op("gated_rms_norm", "native: fp32 x*silu(gate), per-group rms over a reshape, cast back"):
        t, g = r.itensor(x), r.itensor(gate)
        dtype = torch_dtype(t.dtype)
        gf = r.cast(g, torch.float32, "gate_fp32")
        h = r.ew(r.cast(t, torch.float32, "upcast"),
                 r.ew(gf, r.activation_layer(gf, ACT.SIGMOID, "sigmoid"), EW.PROD, "silu"), EW.PROD, "gate")
        rank, channels = r.rank(t), weight.shape[-1]
        groups = r.reshape(h, [0] * (rank - 1) + [channels // group_size, group_size], "groups")
        flat = r.reshape(_rms(r, groups, eps), [0] * (rank - 1) + [channels], "flatten")
        w = r.weight(weight)
        out_dtype = torch.promote_types(weight.dtype, dtype)
        y = r.ew(r.cast(w, out_dtype, "weight_cast"), r.cast(r.cast(flat, dtype, "downcast"), out_dtype),
                 EW.PROD, "scale")
        return r.wrap(y)


def activation(x, name):
    r = _recorder(x)
    with r.op("activation", "native: activation/unary/elementwise layers (silu and softplus via fp32 for half types)"):
        return r.wrap(_act(r, r.itensor(x), name))


def clamp(x, lo, hi):
    r = _recorder(x)
    with r.op("clamp", "native: elementwise max/min (infinite bounds skipped)"):
        t = r.itensor(x)
        if lo is not None and lo != float("-inf"):
            t = r.ew_scalar(t, lo, EW.MAX, "lower")
        if hi is not None and hi != float("inf"):
            t = r.ew_scalar(t, hi, EW.MIN, "upper")
        return r.wrap(t)


def to_float32(x):
    r = _recorder(x)
    with r.op("to_float32", "native: cast"):
        t = r.itensor(x)
        return x if t.dtype == trt.float32 else r.wrap(r.cast(t, torch.float32))


# --- shapes ---------------------------------------------------------------------------------------
def split(x, sizes, dim):
    r = _recorder(x)
    with r.op("split", "native: slices"):
        t = r.itensor(x)
        out, start = [], 0
        for i, size in enumerate(sizes):
            out.append(r.wrap(r.slice(t, dim, start, int(size), f"piece{i}")))
            start += int(size)
        if t.shape[dim] >= 0 and start != t.shape[dim]:
            raise BuildError(f"split: sizes {list(sizes)} do not add up to dim {dim} of {tuple(t.shape)}")
        return out


def concat(xs, dim):
    r = _recorder(*xs)
    with r.op("concat", "native: concatenation"):
        dtype = xs[0].dtype
        for x in xs[1:]:
            dtype = torch.promote_types(dtype, x.dtype)
        ts = [r.cast(r.itensor(x), dtype, "promote") for x in xs]
        return r.wrap(r.concat(ts, dim))


def reshape(x, shape):
    r = _recorder(x)
    with r.op("reshape", "native: shuffle (0 copies, -1 infers)"):
        return r.wrap(r.reshape(r.itensor(x), [int(s) for s in shape]))


def permute(x, dims):
    r = _recorder(x)
    with r.op("permute", "native: shuffle transpose"):
        t = r.itensor(x)
        return r.wrap(r.transpose(t, [d % r.rank(t) for d in dims]))


def _gather_rows(r, data, index):
    """data [B, L, ...], index [B, G] -> [B, G, ...] (gather ND with one elementwise dim)."""
    return r.gather_nd(data, r.reshape(index, [0, 0, 1], "index_column"), 1, "gather_nd")


def gather_rows(x, index):
    r = _recorder(x, index)
    with r.op("gather_rows", "native: gather ND with 1 elementwise dim"):
        return r.wrap(_gather_rows(r, r.itensor(x), r.itensor(index, "index")))


def _keep_mask(r, lengths, seq):
    """[B, T] bool: t < lengths[b]; ``seq`` is T (int or int64 [1] tensor)."""
    dt = _int_dtype(lengths)
    t = r.reshape(r.iota(seq, dt, what="positions"), [1, -1], "row")
    return r.ew(t, r.reshape(lengths, [0, 1], "lengths_column"), EW.LESS, "keep")


def mamba_dt(dt, dt_bias, lo, hi, lengths):
    return mask_padding(clamp(activation(dt + dt_bias, "softplus"), lo, hi), lengths)


def mask_padding(x, lengths):
    r = _recorder(x, lengths)
    with r.op("mask_padding", "native: iota < lengths, cast, multiply"):
        t, lens = r.itensor(x), r.itensor(lengths, "lengths")
        keep = r.cast(_keep_mask(r, lens, r.dim(t, 1)), torch_dtype(t.dtype), "keep_cast")
        keep = r.reshape(keep, [0, 0] + [1] * (r.rank(t) - 2), "keep_reshape")
        return r.wrap(r.ew(t, keep, EW.PROD, "mask"))


# --- mixture of experts ------------------------------------------------------------------------------
def moe(router_input, x, router_weight, router_bias, up, down, top_k, n_group, topk_group,
        norm_topk_prob, routed_scaling_factor, act):
    r = _recorder(x, router_input)
    with r.op("moe", "native: fp32 sigmoid router + group-limited topk, dense experts weighted by a "
                     "[N, E] routing matrix (zero for unchosen experts)"):
        tx, ri = r.itensor(x, "x"), r.itensor(router_input, "router_input")
        dtype = torch_dtype(tx.dtype)
        f32 = torch.float32
        experts, hidden = int(router_weight.shape[0]), int(router_weight.shape[1])
        inner = int(up.shape[2])
        x_shape = r.shape_of(tx)
        ri = r.cast(r.reshape(ri, [-1, hidden], "router_tokens"), f32, "router_fp32")
        xt = r.reshape(tx, [-1, inner], "tokens")  # [N, Hin]
        logits = r.matmul(ri, r.cast(r.weight(router_weight, "router"), f32), transpose_b=True, what="router")
        scores = r.activation_layer(logits, ACT.SIGMOID, "scores")  # [N, E]
        choice = r.ew(scores, r.reshape(r.cast(r.weight(router_bias, "router_bias"), f32), [1, -1], "bias_row"),
                      EW.SUM, "choice")
        per_group = experts // n_group
        grouped = r.reshape(choice, [-1, n_group, per_group], "grouped")
        best2, _ = r.topk(grouped, min(2, per_group), 2, "group_top2")
        group_scores = r.reduce(best2, trt.ReduceOperation.SUM, 2, False, "group_scores")  # [N, ng]
        _, best_groups = r.topk(group_scores, topk_group, 1, "best_groups")  # [N, tg]
        group_ids = r._constant(torch.arange(n_group, dtype=torch.int32).reshape(1, 1, -1), "group_ids")
        hit = r.ew(r.reshape(best_groups, [0, 0, 1], "best_groups_column"),
                   r.cast(group_ids, torch_dtype(best_groups.dtype)), EW.EQUAL, "group_hit")
        keep_groups = r.reduce(r.cast(hit, f32, "group_hit_cast"), trt.ReduceOperation.MAX, 1, False, "keep_groups")
        expert_group = r._constant(torch.arange(experts, dtype=torch.int32) // per_group, "expert_group")
        keep = r.ew_scalar(r.gather(keep_groups, expert_group, 1, "keep_experts"), 0.5, EW.GREATER, "keep")
        masked = r.select(keep, choice, r.scalar(float("-inf"), f32, 2, "neg_inf"), "masked_choice")
        _, index = r.topk(masked, top_k, 1, "topk")  # [N, k]
        weights = r.gather_elements(scores, index, 1, "chosen_scores")
        if norm_topk_prob:
            total = r.ew_scalar(r.reduce(weights, trt.ReduceOperation.SUM, 1, True, "sum"), 1e-20, EW.SUM, "eps")
            weights = r.ew(weights, total, EW.DIV, "normalize")
        weights = r.ew_scalar(weights, float(routed_scaling_factor), EW.PROD, "scale")
        expert_ids = r._constant(torch.arange(experts, dtype=torch.int32).reshape(1, 1, -1), "expert_ids")
        onehot = r.cast(r.ew(r.reshape(index, [0, 0, 1], "index_column"),
                             r.cast(expert_ids, torch_dtype(index.dtype)), EW.EQUAL, "onehot"), f32, "onehot_cast")
        routing = r.reduce(r.ew(onehot, r.reshape(weights, [0, 0, 1], "weights_column"), EW.PROD, "spread"),
                           trt.ReduceOperation.SUM, 1, False, "routing")  # [N, E]
        xin = r.reshape(xt, [1, -1, inner], "expert_input")  # [1, N, Hin]
        h = _act(r, r.matmul(xin, _expert_weights(r, up, dtype, "up"), transpose_b=True, what="up"), act)  # [E, N, I]
        y = r.cast(r.matmul(h, _expert_weights(r, down, dtype, "down"), transpose_b=True, what="down"), f32,
                   "down_fp32")
        gate = r.reshape(r.transpose(routing, [1, 0], "routing_t"), [0, 0, 1], "routing_column")  # [E, N, 1]
        out = r.reduce(r.ew(y, gate, EW.PROD, "weighted"), trt.ReduceOperation.SUM, 0, False, "combine")
        return r.wrap(r.reshape_like(r.cast(out, dtype, "downcast"), x_shape, "restore_shape"))


def _expert_weights(r, w, dtype, what):
    """A MoE layer's stacked expert weights [E, out, in]: NVFP4 stacks stay FP4 (dequantized in the network)."""
    if getattr(w, "is_nvfp4", False):
        return r.nvfp4_weight(w.packed, w.scale, w.scale_2, w.shape, dtype, what)
    return r.weight(w, what)


# --- selection -----------------------------------------------------------------------------------------
def where(cond, a, b):
    r = _recorder(cond, a, b)
    with r.op("where", "native: select (int conditions compared with zero)"):
        def probe(v):
            if isinstance(v, SymbolicTensor):
                return torch.empty((1,) * max(v.ndim, 1), dtype=v.dtype)
            return v
        dtype = torch.result_type(probe(a), probe(b))
        rank = max(v.ndim if isinstance(v, SymbolicTensor) else v.dim() if isinstance(v, torch.Tensor) else 0
                   for v in (cond, a, b))
        c = r.itensor(cond, "cond")
        if c.dtype != trt.bool:
            zero = r.scalar(0, torch_dtype(c.dtype), r.rank(c), "zero")
            c = r.unary(r.ew(c, zero, EW.EQUAL, "is_zero"), UN.NOT, "nonzero")

        def operand(v, what):
            if isinstance(v, (SymbolicTensor, torch.Tensor)):
                return r.cast(r.itensor(v, what), dtype, what + "_cast")
            return r.scalar(v, dtype, rank, what)
        return r.wrap(r.select(c, operand(a, "a"), operand(b, "b"), "select"))
