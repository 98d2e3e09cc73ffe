"""Ops as the block drafts (DFlash, DSpark, P-EAGLE) use them: eager against an explicit-mask
reference, TensorRT lowering (recorded network, CPU interpreter) against eager.

The block drafts need no new op: a DFlash block attends bidirectionally inside itself and to the
context before its anchor by calling ``F.attention`` with every block row's limit set to the last
block position (``builder.models.dflash.block_limit``: a ``gather_rows`` of the positions at
``lengths - 1`` broadcast over the rows). These tests pin that pattern down, plus the integer
``where`` / ``gather_rows`` forms P-EAGLE and the block limit rely on, and the Markov step
(embedding gather + linear + add) DSpark's loop records.
"""
from __future__ import annotations

import pytest
import torch
from network_checks import F32, HALF, check, gen, randn

from builder import functional as F
from builder.models.dflash import block_limit


def _block_case(batch, ctx, rows, cap, dtype=torch.float32, seed=0):
    """q [B, L, 4, 8], caches [B, cap, 2, 8], block positions anchor + 0..L-1, ragged block lengths."""
    q = randn(batch, rows, 4, 8, seed=seed, dtype=dtype)
    k = randn(batch, cap, 2, 8, seed=seed + 1, dtype=dtype)
    v = randn(batch, cap, 2, 8, seed=seed + 2, dtype=dtype)
    anchor = torch.randint(0, ctx + 1, (batch, 1), generator=gen(seed), dtype=torch.int32)
    positions = anchor + torch.arange(rows, dtype=torch.int32)
    lengths = torch.randint(1, rows + 1, (batch,), generator=gen(seed + 3), dtype=torch.int32)
    lengths[0] = rows
    return q, k, v, positions, lengths


