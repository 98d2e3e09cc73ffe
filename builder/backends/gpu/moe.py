"""Routed MoE for few rows (decode, verify: <= 32): ``moe`` as Triton-lang kernels that read only the
experts some row chose. The torch op (``torch_backend.moe``) stays the reference and takes the rest.

Why: at a handful of rows the torch op is several small launches per chosen expert (where, two
linears, index_add) after a host sync (unique), or, on a GPU, a gather that copies each chosen
expert's whole matrices before reading them again. Here each chosen matrix is streamed from
memory once, whatever the number of rows that chose it.

* routing (``_route_kernel``, one program per row): fp32 logits r . W[e], sigmoid scores, the bias
  added for the choice only; groups ranked by the sum of their two best choice values; the best
  ``topk_group`` groups kept; the ``top_k`` best experts in them; their scores (not the choice
  values) optionally normalised (w / (sum + 1e-20)), then scaled. The [N, k] index is in
  descending choice order, as torch.topk's, so equal to it where the values are distinct. Exact ties
  go to the lower index, for groups and experts alike; torch.topk leaves their order unspecified (on
  the CPU it varies from row to row), so a tie at the k-th place may choose another expert than
  the torch op (the output then differs as much as those experts do; either choice is the op's).
* experts: the N*k (row, slot) pairs are sorted by expert on the device (stable; nothing is read
  back to the host, so the grid does not depend on the choice); a program (pair p, block of
  features) does work only when p opens its expert's run of pairs, and then covers every row of
  the run: pass 1 writes
  h = act(round(up[e] @ x)) rounded to x's dtype into a [N*k, I] scratch, pass 2 writes
  round(down[e] @ h) * weight in fp32 into [N*k, Hin], and a last kernel sums each row's k slots in
  ascending expert order (the eager loop's order) and rounds once to x's dtype. Products accumulate in
  fp32; each rounding the reference makes (the linears' outputs, the activation's) is made here too.

Declined (logged once by :func:`fallback`, the torch op runs): more than :data:`MAX_ROWS` rows or
none, NVFP4 weight stacks, dtypes other than fp32/bf16/fp16 (expert weights must have x's dtype, as
the reference's linear requires), activations other than relu2/relu/silu/gelu, shapes off the op's
contract (including top_k above the experts the kept groups hold), tensors on different devices.
"""
from __future__ import annotations

import torch

from builder.backends import gpu

try:
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency
    tl = None

OP = "moe"
MAX_ROWS = 32
MAX_EXPERTS = 1024
ACTIVATIONS = ("relu2", "relu", "silu", "gelu")
_ROUND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


