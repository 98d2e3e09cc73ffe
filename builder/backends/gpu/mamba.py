"""Triton-lang kernels for Mamba-2's conv and selective-state updates over 1..K+1 tokens (decode,
verify, token trees) and its time step: the ops ``causal_conv1d``, ``mamba_dt``, ``ssm_scan``,
``ssm_state`` (torch_backend) and ``tree_conv1d``, ``tree_ssm_scan`` (torch_tree), which stay the
reference and take everything else.

Why separate kernels: a decode/verify chunk is a handful of rows, where the torch ops are a dozen
small launches each (cat, unfold, einsum, a Python loop over rows); one program per (batch, head,
block of P) keeps the fp32 state in registers for the whole chunk and reads each input once.

* conv: one program per (batch, channel block) computes every row's taps as a [T, C] tile from
  ``[conv_state ; x]`` (the state cast to x's dtype first, as the reference does), accumulating in
  fp32 with the bias, rounded once to x's dtype; it also writes the new conv state, the K-1 rows
  ending at row ``lengths[b] - 1`` (``lengths`` is clamped to [0, T] in the kernel: the reference's
  gather would raise past that). The tree variant walks each row's parent chain for its taps. The
  conv's activation (silu) is applied to the rounded output in the same launch.
* time step: softplus(dt + dt_bias), the clamp and the padding mask in one launch (seven torch ops),
  for any number of rows.
* scan: the recurrence h = exp(dt A) h + dt x B^T, y = C . h + D x row by row (decode's order), fp32
  in registers; heads h share group h // (H / G) of B and C. ``ssm_state`` is the same kernel without
  outputs; :func:`ssm_scan_states` also writes the state after each row (for rollbacks).
* tree scan: each row's state is recomputed from the chunk's entry state along its own ancestor
  path (the rows j <= i with ``ancestors[i, j]``, in row order), in registers. That is O(T^2) updates
  for T rows (153 at T = 17, each a [BLOCK_P, N] FMA on cached inputs), chosen over a per-node state
  buffer [B, T, H, P, N] fp32, whose writes and reads would cost ~T times the state's bytes per layer.

Declined (logged once by :func:`fallback`, the torch op runs): chunks over :data:`MAX_TOKENS` rows
(prefill: the torch chunked SSD), empty chunks, dtypes other than fp32/bf16/fp16 (float64 included),
tensors on different devices, and shapes the op's contract does not describe.
"""
from __future__ import annotations

import torch

from builder.backends.gpu import jit, register

try:  # the kernels' language module; absent triton leaves every op on torch
    import triton.language as tl
except ImportError:  # pragma: no cover
    tl = None

