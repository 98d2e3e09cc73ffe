"""The suite's own isolation: conftest fails a test that leaves a watched environment variable or
torch's thread count changed (tests/environment_guard.py), and lets through where runtime.compiled
points inductor."""
import os

import torch


def test_the_guard_names_a_leaked_setting_with_its_values(monkeypatch, tmp_path):
    from environment_guard import changed, watched_environment
    monkeypatch.delenv("NEMOSPEC_SETTING_A_TEST_LEAKS", raising=False)
    before = watched_environment()
    monkeypatch.setenv("NEMOSPEC_SETTING_A_TEST_LEAKS", str(tmp_path))
    monkeypatch.setenv("PATH_UNWATCHED_BY_THE_GUARD", "1")
    assert changed(before, watched_environment()) == f"NEMOSPEC_SETTING_A_TEST_LEAKS (None -> {str(tmp_path)!r})"
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert f"torch.get_num_threads() ('{threads}' -> '{threads + 1}')" in changed(before, watched_environment())
    finally:
        torch.set_num_threads(threads)
    monkeypatch.undo()
    assert changed(before, watched_environment()) == ""


def test_the_guard_lets_inductor_point_at_the_step_store_and_nowhere_else(monkeypatch, tmp_path):
    """runtime.compiled sets TORCHINDUCTOR_CACHE_DIR to its store on every model it compiles for: that
    is the product's behaviour, not a leak; pointing it elsewhere (a test's tmp_path left behind) is."""
    from environment_guard import changed, watched_environment
    from runtime.compiled.steps import cache_dir
    for earlier in (None, str(tmp_path / "set_by_the_caller")):   # unset, or the caller's (a cold run's own)
        if earlier is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", earlier)
        before = watched_environment()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir().resolve())
        assert changed(before, watched_environment()) == ""
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path)
        assert changed(before, watched_environment()) == f"TORCHINDUCTOR_CACHE_DIR ({earlier!r} -> {str(tmp_path)!r})"
