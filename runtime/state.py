"""Per-sequence model state (KV caches, Mamba conv and SSM states) owned by the runtime.

Engines and the eager model are pure functions of their state; this module allocates it and builds
chunk inputs (rollback after a verify is the model's own: ``NemotronH.rollback``).
"""
from __future__ import annotations

import torch


def allocate(spec: dict, device="cpu") -> dict[str, torch.Tensor]:
    """Zero state for a ``state_spec`` (name -> (shape, dtype))."""
    return {name: torch.zeros(shape, dtype=dtype, device=device) for name, (shape, dtype) in spec.items()}


def chunk_inputs(chunks: list[list[int]], past_lengths: list[int], device="cpu", width: int | None = None):
    """Right-padded ``input_ids``, ``positions`` and ``lengths`` for one chunk per sequence, ``width``
    rows wide (default: the longest chunk); padded rows hold token 0 at the positions after the
    chunk's. One tensor built per input from Python lists: this runs every speculative step."""
    width = max(len(c) for c in chunks) if width is None else width
    ids = torch.tensor([list(c) + [0] * (width - len(c)) for c in chunks], dtype=torch.int32, device=device)
    positions = torch.tensor([range(p, p + width) for p in past_lengths], dtype=torch.int32, device=device)
    lengths = torch.tensor([len(c) for c in chunks], dtype=torch.int32, device=device)
    return ids, positions, lengths


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
