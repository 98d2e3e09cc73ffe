"""Speculative decoding: exactness against target-only greedy, rollback, and rejection sampling."""
import pytest
import torch

from runtime import acceptance
from runtime.generation import generate
from runtime.speculative import speculative_generate
from runtime.state import chunk_inputs
from speculative_fixtures import assert_greedy_margin, chi_square_p, layer_subset_draft, runners, target_with_mtp

PROMPTS = [[5, 9, 17, 33, 4, 8, 11], [7], [12, 13, 14], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [3, 60]]


@pytest.fixture(scope="module")
def pair(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target_dir = target_with_mtp(checkpoints["moe"], root / "target")
    draft_dir = layer_subset_draft(target_dir, root / "draft")
    return runners(target_dir, draft_dir)


@pytest.fixture(scope="module")
def reference(pair):
    target, _ = pair
    out = generate(target, PROMPTS, 48).output_ids
    assert_greedy_margin(target, PROMPTS, out)  # min top-2 gap 1.1e-3 (prompt 2), ~5x its bound
    return out


MODES = ["draft_target", "mtp", "eagle", "eagle3", "dflash", "dspark", "peagle", "dflash_nvfp4", "dspark_nvfp4",
         "peagle_nvfp4"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [1, 4])
def test_speculative_greedy_equals_target_greedy(mode, k, pair, reference):
    target, proposer = pair
    result = speculative_generate(target, proposer(mode), PROMPTS, 48, k)
    assert result.output_ids == reference
    stats = result.extra["acceptance"]
    gained = sum(int(n) * c for n, c in stats["histogram"].items())
    assert gained >= 48 * len(PROMPTS) - len(PROMPTS)  # every token after the first came from a verify
    assert sum(stats["histogram"].values()) >= stats["num_verify_forwards"]
    assert list(stats["histogram"]) == [str(n) for n in range(1, k + 2)]


def test_partial_acceptance_is_exercised(pair, reference):
    """The noisy draft agrees sometimes: verifies end at every accepted length, rollback included."""
    target, proposer = pair
    stats = speculative_generate(target, proposer("draft_target"), PROMPTS, 48, 4).extra["acceptance"]
    hist = stats["histogram"]
    assert hist["1"] > 0 and hist["2"] > 0 and hist["3"] > 0, hist
    assert 1.0 < stats["mean_accepted_tokens"] < 5.0


def test_one_token_prompt_alone(pair):
    target, proposer = pair
    want = generate(target, [[9]], 48).output_ids
    assert_greedy_margin(target, [[9]], want, 3)
    for mode in MODES:
        assert speculative_generate(target, proposer(mode), [[9]], 48, 3).output_ids == want, mode


def test_stops_at_end_id_and_max_tokens(pair, reference):
    target, proposer = pair
    stop = reference[0][5]
    got = speculative_generate(target, proposer("draft_target"), PROMPTS[:1], 48, 4, end_ids={stop}).output_ids[0]
    assert got == reference[0][:reference[0].index(stop) + 1]
    got = speculative_generate(target, proposer("mtp"), PROMPTS, 13, 4).output_ids
    assert got == [r[:13] for r in reference]


def test_rollback_state_equals_target_only_state(pair):
    """After a verify that keeps 2 of 4 drafts, the rolled-back Mamba states equal target-only decoding
    (and differ from the state after all 5 rows: the rollback really uses the accepted length)."""
    target, _ = pair
    prompt, drafts = [5, 9, 17, 33], [21, 22, 23, 24]
    ids, positions, lengths = chunk_inputs([prompt], [0])
    state = target.new_state(1, 16)
    _, state, _ = target.forward(ids, positions, lengths, (lengths - 1)[:, None], state)
    ref_state = {k: v.clone() for k, v in state.items()}
    verify = torch.tensor([[40] + drafts], dtype=torch.int32)
    pos = torch.arange(4, 9, dtype=torch.int32)[None]
    _, new_state, _ = target.forward(verify, pos, torch.tensor([5], dtype=torch.int32),
                                     torch.arange(5, dtype=torch.int32)[None], state, verify=True)
    kept = target.rollback(state, new_state, torch.tensor([2]))  # rows 0..2: token 40 and drafts 21, 22
    everything = target.rollback(state, new_state, torch.tensor([4]))
    for t, p in [(40, 4), (21, 5), (22, 6)]:
        _, ref_state, _ = target.forward(torch.tensor([[t]], dtype=torch.int32), torch.tensor([[p]], dtype=torch.int32),
                                         torch.ones(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), ref_state)
    for name, value in ref_state.items():
        if "conv_state" in name or "ssm_state" in name:
            torch.testing.assert_close(kept[name], value, rtol=1e-5, atol=1e-5, msg=name)
            assert not torch.allclose(everything[name], value, rtol=1e-3, atol=1e-3), name


def test_verify_greedy_is_verify_accept_rollback(pair):
    """The one-call greedy verify step equals its three parts: the verify forward, the greedy
    accept and the rollback to the accepted rows (ragged prompts, a draft the target partly keeps)."""
    target, _ = pair
    prompts = [PROMPTS[0], PROMPTS[2]]
    ids, positions, lengths = chunk_inputs(prompts, [0, 0])
    state = target.new_state(2, 32)
    logits, state, _ = target.forward(ids, positions, lengths, (lengths - 1)[:, None], state)
    first = logits[:, 0].argmax(-1)
    greedy_next = [int(first[0]), int(first[1])]
    verify = torch.tensor([[greedy_next[0], 21, 22, 23, 24], [greedy_next[1], 3, 4, 5, 6]], dtype=torch.int32)
    pos = lengths[:, None] + torch.arange(5, dtype=torch.int32)[None]
    five, rows = torch.full((2,), 5, dtype=torch.int32), torch.arange(5, dtype=torch.int32).expand(2, -1)
    before = {k: v.clone() for k, v in state.items()}
    want_logits, verified, want_features = target.forward(verify, pos, five, rows, state, verify=True)
    want_m, want_next = acceptance.greedy(verify[:, 1:].long(), want_logits)
    want_state = target.rollback(state, verified, want_m)
    m, nxt, got_logits, got_state, got_features = target.verify_greedy(verify, pos, five, rows, before)
    assert torch.equal(m, want_m) and torch.equal(nxt, want_next) and torch.equal(got_logits, want_logits)
    assert got_state.keys() == want_state.keys() and all(torch.equal(got_state[k], want_state[k]) for k in want_state)
    assert all(torch.equal(got_features[k], want_features[k]) for k in want_features)


def test_greedy_acceptance_rule():
    logits = torch.full((2, 4, 8), -5.0)
    for b, best in enumerate([[1, 2, 3, 4], [6, 0, 0, 7]]):
        for i, t in enumerate(best):
            logits[b, i, t] = 5.0
    m, nxt = acceptance.greedy(torch.tensor([[1, 2, 5], [6, 1, 0]]), logits)
    assert m.tolist() == [2, 1] and nxt.tolist() == [3, 0]
    m, nxt = acceptance.greedy(torch.tensor([[1, 2, 3]]), logits[:1])
    assert m.tolist() == [3] and nxt.tolist() == [4]
    # a chunk padded past its real drafts: the accept stops at the limit, the next token is that row's
    m, nxt = acceptance.greedy(torch.tensor([[1, 2, 3], [6, 0, 0]]), logits, torch.tensor([2, 3], dtype=torch.int32))
    assert m.tolist() == [2, 3] and nxt.tolist() == [3, 7]


def test_rejection_sampling_step_is_distributed_as_the_target():
    """One verify step in isolation: the emitted token is distributed exactly as p (60k draws)."""
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(1, 2, 6, generator=g) * 1.5
    q = torch.softmax(torch.randn(1, 1, 6, generator=g) * 1.5, -1)
    n = 60000
    drafts = torch.multinomial(q[0].expand(n, 6), 1, replacement=True, generator=g)
    m, token = acceptance.rejection(drafts, q.expand(n, 1, 6), p_logits.expand(n, 2, 6), 1.0, 1.0, g)
    first = torch.where(m > 0, drafts[:, 0], token)
    p = torch.softmax(p_logits[0, 0], -1)
    pvalue, _ = chi_square_p(torch.bincount(first, minlength=6), p)
    assert pvalue > 1e-3
    # the test has power: emitting the draft token itself (no rejection) is caught
    pvalue_wrong, _ = chi_square_p(torch.bincount(drafts[:, 0], minlength=6), p)
    assert pvalue_wrong < 1e-9


def _second_token_marginal(target, prompt, temperature):
    """Exact p(x2 | prompt) = sum_x1 p(x1 | prompt) p(x2 | prompt, x1) under temperature sampling."""
    vocab = target.config.vocab_size
    ids, positions, lengths = chunk_inputs([prompt], [0])
    logits, _, _ = target.forward(ids, positions, lengths, (lengths - 1)[:, None], target.new_state(1, 8))
    p1 = torch.softmax(logits[0, 0] / temperature, -1)
    ids, positions, lengths = chunk_inputs([prompt + [x] for x in range(vocab)], [0] * vocab)
    logits, _, _ = target.forward(ids, positions, lengths, (lengths - 1)[:, None], target.new_state(vocab, 8))
    return p1 @ torch.softmax(logits[:, 0] / temperature, -1)


@pytest.mark.parametrize("mode", ["draft_target", "mtp", "eagle3", "dspark"])
def test_speculative_sampling_preserves_the_target_distribution(mode, pair, monkeypatch):
    """The 2nd generated token (the first one a draft proposes) of 3000 seeded speculative samples
    against the exact target marginal: chi-square p > 1e-3; an always-accepting sampler is caught."""
    target, proposer = pair
    prompt, temperature, n = [5, 9, 17], 1.3, 3000
    marginal = _second_token_marginal(target, prompt, temperature)
    result = speculative_generate(target, proposer(mode), [prompt] * n, 3, 2, temperature=temperature, seed=11)
    second = torch.tensor([o[1] for o in result.output_ids])
    pvalue, dof = chi_square_p(torch.bincount(second, minlength=marginal.shape[0]), marginal)
    assert dof >= 5 and pvalue > 1e-3, (pvalue, dof)

    def accept_everything(drafts, q, target_logits, temperature, top_p, generator=None, top_k=0):
        m = torch.full((drafts.shape[0],), drafts.shape[1], dtype=torch.long)
        bonus = torch.multinomial(torch.softmax(target_logits[:, -1] / temperature, -1).cpu(), 1, generator=generator)[:, 0]
        return m, bonus

    monkeypatch.setattr(acceptance, "rejection", accept_everything)
    biased = speculative_generate(target, proposer(mode), [prompt] * n, 3, 2, temperature=temperature, seed=11)
    second = torch.tensor([o[1] for o in biased.output_ids])
    pvalue, _ = chi_square_p(torch.bincount(second, minlength=marginal.shape[0]), marginal)
    assert pvalue < 1e-6


@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_feeds_the_draft_every_feature(mode, pair, reference):
    """Prompts longer than a prefill chunk: target features are collected across chunks."""
    target, proposer = pair
    chunked = speculative_generate(target, proposer(mode), PROMPTS, 20, 3, prefill_chunk=4)
    whole = speculative_generate(target, proposer(mode), PROMPTS, 20, 3)
    assert chunked.output_ids == [r[:20] for r in reference]
    # identical draft proposals: the draft saw the same features whichever way the prompt was cut
    assert chunked.extra["acceptance"]["histogram"] == whole.extra["acceptance"]["histogram"]
