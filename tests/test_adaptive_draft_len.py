"""``--draft_len_adaptive on`` (runtime.adaptive_draft_len): each sequence's K from its own recent
acceptance and the group's measured step costs; the output stays the target's own."""
from types import SimpleNamespace

import pytest

from runtime.adaptive_draft_len import (PRIOR_COST_PER_PROPOSAL, SequenceRate, StepCostTable, best_length,
                                        candidate_lengths, expected_tokens)
from runtime.draft_policy import DraftPolicy, on_off, policy_from
from runtime.batching import SpeculativeGroup
from runtime.generation import run_group
from runtime.sampling import SamplingParams
from runtime.speculative import speculative_generate
from test_speculative import PROMPTS, pair, reference  # noqa: F401 (fixtures)


def test_expected_tokens_is_the_geometric_chain():
    """A chain of k proposals each kept with probability a emits 1 + a + ... + a^k tokens."""
    for a in (0.0, 0.3, 0.9):
        for k in (1, 4, 8):
            assert expected_tokens(a, k) == pytest.approx(sum(a ** j for j in range(k + 1)))
    assert expected_tokens(1.0, 4) == 5


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
    assert best_length(0.2, ks, flat) == 1
    assert best_length(0.95, ks, flat) == 8
    assert best_length(0.95, ks, steep) < 8


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
