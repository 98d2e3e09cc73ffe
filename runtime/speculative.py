"""The speculative loop: propose -> verify -> accept -> roll back, for a batch of sequences.

One step: the draft proposes K tokens per sequence; the target scores [last accepted token +
K proposals] in ONE forward (keeping each Mamba layer's chunk inputs); greedy acceptance keeps the
longest prefix equal to the target's argmax plus one bonus token, sampling uses rejection
sampling; the target computes its Mamba states at the accepted row from those inputs
(``NemotronH.rollback``) and the draft is told what was kept (``runtime.batching.SpeculativeGroup``). Finished sequences leave
the batch.
"""
from __future__ import annotations

import time
from dataclasses import replace

from runtime.batching import SpeculativeGroup
from runtime.draft_policy import DraftPolicy
from runtime.generation import GenerationResult, check_request, run_group
from runtime.sampling import SamplingParams, seeded_generator
from runtime.tree.draft import TreeShape
from runtime.tree.group import TreeSpeculativeGroup


def acceptance_stats(histogram, draft_len, verifies, prefill_forwards) -> dict:
    total = sum(histogram.values())
    return {
        "mean_accepted_tokens": (sum(n * c for n, c in histogram.items()) / total) if total else 0.0,
        "histogram": {str(n): histogram.get(n, 0) for n in range(1, draft_len + 2)},
        "num_target_forwards": verifies + prefill_forwards,
        "num_verify_forwards": verifies,
        "draft_len": draft_len,
    }


def speculative_generate(target, proposer, prompts: list[list[int]], max_new_tokens: int, draft_len: int, *,
                         temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, end_ids=(),
                         max_seq_len: int = 1 << 30, prefill_chunk: int = 512,
                         policy: DraftPolicy | None = None, trace=None, tree: TreeShape | None = None) -> GenerationResult:
    """Generates with a draft; the result's ``extra["acceptance"]`` has the acceptance statistics and
    ``extra["cost"]`` the per-step costs. ``policy`` adapts K per step (``runtime.draft_policy``).
    ``trace``, if given, is called with one dict per step per sequence (the speculation trace:
    ``step``, ``sequence`` (prompt index), ``position`` of the last accepted token the step starts
    from, ``k`` verified for it (0: a target-only step), ``proposed`` ids, ``accepted`` (how many of
    them), ``bonus`` (the target's token after them), ``emitted`` (tokens of accepted + bonus that
    reached the output before a stop), ``draft_ms`` / ``verify_ms`` of the batch's step). ``tree``:
    verify token trees of that shape instead of chains (``runtime.tree.group``)."""
    check_request(prompts, max_new_tokens, max_seq_len, target.config.vocab_size)
    if draft_len < 1:
        raise ValueError(f"draft_len: expected >= 1, got {draft_len}")
    generator = seeded_generator(seed)
    start = time.perf_counter()
    if tree is not None:
        draft_len = max(draft_len, tree.depth)
    headroom = draft_len + 1 if tree is None else max(draft_len, tree.max_nodes, tree.draft_rows) + 2
    capacity = min(max_seq_len, max(len(p) for p in prompts) + max_new_tokens + headroom)
    policy = replace(policy, draft_len=draft_len) if policy is not None else DraftPolicy(draft_len)
    if tree is None:
        group = SpeculativeGroup(target, lambda: proposer, draft_len, capacity, prefill_chunk, policy, trace)
    else:
        group = TreeSpeculativeGroup(target, lambda: proposer, tree, capacity, prefill_chunk, policy, trace)
    seqs = run_group(group, prompts, max_new_tokens, SamplingParams(temperature, top_p, generator), end_ids)
    stats = acceptance_stats(group.histogram, draft_len, group.verifies, group.forwards - group.verifies)
    stats["target_only_steps"] = group.target_only_steps
    stats["steps_by_draft_len"] = {str(k): group.draft_lens[k] for k in sorted(group.draft_lens)}
    if tree is not None:
        stats["tree"] = {"max_nodes": tree.max_nodes, "topk": tree.topk, "depth": tree.depth,
                         "steps_by_size": {str(k): v for k, v in sorted(group.tree_sizes.items())},
                         "steps_by_accepted_depth": {str(k): v for k, v in sorted(group.path_depths.items())},
                         "accepted_off_chain": group.off_chain}
    return GenerationResult([s.outputs for s in seqs], time.perf_counter() - start, group.forwards,
                            {"acceptance": stats, "cost": group.costs})
