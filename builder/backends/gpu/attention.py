"""Triton-lang GQA over the KV cache for 1..32 query rows: ``attention`` (causal by positions, with
an optional sliding window and sinks), ``tree_attention`` and ``masked_attention``.

Why: a decode/verify/tree step has few query rows and a long cache, so the cost is reading K and V
once. One program per (batch, KV head, block of query rows) holds all the rows of that KV head's
query-head group (row r = t * group + g) and streams the cache in key blocks with an online softmax
in fp32 (flash decoding): K and V are read once per group, not once per query head. The key loop
covers only the keys some row may see (up to the block's largest position; from its smallest
position - window + 1 with a window). Long caches (>= :data:`SPLIT_MIN_KEYS` keys) with too few
programs to fill the GPU also split the keys over a third grid axis; each split writes its running
max, denominator and unnormalised output (fp32) and a second kernel merges them (sinks join there).

The three ops differ only in which keys a row sees (``MODE``): 0 causal ``j <= pos[b, t]`` (and
``j > pos - window``), 1 tree: keys before the chunk's base row ``positions[b, 0]`` plus the rows
``positions[b, j]`` of the ancestors ``ancestors[b, t, j]`` (a key that is a chunk row sees only
the ancestor rule), 2 an explicit ``visible[b, t, j]`` mask. A row that sees nothing gives NaN, as
the reference's softmax over -inf does (0 with sinks).

Numerics: scores, softmax and the output sum in fp32; on the GPU 16-bit inputs go to the tensor
cores as they are (probabilities rounded to the input dtype, as the reference rounds them), under
the interpreter (whose 16-bit dot is wrong) upcast to fp32. The output is rounded once to q's dtype.

Declined (the torch op runs): more than :data:`MAX_ROWS` query rows, dtypes other than
fp32/fp16/bf16 or a cache dtype unlike q's, head dims over 256, tensors on different devices,
empty inputs and shapes outside the op's contract.
"""
from __future__ import annotations

import torch

from builder.backends import gpu

try:
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency
    tl = None

MAX_ROWS = 32                 # query rows per sequence (T) a kernel takes
MAX_DIM = 256
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
KEY_BLOCK = 64                # keys per loop step (32 for head dims over 128)
SPLIT_MIN_KEYS = 2048         # caches at least this long may split over the sequence
SPLIT_CHUNK = 512             # fewest keys one split handles
TARGET_PROGRAMS = 264         # ~2 programs per SM on an H100 (132 SMs): split until reached
_LOG2E = 1.4426950408889634
CAUSAL, TREE, MASK = 0, 1, 2


