"""Per-request sampling settings of the TensorRT-LLM backend (top-k, min_length, the three penalties,
log-probabilities, per-request K): transformers' logits processors are the oracle for the target-only
path, and speculation must give exactly what target-only decoding gives with the same settings."""
import math

import pytest
import torch

from runtime.batching import PlainGroup, Sequence, SpeculativeGroup
from runtime.draft_policy import DraftPolicy
from runtime.logits_shaping import shape
from runtime.sampling import SamplingParams, probabilities
from runtime.state import chunk_inputs
from speculative_fixtures import chi_square_p, layer_subset_draft, runners, target_with_mtp
from tolerances import assert_within, lm_head_bound

PROMPTS = [[5, 9, 17, 33, 4, 8, 11], [12, 13, 14], [40, 41, 42, 43, 44]]
N = 24


@pytest.fixture(scope="module")
def setup(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("shaping")
    target_dir = target_with_mtp(checkpoints["moe"], root / "target")
    draft_dir = layer_subset_draft(target_dir, root / "draft")
    target, proposer = runners(target_dir, draft_dir)
    return target_dir, target, proposer


def _run(group, params_list, end_ids=frozenset(), max_draft=None, n=N):
    """``max_draft``: every sequence's own K, or a list of one per sequence."""
    drafts = max_draft if isinstance(max_draft, list) else [max_draft] * len(PROMPTS)
    seqs = [Sequence(list(p), n, prm, end_ids, max_draft=d) for p, prm, d in zip(PROMPTS, params_list, drafts)]
    group.add(seqs)
    while True:
        keep = [i for i, s in enumerate(group.seqs) if not s.finished]
        if len(keep) < len(group.seqs):
            group.drop(keep)
        if not group.seqs:
            return seqs
        group.step()


def _plain(target, params, **kw):
    return _run(PlainGroup(target, 64), params, **kw)


def _speculative(target, proposer, mode, params, k=4, **kw):
    group = SpeculativeGroup(target, lambda: proposer(mode), k, 64, policy=DraftPolicy(k))
    return _run(group, params, **kw), group


def _hf(target_dir, target, prompt, n=N, **processors):
    """transformers generate (greedy) with its own logits processors, and the smallest top-1/top-2 gap
    of the processed scores along the way (no near tie may decide a token)."""
    from transformers import NemotronHForCausalLM
    model = NemotronHForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=0, **processors)
    scores = torch.stack(out.scores)[:, 0]
    top2 = scores.topk(2, -1).values
    gap = float((top2[:, 0] - top2[:, 1]).min())
    bound = 8 * float(lm_head_bound(target.module.norm_f, target.module.lm_head).max())
    assert gap > bound, f"near tie in the oracle's trajectory: gap {gap:.3g} <= {bound:.3g}"
    return out.sequences[0, len(prompt):].tolist(), scores


def test_repetition_penalty_matches_transformers_and_speculation(setup):
    target_dir, target, proposer = setup
    params = [SamplingParams(repetition_penalty=1.8) for _ in PROMPTS]
    plain = _plain(target, params)
    for prompt, seq in zip(PROMPTS, plain):
        want, _ = _hf(target_dir, target, prompt, repetition_penalty=1.8)
        assert seq.outputs == want
    unpenalised = _plain(target, [SamplingParams() for _ in PROMPTS])
    assert [s.outputs for s in unpenalised] != [s.outputs for s in plain]  # the penalty changed the output
    for mode in ("draft_target", "eagle3", "dflash"):
        seqs, _ = _speculative(target, proposer, mode, [SamplingParams(repetition_penalty=1.8) for _ in PROMPTS])
        assert [s.outputs for s in seqs] == [s.outputs for s in plain], mode


def test_min_length_bans_the_end_id_like_min_new_tokens(setup):
    target_dir, target, proposer = setup
    free = _plain(target, [SamplingParams() for _ in PROMPTS])
    end = free[0].outputs[2]                               # an id the first prompt produces early
    short = _plain(target, [SamplingParams() for _ in PROMPTS], end_ids=frozenset([end]))
    assert len(short[0].outputs) == 3
    params = [SamplingParams(min_length=10) for _ in PROMPTS]
    held = _plain(target, params, end_ids=frozenset([end]))
    want, _ = _hf(target_dir, target, PROMPTS[0], min_new_tokens=10, eos_token_id=end)
    assert held[0].outputs == want and len(want) >= 10 and end not in want[:10]
    for mode in ("eagle", "mtp"):
        seqs, _ = _speculative(target, proposer, mode, [SamplingParams(min_length=10) for _ in PROMPTS],
                               end_ids=frozenset([end]))
        assert [s.outputs for s in seqs] == [s.outputs for s in held], mode


