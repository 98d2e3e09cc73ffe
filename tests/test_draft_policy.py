"""Adaptive draft length (runtime.draft_policy): the batch-size schedule, the draft-confidence stop
and the acceptance floor change K step by step, and the output stays the target's own."""
import pytest
import torch

from builder.errors import NemospecError
from runtime import acceptance
from runtime.draft_policy import AcceptanceTracker, DraftPolicy, parse_schedule
from runtime.batching import SpeculativeGroup
from runtime.generation import run_group
from runtime.sampling import SamplingParams
from runtime.speculative import speculative_generate
from speculative_fixtures import chi_square_p
from test_speculative import PROMPTS, pair, reference  # noqa: F401 (fixtures)


def test_schedule_follows_tensorrt_llm():
    """{max batch size: K}: the smallest key >= the batch size; past the largest key, 0."""
    policy = DraftPolicy(4, parse_schedule("1:4,4:3,8:2,16:0"))
    assert [policy.k_for_batch(b) for b in (1, 2, 4, 5, 8, 9, 16, 17)] == [4, 3, 3, 2, 2, 0, 0, 0]
    assert DraftPolicy(3).k_for_batch(100) == 3
    for bad in ("1:4,x", "0:2", "1:-1", "4"):
        with pytest.raises(NemospecError, match="--draft_len_schedule"):
            parse_schedule(bad)
    with pytest.raises(NemospecError, match="max_draft_len 4"):
        DraftPolicy(4, {1: 5})
    with pytest.raises(NemospecError, match="--draft_confidence_threshold"):
        DraftPolicy(4, confidence_threshold=1.0)


def test_confident_lengths_and_tracker():
    policy = DraftPolicy(4, confidence_threshold=0.5, acceptance_rate_threshold=0.5, acceptance_rate_window_size=2)
    conf = torch.tensor([[0.9, 0.6, 0.4, 0.9], [0.1, 0.9, 0.9, 0.9], [0.9, 0.9, 0.9, 0.9]])
    assert policy.confident_lengths(conf).tolist() == [2, 1, 4]   # leading run, at least one
    t = AcceptanceTracker(policy)
    t.record(2, 4)
    assert t.speculating  # the window is not full yet
    t.record(1, 4)
    assert not t.speculating  # 3 / 8 < 0.5: off for good
    t.record(4, 4)
    assert not t.speculating


def _run_group(target, proposer, prompts, limits, policy):
    """An in-flight group whose sequences ask for different lengths, so the batch shrinks as they finish."""
    group = SpeculativeGroup(target, lambda: proposer, policy.draft_len, max(len(p) for p in prompts) + 60, 512, policy)
    return [s.outputs for s in run_group(group, prompts, limits, SamplingParams())], group


@pytest.mark.parametrize("mode", ["draft_target", "eagle3", "dflash", "peagle"])
def test_batch_schedule_runs_target_only_then_speculates(mode, pair, reference):
    """'batch <= 2: K 3, larger: 0': target-only while the batch is large, speculation once sequences
    have left; the output equals target greedy throughout."""
    target, proposer = pair
    limits = [10, 48, 14, 20, 30]
    outputs, group = _run_group(target, proposer(mode), PROMPTS, limits, DraftPolicy(4, {2: 3}))
    assert outputs == [r[:n] for r, n in zip(reference, limits)]
    assert group.draft_lens[0] > 0 and group.draft_lens[3] > 0 and set(group.draft_lens) == {0, 3}, group.draft_lens


def test_batch_schedule_switches_with_the_batch(pair, reference):
    target, proposer = pair
    policy = DraftPolicy(4, {1: 4, 3: 2})
    prompts, want = PROMPTS[:3], reference[:3]
    # batch 3 drafts 2; with max_new_tokens per prompt equal, all leave together: run 3 then 1
    three = speculative_generate(target, proposer("eagle3"), prompts, 24, 4, policy=policy)
    assert three.output_ids == [w[:24] for w in want]
    assert set(three.extra["acceptance"]["steps_by_draft_len"]) == {"2"}
    one = speculative_generate(target, proposer("eagle3"), prompts[:1], 24, 4, policy=policy)
    assert one.output_ids == [want[0][:24]] and set(one.extra["acceptance"]["steps_by_draft_len"]) == {"4"}


