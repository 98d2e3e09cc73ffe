"""``--draft_len_adaptive on``: each sequence's K, step by step, from its own acceptance and the measured step costs.

One K for every request leaves speed both ways (docs/memory_bound.md, "Draft length by prompt"): a stretch
the draft predicts well gains from a long chain, one it predicts badly pays for proposals it loses. The
same question ``--num_draft_tokens auto`` answers once per run (``runtime.draft_len``), asked again
at every step for every sequence:

* a sequence's acceptance is one rate ``a`` (the chance a proposal is kept once those before it were),
  counted over its recent steps with older steps decayed (a step that kept m of k proposals counts as
  m successes, and one failure unless m == k), so a stretch of full acceptances raises it within a few
  steps and a run of early rejections lowers it;
* the group learns where a draft's positions fall short of its overall rate: all its sequences'
  steps, counted per position and decayed slowly, give each position j a factor
  ``f_j = min(1, group rate at j / group rate overall)``, 1 where it has little evidence. A block
  draft trained at K = 4 loses most proposals past its fourth (the embedded DFlash: 0.84 kept at the
  fourth, 0.43 at the fifth, 0.12 at the sixth), which one rate cannot tell from a uniformly weaker
  draft; an EAGLE-3 chain keeps a long run's later proposals at least as often as its first (factors
  of 1: one rate, as before);
* a chain of k proposals then emits ``1 + a f_1 + (a f_1)(a f_2) + ...`` tokens on average;
* a step drafting k costs what this group's own steps at k measured (per batch size, decayed), and where
  a k was not run yet at this batch size, the nearest measured k scaled by the prior per-proposal share
  ``PRIOR_COST_PER_PROPOSAL`` (or the slope between two measured ks);
* the sequence drafts the candidate k with the most tokens per millisecond. Candidates are the lengths
  whose verify the runner has compiled (verify buckets minus one: 1, 2, 4, 8 and K_max), so no step pads.

Exact whatever it picks: acceptance only ever keeps verified tokens.
"""
from __future__ import annotations

from runtime.draft_len import expected_tokens

#: a proposal's share of a K = 0 step before any other K was measured (draft + verify row): the wide
#: embedded target measured ~0.11 on Zen 4 (docs/memory_bound.md); the model's own steps replace it
PRIOR_COST_PER_PROPOSAL = 0.1
#: weight of older steps in a sequence's acceptance rate (0.7: about the last 3 steps count)
RATE_DECAY = 0.7
#: a new sequence's prior: this rate with the weight of this many proposals
PRIOR_RATE, PRIOR_WEIGHT = 0.7, 2.0
#: weight of older sequence-steps in the group's counts by position (about the last 30 count)
GROUP_RATE_DECAY = 0.97
#: the weight, in proposals, of the group's overall rate in its rate at each position
POSITION_PRIOR_WEIGHT = 2.0
#: weight of a new step time in a (batch, K)'s running cost
COST_STEP_WEIGHT = 0.2


def candidate_lengths(draft_len: int, verify_buckets=()) -> list[int]:
    """The Ks a sequence may draft: 1..K_max, or where the runner compiles verify steps for some row
    counts only, those counts minus one (and K_max)."""
    if not verify_buckets:
        return list(range(1, draft_len + 1))
    return sorted({b - 1 for b in verify_buckets if 1 <= b - 1 <= draft_len} | {draft_len})


class SequenceRate:
    """One sequence's acceptance rate, its older steps decayed."""

    def __init__(self):
        self.kept, self.lost = PRIOR_RATE * PRIOR_WEIGHT, (1 - PRIOR_RATE) * PRIOR_WEIGHT

    def record(self, accepted: int, drafted: int) -> None:
        if drafted <= 0:
            return
        self.kept = self.kept * RATE_DECAY + accepted
        self.lost = self.lost * RATE_DECAY + (1.0 if accepted < drafted else 0.0)

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.lost)


class PositionFactors:
    """A group's acceptance by draft position, relative to its overall rate: at position j (1-based),
    the proposals tried (every earlier one was kept) and kept, over all its sequences' steps."""

    def __init__(self, decay: float = GROUP_RATE_DECAY):
        self.decay = decay
        self.kept: list[float] = []
        self.tried: list[float] = []

    def record(self, accepted: int, drafted: int) -> None:
        """A step that kept ``accepted`` of ``drafted`` proposals (a step that drafted none says nothing)."""
        if drafted <= 0:
            return
        reached = min(accepted + 1, drafted)      # kept at 1..m, rejected at m + 1 (none when m == k)
        grow = reached - len(self.tried)
        if grow > 0:
            self.kept += [0.0] * grow
            self.tried += [0.0] * grow
        self.kept = [x * self.decay for x in self.kept]
        self.tried = [x * self.decay for x in self.tried]
        for j in range(reached):
            self.tried[j] += 1.0
            self.kept[j] += 1.0 if j < accepted else 0.0

    def factors(self, k: int) -> list[float]:
        """f_1..f_k: each position's rate over the overall rate, at most 1; a position's rate is shrunk
        toward the overall one by ``POSITION_PRIOR_WEIGHT`` proposals, so one with little evidence is 1."""
        tried = sum(self.tried)
        if not tried:
            return [1.0] * k
        overall = sum(self.kept) / tried
        out = []
        for j in range(k):
            kept, seen = (self.kept[j], self.tried[j]) if j < len(self.tried) else (0.0, 0.0)
            at = (kept + POSITION_PRIOR_WEIGHT * overall) / (seen + POSITION_PRIOR_WEIGHT)
            out.append(min(1.0, at / overall) if overall > 0 else 1.0)
        return out


def sequence_rates(rate: float, group: PositionFactors | None, k: int) -> list[float]:
    """A sequence's a_1..a_k: its own rate, times the group's factor at each position."""
    return [rate * f for f in (group.factors(k) if group is not None else [1.0] * k)]


class StepCostTable:
    """Running seconds of a speculative step by (batch size, K), as this group measured them."""

    def __init__(self):
        self.seconds: dict[tuple[int, int], float] = {}

    def record(self, batch: int, k: int, seconds: float) -> None:
        key = (batch, k)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else old + COST_STEP_WEIGHT * (seconds - old)

    def cost(self, batch: int, k: int) -> float:
        """A step's seconds at K (relative where nothing was measured at this batch size: only ratios
        between Ks decide)."""
        known = sorted((kk, s) for (b, kk), s in self.seconds.items() if b == batch)
        if not known:
            return 1.0 + PRIOR_COST_PER_PROPOSAL * k
        exact = dict(known)
        if k in exact:
            return exact[k]
        below = [p for p in known if p[0] < k][-2:]
        above = [p for p in known if p[0] > k][:2]
        near = (below[-1:] + above[:1]) if below and above else (below or above)
        if len(near) == 2 and near[0][0] != near[1][0]:
            (k0, s0), (k1, s1) = near
            slope = max(0.0, (s1 - s0) / (k1 - k0))
            return s0 + slope * (k - k0)
        k0, s0 = near[0]
        per = s0 * PRIOR_COST_PER_PROPOSAL / (1.0 + PRIOR_COST_PER_PROPOSAL * k0)
        return s0 + per * (k - k0)


def best_length(rates: list[float], candidates: list[int], cost) -> int:
    """The candidate K with the most tokens per second (``rates``: a_1..a_Kmax; ``cost(K)``: a
    step's seconds); ties: shorter."""
    return max(candidates, key=lambda k: (expected_tokens(rates, k) / max(cost(k), 1e-12), -k))