MAX_TOKENS = 32                      # rows a chunk may have for a kernel: decode/verify/tree chunks
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_P = 16                         # head_dim rows of the state per program
ACTIVATIONS = (None, "silu")         # what the conv kernel applies after the conv (Mamba-2's is silu)
MAX_DT_HEADS = 4096                  # heads one program of the time-step kernel holds


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# --- Triton-lang kernels --------------------------------------------------------------------------------
if tl is not None:

    def _conv_kernel(x_ptr, s_ptr, w_ptr, bias_ptr, len_ptr, par_ptr, y_ptr, ns_ptr,
                     T, C, sx_b, sx_t, ss_b, ss_t,
                     WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, TREE: tl.constexpr, SILU: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
        """Program (batch, channel block). Padded row index r: r < K-1 a conv-state row, else x row
        r-(K-1). Chain: row t's taps are r = t .. t+K-1. Tree: tap K-1 is the row itself, each earlier
        tap the previous one's predecessor (a conv-state row's is r-1, the root's the last state row,
        a tree row's its parent). SILU: y = silu(y) after y's rounding. y and the new state (chain
        only) are contiguous [B, T|K-1, C]."""
        b64 = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_ok = cols < C
        ts = tl.arange(0, BLOCK_T)
        t_ok = ts < T
        ok = t_ok[:, None] & col_ok[None, :]
        acc = tl.full((BLOCK_T, BLOCK_C), 0.0, tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        cur = ts + (WIDTH - 1)                                              # the row itself
        for i in tl.static_range(WIDTH):
            k = WIDTH - 1 - i                                               # tap, newest first
            if TREE:
                rows = cur
            else:
                rows = ts + k
            in_state = rows < WIDTH - 1
            sv = tl.load(s_ptr + b64 * ss_b + rows[:, None] * ss_t + cols[None, :],
                         mask=ok & in_state[:, None], other=0.0).to(x_ptr.dtype.element_ty)
            xv = tl.load(x_ptr + b64 * sx_b + (rows[:, None] - (WIDTH - 1)) * sx_t + cols[None, :],
                         mask=ok & (rows >= WIDTH - 1)[:, None], other=0.0)
            v = tl.where(in_state[:, None], sv, xv)
            wk = tl.load(w_ptr + cols * WIDTH + k, mask=col_ok, other=0.0).to(tl.float32)
            acc += v.to(tl.float32) * wk[None, :]
            if TREE:
                parent = tl.load(par_ptr + b64 * T + (cur - (WIDTH - 1)), mask=t_ok & (cur >= WIDTH), other=0)
                cur = tl.where(cur < WIDTH, cur - 1, parent.to(tl.int32) + (WIDTH - 1))
                cur = tl.maximum(cur, 0)                                    # as the reference's clamp_min(0)
        y = acc.to(y_ptr.dtype.element_ty)
        if SILU:   # on the rounded conv output, as the torch op applies it after the conv
            v = y.to(tl.float32)
            y = (v / (1.0 + tl.exp(-v))).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + b64 * T * C + ts[:, None] * C + cols[None, :], y, mask=ok)
        if not TREE:
            n = tl.minimum(tl.maximum(tl.load(len_ptr + b64).to(tl.int32), 0), T)
            ws = tl.arange(0, BLOCK_W)
            w_ok = (ws < WIDTH - 1)[:, None] & col_ok[None, :]
            rows = n + ws
            in_state = rows < WIDTH - 1
            sv = tl.load(s_ptr + b64 * ss_b + rows[:, None] * ss_t + cols[None, :],
                         mask=w_ok & in_state[:, None], other=0.0).to(x_ptr.dtype.element_ty)
            xv = tl.load(x_ptr + b64 * sx_b + (rows[:, None] - (WIDTH - 1)) * sx_t + cols[None, :],
                         mask=w_ok & (rows >= WIDTH - 1)[:, None], other=0.0)
            win = tl.where(in_state[:, None], sv, xv)
            tl.store(ns_ptr + b64 * (WIDTH - 1) * C + ws[:, None] * C + cols[None, :], win, mask=w_ok)

    def _ssm_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, h0_ptr, y_ptr, h_ptr, hs_ptr,
                    T, H, P, N, heads_per_group,
                    sx_b, sx_t, sx_h, sdt_b, sdt_t, sb_b, sb_t, sb_g, sc_b, sc_t, sc_g, sh_b, sh_h, sh_p,
                    WRITE_Y: tl.constexpr, WRITE_STATES: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program (batch * head, block of P): the recurrence over T rows with h [BLOCK_P, N] fp32 in
        registers. Writes y [B, T, H, P] (x's dtype) if WRITE_Y, the state after each row
        [B, T, H, P, N] if WRITE_STATES, and the final state [B, H, P, N] (all contiguous)."""
        bh = tl.program_id(0)
        b64, head = (bh // H).to(tl.int64), bh % H
        g = head // heads_per_group
        ps = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        ns = tl.arange(0, BLOCK_N)
        p_ok, n_ok = ps < P, ns < N
        pn_ok = p_ok[:, None] & n_ok[None, :]
        pn = ps[:, None] * N + ns[None, :]
        h = tl.load(h0_ptr + b64 * sh_b + head * sh_h + ps[:, None] * sh_p + ns[None, :], mask=pn_ok,
                    other=0.0).to(tl.float32)
        a = tl.load(a_ptr + head).to(tl.float32)
        if WRITE_Y:
            d = tl.load(d_ptr + head).to(tl.float32)
        for t in range(T):
            xv = tl.load(x_ptr + b64 * sx_b + t * sx_t + head * sx_h + ps, mask=p_ok, other=0.0).to(tl.float32)
            dt = tl.load(dt_ptr + b64 * sdt_b + t * sdt_t + head).to(tl.float32)
            bv = tl.load(b_ptr + b64 * sb_b + t * sb_t + g * sb_g + ns, mask=n_ok, other=0.0).to(tl.float32)
            h = h * tl.exp(dt * a) + (dt * xv)[:, None] * bv[None, :]
            if WRITE_STATES:
                tl.store(hs_ptr + ((b64 * T + t) * H + head) * P * N + pn, h, mask=pn_ok)
            if WRITE_Y:
                cv = tl.load(c_ptr + b64 * sc_b + t * sc_t + g * sc_g + ns, mask=n_ok, other=0.0).to(tl.float32)
                y = tl.reduce(h * cv[None, :], 1, tl.standard._sum_combine) + xv * d
                tl.store(y_ptr + ((b64 * T + t) * H + head) * P + ps, y.to(y_ptr.dtype.element_ty), mask=p_ok)
        tl.store(h_ptr + (b64 * H + head) * P * N + pn, h, mask=pn_ok)

    def _tree_ssm_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, h0_ptr, anc_ptr, y_ptr,
                         T, H, P, N, heads_per_group,
                         sx_b, sx_t, sx_h, sdt_b, sdt_t, sb_b, sb_t, sb_g, sc_b, sc_t, sc_g, sh_b, sh_h, sh_p,
                         BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program (batch * head, block of P): for each row i, h = the entry state taken through the
        rows j <= i on i's path (``ancestors[b, i, j]`` nonzero; rows off it leave h exactly as it
        is: decay 1, input 0), then y_i = C_i . h + D x_i. ancestors is contiguous uint8 [B, T, T]."""
        bh = tl.program_id(0)
        b64, head = (bh // H).to(tl.int64), bh % H
        g = head // heads_per_group
        ps = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        ns = tl.arange(0, BLOCK_N)
        p_ok, n_ok = ps < P, ns < N
        pn_ok = p_ok[:, None] & n_ok[None, :]
        h0 = tl.load(h0_ptr + b64 * sh_b + head * sh_h + ps[:, None] * sh_p + ns[None, :], mask=pn_ok,
                     other=0.0).to(tl.float32)
        a = tl.load(a_ptr + head).to(tl.float32)
        d = tl.load(d_ptr + head).to(tl.float32)
        for i in range(T):
            h = h0
            for j in range(i + 1):
                on = tl.load(anc_ptr + (b64 * T + i) * T + j) != 0
                xv = tl.load(x_ptr + b64 * sx_b + j * sx_t + head * sx_h + ps, mask=p_ok, other=0.0).to(tl.float32)
                dt = tl.load(dt_ptr + b64 * sdt_b + j * sdt_t + head).to(tl.float32)
                bv = tl.load(b_ptr + b64 * sb_b + j * sb_t + g * sb_g + ns, mask=n_ok, other=0.0).to(tl.float32)
                decay = tl.where(on, tl.exp(dt * a), 1.0)
                dt_on = tl.where(on, dt, 0.0)
                h = h * decay + (dt_on * xv)[:, None] * bv[None, :]
            xi = tl.load(x_ptr + b64 * sx_b + i * sx_t + head * sx_h + ps, mask=p_ok, other=0.0).to(tl.float32)
            cv = tl.load(c_ptr + b64 * sc_b + i * sc_t + g * sc_g + ns, mask=n_ok, other=0.0).to(tl.float32)
            y = tl.reduce(h * cv[None, :], 1, tl.standard._sum_combine) + xi * d
            tl.store(y_ptr + ((b64 * T + i) * H + head) * P + ps, y.to(y_ptr.dtype.element_ty), mask=p_ok)
    def _dt_kernel(dt_ptr, bias_ptr, len_ptr, out_ptr, T, H, sd_b, sd_t, lo, hi,
                   HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, BF16: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        """Program (batch, block of rows): out = softplus(dt + bias) clamped, times (t < lengths[b]),
        rounded to the dtype where the torch ops round (the sum, softplus; clamp and the mask are
        exact; bf16 to nearest even by bits: the interpreter's bf16 cast truncates). softplus(v) = v
        past 20 (torch's threshold), else log1p(e^v) in Kahan's form log(u) e / (u - 1), u = 1 + e (e
        where u rounds to 1). out is contiguous [B, T, H]."""
        b64 = tl.program_id(0).to(tl.int64)
        ts = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        hs = tl.arange(0, BLOCK_H)
        ok = (ts < T)[:, None] & (hs < H)[None, :]
        dt = tl.load(dt_ptr + b64 * sd_b + ts[:, None] * sd_t + hs[None, :], mask=ok, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + hs, mask=hs < H, other=0.0).to(tl.float32)
        v = dt + bias[None, :]
        if BF16:
            bits = v.to(tl.int32, bitcast=True)
            v = tl.where(v != v, v,   # NaN stays NaN (0x7FFFFFFF would carry into the sign)
                         ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True))
        else:
            v = v.to(out_ptr.dtype.element_ty).to(tl.float32)
        e = tl.exp(v)
        u = 1.0 + e
        sp = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
        sp = tl.where(v > 20.0, v, sp)
        if BF16:
            bits = sp.to(tl.int32, bitcast=True)
            sp = tl.where(sp != sp, sp,   # NaN stays NaN (0x7FFFFFFF would carry into the sign)
                         ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True))
        if HAS_LO:   # a NaN stays NaN, as torch.clamp keeps it
            sp = tl.maximum(sp, lo, propagate_nan=tl.PropagateNan.ALL)
        if HAS_HI:
            sp = tl.minimum(sp, hi, propagate_nan=tl.PropagateNan.ALL)
        if BF16 and (HAS_LO or HAS_HI):   # a bound the clamp took, rounded as torch rounds it
            bits = sp.to(tl.int32, bitcast=True)
            sp = tl.where(sp != sp, sp,   # NaN stays NaN (0x7FFFFFFF would carry into the sign)
                         ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True))
        n = tl.load(len_ptr + b64).to(tl.int32)
        keep = (ts < n).to(tl.float32)
        tl.store(out_ptr + (b64 * T + ts[:, None]) * H + hs[None, :], (sp * keep[:, None]).to(out_ptr.dtype.element_ty),
                 mask=ok)
else:  # pragma: no cover
    _conv_kernel = _ssm_kernel = _tree_ssm_kernel = _dt_kernel = None


# --- checks ---------------------------------------------------------------------------------------------
def _decline(x, floats=(), tokens: bool = True):
    """The reason to decline these inputs, or None. ``floats`` must be fp32/bf16/fp16 on x's device
    (index tensors such as lengths, parents and ancestors are moved there, as the reference does)."""
    if tl is None:
        return "triton is not installed"
    for t in (x,) + tuple(floats):
        if t is not None and t.dtype not in FLOATS:
            return f"dtype {t.dtype}"
    if any(t is not None and t.device != x.device for t in floats):
        return "tensors on different devices"
    if tokens and not 1 <= x.shape[1] <= MAX_TOKENS:
        return f"{x.shape[1]} tokens (kernel covers 1..{MAX_TOKENS})"
    return None


def _conv_checks(x, conv_state, weight, bias, activation):
    reason = _decline(x, (conv_state, weight, bias))
    if reason is None and activation not in ACTIVATIONS:
        reason = f"activation {activation!r}"
    if reason is None and (x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]
                           or weight.shape[1] < 2 or conv_state.shape != (x.shape[0], weight.shape[1] - 1, x.shape[2])
                           or (bias is not None and bias.shape != (x.shape[2],))):
        reason = "shapes outside the op's contract"
    if reason is None and (weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype)):
        reason = "weight/bias dtype differs from x's"   # the reference's einsum would refuse it
    return reason


