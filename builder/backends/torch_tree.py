"""Eager torch lowerings of the token-tree ops (``builder.functional.tree_*``)."""
from __future__ import annotations

import torch

from builder.backends import gpu as _gpu
from builder.backends.torch_backend import activation as _activation, gqa_mix, gqa_scores


def tree_conv1d(x, conv_state, weight, bias, parents, activation=None):
    if _gpu.active(x):
        out = _gpu.dispatch("tree_conv1d", x, conv_state, weight, bias, parents, activation)
        if out is not None:
            return out
    batch, seq, _ = x.shape
    width = weight.shape[1]
    padded = torch.cat([conv_state.to(x.dtype), x], dim=1)                  # [B, K-1+T, C]
    # each padded row's predecessor: conv-state rows the previous row, the root the last conv row,
    # a tree row its parent
    before = torch.arange(-1, width - 2, device=x.device).expand(batch, -1)
    up = torch.cat([before, parents.long().to(x.device) + (width - 1)], dim=1)
    up[:, width - 1] = width - 2
    index = torch.arange(width - 1, width - 1 + seq, device=x.device).expand(batch, -1)
    taps = [index]
    for _ in range(width - 1):
        index = up.gather(1, index.clamp_min(0))
        taps.append(index)
    rows = torch.stack(taps[::-1], dim=-1)                                   # [B, T, K] oldest first
    window = padded.gather(1, rows.flatten(1)[..., None].expand(-1, -1, padded.shape[2]).clamp_min(0))
    y = torch.einsum("btkc,ck->btc", window.view(batch, seq, width, -1), weight)
    y = y if bias is None else y + bias
    return y if activation is None else _activation(y, activation)


def tree_ssm_scan(x, dt, A, B, C, D, state, ancestors):
    if _gpu.active(x):
        out = _gpu.dispatch("tree_ssm_scan", x, dt, A, B, C, D, state, ancestors)
        if out is not None:
            return out
    dtype, heads = x.dtype, x.shape[2]
    xf, dtf = x.float(), dt.float()
    Bf = B.float().repeat_interleave(heads // B.shape[2], dim=2)
    Cf = C.float().repeat_interleave(heads // C.shape[2], dim=2)
    mask = ancestors.to(torch.bool)                                          # [B, T, T]
    a = dtf * A.float()                                                      # [B, T, H]
    path = torch.einsum("bij,bjh->bih", mask.float(), a)                     # decay summed root..i
    gap = path[:, :, None, :] - path[:, None, :, :]                          # [B, i, j, H]
    decay = torch.exp(gap.masked_fill(~mask[..., None], float("-inf")))
    scores = torch.einsum("bihn,bjhn->bijh", Cf, Bf) * decay
    y = torch.einsum("bijh,bjhp->bihp", scores, xf * dtf[..., None])
    y = y + torch.einsum("bihn,bhpn->bihp", Cf, state.float()) * torch.exp(path)[..., None]
    return (y + xf * D.float()[:, None]).to(dtype)


def tree_attention(q, k_cache, v_cache, positions, ancestors, scale):
    if _gpu.active(q):
        out = _gpu.dispatch("tree_attention", q, k_cache, v_cache, positions, ancestors, scale)
        if out is not None:
            return out
    batch, seq = q.shape[:2]
    keys = torch.arange(k_cache.shape[1], device=q.device)
    base = positions.long()[:, :1]                                           # [B, 1]: the root's row
    visible = (keys[None, None, :] < base[:, :, None]).expand(batch, seq, -1).clone()
    rows = positions.long()[:, None, :].expand(batch, seq, seq)              # ancestor j's cache row
    visible.scatter_(2, rows, ancestors.to(torch.bool))
    return masked_attention(q, k_cache, v_cache, visible, scale)


def masked_attention(q, k_cache, v_cache, visible, scale):
    if _gpu.active(q):
        out = _gpu.dispatch("masked_attention", q, k_cache, v_cache, visible, scale)
        if out is not None:
            return out
    scores = gqa_scores(q, k_cache, scale)
    scores = scores.masked_fill(~visible.to(torch.bool)[:, None, None], float("-inf"))
    return gqa_mix(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v_cache)
