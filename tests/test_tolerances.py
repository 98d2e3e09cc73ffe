"""The bounds of tests/tolerances.py and the near-tie checks of tests/speculative_fixtures.py: they hold
on real reorderings and fail on wrong results (the other tests' tolerances and greedy exactness stand
on them)."""
import pytest
import torch

import tolerances
from tolerances import assert_no_near_tie, assert_within, gamma, lm_head_bound, matmul_bound, sum_bound


def test_sum_bound_covers_every_order_and_catches_a_lost_term():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g) * torch.logspace(-3, 3, 32)  # magnitudes over 6 decades
    exact = x.double().sum(-1)
    orders = [x.sum(-1), x.flip(-1).sum(-1), x.cumsum(-1)[:, -1], x[:, x[0].abs().argsort()].sum(-1),
              (x[:, ::2] + x[:, 1::2]).sum(-1)]
    bound = sum_bound(x.abs().sum(-1), 32)
    for a in orders:
        assert_within(a, exact, bound / 2, "one order vs exact")  # gamma_n sum|x| each
        for b in orders:
            assert_within(a, b, bound, "two orders")
    lost = torch.cat([x[:, :16], x[:, 17:]], -1).sum(-1)  # a sum that lost one term of the middle decade
    with pytest.raises(AssertionError, match="exceeds its bound"):
        assert_within(lost, exact, bound)
    assert gamma(32) == pytest.approx(32 * 2.0 ** -24, rel=1e-5)


def test_matmul_and_lm_head_bounds():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(5, 48, generator=g), torch.randn(20, 48, generator=g)
    h = torch.nn.functional.rms_norm(h, (48,)) * 0.7
    exact = h.double() @ w.double().t()
    assert_within(h @ w.t(), exact, matmul_bound(h, w.t()) / 2)
    # Cauchy-Schwarz over any normed h: never below the bound from this h's own |h| @ |W|
    head = lm_head_bound(torch.full((48,), 0.7), w)
    assert (head >= matmul_bound(h, w.t())).all()
    assert (lm_head_bound(torch.full((48,), 0.7), w, torch.bfloat16) > 100 * head).all()  # bf16 rounding dominates


def test_no_near_tie_check():
    logits = torch.tensor([[3.0, 1.0, 2.9999], [0.0, 5.0, 4.0]])
    bound = torch.full((3,), 1e-4)
    assert assert_no_near_tie(logits[1:], torch.tensor([1]), bound) == pytest.approx(1 / 2e-4)
    with pytest.raises(AssertionError, match="near-tie at \\(0,\\)"):
        assert_no_near_tie(logits, torch.tensor([0, 1]), bound)
    with pytest.raises(AssertionError, match="not the reference token"):
        assert_no_near_tie(logits[1:], torch.tensor([2]), bound)


def test_greedy_margin_holds_and_catches_a_wrong_reference_or_a_tie(checkpoints, monkeypatch):
    from builder.checkpoint import load_checkpoint
    from builder.models.nemotron_h import NemotronH
    from runtime.generation import generate
    from runtime.runner import TorchRunner
    from speculative_fixtures import assert_greedy_margin, teacher_forced_logits
    runner = TorchRunner(NemotronH(*load_checkpoint(checkpoints["moe"])))
    prompts = [[5, 9, 17], [7]]
    out = generate(runner, prompts, 12).output_ids
    # teacher forcing one token at a time repeats generate()'s decode steps
    assert torch.equal(teacher_forced_logits(runner, prompts, out).argmax(-1), torch.tensor(out))
    ratio = assert_greedy_margin(runner, prompts, out, 3)
    assert ratio > 1
    wrong = [list(o) for o in out]
    wrong[1][4] = (wrong[1][4] + 1) % runner.config.vocab_size
    with pytest.raises(AssertionError, match="not the reference token"):
        assert_greedy_margin(runner, prompts, wrong, 3)
    # a bound just over the smallest gap: reported as a near-tie
    real = tolerances.logit_order_bound
    monkeypatch.setattr(tolerances, "logit_order_bound", lambda head, spread: real(head, spread) * ratio * 1.01)
    with pytest.raises(AssertionError, match="near-tie"):
        assert_greedy_margin(runner, prompts, out, 3)
