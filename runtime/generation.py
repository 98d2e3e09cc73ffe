"""Target-only generation for a batch of prompts: chunked prefill, then one token per step."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class GenerationResult:
    output_ids: list[list[int]]          # generated ids per prompt, prompt excluded
    seconds: float
    num_target_forwards: int
    extra: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(o) for o in self.output_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


def check_request(prompts, max_new_tokens, max_seq_len, vocab_size):
    """One-line ValueError for a request the engine cannot serve."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("input_ids: every prompt needs at least one token")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens: expected a positive number, got {max_new_tokens}")
    for p in prompts:
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"input_ids: token {bad[0]} outside the vocabulary [0, {vocab_size})")
        if len(p) + max_new_tokens > max_seq_len:
            raise ValueError(f"max_new_tokens: prompt ({len(p)}) + max_new_tokens ({max_new_tokens}) "
                             f"exceeds max_seq_len {max_seq_len}")



def run_group(group, prompts, max_new_tokens, params, end_ids=()):
    """Adds every prompt to an in-flight group and steps it until all are finished;
    ``max_new_tokens`` is one limit or one per prompt."""
    from runtime.batching import Sequence
    limits = max_new_tokens if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
    seqs = [Sequence(list(p), n, params, frozenset(end_ids), request_id=i) for i, (p, n) in enumerate(zip(prompts, limits))]
    group.add(seqs)
    while True:
        keep = [i for i, s in enumerate(group.seqs) if not s.finished]
        if len(keep) < len(group.seqs):
            group.drop(keep)
        if not group.seqs:
            return seqs
        group.step()


def generate(runner, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, end_ids=(),
             max_seq_len: int = 1 << 30, prefill_chunk: int = 512) -> GenerationResult:
    """Target-only generation; every prompt of the batch draws from one seeded generator in order."""
    from runtime.batching import PlainGroup
    from runtime.sampling import SamplingParams, seeded_generator
    check_request(prompts, max_new_tokens, max_seq_len, runner.config.vocab_size)
    generator = seeded_generator(seed)
    start = time.perf_counter()
    group = PlainGroup(runner, max(len(p) for p in prompts) + max_new_tokens, prefill_chunk)
    seqs = run_group(group, prompts, max_new_tokens, SamplingParams(temperature, top_p, generator), end_ids)
    return GenerationResult([s.outputs for s in seqs], time.perf_counter() - start, group.forwards,
                            {"cost": group.costs})