if tl is not None:

    def _attn_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, aux_ptr, sink_ptr, out_ptr, ws_m, ws_l, ws_acc,
                     T, S, D, group, kv_heads, n_rows, chunk, n_splits, qk_scale, window,
                     sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, spb, spt,
                     sab, sat, saj, sob, sot, soh,
                     MODE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
                     SPLIT: tl.constexpr, F32_DOT: tl.constexpr, ROUND_BF16: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program (batch * kv head, row block, split). Scores are kept in log2 units (qk_scale
        includes log2 e) so the softmax uses exp2. Without SPLIT it normalises and stores the
        output; with SPLIT it stores m, l, acc for the merge kernel."""
        bh = tl.program_id(0)
        b = (bh // kv_heads).to(tl.int64)
        kvh = bh % kv_heads
        sid = tl.program_id(2)
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        t = tl.where(row_ok, rows // group, 0)
        head = kvh * group + rows % group
        dims = tl.arange(0, BLOCK_D)
        d_ok = dims < D
        q = tl.load(q_ptr + b * sqb + t[:, None] * sqt + head[:, None] * sqh + dims[None, :] * sqd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if F32_DOT:
            q = q.to(tl.float32)
        # the keys some row of this block may see: [lo, hi)
        lo = 0
        hi = S
        if MODE == 0:
            pos = tl.load(pos_ptr + b * spb + t * spt, mask=row_ok, other=0).to(tl.int32)
            hi = tl.minimum(tl.reduce(tl.where(row_ok, pos, -1), 0, tl.standard._elementwise_max) + 1, S)
            if HAS_WINDOW:
                lo = tl.reduce(tl.where(row_ok, pos, S), 0, tl.standard._elementwise_min) - window + 1
                lo = tl.maximum(lo, 0) // BLOCK_N * BLOCK_N
        elif MODE == 1:
            base = tl.load(pos_ptr + b * spb).to(tl.int32)
            pmin = base
            pmax = base
            for j in range(1, T):
                pj = tl.load(pos_ptr + b * spb + j * spt).to(tl.int32)
                pmin = tl.minimum(pmin, pj)
                pmax = tl.maximum(pmax, pj)
            hi = tl.minimum(pmax + 1, S)
        start0 = tl.maximum(sid * chunk, lo)
        end = tl.minimum(sid * chunk + chunk, hi)
        kvh64 = kvh.to(tl.int64)
        m_i = tl.full((BLOCK_R,), float("-inf"), tl.float32)
        l_i = tl.full((BLOCK_R,), 0.0, tl.float32)
        acc = tl.full((BLOCK_R, BLOCK_D), 0.0, tl.float32)
        for start in range(start0, end, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            k_in = keys < end
            kmask = k_in[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + b * skb + keys[:, None].to(tl.int64) * sks + kvh64 * skh + dims[None, :] * skd,
                        mask=kmask, other=0.0)
            v = tl.load(v_ptr + b * svb + keys[:, None].to(tl.int64) * svs + kvh64 * svh + dims[None, :] * svd,
                        mask=kmask, other=0.0)
            if F32_DOT:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * qk_scale
            if MODE == 0:
                vis = keys[None, :] <= pos[:, None]
                if HAS_WINDOW:
                    vis = vis & (keys[None, :] > pos[:, None] - window)
            elif MODE == 1:
                vis = (keys[None, :] < base) & row_ok[:, None]
                if start + BLOCK_N > pmin:  # the block holds chunk rows: the ancestor rule
                    covered = tl.full((BLOCK_N,), 0, tl.int32)
                    hit = tl.full((BLOCK_R, BLOCK_N), 0, tl.int32)
                    for j in range(0, T):
                        pj = tl.load(pos_ptr + b * spb + j * spt).to(tl.int32)
                        aj = tl.load(aux_ptr + b * sab + t * sat + j * saj, mask=row_ok, other=0).to(tl.int32)
                        eq = (keys == pj).to(tl.int32)
                        covered = covered | eq
                        hit = hit | (eq[None, :] & aj[:, None])
                    vis = tl.where(covered[None, :] != 0, hit != 0, vis)
            else:
                vis = tl.load(aux_ptr + b * sab + t[:, None] * sat + keys[None, :].to(tl.int64) * saj,
                              mask=row_ok[:, None] & k_in[None, :], other=0) != 0
            vis = vis & k_in[None, :] & row_ok[:, None]
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)       # nothing seen yet: no NaN
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            if F32_DOT:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if SPLIT:
            w = (bh * n_splits + sid) * n_rows + rows
            tl.store(ws_m + w, m_i, mask=row_ok)
            tl.store(ws_l + w, l_i, mask=row_ok)
            tl.store(ws_acc + w.to(tl.int64)[:, None] * BLOCK_D + dims[None, :], acc, mask=row_ok[:, None])
        else:
            if HAS_SINKS:
                sink = tl.load(sink_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
                m_f = tl.maximum(m_i, sink)
                alpha = tl.exp2(m_i - m_f)
                l_i = l_i * alpha + tl.exp2(sink - m_f)
                acc = acc * alpha[:, None]
            o = acc / l_i[:, None]
            if ROUND_BF16:  # round to nearest even by bits (the interpreter's bf16 cast truncates)
                bits = o.to(tl.int32, bitcast=True)
                o = tl.where(o != o, o,   # NaN stays NaN (0x7FFFFFFF would carry into the sign)
                             ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True))
            tl.store(out_ptr + b * sob + t[:, None] * sot + head[:, None] * soh + dims[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    def _merge_kernel(sink_ptr, out_ptr, ws_m, ws_l, ws_acc, D, group, kv_heads, n_rows, n_splits,
                      sob, sot, soh,
                      HAS_SINKS: tl.constexpr, ROUND_BF16: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program (batch * kv head, row block): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s
        (+ the sink in the denominator)."""
        bh = tl.program_id(0)
        b = (bh // kv_heads).to(tl.int64)
        kvh = bh % kv_heads
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        t = tl.where(row_ok, rows // group, 0)
        head = kvh * group + rows % group
        dims = tl.arange(0, BLOCK_D)
        m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
        for s in range(0, n_splits):
            w = (bh * n_splits + s) * n_rows + rows
            m = tl.maximum(m, tl.load(ws_m + w, mask=row_ok, other=float("-inf")))
        if HAS_SINKS:
            sink = tl.load(sink_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            m = tl.maximum(m, sink)
        m_use = tl.where(m == float("-inf"), 0.0, m)
        l_i = tl.full((BLOCK_R,), 0.0, tl.float32)
        acc = tl.full((BLOCK_R, BLOCK_D), 0.0, tl.float32)
        for s in range(0, n_splits):
            w = (bh * n_splits + s) * n_rows + rows
            scale = tl.exp2(tl.load(ws_m + w, mask=row_ok, other=float("-inf")) - m_use)
            l_i += tl.load(ws_l + w, mask=row_ok, other=0.0) * scale
            acc += tl.load(ws_acc + w.to(tl.int64)[:, None] * BLOCK_D + dims[None, :], mask=row_ok[:, None],
                           other=0.0) * scale[:, None]
        if HAS_SINKS:
            l_i += tl.exp2(sink - m_use)
        o = acc / l_i[:, None]
        if ROUND_BF16:
            bits = o.to(tl.int32, bitcast=True)
            o = tl.where(o != o, o,   # NaN stays NaN (0x7FFFFFFF would carry into the sign)
                         ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True))
        tl.store(out_ptr + b * sob + t[:, None] * sot + head[:, None] * soh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims < D)[None, :])
else:  # pragma: no cover
    _attn_kernel = _merge_kernel = None


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _launch(kernel, grid, *args, **meta):
    """One kernel launch (a seam for tests counting launches)."""
    gpu.jit(kernel)[grid](*args, **meta)


def _decline(q, k_cache, v_cache):
    """Why the kernel does not take these q/caches, or None (shared by the three ops)."""
    if tl is None:
        return "triton is not installed"
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (q, k_cache, v_cache)):
        return "q and caches must be 4-D"
    if q.dtype not in FLOATS:
        return f"dtype {q.dtype}"
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return "cache dtype differs from q's"
    batch, rows, q_heads, dim = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != batch or k_cache.shape[3] != dim:
        return "cache shapes"
    kv_heads = k_cache.shape[2]
    if kv_heads == 0 or q_heads % kv_heads:
        return "query heads not a multiple of KV heads"
    if rows > MAX_ROWS:
        return f"more than {MAX_ROWS} query rows"
    if dim > MAX_DIM:
        return f"head dim over {MAX_DIM}"
    if q.numel() == 0 or k_cache.numel() == 0:
        return "empty inputs"
    if k_cache.device != q.device or v_cache.device != q.device:
        return "tensors on different devices"
    return None


