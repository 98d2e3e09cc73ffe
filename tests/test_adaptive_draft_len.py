"""``--draft_len_adaptive on`` (runtime.adaptive_draft_len): each sequence's K from its own recent
acceptance and the group's measured step costs; the output stays the target's own."""
from types import SimpleNamespace

import pytest
import torch

from runtime.adaptive_draft_len import (PRIOR_COST_PER_PROPOSAL, PositionFactors, SequenceRate, StepCostTable,
                                        best_length, candidate_lengths, expected_tokens, sequence_rates)
from runtime.draft_policy import DraftPolicy, on_off, policy_from
from runtime.batching import SpeculativeGroup
from runtime.generation import run_group
from runtime.sampling import SamplingParams
from runtime.speculative import speculative_generate
from test_speculative import PROMPTS, pair, reference  # noqa: F401 (fixtures)


def test_expected_tokens_multiply_the_rates_along_the_chain():
    """A chain whose j-th proposal is kept with probability a_j (once those before it were) emits
    1 + a_1 + a_1 a_2 + ... tokens; one rate everywhere is the geometric chain."""
    for a in (0.0, 0.3, 0.9):
        for k in (1, 4, 8):
            assert expected_tokens([a] * 8, k) == pytest.approx(sum(a ** j for j in range(k + 1)))
    assert expected_tokens([1.0] * 4, 4) == 5
    assert expected_tokens([0.5, 1.0, 0.0, 1.0], 4) == pytest.approx(1 + 0.5 + 0.5)


def test_candidates_are_the_compiled_verify_lengths():
    assert candidate_lengths(8, [2, 3, 5, 9]) == [1, 2, 4, 8]
    assert candidate_lengths(6, [2, 3, 5, 7, 9]) == [1, 2, 4, 6]     # K_max itself, and nothing past it
    assert candidate_lengths(3) == [1, 2, 3]                           # eager: every length


def test_rate_follows_the_recent_steps():
    """Full acceptances raise a sequence's rate within a few steps, early rejections lower it (a step
    that kept m of k is m successes and one failure, older steps decayed)."""
    r = SequenceRate()
    start = r.rate
    for _ in range(4):
        r.record(8, 8)
    assert r.rate > 0.95 > start
    high = r.rate
    for _ in range(4):
        r.record(0, 8)
    assert r.rate < 0.7 < high
    fresh = SequenceRate()
    for _ in range(4):
        fresh.record(0, 4)
    assert fresh.rate < 0.2
    fresh.record(0, 0)        # a step that proposed nothing for it says nothing
    assert fresh.rate < 0.2


def test_positions_that_fall_short_of_the_groups_rate_shorten_k():
    """A block draft trained at K = 4 loses its later proposals (the embedded DFlash: 0.43 kept at the
    5th, 0.12 at the 6th): the group's steps at K = 8 teach every sequence that, so a sequence that
    keeps all of its K = 4 does not go to K = 8 (one rate for every position would), while behind a
    chain draft whose later proposals hold up it does; positions with no evidence keep factor 1."""
    flat = lambda k: 1.0 + 0.1 * k          # noqa: E731
    assert PositionFactors().factors(3) == [1.0] * 3
    block = PositionFactors()
    for step in range(40):
        block.record(4 if step % 4 else 2, 8)     # the 5th always rejected, the 3rd now and then
    f = block.factors(8)
    assert f[:2] == [1.0, 1.0] and f[4] < 0.3 and f[5:] == [1.0] * 3, f    # 6..8: never tried
    seq = SequenceRate()
    for _ in range(3):
        seq.record(4, 4)                          # this sequence: every proposal of its K = 4 kept
    assert best_length(sequence_rates(seq.rate, None, 8), [1, 2, 4, 8], flat) == 8
    assert best_length(sequence_rates(seq.rate, block, 8), [1, 2, 4, 8], flat) == 4
    chain = PositionFactors()
    for step in range(40):
        chain.record(8 if step % 2 else 0, 8)     # later proposals kept more often than the first
    assert chain.factors(8)[1:] == [1.0] * 7
    assert best_length(sequence_rates(seq.rate, chain, 8), [1, 2, 4, 8], flat) == 8


