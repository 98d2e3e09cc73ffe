"""Chunked prefill: every prompt of a batch fed to a runner in chunks of at most the engine's
max_input_len, with each sequence's last-token logits and (for feature drafts) per-position features."""
from __future__ import annotations

import torch

from runtime.state import chunk_inputs, keep_rows

def prefill(runner, prompts, state, chunk_size, features=()):
    """Feeds every prompt in chunks of at most chunk_size tokens; a batch one prompt at a time where
    the runner says so (``prefills_alone``).

    Returns (last-token logits [B, V], state, number of forwards, {feature name: per-sequence
    [L_b, F] tensors}) where ``features`` names the runner's feature outputs to collect per row.
    """
    alone = getattr(runner, "prefills_alone", None)
    if len(prompts) > 1 and alone is not None and alone(prompts, chunk_size) \
            and all(v.shape[0] == len(prompts) for v in state.values()):
        return _each_alone(runner, prompts, state, chunk_size, features)
    done = [0] * len(prompts)
    last = [None] * len(prompts)
    collected = {name: [[] for _ in prompts] for name in features}
    forwards = 0
    while any(d < len(p) for d, p in zip(done, prompts)):
        active = [b for b, p in enumerate(prompts) if done[b] < len(p)]
        chunks = [prompts[b][done[b]:done[b] + chunk_size] if b in active else [0] for b in range(len(prompts))]
        ids, positions, lengths = chunk_inputs(chunks, done, runner.device)
        index = (lengths - 1).to(torch.int32)[:, None]
        logits, new_state, feats = runner.forward(ids, positions, lengths, index, state)
        forwards += 1
        state = keep_rows(state, new_state, active, len(prompts))  # sequences with nothing left keep theirs
        for b in active:
            last[b] = logits[b, 0]
            for name in features:
                collected[name][b].append(feats[name][b, :len(chunks[b])])
            done[b] += len(chunks[b])
    collected = {name: [torch.cat(rows) for rows in per_seq] for name, per_seq in collected.items()}
    return torch.stack(last), state, forwards, collected


def _each_alone(runner, prompts, state, chunk_size, features):
    """``prefill`` of each prompt as a batch of one, on its rows of ``state``, joined back: the
    compiled path's prompt chunks are batch-1 graphs, so a prompt admitted beside others runs them as
    it would alone (a batch's chunk ran eagerly: slower, and its sums in another order)."""
    # each its own copy of its rows, not a view into the batch's tensors: a step compiled (or
    # recorded for a direct call) on a view input writes that input back after its graph
    rows = [{k: v[b:b + 1].clone() for k, v in state.items()} for b in range(len(prompts))]
    outs = [prefill(runner, [p], rows[b], chunk_size, features) for b, p in enumerate(prompts)]
    joined = {k: torch.cat([out[1][k] for out in outs]) for k in state}
    collected = {name: [out[3][name][0] for out in outs] for name in features}
    return torch.cat([out[0] for out in outs]), joined, sum(out[2] for out in outs), collected