def _conv_launch(x, conv_state, weight, bias, lengths=None, parents=None, activation=None):
    batch, seq, chans = x.shape
    width = weight.shape[1]
    tree = parents is not None
    xs = x if x.stride(2) == 1 else x.contiguous()
    ss = conv_state if conv_state.stride(2) == 1 else conv_state.contiguous()
    y = torch.empty((batch, seq, chans), dtype=x.dtype, device=x.device)
    new_state = y if tree else torch.empty((batch, width - 1, chans), dtype=x.dtype, device=x.device)
    index = (parents if tree else lengths).to(device=x.device).contiguous()
    block_t = _pow2(seq)
    block_c = min(_pow2(chans), max(16, 4096 // block_t), 256)
    grid = (batch, -(-chans // block_c))
    jit(_conv_kernel)[grid](
        xs, ss, weight.contiguous(), bias.contiguous() if bias is not None else weight, index, index, y, new_state,
        seq, chans, xs.stride(0), xs.stride(1), ss.stride(0), ss.stride(1),
        WIDTH=width, HAS_BIAS=bias is not None, TREE=tree, SILU=activation == "silu", BLOCK_T=block_t,
        BLOCK_W=_pow2(width - 1),
        BLOCK_C=block_c)
    return y if tree else (y, new_state)


def _causal_conv1d_check(x, conv_state, weight, bias, lengths, activation=None):
    reason = _conv_checks(x, conv_state, weight, bias, activation)
    if reason is None and tuple(lengths.shape) != (x.shape[0],):
        reason = "lengths is not [B]"
    return reason


@register("causal_conv1d", "(Tensor x, Tensor conv_state, Tensor weight, Tensor? bias, Tensor lengths, "
          "str? activation=None) -> (Tensor, Tensor)", _causal_conv1d_check)
def causal_conv1d(x, conv_state, weight, bias, lengths, activation=None):
    """(y, new_conv_state) as torch_backend.causal_conv1d, for 1..MAX_TOKENS rows."""
    return _conv_launch(x, conv_state, weight, bias, lengths=lengths, activation=activation)


def _tree_conv1d_check(x, conv_state, weight, bias, parents, activation=None):
    reason = _conv_checks(x, conv_state, weight, bias, activation)
    if reason is None and tuple(parents.shape) != tuple(x.shape[:2]):
        reason = "parents is not [B, T]"
    return reason


@register("tree_conv1d", "(Tensor x, Tensor conv_state, Tensor weight, Tensor? bias, Tensor parents, "
          "str? activation=None) -> Tensor", _tree_conv1d_check)
def tree_conv1d(x, conv_state, weight, bias, parents, activation=None):
    """y as torch_tree.tree_conv1d, for trees of 1..MAX_TOKENS rows (parents[b, r] < r; row 0's is
    not read)."""
    return _conv_launch(x, conv_state, weight, bias, parents=parents, activation=activation)


def _mamba_dt_check(dt, dt_bias, lo, hi, lengths):
    reason = _decline(dt, (dt_bias,), tokens=False)
    if reason is None and (dt.dim() != 3 or tuple(dt_bias.shape) != (dt.shape[2],) or dt.shape[2] > MAX_DT_HEADS
                           or not isinstance(lengths, torch.Tensor) or tuple(lengths.shape) != (dt.shape[0],)):
        reason = "shapes outside the op's contract"
    if reason is None and dt_bias.dtype != dt.dtype:
        reason = "dt_bias dtype differs from dt's"
    if reason is None and lengths.device != dt.device:
        reason = "lengths on another device"
    return reason


def _bound(v, skipped: float):
    """A clamp bound the kernel applies, or None where the clamp does nothing (None, or the infinity
    on its own side: -inf below, +inf above)."""
    return None if v is None or float(v) == skipped else float(v)


@register("mamba_dt", "(Tensor dt, Tensor dt_bias, float? lo, float? hi, Tensor lengths) -> Tensor", _mamba_dt_check)
def mamba_dt(dt, dt_bias, lo, hi, lengths):
    """torch_backend.mamba_dt in one launch (the torch ops are seven on a GPU), any number of rows."""
    batch, seq, heads = dt.shape
    lo, hi = _bound(lo, float("-inf")), _bound(hi, float("inf"))
    out = torch.empty((batch, seq, heads), dtype=dt.dtype, device=dt.device)
    ds = dt if dt.stride(2) == 1 else dt.contiguous()
    block_h = _pow2(heads)
    block_t = max(1, min(_pow2(seq), 4096 // block_h))
    jit(_dt_kernel)[(batch, -(-seq // block_t))](
        ds, dt_bias.contiguous(), lengths.contiguous(), out, seq, heads, ds.stride(0), ds.stride(1),
        0.0 if lo is None else lo, 0.0 if hi is None else hi, HAS_LO=lo is not None, HAS_HI=hi is not None,
        BF16=dt.dtype == torch.bfloat16, BLOCK_T=block_t, BLOCK_H=block_h)
    return out


def _ssm_checks(x, dt, A, B, C, D, state, tokens=True):
    reason = _decline(x, (dt, A, B, C, D, state), tokens=tokens)
    if reason is None:
        batch, seq, heads, dim = x.shape if x.dim() == 4 else (0, 0, 0, 0)
        groups = B.shape[2] if B.dim() == 4 else 0
        n = B.shape[3] if B.dim() == 4 else 0
        if (x.dim() != 4 or groups == 0 or heads % groups or B.shape != (batch, seq, groups, n)
                or (C is not None and C.shape != B.shape) or dt.shape != (batch, seq, heads)
                or A.shape != (heads,) or (D is not None and D.shape != (heads,))
                or state.shape != (batch, heads, dim, n)):
            reason = "shapes outside the op's contract"
    return reason


def _last(t):
    """t with unit stride in its last dim (the kernels' assumption), copying only if needed."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _ssm_args(x, dt, A, B, C, D, state):
    x, B, state = _last(x), _last(B), _last(state)
    C = B if C is None else _last(C)
    dt = dt if dt.stride(2) == 1 else dt.contiguous()
    A, D = A.contiguous(), (A if D is None else D).contiguous()
    strides = (x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1),
               B.stride(2), C.stride(0), C.stride(1), C.stride(2), state.stride(0), state.stride(1), state.stride(2))
    return (x, dt, A, B, C, D, state), strides


def _ssm_launch(x, dt, A, B, C, D, state, write_y=True, write_states=False):
    """Runs the chain kernel; returns (y or None, final state, per-row states or None)."""
    batch, seq, heads, dim = x.shape
    n = B.shape[3]
    (x, dt, A, B, C, D, state), strides = _ssm_args(x, dt, A, B, C, D, state)
    dev = x.device
    y = torch.empty(x.shape, dtype=x.dtype, device=dev) if write_y else None
    final = torch.empty((batch, heads, dim, n), dtype=torch.float32, device=dev)
    states = torch.empty((batch, seq, heads, dim, n), dtype=torch.float32, device=dev) if write_states else None
    grid = (batch * heads, -(-dim // BLOCK_P))
    jit(_ssm_kernel)[grid](x, dt, A, B, C, D, state, y if write_y else final, final,
                           states if write_states else final, seq, heads, dim, n, heads // B.shape[2], *strides,
                           WRITE_Y=write_y, WRITE_STATES=write_states, BLOCK_P=BLOCK_P, BLOCK_N=_pow2(n))
    return y, final, states


def _ssm_scan_check(x, dt, A, B, C, D, state, chunk_size):
    return _ssm_checks(x, dt, A, B, C, D, state)


@register("ssm_scan", "(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor state, int chunk_size)"
          " -> (Tensor, Tensor)", _ssm_scan_check)
def ssm_scan(x, dt, A, B, C, D, state, chunk_size):
    """(y in x's dtype, final state fp32) as torch_backend.ssm_scan, for 1..MAX_TOKENS rows (the math
    does not depend on chunk_size)."""
    y, final, _ = _ssm_launch(x, dt, A, B, C, D, state)
    return y, final


def _ssm_state_check(x, dt, A, B, state):
    return _ssm_checks(x, dt, A, B, None, None, state)


@register("ssm_state", "(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor state) -> Tensor", _ssm_state_check)
def ssm_state(x, dt, A, B, state):
    """The fp32 state after the chunk, as torch_backend.ssm_state, for 1..MAX_TOKENS rows."""
    return _ssm_launch(x, dt, A, B, None, None, state, write_y=False)[1]


def ssm_scan_states(x, dt, A, B, C, D, state):
    """(y [B, T, H, P] in x's dtype, states [B, T, H, P, N] fp32): ssm_scan's outputs plus the state
    after each row (states[:, -1] is the final one), for rollbacks that pick a row later. Any T >= 1;
    inputs the kernel declines raise ValueError (no torch twin of this op)."""
    reason = _ssm_checks(x, dt, A, B, C, D, state, tokens=False)
    if reason is None and x.shape[1] < 1:
        reason = "empty chunk"
    if reason:
        raise ValueError(f"ssm_scan_states: {reason}")
    y, _, states = _ssm_launch(x, dt, A, B, C, D, state, write_states=True)
    return y, states


def _tree_ssm_scan_check(x, dt, A, B, C, D, state, ancestors):
    reason = _ssm_checks(x, dt, A, B, C, D, state)
    if reason is None and tuple(ancestors.shape) != (x.shape[0], x.shape[1], x.shape[1]):
        reason = "ancestors is not [B, T, T]"
    return reason


@register("tree_ssm_scan", "(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor state, "
          "Tensor ancestors) -> Tensor", _tree_ssm_scan_check)
def tree_ssm_scan(x, dt, A, B, C, D, state, ancestors):
    """y as torch_tree.tree_ssm_scan, for trees of 1..MAX_TOKENS rows; ``ancestors`` [B, T, T]
    (nonzero = on the path, self included) must describe a tree whose rows are in topological order."""
    batch, seq, heads, dim = x.shape
    n = B.shape[3]
    anc = ancestors.to(device=x.device)
    anc = (anc if anc.dtype == torch.bool else anc != 0).contiguous().view(torch.uint8)
    (x, dt, A, B, C, D, state), strides = _ssm_args(x, dt, A, B, C, D, state)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid = (batch * heads, -(-dim // BLOCK_P))
    jit(_tree_ssm_kernel)[grid](x, dt, A, B, C, D, state, anc, y, seq, heads, dim, n, heads // B.shape[2],
                                *strides, BLOCK_P=BLOCK_P, BLOCK_N=_pow2(n))
    return y
