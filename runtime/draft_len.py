"""``--num_draft_tokens auto``: the chain length K that maximises tokens per second where it runs.

The SpecInfer / Sequoia argument for a chain, with this machine's measured costs. A step drafting K
tokens emits E(K) = 1 + sum_{i<=K} a_1 ... a_i tokens, where a_j is the rate at which the j-th
proposal is accepted once the ones before it were, and costs

    step(K) = draft(K) + verify(K + 1 rows) + accept/rollback + host.

A chain draft (EAGLE, EAGLE-3, MTP, a draft model) pays per proposal; a block draft (DFlash,
DSpark, P-EAGLE) proposes its block in one call whatever K. A verify of T rows costs what the
measured decode (T = 1) and verify (T = K_max + 1) say, linearly between them (products stream the
same weights for every row count; the rows add multiply-adds), after padding T to the runner's
compiled verify buckets. The chosen K maximises E(K) x target-only step / step(K), the speedup
the costs predict (``step_costs.cost_model``'s), and is never more than the engine's K_max.
Both summaries come from one short calibration run of each side (``calibrate``).

``--draft_len_schedule auto`` asks the same question per batch size (``calibrate_schedule``): at
batch b a verify multiplies b(K+1) rows, so where the products turn compute-bound (many sequences
on a CPU) no K pays and the schedule keeps b target-only (K = 0).
"""
from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"


def draft_len_arg(text: str):
    """argparse type: a positive int, or ``auto``."""
    if text == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a positive integer or '{AUTO}', got {text!r}") from None
    return value


def acceptance_rates(histogram: dict, k_max: int) -> list[float]:
    """a_1..a_K from a chain's histogram {tokens per verify (1..K+1): steps}: a_j = P(at least j
    proposals accepted) / P(at least j - 1). A position no step reached keeps the last rate seen."""
    counts = [int(histogram.get(str(n), histogram.get(n, 0))) for n in range(1, k_max + 2)]
    reached = [sum(counts[j:]) for j in range(k_max + 1)]   # steps with >= j proposals accepted
    rates, last = [], 0.0
    for j in range(1, k_max + 1):
        last = reached[j] / reached[j - 1] if reached[j - 1] else last
        rates.append(last)
    return rates


def expected_tokens(rates: list[float], k: int) -> float:
    """Tokens a K-draft chain step emits on average: the accepted prefix plus the bonus token."""
    out, run = 1.0, 1.0
    for a in rates[:k]:
        run *= a
        out += run
    return out


@dataclass
class Costs:
    """Per-step milliseconds at K_max (``cost_model`` summaries) and how the draft scales with K."""
    k_max: int
    decode_ms: float            # target-only: the target forward of one row
    target_only_step_ms: float  # target-only: the whole step
    verify_ms: float            # speculative at K_max: the target forward of K_max + 1 rows
    draft_ms: float             # speculative at K_max: proposing, per step
    fixed_ms: float             # accept/rollback + host, per speculative step
    block: bool                 # a block draft: one call per step whatever K
    buckets: tuple = ()         # the runner's compiled verify row counts (a verify pads up to one)

    def rows(self, k: int) -> int:
        t = k + 1
        return next((b for b in sorted(self.buckets) if b >= t), t)

    def verify(self, k: int) -> float:
        top = self.rows(self.k_max)
        if top <= 1:
            return self.decode_ms
        return self.decode_ms + (self.verify_ms - self.decode_ms) * (self.rows(k) - 1) / (top - 1)

    def draft(self, k: int) -> float:
        return self.draft_ms if self.block else self.draft_ms * k / self.k_max

    def step(self, k: int) -> float:
        return self.draft(k) + self.verify(k) + self.fixed_ms


def predicted_speedups(costs: Costs, rates: list[float]) -> dict[int, float]:
    """K -> the speedup over target-only the costs predict, for K = 1..K_max."""
    return {k: round(expected_tokens(rates, k) * costs.target_only_step_ms / costs.step(k), 3)
            for k in range(1, costs.k_max + 1)}


def choose(costs: Costs, rates: list[float]) -> tuple[int, dict[int, float]]:
    """(the K with the highest predicted speedup, every K's prediction); ties go to the shorter K."""
    table = predicted_speedups(costs, rates)
    best = max(table, key=lambda k: (table[k], -k))
    return best, table


def costs_from(speculative: dict, target_only: dict, k_max: int, block: bool, buckets=()) -> Costs:
    """``Costs`` from ``StepCosts.summary()`` of a speculative run at K_max and a target-only run."""
    return Costs(k_max=k_max, decode_ms=target_only["verify_ms"], target_only_step_ms=target_only["step_ms"],
                 verify_ms=speculative["verify_ms"], draft_ms=speculative["draft_ms"],
                 fixed_ms=speculative["accept_ms"] + speculative["host_ms"], block=block, buckets=tuple(buckets))


def is_block_draft(proposer) -> bool:
    """Whether the proposer drafts its whole block in one call (DFlash, DSpark, P-EAGLE)."""
    from runtime.block_proposers import BlockDraftProposer, ParallelDraftProposer
    return isinstance(proposer, (BlockDraftProposer, ParallelDraftProposer))


def _measure(loaded, batch: list[list[int]], k_max: int, new_tokens: int, **generate_args):
    """One speculative run of ``batch`` at K_max and one target-only run: (the speculative result, the
    target-only cost summary, acceptance rates by position, ``Costs``)."""
    from runtime.generation import generate
    from runtime.speculative import speculative_generate
    proposer = loaded.proposer()
    spec = speculative_generate(loaded.runner, proposer, batch, new_tokens, k_max, **generate_args)
    plain = generate(loaded.runner, batch, new_tokens, **generate_args).extra["cost"].summary()
    rates = acceptance_rates(spec.extra["acceptance"]["histogram"], k_max)
    costs = costs_from(spec.extra["cost"].summary(), plain, k_max, is_block_draft(proposer),
                       getattr(loaded.runner, "verify_buckets", ()))
    return spec, plain, rates, costs