def _reference(q, k, v, positions, lengths, scale):
    """Explicit mask: slots < anchor (context) and the valid block slots anchor .. anchor+len-1."""
    batch, rows, heads, dim = q.shape
    kv = k.shape[2]
    out = torch.zeros_like(q, dtype=torch.float32)
    for b in range(batch):
        anchor, n = int(positions[b, 0]), int(lengths[b])
        keys = torch.arange(k.shape[1])
        visible = keys < anchor + n
        kk = k[b].float().repeat_interleave(heads // kv, dim=1)  # [S, H, D]
        vv = v[b].float().repeat_interleave(heads // kv, dim=1)
        scores = torch.einsum("thd,shd->hts", q[b].float(), kk) * scale
        scores = scores.masked_fill(~visible[None, None], float("-inf"))
        out[b] = torch.einsum("hts,shd->thd", torch.softmax(scores, -1), vv)
    return out.to(q.dtype)


def test_block_limit_is_last_valid_position():
    positions = torch.tensor([[5, 6, 7, 8], [0, 1, 2, 3]], dtype=torch.int32)
    lengths = torch.tensor([4, 2], dtype=torch.int32)
    assert block_limit(positions, lengths).tolist() == [[8, 8, 8, 8], [1, 1, 1, 1]]


@pytest.mark.parametrize("batch,ctx,rows", [(1, 0, 1), (2, 5, 4), (3, 9, 3)])
def test_block_attention_matches_explicit_mask(batch, ctx, rows):
    """Bidirectional inside the block, full view of the context before the anchor, nothing after."""
    q, k, v, positions, lengths = _block_case(batch, ctx, rows, cap=16, seed=batch)
    got = F.attention(q, k, v, block_limit(positions, lengths), 8 ** -0.5)
    want = _reference(q, k, v, positions, lengths, 8 ** -0.5)
    for b in range(batch):
        n = int(lengths[b])
        torch.testing.assert_close(got[b, :n], want[b, :n], **F32)


def test_block_attention_rows_see_later_rows():
    """Changing the last block row's key changes the first row's output (bidirectional), changing a
    slot past the block does not."""
    q, k, v, positions, lengths = _block_case(1, 4, 3, cap=12, seed=7)
    limit = block_limit(positions, lengths)
    base = F.attention(q, k, v, limit, 0.5)
    last = int(positions[0, -1])
    k2 = k.clone()
    k2[0, last] += 1.0
    assert not torch.allclose(F.attention(q, k2, v, limit, 0.5)[0, 0], base[0, 0])
    k3 = k.clone()
    k3[0, last + 1:] += 5.0
    torch.testing.assert_close(F.attention(q, k3, v, limit, 0.5), base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_attention_lowering(dtype):
    specs = [("q", dtype, (-1, -1, 4, 8)), ("k", dtype, (-1, -1, 2, 8)), ("v", dtype, (-1, -1, 2, 8)),
             ("pos", torch.int32, (-1, -1)), ("len", torch.int32, (-1,))]
    cases = [list(_block_case(b, c, r, cap=s, dtype=dtype, seed=b + r)) for b, c, r, s in
             [(1, 0, 1, 4), (2, 5, 4, 12), (3, 7, 5, 16)]]
    rec = check(lambda q, k, v, p, n: F.attention(q, k, v, block_limit(p, n), 8 ** -0.5), specs, cases,
                HALF.get(dtype, F32))
    assert {"gather_rows", "attention"} <= set(rec.lowerings)


def test_block_kv_write_then_attend_lowering():
    """The block's own K/V are written at its positions, then read back by the same rows."""
    def fn(q, knew, vnew, kc, vc, p, n):
        kc = F.kv_cache_update(kc, knew, p)
        vc = F.kv_cache_update(vc, vnew, p)
        return F.attention(q, kc, vc, block_limit(p, n), 8 ** -0.5), kc
    specs = [("q", torch.float32, (-1, -1, 4, 8)), ("kn", torch.float32, (-1, -1, 2, 8)),
             ("vn", torch.float32, (-1, -1, 2, 8)), ("kc", torch.float32, (-1, -1, 2, 8)),
             ("vc", torch.float32, (-1, -1, 2, 8)), ("pos", torch.int32, (-1, -1)), ("len", torch.int32, (-1,))]
    cases = []
    for b, r in [(1, 2), (2, 4)]:
        q, kc, vc, pos, lens = _block_case(b, 6, r, cap=14, seed=3 * b)
        cases.append([q, randn(b, r, 2, 8, seed=11), randn(b, r, 2, 8, seed=12), kc, vc, pos, lens])
    check(fn, specs, cases)


def test_where_int_scalar_replaces_ids_lowering():
    """P-EAGLE's placeholder rows: ids = where(is_mask, mask_token_id, ids), aux = where(.., mask_hidden, aux)."""
    mask_hidden = randn(6, seed=3)

    def fn(m, ids, aux):
        return F.where(m, 93, ids), F.where(F.reshape(m, [0, 0, 1]), mask_hidden, aux)
    cases = [[torch.randint(0, 2, (b, t), generator=gen(t), dtype=torch.int32),
              torch.randint(0, 90, (b, t), generator=gen(b), dtype=torch.int32), randn(b, t, 6, seed=t)]
             for b, t in [(1, 1), (2, 5)]]
    check(fn, [("m", torch.int32, (-1, -1)), ("ids", torch.int32, (-1, -1)), ("aux", torch.float32, (-1, -1, 6))],
          cases)


def test_markov_step_lowering():
    """DSpark's step: logits + W2 @ W1[prev] (embedding gather, linear, fp32 add)."""
    w1, w2 = randn(96, 8, seed=1), randn(64, 8, seed=2)

    def fn(logits, prev):
        return logits + F.to_float32(F.linear(F.embedding(prev, w1), w2))
    cases = [[randn(b, g, 64, seed=b), torch.randint(0, 96, (b, g), generator=gen(g), dtype=torch.int32)]
             for b, g in [(1, 1), (3, 2)]]
    check(fn, [("logits", torch.float32, (-1, -1, 64)), ("prev", torch.int32, (-1, -1))], cases)