if tl is not None:

    def _route_kernel(r_ptr, w_ptr, b_ptr, idx_ptr, wt_ptr, E, H, srn, GSIZE, scale,
                      N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                      TWO: tl.constexpr, NORM: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        """Program row: index [N, TOP_K] int64 and weights [N, TOP_K] fp32 (both contiguous)."""
        row = tl.program_id(0).to(tl.int64)
        es = tl.arange(0, BLOCK_E)
        e_ok = es < E
        acc = tl.full((BLOCK_E, BLOCK_H), 0.0, tl.float32)
        for h0 in range(0, H, BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            h_ok = hs < H
            r = tl.load(r_ptr + row * srn + hs, mask=h_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + es[:, None] * H + hs[None, :], mask=e_ok[:, None] & h_ok[None, :],
                        other=0.0).to(tl.float32)
            acc += w * r[None, :]
        logit = tl.reduce(acc, 1, tl.standard._sum_combine)
        score = 1.0 / (1.0 + tl.exp(-logit))
        neg = float("-inf")
        choice = tl.where(e_ok, score + tl.load(b_ptr + es, mask=e_ok, other=0.0).to(tl.float32), neg)
        # groups: the sum of each group's two best choice values (one if a group holds one expert)
        gs = tl.arange(0, BLOCK_G)
        member = ((es[None, :] // GSIZE) == gs[:, None]) & e_ok[None, :]
        v = tl.where(member, choice[None, :], neg)
        m1 = tl.reduce(v, 1, tl.standard._elementwise_max)
        a1 = tl.reduce(tl.where(member & (v == m1[:, None]), es[None, :], BLOCK_E), 1, tl.standard._elementwise_min)
        if TWO:
            v2 = tl.where(es[None, :] == a1[:, None], neg, v)
            gscore = m1 + tl.reduce(v2, 1, tl.standard._elementwise_max)
        else:
            gscore = m1
        g_ok = gs < N_GROUP
        kept = tl.full((BLOCK_G,), 0, tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            cand = g_ok & (kept == 0)
            best = tl.reduce(tl.where(cand, gscore, neg), 0, tl.standard._elementwise_max)
            gi = tl.reduce(tl.where(cand & (gscore == best), gs, BLOCK_G), 0, tl.standard._elementwise_min)
            kept = tl.where(gs == gi, 1, kept)
        keep_e = tl.reduce(tl.where(member & (kept[:, None] != 0), 1, 0), 0, tl.standard._elementwise_max)
        masked = tl.where(keep_e != 0, choice, neg)
        # experts: TOP_K best of the kept groups, lower index first on ties
        taken = tl.full((BLOCK_E,), 0, tl.int32)
        ks = tl.arange(0, BLOCK_K)
        sel = tl.full((BLOCK_K,), 0, tl.int64)
        wts = tl.full((BLOCK_K,), 0.0, tl.float32)
        total = 0.0
        for j in tl.static_range(TOP_K):
            cand = e_ok & (taken == 0)
            best = tl.reduce(tl.where(cand, masked, neg), 0, tl.standard._elementwise_max)
            ej = tl.reduce(tl.where(cand & (masked == best), es, BLOCK_E), 0, tl.standard._elementwise_min)
            taken = tl.where(es == ej, 1, taken)
            sj = tl.reduce(tl.where(es == ej, score, 0.0), 0, tl.standard._sum_combine)
            sel = tl.where(ks == j, ej.to(tl.int64), sel)
            wts = tl.where(ks == j, sj, wts)
            total = total + sj
        if NORM:
            wts = wts / (total + 1e-20)
        wts = wts * scale
        k_ok = ks < TOP_K
        tl.store(idx_ptr + row * TOP_K + ks, sel, mask=k_ok)
        tl.store(wt_ptr + row * TOP_K + ks, wts, mask=k_ok)

    def _up_kernel(x_ptr, up_ptr, se_ptr, perm_ptr, h_ptr, P, SLOTS, I, HIN, sxn,
                   ACT: tl.constexpr, ROUND: tl.constexpr, F32_DOT: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr):
        """Program (pair p, block of I): if p opens expert e's run of sorted pairs, h[pair] =
        act(up[e] @ x[row]) for each pair of the run, rounded to x's dtype after the product and
        after the activation (as the reference's two torch ops). h is contiguous [P, I]."""
        p = tl.program_id(0)
        e = tl.load(se_ptr + p)
        prev = tl.load(se_ptr + tl.maximum(p - 1, 0))
        if (p == 0) | (prev != e):
            q = p + tl.arange(0, BLOCK_R)
            q_ok = q < P
            r_ok = q_ok & (tl.load(se_ptr + q, mask=q_ok, other=-1) == e)
            pair = tl.load(perm_ptr + q, mask=r_ok, other=0).to(tl.int64)
            row = pair // SLOTS
            cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
            i_ok = cols < I
            base = up_ptr + e.to(tl.int64) * I * HIN
            acc = tl.full((BLOCK_R, BLOCK_I), 0.0, tl.float32)
            for h0 in range(0, HIN, BLOCK_H):
                hs = h0 + tl.arange(0, BLOCK_H)
                h_ok = hs < HIN
                xt = tl.load(x_ptr + row[:, None] * sxn + hs[None, :], mask=r_ok[:, None] & h_ok[None, :], other=0.0)
                wt = tl.load(base + cols[:, None].to(tl.int64) * HIN + hs[None, :],
                             mask=i_ok[:, None] & h_ok[None, :], other=0.0)
                if F32_DOT:
                    acc += tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision="ieee")
                else:  # 16-bit operands on the tensor cores, fp32 accumulation
                    acc += tl.dot(xt, tl.trans(wt))
            z = acc
            if ROUND == 1:
                z = z.to(tl.float16).to(tl.float32)
            elif ROUND == 2:
                bits = z.to(tl.int32, bitcast=True)
                z = tl.where(z != z, z,   # NaN stays NaN (0x7FFFFFFF would carry into the sign)
                             ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True))
            if ACT == 0:
                z = tl.maximum(z, 0.0)
                z = z * z
            elif ACT == 1:
                z = tl.maximum(z, 0.0)
            elif ACT == 2:
                z = z / (1.0 + tl.exp(-z))
            else:
                z = z * 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
            if ROUND == 2:
                bits = z.to(tl.int32, bitcast=True)
                z = tl.where(z != z, z,   # NaN stays NaN (0x7FFFFFFF would carry into the sign)
                             ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True))
            tl.store(h_ptr + pair[:, None] * I + cols[None, :], z.to(h_ptr.dtype.element_ty),
                     mask=r_ok[:, None] & i_ok[None, :])

    def _down_kernel(h_ptr, down_ptr, se_ptr, perm_ptr, wt_ptr, y_ptr, P, I, HOUT,
                     ROUND: tl.constexpr, F32_DOT: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr):
        """Program (pair p, block of Hout): for p opening expert e's run, y[pair] = round(down[e] @
        h[pair]) * weight[pair] in fp32 for each pair of the run; y is contiguous [P, Hout] fp32."""
        p = tl.program_id(0)
        e = tl.load(se_ptr + p)
        prev = tl.load(se_ptr + tl.maximum(p - 1, 0))
        if (p == 0) | (prev != e):
            q = p + tl.arange(0, BLOCK_R)
            q_ok = q < P
            r_ok = q_ok & (tl.load(se_ptr + q, mask=q_ok, other=-1) == e)
            pair = tl.load(perm_ptr + q, mask=r_ok, other=0).to(tl.int64)
            cols = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
            o_ok = cols < HOUT
            base = down_ptr + e.to(tl.int64) * HOUT * I
            acc = tl.full((BLOCK_R, BLOCK_O), 0.0, tl.float32)
            for i0 in range(0, I, BLOCK_I):
                ii = i0 + tl.arange(0, BLOCK_I)
                ii_ok = ii < I
                ht = tl.load(h_ptr + pair[:, None] * I + ii[None, :], mask=r_ok[:, None] & ii_ok[None, :], other=0.0)
                dt = tl.load(base + cols[:, None].to(tl.int64) * I + ii[None, :],
                             mask=o_ok[:, None] & ii_ok[None, :], other=0.0)
                if F32_DOT:
                    acc += tl.dot(ht.to(tl.float32), tl.trans(dt.to(tl.float32)), input_precision="ieee")
                else:
                    acc += tl.dot(ht, tl.trans(dt))
            if ROUND == 1:
                acc = acc.to(tl.float16).to(tl.float32)
            elif ROUND == 2:
                bits = acc.to(tl.int32, bitcast=True)
                acc = tl.where(acc != acc, acc,   # NaN stays NaN (0x7FFFFFFF would carry into the sign)
                             ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True))
            w = tl.load(wt_ptr + pair, mask=r_ok, other=0.0)
            tl.store(y_ptr + pair[:, None] * HOUT + cols[None, :], acc * w[:, None], mask=r_ok[:, None] & o_ok[None, :])

    def _sum_kernel(y_ptr, order_ptr, o_ptr, HOUT, SLOTS: tl.constexpr, ROUND: tl.constexpr,
                    BLOCK_O: tl.constexpr):
        """Program (row, block of Hout): out[row] = the row's k slots of y summed in fp32 in
        ascending expert order (order [N, k]: slots so sorted), rounded once to x's dtype."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        o_ok = cols < HOUT
        acc = tl.full((BLOCK_O,), 0.0, tl.float32)
        for j in tl.static_range(SLOTS):
            slot = tl.load(order_ptr + row * SLOTS + j).to(tl.int64)
            acc += tl.load(y_ptr + (row * SLOTS + slot) * HOUT + cols, mask=o_ok, other=0.0)
        if ROUND == 2:
            bits = acc.to(tl.int32, bitcast=True)
            acc = tl.where(acc != acc, acc,   # NaN stays NaN (0x7FFFFFFF would carry into the sign)
                         ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True))
        tl.store(o_ptr + row * HOUT + cols, acc.to(o_ptr.dtype.element_ty), mask=o_ok)
else:  # pragma: no cover
    _route_kernel = _up_kernel = _down_kernel = _sum_kernel = None


def _launch(kernel, grid, *args, **meta):
    """One kernel launch (a seam for tests counting launches)."""
    gpu.jit(kernel)[grid](*args, **meta)


def _decline(router_input, x, router_weight, router_bias, up, down, top_k, n_group, topk_group, act):
    """Why the kernels do not take these inputs, or None."""
    if tl is None:
        return "triton is not installed"
    if getattr(up, "is_nvfp4", False) or getattr(down, "is_nvfp4", False):
        return "NVFP4 expert stacks"
    tensors = (router_input, x, router_weight, router_bias, up, down)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "arguments that are not tensors"
    if any(t.dtype not in _ROUND for t in tensors):
        return "dtype outside fp32/bf16/fp16"
    if up.dtype != x.dtype or down.dtype != x.dtype:
        return "expert weights' dtype differs from x's"
    if act not in ACTIVATIONS:
        return f"activation {act!r}"
    if any(t.device != x.device for t in tensors):
        return "tensors on different devices"
    if (router_input.dim() < 1 or x.dim() < 1 or router_weight.dim() != 2 or up.dim() != 3 or down.dim() != 3
            or router_input.shape[:-1] != x.shape[:-1]):
        return "shapes outside the op's contract"
    experts, hidden = router_weight.shape
    _, inter, hin = up.shape
    top_k, n_group, topk_group = int(top_k), int(n_group), int(topk_group)
    if (router_input.shape[-1] != hidden or tuple(router_bias.shape) != (experts,) or x.shape[-1] != hin
            or up.shape[0] != experts or tuple(down.shape) != (experts, hin, inter) or min(hidden, inter, hin) < 1
            or n_group < 1 or experts % n_group or not 1 <= topk_group <= n_group
            or not 1 <= top_k <= topk_group * (experts // n_group)):
        return "shapes outside the op's contract"
    if experts > MAX_EXPERTS:
        return f"more than {MAX_EXPERTS} experts"
    rows = x.numel() // hin
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows (kernel covers 1..{MAX_ROWS})"
    return None


def route(router_input, router_weight, router_bias, top_k, n_group, topk_group, norm_topk_prob,
          routed_scaling_factor):
    """``torch_backend.route`` in one kernel: (index [N, k] int64, weights [N, k] fp32) for
    router_input [N, H]; the caller has checked the contract (see :func:`_decline`)."""
    r = router_input if router_input.stride(-1) == 1 else router_input.contiguous()
    rows = r.shape[0]
    experts, hidden = router_weight.shape
    top_k, n_group = int(top_k), int(n_group)
    index = torch.empty((rows, top_k), dtype=torch.int64, device=r.device)
    weights = torch.empty((rows, top_k), dtype=torch.float32, device=r.device)
    block_e = max(16, _pow2(experts))
    block_h = max(16, min(_pow2(hidden), 8192 // block_e))
    _launch(_route_kernel, (rows,), r, router_weight.contiguous(), router_bias.contiguous(), index, weights,
            experts, hidden, r.stride(0), experts // n_group, float(routed_scaling_factor),
            N_GROUP=n_group, TOPK_GROUP=int(topk_group), TOP_K=top_k, TWO=experts // n_group >= 2,
            NORM=bool(norm_topk_prob), BLOCK_E=block_e, BLOCK_H=block_h, BLOCK_G=max(2, _pow2(n_group)),
            BLOCK_K=max(2, _pow2(top_k)))
    return index, weights


def _check(router_input, x, router_weight, router_bias, up, down, top_k, n_group, topk_group,
           norm_topk_prob, routed_scaling_factor, act):
    return _decline(router_input, x, router_weight, router_bias, up, down, top_k, n_group, topk_group, act)


@gpu.register(OP, "(Tensor router_input, Tensor x, Tensor router_weight, Tensor router_bias, Tensor up, Tensor down, "
              "int top_k, int n_group, int topk_group, bool norm_topk_prob, float routed_scaling_factor, str act) "
              "-> Tensor", _check)
def moe(router_input, x, router_weight, router_bias, up, down, top_k, n_group, topk_group,
        norm_topk_prob, routed_scaling_factor, act):
    """``torch_backend.moe`` for 1..MAX_ROWS rows: [..., Hin] in x's dtype."""
    shape = x.shape
    experts, inter, hin = up.shape
    x2 = x.reshape(-1, hin)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    rows = x2.shape[0]
    index, weights = route(router_input.reshape(rows, -1), router_weight, router_bias, top_k, n_group,
                           topk_group, norm_topk_prob, routed_scaling_factor)
    slots = index.shape[1]
    pairs = rows * slots
    sorted_e, perm = torch.sort(index.reshape(-1), stable=True)       # pairs grouped by expert, rows ascending
    order = torch.argsort(index, dim=1)                                # each row's slots by ascending expert
    up, down = up.contiguous(), down.contiguous()
    h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((pairs, hin), dtype=torch.float32, device=x.device)
    out = torch.empty((rows, hin), dtype=x.dtype, device=x.device)
    f32_dot = x.dtype == torch.float32 or gpu.interpreting()   # the interpreter's 16-bit dot is wrong
    rnd = _ROUND[x.dtype]
    block_r = max(16, _pow2(rows))
    block_i = max(16, min(64, _pow2(inter)))
    block_o = max(16, min(64, _pow2(hin)))
    _launch(_up_kernel, (pairs, -(-inter // block_i)), x2, up, sorted_e, perm, h, pairs, slots, inter, hin,
            x2.stride(0), ACT=ACTIVATIONS.index(act), ROUND=rnd, F32_DOT=f32_dot,
            BLOCK_R=block_r, BLOCK_I=block_i, BLOCK_H=max(16, min(128, _pow2(hin))))
    _launch(_down_kernel, (pairs, -(-hin // block_o)), h, down, sorted_e, perm, weights, y, pairs, inter, hin,
            ROUND=rnd, F32_DOT=f32_dot, BLOCK_R=block_r, BLOCK_O=block_o, BLOCK_I=max(16, min(128, _pow2(inter))))
    _launch(_sum_kernel, (rows, -(-hin // block_o)), y, order, out, hin, SLOTS=slots, ROUND=rnd, BLOCK_O=block_o)
    return out.reshape(shape)
