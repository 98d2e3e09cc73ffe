"""What tests/conftest.py checks each test leaves as it found it: the environment variables the code
reads its settings from (a leaked one changes every later test of that worker)."""
import os
import sys

WATCHED = ("NEMOSPEC_", "TORCHINDUCTOR_", "TRITON_", "CUDA_", "ATEN_", "OMP_", "MKL_")


def watched_environment() -> dict:
    """The watched variables, less TORCHINDUCTOR_CACHE_DIR where it names the directory that
    runtime.compiled points inductor at (its own store) or inductor's default, which inductor sets
    at its first use."""
    env = {k: v for k, v in os.environ.items() if k.startswith(WATCHED)}
    steps, inductor = sys.modules.get("runtime.compiled.steps"), sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    expected = {str(steps.cache_dir().resolve()) if steps else None, inductor.default_cache_dir() if inductor else None}
    if env.get("TORCHINDUCTOR_CACHE_DIR", None) in expected - {None}:
        del env["TORCHINDUCTOR_CACHE_DIR"]
    return env


def changed(before: dict, after: dict) -> str:
    """The variables that differ, each with its value before and after; empty when none does."""
    keys = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return ", ".join(f"{k} ({before.get(k)!r} -> {after.get(k)!r})" for k in keys)