@pytest.mark.parametrize("mode", ["draft_target", "eagle", "mtp", "dspark"])
def test_confidence_threshold_drafts_fewer_and_stays_exact(mode, pair, reference):
    target, proposer = pair
    plain = speculative_generate(target, proposer(mode), PROMPTS, 48, 4)
    result = speculative_generate(target, proposer(mode), PROMPTS, 48, 4, policy=DraftPolicy(4, confidence_threshold=0.6))
    assert result.output_ids == reference
    steps = result.extra["acceptance"]["steps_by_draft_len"]
    assert any(int(k) < 4 for k in steps), steps     # some steps stopped drafting early
    assert result.extra["cost"].proposals < plain.extra["cost"].proposals


def test_acceptance_floor_turns_speculation_off(pair, reference):
    """A floor no draft can hold (every draft accepted, over 1 step) sends each sequence to target-only
    decoding after its first imperfect step; the output is still the target's."""
    target, proposer = pair
    policy = DraftPolicy(4, acceptance_rate_threshold=1.0, acceptance_rate_window_size=1)
    result = speculative_generate(target, proposer("draft_target"), PROMPTS, 48, 4, policy=policy)
    assert result.output_ids == reference
    a = result.extra["acceptance"]
    assert a["target_only_steps"] > 0 and a["num_verify_forwards"] < 20, a


def test_rejection_with_fewer_proposals_is_distributed_as_the_target():
    """A row that proposed 1 of 2 slots: its first token is distributed as p_0 (60k draws), and when the
    one draft is kept the bonus comes from p_1 (not from the padding slot's residual)."""
    g = torch.Generator().manual_seed(1)
    p_logits = torch.randn(1, 3, 6, generator=g) * 1.5
    q = torch.softmax(torch.randn(1, 2, 6, generator=g) * 1.5, -1)
    n = 60000
    drafts = torch.stack([torch.multinomial(q[0, j].expand(n, 6), 1, replacement=True, generator=g)[:, 0]
                          for j in range(2)], 1)
    params = [acceptance.SamplingParams(1.0, 1.0, g)] * 1
    firsts, seconds = [], []
    for i in range(0, 6000):
        m, t = acceptance.accept(drafts[i:i + 1], q, p_logits, params, torch.tensor([1]))
        assert int(m) <= 1
        firsts.append(int(drafts[i, 0]) if int(m) == 1 else int(t))
        if int(m) == 1:
            seconds.append(int(t))
    p0, p1 = torch.softmax(p_logits[0, 0], -1), torch.softmax(p_logits[0, 1], -1)
    assert chi_square_p(torch.bincount(torch.tensor(firsts), minlength=6), p0)[0] > 1e-3
    assert chi_square_p(torch.bincount(torch.tensor(seconds), minlength=6), p1)[0] > 1e-3


def test_generate_warms_up_with_the_policy_its_flags_give(monkeypatch):
    """`generate --backend compiled --draft_confidence_threshold P` warmed up with the engine's
    recorded policy (none), so the timed run compiled the shorter verify chunks the confidence stop
    cuts to (K=8, P=0.3, wide model: 447 ms a verify, mostly compiles). The warm-up now gets the run's
    policy; stopped there, before any step compiles."""
    from nemospec import cli
    from runtime.compiled import runner
    seen = []

    def warm_up(loaded, prompts, k, tree, policy=None, **kwargs):
        seen.append((k, policy))
        raise NemospecError("stopped after the warm-up call")

    monkeypatch.setattr(runner, "warm_up", warm_up)
    code = cli.main(["generate", "--backend", "compiled", "--speculative_decoding_mode", "eagle3",
                     "--input_ids", "1,2,3", "--max_new_tokens", "4", "--draft_confidence_threshold", "0.3"])
    assert code == 2 and len(seen) == 1
    k, policy = seen[0]
    assert k == 4 and policy is not None and policy.confidence_threshold == 0.3


