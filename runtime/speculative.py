"""The speculative loop: propose -> verify -> accept -> roll back, for a batch of sequences.

One step: the draft proposes K tokens per sequence; the target scores [last accepted token +
K proposals] in ONE forward (returning per-position Mamba states); greedy acceptance keeps the
longest prefix equal to the target's argmax plus one bonus token, sampling uses rejection
sampling; the target's Mamba states are restored to the accepted row of the verify pass and the
draft is told what was kept. Finished sequences leave the batch.
"""
from __future__ import annotations

import time
from collections import Counter

import torch

from runtime import acceptance, sampling
from runtime.generation import GenerationResult, check_request, prefill
from runtime.rollback import select_verified


def speculative_generate(target, proposer, prompts: list[list[int]], max_new_tokens: int, draft_len: int, *,
                         temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, end_ids=(),
                         max_seq_len: int = 1 << 30, prefill_chunk: int = 512) -> GenerationResult:
    """Generates with a draft; the result's ``extra["acceptance"]`` has the acceptance statistics."""
    check_request(prompts, max_new_tokens, max_seq_len, target.config.vocab_size)
    if draft_len < 1:
        raise ValueError(f"draft_len: expected >= 1, got {draft_len}")
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    start = time.perf_counter()
    dev = target.device
    capacity = min(max_seq_len, max(len(p) for p in prompts) + max_new_tokens + draft_len + 1)
    state = target.new_state(len(prompts), capacity)
    logits, state, forwards, features = prefill(target, prompts, state, prefill_chunk, proposer.features)
    first = sampling.choose(logits, temperature, top_p, generator).tolist()
    outputs = [[t] for t in first]
    live = [b for b, t in enumerate(first) if t not in end_ids and max_new_tokens > 1]
    histogram, verifies = Counter(), 0
    if len(live) < len(prompts):
        keep = torch.tensor(live, dtype=torch.long)
        state = {k: v[keep.to(v.device)] for k, v in state.items()}
        features = {k: [v[i] for i in live] for k, v in features.items()}
    if live:
        proposer.start([prompts[b] for b in live], [first[b] for b in live], features, capacity)
    position = [len(prompts[b]) for b in live]          # where each live sequence's last token sits
    last = [first[b] for b in live]
    while live:
        k = min(draft_len, capacity - 1 - max(position))
        drafts, q = proposer.propose(k, temperature, top_p, generator)
        ids = torch.cat([torch.tensor(last, dtype=torch.int32, device=dev)[:, None], drafts.to(torch.int32).to(dev)], 1)
        pos = torch.tensor(position, dtype=torch.int32, device=dev)[:, None] + torch.arange(k + 1, dtype=torch.int32, device=dev)
        lengths = torch.full((len(live),), k + 1, dtype=torch.int32, device=dev)
        rows = torch.arange(k + 1, dtype=torch.int32, device=dev).repeat(len(live), 1)
        verify_logits, new_state, verify_features = target.forward(ids, pos, lengths, rows, state, all_states=True)
        verifies += 1
        if temperature:
            m, nxt = acceptance.rejection(drafts, q, verify_logits, temperature, top_p, generator)
        else:
            m, nxt = acceptance.greedy(drafts.to(verify_logits.device), verify_logits)
        state = select_verified(new_state, m.to(dev))
        proposer.accept(m, nxt, drafts, verify_features)
        done = []
        for i, b in enumerate(live):
            gained = drafts[i, :int(m[i])].tolist() + [int(nxt[i])]
            histogram[len(gained)] += 1
            for t in gained:
                outputs[b].append(t)
                if t in end_ids or len(outputs[b]) >= max_new_tokens:
                    done.append(i)
                    break
            position[i] += int(m[i]) + 1
            last[i] = int(nxt[i])
        if done:
            keep = [i for i in range(len(live)) if i not in set(done)]
            index = torch.tensor(keep, dtype=torch.long)
            state = {k_: v[index.to(v.device)] for k_, v in state.items()}
            proposer.keep(index)
            live = [live[i] for i in keep]
            position = [position[i] for i in keep]
            last = [last[i] for i in keep]
    total = sum(histogram.values())
    stats = {
        "mean_accepted_tokens": (sum(n * c for n, c in histogram.items()) / total) if total else 0.0,
        "histogram": {str(n): histogram.get(n, 0) for n in range(1, draft_len + 2)},
        "num_target_forwards": verifies + forwards,
        "num_verify_forwards": verifies,
        "draft_len": draft_len,
    }
    return GenerationResult(outputs, time.perf_counter() - start, verifies + forwards, {"acceptance": stats})