def test_bad_words_of_several_tokens_match_transformers_and_speculation(setup):
    """A bad word of two tokens bans its second token right after its first (transformers'
    bad_words_ids is the oracle); speculative verify rows check it against the drafts they follow."""
    target_dir, target, proposer = setup
    free = _plain(target, [SamplingParams() for _ in PROMPTS])[0].outputs
    word = (free[3], free[4])                    # the free run says it: the ban must change the output
    params = lambda: [SamplingParams(bad_sequences=(word,)) for _ in PROMPTS]  # noqa: E731
    plain = _plain(target, params())
    want, _ = _hf(target_dir, target, PROMPTS[0], bad_words_ids=[list(word)])
    assert plain[0].outputs == want != free
    assert not any(tuple(s.prompt[-1:] + s.outputs)[i:i + 2] == word for s in plain for i in range(len(s.outputs)))
    for mode in ("eagle3", "dflash", "mtp"):
        seqs, _ = _speculative(target, proposer, mode, params())
        assert [s.outputs for s in seqs] == [s.outputs for s in plain], mode


def test_presence_and_frequency_penalties_follow_their_formula():
    """No transformers processor for these two: the formula itself, on a verify chunk whose rows
    continue the drafts (row j counts the first j drafts too)."""
    logits = torch.zeros(1, 3, 8)
    seq = Sequence([1, 1, 2], 10, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    seq.outputs = [3]
    got = shape(logits, [seq], torch.tensor([[4, 4]]))
    counts = [torch.bincount(torch.tensor(h), minlength=8).float() for h in ([1, 1, 2, 3], [1, 1, 2, 3, 4],
                                                                             [1, 1, 2, 3, 4, 4])]
    want = torch.stack([-(0.5 * (c > 0) + 0.25 * c) for c in counts])[None]
    assert torch.equal(got, want)
    # sampled at T: TensorRT-LLM subtracts them from the scaled logits, l/T - p (vLLM: (l - p)/T),
    # so the distribution the sampler draws from is softmax(l/T - p)
    raw = torch.randn(1, 1, 8, generator=torch.Generator().manual_seed(0))
    seq = Sequence([1, 1, 2], 10, SamplingParams(temperature=0.5, presence_penalty=0.5, frequency_penalty=0.25))
    seq.outputs = [3]
    drawn = probabilities(shape(raw, [seq])[0, 0], 0.5, 1.0)
    c = counts[0][:8]
    want = torch.softmax(raw[0, 0] / 0.5 - 0.5 * (c > 0) - 0.25 * c, -1)
    # each shaped logit carries a few roundings of its magnitude; a softmax moves by at most twice that
    assert_within(drawn, want, 8 * torch.finfo(torch.float32).eps * (1 + (raw / 0.5).abs().max()))


def test_prompt_ignore_length_leaves_the_first_prompt_tokens_out_of_presence_and_frequency():
    """TensorRT-LLM's prompt_ignore_length: presence and frequency count the history less the first N
    prompt tokens (the OpenAI frontend sends all of them: OpenAI and vLLM count generated tokens
    only); the repetition penalty still sees every token. A chain verify and a tree verify alike."""
    from runtime.logits_shaping import shape_tree
    logits = torch.full((1, 2, 8), 2.0)
    for ignore, counted in ((2, [2, 3, 4]), (10, [3, 4]), (0, [1, 1, 2, 3, 4])):
        seq = Sequence([1, 1, 2], 10, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25,
                                                     repetition_penalty=2.0, prompt_ignore_length=ignore))
        seq.outputs = [3, 4]
        rows = []
        for drafted in ([], [5]):     # row 0 continues the sequence, row 1 the draft 5 after it
            seen = torch.bincount(torch.tensor([1, 1, 2, 3, 4] + drafted), minlength=8) > 0
            n = torch.bincount(torch.tensor(counted + drafted), minlength=8).float()
            rows.append(torch.where(seen, 1.0, 2.0) - 0.5 * (n > 0) - 0.25 * n)
        want = torch.stack(rows)[None]
        assert torch.equal(shape(logits, [seq], torch.tensor([[5]])), want), ignore
        tree = shape_tree(logits, [seq], torch.tensor([[4, 5]]), torch.tensor([[-1, 0]]), torch.tensor([[0, 1]]))
        assert torch.equal(tree, want), ignore


