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
