"""Chunked prefill: every prompt of a batch fed to a runner in chunks of at most the engine's
max_input_len, with each sequence's last-token logits and (for feature drafts) per-position features."""
from __future__ import annotations

import torch

from runtime.state import chunk_inputs, keep_rows

def prefill(runner, prompts, state, chunk_size, features=()):
    """Feeds every prompt in chunks of at most chunk_size tokens: each prompt that the runner wants fed
    alone (``prefills_alone``) as a batch of one, the batch's other prompts together.

    Returns (last-token logits [B, V], state, number of forwards, {feature name: per-sequence
    [L_b, F] tensors}) where ``features`` names the runner's feature outputs to collect per row.
    """
    alone = getattr(runner, "prefills_alone", None)
    if len(prompts) > 1 and alone is not None and all(v.shape[0] == len(prompts) for v in state.values()):
        single = [b for b, p in enumerate(prompts) if alone(p, chunk_size)]
        if single:
            rest = [b for b in range(len(prompts)) if b not in single]
            return _in_groups(runner, prompts, state, chunk_size, features, [[b] for b in single] + ([rest] if rest else []))
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


def _in_groups(runner, prompts, state, chunk_size, features, groups):
    """``prefill`` of each group of the batch's rows (a prompt alone, or the rest together) on its
    rows of ``state``, joined back in the batch's order: the compiled path's prompt chunks are batch-1
    graphs, so a prompt admitted beside others runs them as it would alone, whatever else arrived
    with it (a batch's chunk runs eagerly: slower, and its sums in another order)."""
    # each its own copy of its rows, not a view into the batch's tensors: a step compiled (or
    # recorded for a direct call) on a view input writes that input back after its graph
    outs = [prefill(runner, [prompts[b] for b in g], {k: v[g].clone() for k, v in state.items()}, chunk_size, features)
            for g in groups]
    order = torch.tensor([b for g in groups for b in g])
    back = torch.argsort(order)                      # row of the joined groups that holds batch row b
    joined = {k: torch.cat([out[1][k] for out in outs])[back.to(state[k].device)] for k in state}
    logits = torch.cat([out[0] for out in outs])[back.to(outs[0][0].device)]
    collected = {name: [rows for out in outs for rows in out[3][name]] for name in features}
    collected = {name: [rows[i] for i in back.tolist()] for name, rows in collected.items()}
    return logits, joined, sum(out[2] for out in outs), collected