def _second_token_marginal(target, prompt, settings):
    """Exact p(x2 | prompt) = sum_x1 p(x1 | prompt) p(x2 | prompt, x1) under the shaped sampling."""
    def dist(history):
        ids, positions, lengths = chunk_inputs([history], [0])
        logits, _, _ = target.forward(ids, positions, lengths, (lengths - 1)[:, None], target.new_state(1, 16))
        seq = Sequence(list(prompt), 2, SamplingParams(**settings))
        seq.outputs = history[len(prompt):]
        shaped = shape(logits, [seq])[0, 0]
        return probabilities(shaped, settings["temperature"], 1.0, settings["top_k"])
    p1 = dist(prompt)
    return sum(p1[x] * dist(prompt + [x]) for x in torch.nonzero(p1)[:, 0].tolist())


def _second_tokens(group, prompt, settings, draws):
    gen = torch.Generator().manual_seed(3)
    seqs = [Sequence(list(prompt), 2, SamplingParams(generator=gen, **settings)) for _ in range(draws)]
    group.add(seqs)
    while group.seqs:
        group.step()
        keep = [i for i, s in enumerate(group.seqs) if not s.finished]
        if len(keep) < len(group.seqs):
            group.drop(keep)
    return torch.tensor([s.outputs[1] for s in seqs])


def test_speculative_sampling_with_penalties_and_top_k_is_the_shaped_target(setup, monkeypatch):
    """The 2nd token (the first a draft proposes) of 2000 speculative samples with top-k and two
    penalties against the exact shaped target marginal (chi-square); a verify that ignores the
    shaping is caught."""
    _, target, proposer = setup
    prompt, draws = PROMPTS[0], 2000
    settings = dict(temperature=1.0, top_k=6, presence_penalty=1.5, repetition_penalty=1.3)
    marginal = _second_token_marginal(target, prompt, settings)
    assert int((marginal > 0).sum()) <= 36                # top-6 after each of the 6 first tokens

    def speculative():
        return SpeculativeGroup(target, lambda: proposer("draft_target"), 3, 16, policy=DraftPolicy(3))

    second = _second_tokens(speculative(), prompt, settings, draws)
    pvalue, dof = chi_square_p(torch.bincount(second, minlength=marginal.shape[0]), marginal)
    assert dof >= 5 and pvalue > 1e-3, (pvalue, dof)
    import runtime.batching as batching
    real = batching.shape
    monkeypatch.setattr(batching, "shape", lambda logits, seqs, drafts=None: real(logits, seqs) if drafts is None
                        else logits)
    second = _second_tokens(speculative(), prompt, settings, draws)
    pvalue, _ = chi_square_p(torch.bincount(second, minlength=marginal.shape[0]), marginal)
    assert pvalue < 1e-6


def test_log_probs_are_the_shaped_distributions(setup):
    target_dir, target, proposer = setup
    plain = _plain(target, [SamplingParams(logprobs=True, repetition_penalty=1.8) for _ in PROMPTS])
    _, scores = _hf(target_dir, target, PROMPTS[0], repetition_penalty=1.8)
    want = torch.log_softmax(scores, -1).gather(1, torch.tensor(plain[0].outputs)[:, None])[:, 0]
    got = torch.tensor(plain[0].logprobs)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4, rtol=0)
    seqs, _ = _speculative(target, proposer, "eagle3", [SamplingParams(logprobs=True, repetition_penalty=1.8)
                                                        for _ in PROMPTS])
    for s, p in zip(seqs, plain):
        assert s.outputs == p.outputs and len(s.logprobs) == len(s.outputs)
        assert torch.allclose(torch.tensor(s.logprobs), torch.tensor(p.logprobs), atol=1e-4, rtol=0)
    assert all(math.isfinite(x) and x <= 0 for x in seqs[0].logprobs)


