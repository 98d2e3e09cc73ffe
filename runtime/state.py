"""Per-sequence model state (KV caches, Mamba conv and SSM states) owned by the runtime.

Engines and the eager model are pure functions of their state; this module allocates it and builds
chunk inputs (rollback after a verify is the model's own: ``NemotronH.rollback``).
"""
from __future__ import annotations

import torch


def allocate(spec: dict, device="cpu") -> dict[str, torch.Tensor]:
    """Zero state for a ``state_spec`` (name -> (shape, dtype))."""
    return {name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in spec.items()}


def chunk_inputs(chunks: list[list[int]], past_lengths: list[int], device="cpu"):
    """Right-padded ``input_ids``, ``positions`` and ``lengths`` for one chunk per sequence."""
    width = max(len(c) for c in chunks)
    ids = torch.zeros(len(chunks), width, dtype=torch.int32)
    for b, c in enumerate(chunks):
        ids[b, :len(c)] = torch.tensor(c, dtype=torch.int32)
    past = torch.tensor(past_lengths, dtype=torch.int32)
    positions = past[:, None] + torch.arange(width, dtype=torch.int32)[None, :]
    lengths = torch.tensor([len(c) for c in chunks], dtype=torch.int32)
    return ids.to(device), positions.to(device), lengths.to(device)


def keep_rows(state: dict, new_state: dict, rows: list[int], batch: int) -> dict:
    """The state after a chunk in which only sequences ``rows`` consumed tokens (the others ran a
    padding row): ``new_state`` itself when every sequence did, else a merge taking those rows from
    it (tensors the forward updated in place are kept as they are)."""
    if len(rows) == batch:
        return new_state
    keep = torch.zeros(batch, dtype=torch.bool)
    keep[rows] = True
    out = {}
    for name, value in new_state.items():
        old = state[name]
        out[name] = value if value is old else torch.where(
            keep.to(value.device).view(-1, *[1] * (value.dim() - 1)), value, old)
    return out