def test_a_feature_drafts_queue_carries_target_only_steps_in_order(pair):
    """A feature draft (eagle3) queues each target-only step's token and feature rows, one chunk a
    step, until its next proposal; the catch-up reads them in order, each step's rows as they were
    when queued (the buffer they came in is reused afterwards)."""
    target, proposer = pair
    p = proposer("eagle3")
    prompt = PROMPTS[0]
    logits, state, features = target.forward(
        torch.tensor([prompt], dtype=torch.int32), torch.arange(len(prompt), dtype=torch.int32)[None],
        torch.tensor([len(prompt)], dtype=torch.int32), torch.arange(len(prompt), dtype=torch.int32)[None], target.new_state(1, 64))
    p.start([prompt], [int(logits[0, -1].argmax())], features, 64)
    p._queued_consumed()                            # an empty queue, as after a proposal's catch-up
    width = features[p.draft.feature].shape[-1]
    for step in range(5):
        feats = {p.draft.feature: torch.full((1, 1, width), float(step))}
        p.accept(torch.zeros(1, dtype=torch.long), torch.tensor([7 + step]), torch.zeros(1, 0, dtype=torch.long), feats)
        feats[p.draft.feature].fill_(-1.0)          # the buffer reused by a later call
    ids, rows, _, lengths = p._queued_chunk()
    assert int(lengths[0]) == 5 and ids[0, :5].tolist() == [7, 8, 9, 10, 11]
    got = rows[0, :5]
    assert torch.equal(got, torch.arange(5.0)[:, None].expand_as(got).to(got.dtype))


@pytest.mark.parametrize("mode", ["dflash", "peagle"])
def test_an_aux_drafts_queue_carries_target_only_steps_in_order(pair, mode):
    """A block (dflash) or parallel (peagle) draft queues each target-only step's feature rows, one
    chunk a step, as they were when queued (the buffer they came in is reused afterwards); its next
    forward reads them joined, in order, from the position of the first."""
    from runtime.proposers import _joined
    target, proposer = pair
    p = proposer(mode)
    prompt = PROMPTS[0]
    logits, state, features = target.forward(
        torch.tensor([prompt], dtype=torch.int32), torch.arange(len(prompt), dtype=torch.int32)[None],
        torch.tensor([len(prompt)], dtype=torch.int32), torch.arange(len(prompt), dtype=torch.int32)[None], target.new_state(1, 64))
    p.start([prompt], [int(logits[0, -1].argmax())], features, 64)
    p.propose(2, [SamplingParams()])               # writes the prompt's rows: an empty queue
    inner, width = p.inner, p.inner.module.aux_width
    queue = (lambda: inner.context[0]) if mode == "dflash" else (lambda: inner.feats[0])
    assert _joined(queue()).shape[0] == 0
    for step in range(5):
        feats = {"aux_hidden": torch.full((1, 1, width), float(step))}
        inner.accept(torch.zeros(1, dtype=torch.long), torch.tensor([7 + step]), torch.zeros(1, 0, dtype=torch.long), feats)
        feats["aux_hidden"].fill_(-1.0)            # the buffer reused by a later call
    got = _joined(queue())
    assert torch.equal(got, torch.arange(5.0)[:, None].expand_as(got).to(got.dtype))
    if mode == "dflash":
        assert inner.context_start[0] == len(prompt) and inner.position[0] == len(prompt) + 5 and inner.anchor == [11]
    else:
        assert inner.rows[0] == [7, 8, 9, 10, 11] and inner.start_pos[0] == len(prompt)
    tokens, _, _ = p.propose(2, [SamplingParams()])
    assert tokens.shape == (1, 2) and _joined(queue()).shape[0] == 0