def test_per_request_draft_length(setup):
    _, target, proposer = setup
    want = [s.outputs for s in _plain(target, [SamplingParams() for _ in PROMPTS])]
    seqs, group = _speculative(target, proposer, "eagle3", [SamplingParams() for _ in PROMPTS], max_draft=1)
    assert [s.outputs for s in seqs] == want
    assert set(group.draft_lens) == {1} and all(s.drafted == sum(s.gained.values()) for s in seqs)
    seqs, group = _speculative(target, proposer, "eagle3", [SamplingParams() for _ in PROMPTS], max_draft=0)
    assert [s.outputs for s in seqs] == want and set(group.draft_lens) == {0}
    stats = seqs[0].speculation_stats()
    assert stats["draft_tokens"] == 0 and stats["steps"] == 0


def test_a_row_that_proposes_nothing_is_not_a_speculative_step(setup):
    """Batched with rows that speculate, a row whose own K is 0 decodes inside their verify steps:
    it reports no speculative steps (as it does alone), and the group's histogram, which the server's
    acceptance metrics read, counts only the rows that proposed."""
    _, target, proposer = setup
    want = [s.outputs for s in _plain(target, [SamplingParams() for _ in PROMPTS])]
    seqs, group = _speculative(target, proposer, "eagle3", [SamplingParams() for _ in PROMPTS], max_draft=[0, None, 2])
    assert [s.outputs for s in seqs] == want
    assert seqs[0].speculation_stats() == {"steps": 0, "draft_tokens": 0, "accepted_draft_tokens": 0, "histogram": [0]}
    assert all(s.speculation_stats()["steps"] > 0 for s in seqs[1:])
    assert sum(group.histogram.values()) == sum(sum(s.gained.values()) for s in seqs[1:])


def test_a_temperature_too_small_to_divide_by_is_greedy():
    """1e-38 (found by the OpenAI fuzz test): logits / T overflowed fp32 and the softmax turned NaN,
    a 500. Below vLLM's 1e-5 a temperature is greedy, the limit it tends to."""
    from runtime.sampling import GREEDY_BELOW, draw
    logits = torch.tensor([[1.0, 30.0, -4.0], [2.0, -1.0, 0.5]])
    for t in (1.1754943508222875e-38, 1e-30, GREEDY_BELOW / 2):
        params = [SamplingParams(temperature=t, generator=torch.Generator().manual_seed(0)) for _ in range(2)]
        assert all(p.temperature == 0.0 and p.argmax for p in params)
        tokens, q = draw(logits, params)
        assert tokens.tolist() == [1, 0] and q is None
    kept = SamplingParams(temperature=GREEDY_BELOW)
    assert kept.temperature == GREEDY_BELOW and torch.isfinite(probabilities(logits[0], kept.temperature, 1.0)).all()


def test_top_logprobs_are_the_most_probable_tokens_of_the_drawing_distribution():
    """Greedy rows: the log-softmax's top N, the chosen (argmax) token first with the log-probability
    token_logprobs gives it; sampled rows: the distribution they draw from (top-k cut, temperature),
    so no alternative lies outside the top-k (nor has log-probability -inf, which JSON cannot hold);
    rows that did not ask get None."""
    from runtime.logits_shaping import token_logprobs, top_logprobs
    from runtime.sampling import SamplingParams, probabilities
    logits = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(logprobs=True, top_logprobs=3),
              SamplingParams(0.7, 1.0, None, top_k=2, logprobs=True, top_logprobs=5),
              SamplingParams(logprobs=True)]
    tops = top_logprobs(logits, params)
    want = torch.log_softmax(logits[0], -1).topk(3)
    assert [[t for t, _ in row] for row in tops[0]] == want.indices.tolist()
    assert torch.allclose(torch.tensor([[v for _, v in row] for row in tops[0]]), want.values)
    chosen = logits[0].argmax(-1)
    assert [row[0][1] for row in tops[0]] == token_logprobs(logits, torch.stack([chosen] * 3), params)[0]
    allowed = logits[1].topk(2).indices.tolist()
    sampled = torch.log(probabilities(logits[1], 0.7, 1.0, 2))
    for r, row in enumerate(tops[1]):
        assert {t for t, _ in row} == set(allowed[r]) and all(abs(v - float(sampled[r, t])) < 1e-6 for t, v in row)
    assert tops[2] is None