def _splits(programs: int, keys: int, block_n: int):
    """(number of splits, keys per split): one split unless the cache is long and the grid small."""
    chunk = -(-keys // block_n) * block_n
    if keys >= SPLIT_MIN_KEYS and programs < TARGET_PROGRAMS:
        n = max(1, min(-(-TARGET_PROGRAMS // programs), keys // max(SPLIT_CHUNK, 1)))
        chunk = -(-(-(-keys // n)) // block_n) * block_n
    return -(-keys // chunk), chunk


def _run(mode, q, k_cache, v_cache, positions, aux, scale, window=None, sinks=None):
    """Launch for one of the modes; ``aux`` is ancestors (tree) or visible (mask), uint8 views."""
    batch, seq, q_heads, dim = q.shape
    keys, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    n_rows = seq * group
    out = torch.empty((batch, seq, q_heads, dim), dtype=q.dtype, device=q.device)
    block_d = max(16, _pow2(dim))
    block_r = min(64 if block_d <= 128 else 32, max(16, _pow2(n_rows)))
    block_n = KEY_BLOCK if block_d <= 128 else min(KEY_BLOCK, 32)
    row_blocks = -(-n_rows // block_r)
    n_splits, chunk = _splits(batch * kv_heads * row_blocks, keys, block_n)
    split = n_splits > 1
    if split:
        ws_m = torch.empty((batch * kv_heads, n_splits, n_rows), dtype=torch.float32, device=q.device)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty((batch * kv_heads, n_splits, n_rows, block_d), dtype=torch.float32, device=q.device)
    else:
        ws_m = ws_l = ws_acc = out
    pos = positions if positions is not None else out
    aux_t = aux if aux is not None else out
    pos_strides = positions.stride() if positions is not None else (0, 0)
    aux_strides = aux.stride() if aux is not None else (0, 0, 0)
    sink = sinks.reshape(-1).contiguous() if sinks is not None else out
    f32_dot = q.dtype == torch.float32 or gpu.interpreting()    # the interpreter's 16-bit dot is wrong
    round_bf16 = q.dtype == torch.bfloat16
    _launch(_attn_kernel, (batch * kv_heads, row_blocks, n_splits),
            q, k_cache, v_cache, pos, aux_t, sink, out, ws_m, ws_l, ws_acc,
            seq, keys, dim, group, kv_heads, n_rows, chunk, n_splits, float(scale) * _LOG2E,
            int(window) if window is not None else 0,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *pos_strides, *aux_strides, *out.stride()[:3],
            MODE=mode, HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None, SPLIT=split,
            F32_DOT=f32_dot, ROUND_BF16=round_bf16, BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_D=block_d)
    if split:
        _launch(_merge_kernel, (batch * kv_heads, row_blocks),
                sink, out, ws_m, ws_l, ws_acc, dim, group, kv_heads, n_rows, n_splits, *out.stride()[:3],
                HAS_SINKS=sinks is not None, ROUND_BF16=round_bf16, BLOCK_R=block_r, BLOCK_D=block_d)
    return out


def _positions_ok(positions, q) -> bool:
    return (isinstance(positions, torch.Tensor) and positions.dtype in (torch.int32, torch.int64)
            and tuple(positions.shape) == tuple(q.shape[:2]) and positions.device == q.device)


def _attention_check(q, k_cache, v_cache, positions, scale, window=None, sinks=None):
    reason = _decline(q, k_cache, v_cache)
    if reason is None and not _positions_ok(positions, q):
        reason = "positions must be int [B, T]"
    if reason is None and sinks is not None and (
            not isinstance(sinks, torch.Tensor) or sinks.numel() != q.shape[2] or sinks.device != q.device):
        reason = "sinks must hold one logit per query head"
    return reason


@gpu.register("attention", "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor positions, float scale, "
              "int? window=None, Tensor? sinks=None) -> Tensor", _attention_check)
def attention(q, k_cache, v_cache, positions, scale, window=None, sinks=None):
    """``torch_backend.attention``: [B, T, Hq, D] in q's dtype."""
    return _run(CAUSAL, q, k_cache, v_cache, positions, None, scale, window, sinks)


def _tree_attention_check(q, k_cache, v_cache, positions, ancestors, scale):
    reason = _decline(q, k_cache, v_cache)
    if reason is None and not _positions_ok(positions, q):
        reason = "positions must be int [B, T]"
    if reason is None and (not isinstance(ancestors, torch.Tensor)
                           or tuple(ancestors.shape) != (q.shape[0], q.shape[1], q.shape[1])
                           or ancestors.device != q.device):
        reason = "ancestors must be [B, T, T]"
    return reason


@gpu.register("tree_attention", "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor positions, Tensor ancestors, "
              "float scale) -> Tensor", _tree_attention_check)
def tree_attention(q, k_cache, v_cache, positions, ancestors, scale):
    """``torch_tree.tree_attention``: [B, T, Hq, D] in q's dtype."""
    anc = (ancestors if ancestors.dtype == torch.bool else ancestors != 0).view(torch.uint8)
    return _run(TREE, q, k_cache, v_cache, positions, anc, scale)


def _masked_attention_check(q, k_cache, v_cache, visible, scale):
    reason = _decline(q, k_cache, v_cache)
    if reason is None:
        target = (q.shape[0], q.shape[1], k_cache.shape[1])
        if (not isinstance(visible, torch.Tensor) or visible.dim() != 3
                or any(have not in (1, want) for have, want in zip(visible.shape, target))):
            reason = "visible must broadcast to [B, T, S]"
        elif visible.device != q.device:
            reason = "tensors on different devices"
    return reason


@gpu.register("masked_attention", "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor visible, float scale) -> Tensor",
              _masked_attention_check)
def masked_attention(q, k_cache, v_cache, visible, scale):
    """``torch_tree.masked_attention``: [B, T, Hq, D] in q's dtype."""
    visible = visible.to(torch.bool).expand(q.shape[0], q.shape[1], k_cache.shape[1])
    return _run(MASK, q, k_cache, v_cache, None, visible.view(torch.uint8), scale)
