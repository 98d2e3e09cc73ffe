"""Runners execute one chunk of the target (or a draft_target draft) for a batch of sequences.

A runner has two methods that matter: ``forward(input_ids, positions, lengths, logit_index,
state, verify=False)`` -> ``(logits, new_state, features)``, the I/O contract of
``builder.models.nemotron_h``, and ``rollback(state, verified, accepted_rows)`` -> the state after
the accepted rows of a verify pass. The TorchRunner runs the eager definition (CPU or CUDA);
``runtime.engine_runner`` runs engine directories (TensorRT on a GPU, or the CPU interpreter).
"""
from __future__ import annotations

from typing import Protocol

import torch

from runtime import state as state_lib
from runtime.tree.paths import ancestors, greedy_path


class Runner(Protocol):
    config: object
    dtype: torch.dtype
    device: torch.device

    def new_state(self, batch: int, capacity: int) -> dict[str, torch.Tensor]: ...

    def forward(self, input_ids, positions, lengths, logit_index, state: dict, verify=False, tree=None):
        ...

    def rollback(self, state: dict, verified: dict, accepted_rows: torch.Tensor) -> dict: ...

    # runners that verify token trees (tree speculation) also have
    # tree_rollback(state, verified, paths, lengths, base) -> dict
    # and runners that can verify, accept greedily and roll back in one call have
    # verify_greedy(input_ids, positions, lengths, logit_index, state) -> (m, next, logits, state, features)
    # and its tree form verify_tree_greedy(input_ids, positions, state, parents, base, depth)
    # -> (paths, lengths, bonus, logits, state, features)


def verify_greedy(module, input_ids, positions, lengths, logit_index, state):
    """A greedy verify step whole: the verify forward of [last token, K drafts], the greedy accept
    (``runtime.acceptance.greedy``) and the rollback to the accepted rows, with no host round trip
    between them. Returns (accepted drafts m [B], the target's next token [B], logits, the
    rolled-back state, the verify's features)."""
    from runtime.acceptance import greedy
    logits, verified, features = module.forward(input_ids, positions, lengths, logit_index, state, True)
    m, nxt = greedy(input_ids[:, 1:].long(), logits, lengths - 1)   # rows past ``lengths``: padding
    return m, nxt, logits, module.rollback(state, verified, m), features


def verify_tree_greedy(module, input_ids, positions, state, parents, base, depth: int):
    """A greedy tree step whole: the tree verify of input_ids [B, T] (row 0 the root) with ``parents``
    [B, T], the greedy accept (``runtime.tree.paths.greedy_path``) and ``tree_rollback`` to the accepted
    path, with no host round trip between them; ``depth`` (the tree shape's) fixes the ancestor
    gathers and the path width depth + 1. Returns (paths [B, depth + 1], lengths [B], bonus [B],
    logits [B, T, V], the rolled-back state, the verify's features)."""
    batch, size = input_ids.shape
    rows = torch.arange(size, dtype=torch.int32, device=input_ids.device).expand(batch, -1)
    anc = ancestors(parents, depth)
    logits, verified, features = module.forward(input_ids, positions, torch.full_like(rows[:, 0], size), rows, state,
                                                True, (parents, anc))
    paths, lengths, bonus = greedy_path(input_ids, parents, logits.argmax(-1), anc, depth + 1)
    return paths, lengths, bonus, logits, module.tree_rollback(state, verified, paths, lengths, base), features


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
    def forward(self, input_ids, positions, lengths, logit_index, state, verify=False, tree=None):
        return self.module.forward(input_ids, positions, lengths, logit_index, state, verify, tree)

    @torch.inference_mode()
    def rollback(self, state, verified, accepted_rows):
        return self.module.rollback(state, verified, accepted_rows)

    @torch.inference_mode()
    def verify_greedy(self, input_ids, positions, lengths, logit_index, state):
        return verify_greedy(self.module, input_ids, positions, lengths, logit_index, state)

    @torch.inference_mode()
    def verify_tree_greedy(self, input_ids, positions, state, parents, base, depth):
        return verify_tree_greedy(self.module, input_ids, positions, state, parents, base, depth)

    @torch.inference_mode()
    def tree_rollback(self, state, verified, paths, lengths, base):
        return self.module.tree_rollback(state, verified, paths, lengths, base)