def test_step_costs_interpolate_and_extrapolate():
    t = StepCostTable()
    assert t.cost(1, 4) / t.cost(1, 0) == pytest.approx(1 + 4 * PRIOR_COST_PER_PROPOSAL)   # nothing measured
    t.record(1, 4, 6.0)
    assert t.cost(1, 4) == 6.0
    assert t.cost(1, 8) > 6.0 > t.cost(1, 2)                        # one point: the prior share per proposal
    t.record(1, 8, 8.0)
    assert t.cost(1, 6) == pytest.approx(7.0)                       # between two: the line through them
    t.record(1, 2, 5.5)
    assert t.cost(1, 1) == pytest.approx(5.25)                      # below: the slope of the nearest two
    t.record(1, 4, 7.0)
    assert t.cost(1, 4) == pytest.approx(6.2)                       # a new step moves the running cost
    assert t.cost(2, 4) == pytest.approx(1 + 4 * PRIOR_COST_PER_PROPOSAL)   # per batch size


def test_best_length_weighs_acceptance_against_cost():
    """A sequence the draft predicts badly drafts little, one it predicts well the longest K; a steep
    cost per proposal (cache-resident weights: compute-bound verifies) shortens it."""
    flat = lambda k: 1.0 + 0.1 * k          # noqa: E731
    steep = lambda k: 1.0 + 0.6 * k         # noqa: E731
    ks = [1, 2, 4, 8]
    assert best_length([0.2] * 8, ks, flat) == 1
    assert best_length([0.95] * 8, ks, flat) == 8
    assert best_length([0.95] * 8, ks, steep) < 8


def test_flag_parses_and_overrides():
    assert on_off("on") is True and on_off("OFF") is False and on_off(True) is True and on_off("True") is True
    with pytest.raises(ValueError, match="on or off"):
        on_off("maybe")
    assert policy_from(4, {"draft_len_adaptive": True}).adaptive
    assert not policy_from(4, {"draft_len_adaptive": True}, SimpleNamespace(draft_len_adaptive=False)).adaptive
    from serving.repository import decode_policy, encode_policy
    assert decode_policy(encode_policy({"draft_len_adaptive": True})).draft_len_adaptive is True
    assert decode_policy(encode_policy({"draft_len_adaptive": False})).draft_len_adaptive is False


@pytest.mark.parametrize("mode", ["eagle3", "draft_target", "dflash", "mtp"])
def test_adaptive_k_varies_and_stays_exact(mode, pair, reference):
    """Greedy: every K it picks verifies against the target, so the ids are target greedy's, and the
    steps draft more than one K (the rates move with what is accepted)."""
    target, proposer = pair
    result = speculative_generate(target, proposer(mode), PROMPTS, 48, 4, policy=DraftPolicy(4, adaptive=True))
    assert result.output_ids == reference
    assert len(result.extra["acceptance"]["steps_by_draft_len"]) > 1, result.extra["acceptance"]


@pytest.fixture(scope="module")
def embedded():
    """The embedded target and its trained EAGLE-3 draft (eager), whose acceptance differs by prompt
    as a served model's does, and code prompts of the bench: one it predicts badly, two well."""
    from builder.embedded.sources import resolve_sources
    from builder.tokenizer_file import load_tokenizer
    from nemospec.bench import PROMPTS as CODE
    from runtime.loading import open_checkpoint
    target, draft = resolve_sources(None, "eagle3")
    loaded = open_checkpoint(target, "auto", mode="eagle3", draft_dir=draft, max_draft_len=8, backend="torch")
    tok = load_tokenizer(loaded.tokenizer_path)
    return loaded, [tok.encode(text).ids for text in CODE[:3]]


