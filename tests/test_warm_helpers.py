"""A server's warm-up with helper processes (runtime.compiled.warm_helpers): each helper runs the
warm-up units last to first from its own share, how many is bounded by the units, the cores and the
memory, and with a real helper beside the warm-up no step is compiled twice, the server ends with
every step, and no helper outlives it."""
import os
import re
import subprocess

import pytest
import torch

from runtime.compiled import warm_helpers

UNITS = [[4, 1, False], [4, 1, True], [4, 2, False], [4, 2, True], [0, 2, False]]


def test_each_helper_runs_the_units_last_first_from_its_own_share(monkeypatch, tmp_path):
    started = []

    class Recorded:
        def __init__(self, command, **kw):
            import json
            started.append(json.loads(command[-1]))
            assert command[1:3] == ["-m", "runtime.compiled.warm_helper"] and kw["preexec_fn"] is not None
    monkeypatch.setattr(subprocess, "Popen", Recorded)
    monkeypatch.setenv(warm_helpers.HELPERS_ENV, "2")
    reopen = {"engine_dir": str(tmp_path), "backend": "compiled", "threads": 1, "policy": {}}
    assert len(warm_helpers.start(reopen, UNITS)) == 2
    backwards = UNITS[::-1]
    assert [s["units"] for s in started] == [backwards, backwards[2:] + backwards[:2]]
    assert all({k: s[k] for k in reopen} == reopen and s["parent"] == os.getpid() for s in started)
    monkeypatch.setenv("NEMOSPEC_CHECK_GUARDS", "1")       # steps then are not saved: nothing to share
    assert warm_helpers.start(reopen, UNITS) == [] and len(started) == 2


def test_a_helper_whose_server_died_before_it_started_does_nothing():
    """PR_SET_PDEATHSIG, set in the child after fork, misses a parent that died in between: the helper
    then finds another parent and exits before opening the engine."""
    import json
    from runtime.compiled import warm_helper
    assert warm_helper.main(["", json.dumps({"parent": os.getpid() + 1, "engine_dir": "/nonexistent"})]) == 0


def test_how_many_helpers(monkeypatch, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 1000)
    monkeypatch.setenv(warm_helpers.HELPERS_ENV, "0")
    assert warm_helpers.helper_count(tmp_path, 5) == 0
    monkeypatch.setenv(warm_helpers.HELPERS_ENV, "8")
    assert warm_helpers.helper_count(tmp_path, 5) == 4           # one unit each at most, the server's too
    monkeypatch.setenv(warm_helpers.HELPERS_ENV, "two")
    with pytest.raises(ValueError, match=warm_helpers.HELPERS_ENV):
        warm_helpers.helper_count(tmp_path, 5)
    monkeypatch.delenv(warm_helpers.HELPERS_ENV)
    monkeypatch.setattr(warm_helpers, "_cores", lambda: 16)
    monkeypatch.setattr(warm_helpers, "_available_memory", lambda: 10**9)
    assert warm_helpers.helper_count(tmp_path, 5) == warm_helpers.MAX_HELPERS
    assert warm_helpers.helper_count(tmp_path, 2) == 1
    monkeypatch.setattr(warm_helpers, "_available_memory", lambda: 3 * 1000 * 2)   # room for one copy more
    assert warm_helpers.helper_count(tmp_path, 5) == 1
    monkeypatch.setattr(warm_helpers, "_cores", lambda: 1)
    assert warm_helpers.helper_count(tmp_path, 5) == 0


def test_a_helper_compiles_beside_the_warm_up_and_no_step_twice(tmp_path, monkeypatch, capfd):
    """A target-only engine warmed for one sequence and a batch (two units): the helper starts at the
    batch, the server at one sequence. Across both processes every step is compiled once (the other
    loads it), the server ends with every step ready (a generation after it runs nothing eagerly), and
    the helper is gone. The model's weights are new each run, so no step of it is in the store yet."""
    from collections import Counter
    from builder.engine import BuildOptions, build
    from builder.random_checkpoint import write_random_checkpoint
    from runtime.compiled import steps
    from runtime.compiled.runner import warm_up_for_serving
    from runtime.generation import generate
    from runtime.loading import open_engine_dir
    monkeypatch.setenv(warm_helpers.HELPERS_ENV, "1")
    seed = int.from_bytes(os.urandom(4), "little")
    checkpoint = write_random_checkpoint(tmp_path / "checkpoint", "M*", seed=seed, tokenizer=True)
    engine = tmp_path / "engine"
    build(checkpoint, engine, BuildOptions(max_batch_size=2, max_input_len=16, max_seq_len=64), log=lambda m: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    started = []
    real_start = warm_helpers.start
    monkeypatch.setattr(warm_helpers, "start", lambda *a, **k: started.extend(real_start(*a, **k)) or started)
    monkeypatch.setattr(steps, "EAGER_AFTER_WARM_UP", Counter())
    monkeypatch.setitem(steps._COMPILING, "on", True)   # the warm-up stops compiling: on again after the test
    try:
        loaded = open_engine_dir(engine, "compiled")
        before = len(steps.COMPILE_LOG)
        warm_up_for_serving(loaded, 0, sampled=False, batched=True,
                            reopen={"engine_dir": str(engine), "backend": "compiled", "threads": 1, "policy": {}})
        mine = steps.COMPILE_LOG[before:]
        generate(loaded.runner, [[5, 9, 17, 33, 8], [42, 7, 3]], 6)   # the warm-up's prompt lengths
        generate(loaded.runner, [[5, 9, 17]], 6)
    finally:
        torch.set_num_threads(threads)
    assert not steps.EAGER_AFTER_WARM_UP, steps.EAGER_AFTER_WARM_UP
    assert len(started) == 1 and started[0].poll() is not None, "the helper was stopped"
    both = Counter(re.findall(r"compiling (.+?) \.\.\.", capfd.readouterr().err))   # this process's and the helper's
    assert both and max(both.values()) == 1, both
    compiled_here = {e[len("compiled "):].rsplit(" (", 1)[0] for e in mine if e.startswith("compiled ")}
    loaded_here = {e[len("loaded "):].rsplit(" (", 1)[0] for e in mine if e.startswith("loaded ")}
    assert compiled_here | loaded_here == set(both), (mine, both)   # every step: made here or by the helper
    assert not compiled_here & loaded_here
