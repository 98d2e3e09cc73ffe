"""Where decode time goes, per step: draft, verify (or target decode), accept + rollback, host.

A speculative step costs draft + verify + accept/rollback + host and emits ``tokens_per_step``
tokens; a target-only step costs decode + host and emits one. The cost model
``tokens_per_step * target_only_step / speculative_step`` is the speedup those numbers predict; a
report puts it beside the measured one, so a reader sees where the time goes and that the model
explains the measurement. Prefill is not a step; ``with_prefill`` adds each side's measured prefill
per request (a draft model's prefill runs a second network over the prompt, which the step model
leaves out) and the end-to-end speedup those shares predict.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

PARTS = ("draft", "verify", "accept", "host")


@dataclass
class StepCosts:
    """Seconds summed over the decode steps of one group (speculative or target-only)."""
    steps: int = 0
    tokens: int = 0          # tokens emitted by those steps (over all sequences)
    rows: int = 0            # sequences stepped, summed over steps (batch size x steps)
    proposals: int = 0       # draft tokens proposed (per sequence), summed over steps
    draft: float = 0.0       # proposing (incl. the draft's catch-up on verified tokens)
    verify: float = 0.0      # the target forward: verify chunk, or the decode step target-only
    accept: float = 0.0      # acceptance + rollback of the target state
    host: float = 0.0        # the rest of the step: inputs, emitting tokens, bookkeeping

    def add(self, total: float, tokens: int, rows: int, proposals: int = 0, draft: float = 0.0,
            verify: float = 0.0, accept: float = 0.0) -> None:
        self.steps += 1
        self.tokens += tokens
        self.rows += rows
        self.proposals += proposals
        self.draft += draft
        self.verify += verify
        self.accept += accept
        self.host += max(0.0, total - draft - verify - accept)

    def merge(self, other: "StepCosts") -> "StepCosts":
        for f in ("steps", "tokens", "rows", "proposals", *PARTS):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        return self

    @property
    def step_seconds(self) -> float:
        return sum(getattr(self, p) for p in PARTS)

    def summary(self) -> dict:
        """Per-step milliseconds of every part, their sum, and tokens per sequence-step."""
        n = max(1, self.steps)
        out = {f"{p}_ms": round(1e3 * getattr(self, p) / n, 4) for p in PARTS}
        out["step_ms"] = round(sum(out[f"{p}_ms"] for p in PARTS), 4)
        out.update(steps=self.steps, tokens=self.tokens,
                   tokens_per_step=round(self.tokens / max(1, self.rows), 4),
                   proposals_per_step=round(self.proposals / max(1, self.rows), 4),
                   draft_ms_per_proposal=round(1e3 * self.draft / max(1, self.proposals), 4)
                   if self.proposals else 0.0)
        return out


def cost_model(speculative: dict, target_only: dict) -> dict:
    """Both summaries side by side (``speculative``, ``target_only``, measured on the same prompts, so
    at the same batch), the speedup the costs predict per sequence at that batch (tokens_per_step x
    target-only step / speculative step) and the parts relative to a decode."""
    decode, step = target_only["step_ms"], speculative["step_ms"]
    return {"speculative": speculative, "target_only": target_only, "target_only_step_ms": decode, "target_decode_ms": target_only["verify_ms"],
            "verify_over_decode": round(speculative["verify_ms"] / target_only["verify_ms"], 3)
            if target_only["verify_ms"] else None,
            "draft_proposal_over_decode": round(speculative["draft_ms_per_proposal"] / target_only["verify_ms"], 3)
            if target_only["verify_ms"] else None,
            "model_speedup": round(speculative["tokens_per_step"] * decode / step, 3) if step else None}


def with_prefill(cost: dict, prefill_ms: dict, new_tokens: int) -> dict:
    """``cost`` (``cost_model``'s) with each side's prefill per request, timed apart from the runs
    (``prefill_ms``: {"speculative", "target_only"}: a one-token run, which on the speculative side
    includes the draft's own pass over the prompt), and the speedup prefill and steps then predict for
    requests of ``new_tokens`` tokens: (prefill + (N - 1) target-only steps) / (prefill + (N - 1) /
    tokens_per_step speculative steps); the first token comes from the prefill. Whatever else a run
    spends outside its steps is left out: it is the gap between this and the measured speedup."""
    s, plain = cost["speculative"], cost["target_only"]
    steps = max(0, new_tokens - 1)
    spec_ms = prefill_ms["speculative"] + steps / max(s["tokens_per_step"], 1e-9) * s["step_ms"]
    plain_ms = prefill_ms["target_only"] + steps * plain["step_ms"]
    return {**cost, "prefill_ms": {k: round(v, 3) for k, v in prefill_ms.items()},
            "model_speedup_with_prefill": round(plain_ms / spec_ms, 3) if spec_ms else None}


class Stopwatch:
    """Laps of one step: ``lap()`` returns the seconds since the previous lap (or the start)."""

    def __init__(self):
        self.start = self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        out, self.last = now - self.last, now
        return out

    def total(self) -> float:
        return time.perf_counter() - self.start

def cost_line(cost: dict) -> str:
    """One line: a speculative step's parts beside a target-only step, and the speedup they predict."""
    s = cost["speculative"]
    return (f"step cost: draft {s['draft_ms']:.2f} ms ({s['draft_ms_per_proposal']:.2f} per proposal) + verify "
            f"{s['verify_ms']:.2f} ms ({cost['verify_over_decode']:.2f}x a decode) + accept/rollback {s['accept_ms']:.2f} ms "
            f"+ host {s['host_ms']:.2f} ms = {s['step_ms']:.2f} ms for {s['tokens_per_step']:.2f} tokens; target-only "
            f"step {cost['target_only_step_ms']:.2f} ms; predicted speedup {cost['model_speedup']:.2f}x")
