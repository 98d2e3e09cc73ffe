"""Which draft lengths the compiled path's warm-ups run (runtime.compiled.runner): a server's and a
timed run's, with a --draft_len_schedule or an adaptive K. The runs themselves are recorded, not
compiled (tests/test_compiled.py compiles the adaptive ones)."""
import pytest

from builder import embedded
from runtime.compiled import runner as compiled_runner
from runtime.draft_policy import DraftPolicy
from runtime.loading import open_checkpoint


@pytest.fixture
def recorded(monkeypatch):
    """The embedded eagle3 on the compiled path, with each warm-up run recorded as (K, batch size)
    instead of run, and the server warm-up's stop_compiling left out (it is process-wide)."""
    import runtime.generation
    loaded = open_checkpoint(embedded.target_dir(), mode="eagle3", draft_dir=embedded.draft_dir("eagle3"),
                             backend="compiled")
    runs = []
    monkeypatch.setattr(compiled_runner, "_warm_speculative",
                        lambda loaded, prompts, k, tree, **kw: runs.append((k, len(prompts))))
    monkeypatch.setattr(runtime.generation, "generate", lambda runner, prompts, new, **kw: runs.append((0, len(prompts))))
    monkeypatch.setattr(compiled_runner, "stop_compiling", lambda: None)
    return loaded, runs


def test_a_server_warms_each_k_its_schedule_drafts(recorded):
    """An explicit schedule (1:4,4:2,8:0): K=2 steps (batches of 2-4) were met only after the warm-up,
    eagerly for the life of the server; now K=4 and K=2 are warmed at batch 1 and 2, K=0 (target-only)
    as always."""
    loaded, runs = recorded
    loaded.draft_policy = DraftPolicy(4, schedule={1: 4, 4: 2, 8: 0})
    compiled_runner.warm_up_for_serving(loaded, 4, sampled=False)
    assert {k for k, _ in runs} == {4, 2, 0}
    assert {(k, b) for k, b in runs if k} == {(4, 1), (4, 2), (2, 1), (2, 2)}


def test_a_timed_run_warms_each_k_its_schedule_or_adaptive_k_drafts(recorded):
    """generate and bench warm up before timing: a schedule's K for the run's batch sizes (a batch
    shrinks as sequences finish) compiled inside the timed run before; an adaptive K's candidates
    were warmed already, and still are."""
    loaded, runs = recorded
    compiled_runner.warm_up(loaded, [[5, 9, 17]], 4, policy=DraftPolicy(4, schedule={1: 3}))
    assert {k for k, _ in runs if k} == {4, 3}
    runs.clear()
    compiled_runner.warm_up(loaded, [[5, 9, 17]], 4, policy=DraftPolicy(4, adaptive=True))
    assert {k for k, _ in runs if k} == {4, *[b - 1 for b in loaded.runner.verify_buckets if 1 <= b - 1 <= 4]}


def test_a_server_with_a_confidence_stop_warms_each_shorter_verify_greedy_and_sampled(recorded, monkeypatch):
    """A confidence stop trims a step to a shorter verify: a greedy step runs it in the greedy graph
    (warmed before), a sampled one in the verify forward and rollback, which were met only after the
    warm-up (eagerly). Each length up to K+1, at batch 1 and 2."""
    loaded, runs = recorded
    greedy, sampled = [], []
    monkeypatch.setattr(loaded.runner, "warm_verify", lambda tokens, batch: greedy.append((tokens, batch)))
    monkeypatch.setattr(loaded.runner, "warm_sampled_verify", lambda tokens, batch: sampled.append((tokens, batch)),
                        raising=False)
    loaded.draft_policy = DraftPolicy(4, confidence_threshold=0.5)
    compiled_runner.warm_up_for_serving(loaded, 4)
    lengths = {(t, b) for t in loaded.runner.verify_buckets if t <= 5 for b in (1, 2)}
    assert set(greedy) == lengths
    assert set(sampled) == lengths
