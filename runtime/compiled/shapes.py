"""The shapes of the compiled path's steps: which chunks compile, how their inputs are laid out and
padded so that one graph serves many calls (row-major strides, the batch and KV-capacity dims marked
dynamic, short chunks right-padded to a fixed row count), shared by the target's and the draft's
runners (``runtime.compiled.runner``, ``runtime.compiled.draft``)."""
from __future__ import annotations

import functools

import torch

HEADROOM = 16          # extra KV slots per sequence: the longest compiled chunk
MAX_TOKENS = 16        # chunks longer than this always run eagerly (prefill)
STEP_CALLS = 2         # decode, verify, rollback and draft rows compile on their 2nd call
# One sequence's prompt chunk of up to PROMPT_COMPILED_MAX tokens runs as compiled chunks of PROMPT_ROWS
# rows (the last right-padded): embedded target, 1 thread, eagerly ~4 ms + 0.1 ms a token (11 tokens 6.0 ms,
# 64: 10.2, 128: 17.3), compiled 2.2 ms per 16 rows (11 tokens: 2.2 ms); longer chunks stay eager.
PROMPT_ROWS, PROMPT_COMPILED_MAX = 16, 64
FEATURE_DRAFTS = ("eagle", "eagle3", "mtp")
BLOCK_DRAFTS = ("dflash", "dspark")      # context rows padded to K+1 by the proposer: one graph per step
PARALLEL_DRAFTS = ("peagle",)             # catch-up rows and placeholders right-padded to 2K: one graph per K
# Inductor turns a one-row attention (q [.., 1, D] x keys [.., D, S]) into a pointwise product and a
# sum, and by default recomputes q's rotary embedding (pow, cos, sin) inside it for every key slot.
# Storing such intermediates instead: embedded eagle3 draft step 0.50 -> 0.35 ms (the target's decode
# step unchanged, so it keeps the defaults).
DRAFT_OPTIONS = {"realize_cpu_opcount_threshold": 4, "realize_reads_threshold": 1}


def _dims(state_spec) -> dict[str, tuple[int, ...]]:
    """State name -> the dims that hold the capacity (from a symbolic ``state_spec``)."""
    try:
        spec = state_spec("batch", "capacity")
    except Exception:  # a module whose spec needs numbers: no dynamic capacity
        return {}
    return {name: tuple(i for i, d in enumerate(shape) if d == "capacity") for name, (shape, _) in spec.items()}


@functools.lru_cache(maxsize=1024)
def _dense_strides(shape) -> tuple:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return tuple(reversed(out))


def _prepare(tree, batch: int, capacity_dims: dict):
    """Tensors with row-major strides (graph guards check strides, those of size-1 dims too, and a
    step leaves views such as a conv window), the batch dim marked dynamic for batch >= 2 and the
    capacity dims of known state names marked dynamic."""
    def one(name, t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.stride() != _dense_strides(tuple(t.shape)):
            t = t.clone(memory_format=torch.contiguous_format)
        if batch > 1 and t.dim() and t.shape[0] == batch:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        for d in capacity_dims.get(name, ()):
            torch._dynamo.maybe_mark_dynamic(t, d)
        return t
    if isinstance(tree, dict):
        return {k: one(k, v) for k, v in tree.items()}
    return one(None, tree)


def _batch_label(batch: int) -> str:
    return "batch 1" if batch == 1 else "batch 2+"


def _pad_rows(feeds: dict, batch: int, rows: int, pad: int) -> dict:
    """Right-pads every [B, rows, ...] feed to ``pad`` rows: positions continue past the last row,
    everything else is zero; ``lengths`` and ``logit_index`` are unchanged."""
    out = {}
    for name, v in feeds.items():
        if not (isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == batch and v.shape[1] == rows
                and name not in ("logit_index",) and not name.startswith("past.")):
            out[name] = v
        elif name == "positions":
            out[name] = torch.cat([v, v[:, -1:] + torch.arange(1, pad - rows + 1, dtype=v.dtype, device=v.device)], 1)
        else:
            out[name] = torch.cat([v, v.new_zeros((batch, pad - rows) + tuple(v.shape[2:]))], 1)
    return out