def test_sequences_of_one_batch_draft_their_own_k(embedded):
    """In a batch each row verifies at most its own K (a row the draft predicts badly stops paying for
    the long chain another row earns), and each row's output is still target greedy's."""
    from runtime.generation import generate
    loaded, prompts = embedded
    rows = []
    group = SpeculativeGroup(loaded.runner, loaded.proposer, 8, max(len(p) for p in prompts) + 80, 512,
                             DraftPolicy(8, adaptive=True), trace=rows.append)
    seqs = run_group(group, prompts, [64] * len(prompts), SamplingParams())
    assert [s.outputs for s in seqs] == generate(loaded.runner, prompts, 64).output_ids
    by_step = {}
    for r in rows:
        if r["k"]:
            by_step.setdefault(r["step"], set()).add(r["k"])
    assert sum(len(ks) > 1 for ks in by_step.values()) >= 3, by_step
    assert max(max(ks) for ks in by_step.values()) == 8 and min(min(ks) for ks in by_step.values()) <= 2, by_step


def test_sampled_adaptive_run_finishes_with_its_lengths(pair):
    """Sampled rows adapt too (acceptance is the rejection rule's, exact for any K chosen from the past)."""
    target, proposer = pair
    result = speculative_generate(target, proposer("eagle3"), PROMPTS[:2], 32, 4, temperature=0.8, seed=3,
                                  policy=DraftPolicy(4, adaptive=True))
    assert [len(o) for o in result.output_ids] == [32, 32]
    assert sum(result.extra["acceptance"]["steps_by_draft_len"].values()) == result.extra["acceptance"]["num_verify_forwards"]


def test_a_bad_switch_value_is_one_line_naming_the_flag(capsys):
    from nemospec import cli
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--speculative_decoding_mode", "eagle3", "--input_ids", "1,2", "--max_new_tokens", "2",
                  "--draft_len_adaptive", "maybe"])
    assert e.value.code == 2
    assert "argument --draft_len_adaptive: expected on or off, got 'maybe'" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["dflash", "dspark"])
def test_a_block_draft_runs_its_whole_compiled_block_at_a_shorter_k(mode, pair, reference):
    """A compiled block draft has one graph, at K_max + 1 block rows and context rows padded to as
    many (``pad_to``). A step of a shorter K (adaptive, a request's own, a batch size's schedule) runs
    that whole block and verifies the first K of it: a shorter block ran eagerly, 3-4 ms against 1 ms
    a step on the wide embedded model, which also made every shorter K look dear to the adaptive
    policy. The ids stay target greedy's."""
    from collections import Counter
    target, proposer = pair
    p = proposer(mode)
    draft = p.inner.draft
    draft.pad_to = 5                                   # as a CompiledDraft of max_draft_len 4
    blocks = Counter()
    original = draft.block_chain

    def counted(feeds, state, anchor):
        blocks[feeds["input_ids"].shape[1]] += 1
        return original(feeds, state, anchor)
    draft.block_chain = counted
    result = speculative_generate(target, p, PROMPTS, 48, 2)
    assert result.output_ids == reference
    assert set(result.extra["acceptance"]["histogram"]) <= {"1", "2", "3"}      # K = 2 verified
    rows = {k: p.inner.module.block_inputs(torch.tensor([0]), torch.tensor([0]), k)[0].shape[1] for k in (2, 4)}
    assert blocks[rows[4]] >= 0.8 * sum(blocks.values()) and set(blocks) <= set(rows.values()), blocks
    # (a K = 2 block only where the whole one does not fit in the cache, at the end)


def test_a_newcomers_first_step_is_not_a_step_cost(pair):
    """The step that admits a sequence also drafts over its prompt (a block draft's whole context): its
    time is not what a step at that K costs, and once recorded it kept the adaptive policy off that K
    for the rest of a run. The group records steps only once every sequence in it has stepped."""
    from runtime.batching import Sequence
    target, proposer = pair
    group = SpeculativeGroup(target, lambda: proposer("dflash"), 4, 80, 512, DraftPolicy(4, adaptive=True))
    group.add([Sequence(list(PROMPTS[0]), 16, SamplingParams(), frozenset())])
    group.step()
    assert group.step_costs.seconds == {}
    group.step()
    assert list(group.step_costs.seconds) == [(1, group.seqs[0].adaptive_k)]
    group.add([Sequence(list(PROMPTS[1]), 16, SamplingParams(), frozenset())])
    before = dict(group.step_costs.seconds)
    group.step()
    assert group.step_costs.seconds == before                # a newcomer's first step
    group.step()
    assert any(b == 2 for b, _ in group.step_costs.seconds)
