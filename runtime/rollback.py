"""Rolling draft state back to an accepted position after a speculative verify.

The target rolls itself back (``NemotronH.rollback`` through its runner): its verify pass keeps each
Mamba layer's chunk inputs and the accepted position's state is computed once acceptance is known.
A draft_target draft consumes its own proposals one step at a time, so it keeps one state snapshot
per draft step and restores the accepted one.
"""
from __future__ import annotations

import torch


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
