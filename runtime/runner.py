"""Runners execute one chunk of the target (or a draft_target draft) for a batch of sequences.

A runner has one method that matters, ``forward(input_ids, positions, lengths, logit_index,
state, all_states=False)`` -> ``(logits, new_state, features)``, the I/O contract of
``builder.models.nemotron_h``. The TorchRunner runs the eager definition (CPU or CUDA);
``runtime.engine_runner`` runs engine directories (TensorRT on a GPU, or the CPU interpreter).
"""
from __future__ import annotations

from typing import Protocol

import torch

from runtime import state as state_lib


class Runner(Protocol):
    config: object
    dtype: torch.dtype
    device: torch.device

    def new_state(self, batch: int, capacity: int) -> dict[str, torch.Tensor]: ...

    def forward(self, input_ids, positions, lengths, logit_index, state: dict):
        ...


class TorchRunner:
    """Eager execution of a model module (the reference path)."""

    def __init__(self, module, device="cpu"):
        self.module = module
        self.config = module.cfg
        self.dtype = module.dtype
        self.device = torch.device(device)

    def new_state(self, batch, capacity):
        return state_lib.allocate(self.module.state_spec(batch, capacity), self.device)

    @torch.inference_mode()
    def forward(self, input_ids, positions, lengths, logit_index, state, all_states=False):
        return self.module.forward(input_ids, positions, lengths, logit_index, state, all_states)