def calibrate(loaded, prompt: list[int], k_max: int, new_tokens: int = 48, **generate_args) -> dict:
    """One speculative run at K_max and one target-only run of ``prompt`` on ``loaded``, and the K
    they pick: {"k", "predicted": {K: speedup}, "rates", "costs"}."""
    _, _, rates, costs = _measure(loaded, [prompt], k_max, new_tokens, **generate_args)
    k, table = choose(costs, rates)
    return {"k": k, "predicted": table, "rates": [round(a, 3) for a in rates], "costs": costs.__dict__}


def describe(choice: dict) -> str:
    """One line for a log: the K chosen and every K's predicted speedup."""
    table = ", ".join(f"K={k} {v:.2f}x" for k, v in choice["predicted"].items())
    rates = ", ".join(f"{a:.2f}" for a in choice["rates"])
    return f"--num_draft_tokens auto: K={choice['k']} (predicted {table}; acceptance by position {rates})"


#: prompts a server calibrates on when no request has come yet: code and prose, as users send
CALIBRATION_TEXTS = ("def fibonacci(n):\n", "import os\nimport sys\n\n", "class Parser(object):\n",
                     "The quick brown fox", "# utilities\nfrom re import")


def calibration_prompts(tokenizer_path, vocab_size: int) -> list[list[int]]:
    """CALIBRATION_TEXTS encoded with the model's tokenizer (token ids spread over the vocabulary where
    there is none)."""
    if tokenizer_path is not None:
        from builder.tokenizer_file import load_tokenizer
        tok = load_tokenizer(tokenizer_path)
        prompts = [tok.encode(t).ids for t in CALIBRATION_TEXTS]
        if all(prompts):
            return prompts
    return [[(7 * i + 3 * j + 1) % vocab_size for j in range(6)] for i in range(len(CALIBRATION_TEXTS))]


def schedule_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch``, and ``max_batch`` itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max(1, max_batch)]


#: a batch size speculates only where a run measured at least this step speedup: a step ratio leaves out
#: the draft's own prefill, and one short run on these shared machines moves by about 5% (measured at
#: 16 sequences on the wide target, Zen 4: K=4 1.02x in the calibration, 0.95x end to end through Triton)
MIN_MEASURED_GAIN = 1.05


def calibrate_schedule(loaded, prompts: list[list[int]], k_max: int, batch_sizes: list[int], new_tokens: int = 32,
                       warm=None, **generate_args) -> dict:
    """For each batch size b: b sequences (``prompts`` cycled) run speculative at K_max and target-only;
    their costs and acceptance propose a K (``schedule_entry``), and a K other than K_max is then run
    too, so the entry rests on measured steps: the K whose own run measured the higher speedup, or 0
    where no run beat target-only by MIN_MEASURED_GAIN (the model's draft cost, linear in K, is
    optimistic where a step's catch-up dominates, as at 16 sequences). Returns {"schedule": {b: K}, "predicted": {b: {K: x}},
    "measured": {b: {K: x}}}, the schedule in ``DraftPolicy.schedule``'s form; each speedup is the
    steady-state step ratio (``step_costs.cost_model``), prefill excluded. ``warm(K, batch)`` (K = 0:
    target-only) readies a run's steps before it is timed (the compiled path: compiled or loaded)."""
    from runtime.speculative import speculative_generate
    from runtime.step_costs import cost_model
    schedule, predicted, measured = {}, {}, {}
    for b in sorted(set(batch_sizes)):
        batch = [prompts[i % len(prompts)] for i in range(b)]
        if warm is not None:
            warm(k_max, batch)
            warm(0, batch)
        spec, plain, rates, costs = _measure(loaded, batch, k_max, new_tokens, **generate_args)
        k, predicted[b] = schedule_entry(costs, rates)
        runs = {k_max: spec}
        if 0 < k < k_max:
            if warm is not None:
                warm(k, batch)
            runs[k] = speculative_generate(loaded.runner, loaded.proposer(), batch, new_tokens, k, **generate_args)
        measured[b] = {kk: cost_model(run.extra["cost"].summary(), plain)["model_speedup"] or 0.0
                       for kk, run in runs.items()}
        best = max(measured[b], key=lambda kk: (measured[b][kk], -kk))
        schedule[b] = best if measured[b][best] >= MIN_MEASURED_GAIN else 0
    return {"schedule": schedule, "predicted": predicted, "measured": measured}


def schedule_entry(costs: Costs, rates: list[float]) -> tuple[int, dict[int, float]]:
    """(K for this batch size, every K's prediction): ``choose``'s K, or 0 (target-only) where no K is
    predicted to beat target-only."""
    k, table = choose(costs, rates)
    return (k if table[k] > 1.0 else 0), table


def describe_schedule(choice: dict) -> str:
    """One line for a log: the schedule and the speedups each batch size's runs measured."""
    schedule = ",".join(f"{b}:{k}" for b, k in choice["schedule"].items())
    runs = "; ".join(f"batch {b}: " + ", ".join(f"K={k} {x:.2f}x" for k, x in sorted(m.items()))
                     for b, m in choice["measured"].items())
    return f"--draft_len_schedule auto: {schedule} (measured step speedups: {runs})"


def scheduled_lengths(schedule: dict[int, int], k_max: int) -> list[int]:
    """The draft lengths a schedule uses besides K_max (their steps to warm up before serving)."""
    return sorted({k for k in schedule.values() if 0 < k < k_max})
