"""Rolling model state back to an accepted position after a speculative verify.

Attention KV caches need nothing: rows past the accepted position are masked by ``positions`` and
overwritten by the next chunk. Mamba conv and SSM states are restored by selecting, per sequence,
the state the verify pass returned for the accepted row, never by recomputing the target.
"""
from __future__ import annotations

import torch

PER_POSITION = {"conv_state": "conv_states", "ssm_state": "ssm_states"}


def select_verified(new_state: dict, accepted_rows: torch.Tensor) -> dict:
    """State after consuming chunk rows 0..accepted_rows[b] of a verify pass run with all_states.

    ``new_state`` holds the per-position ``*.conv_states`` [B, T, ...] and ``*.ssm_states``; the
    result holds ordinary state tensors only.
    """
    rows = torch.arange(accepted_rows.shape[0], device=accepted_rows.device)
    out = {}
    for name, value in new_state.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf in PER_POSITION.values():
            continue
        per_position = new_state.get(f"{prefix}.{PER_POSITION[leaf]}") if leaf in PER_POSITION else None
        out[name] = value if per_position is None else per_position[rows, accepted_rows.long()]
    return out


def select_snapshots(snapshots: list[dict], index: torch.Tensor) -> dict:
    """Per sequence b, the state of snapshots[index[b]] (drafts keep one snapshot per draft step)."""
    if all(int(i) == int(index[0]) for i in index):
        return dict(snapshots[int(index[0])])
    out = {}
    for name in snapshots[0]:
        if all(s[name] is snapshots[0][name] for s in snapshots):  # one buffer updated in place
            out[name] = snapshots[0][name]
            continue
        stacked = torch.stack([s[name] for s in snapshots])          # [S, B, ...]
        out[name] = stacked[index.long(), torch.arange(stacked.shape[1])]
    return out
