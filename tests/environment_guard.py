"""What tests/conftest.py checks each test leaves as it found it: the environment variables the code
reads its settings from, and torch's thread count (a leaked one changes every later test of that
worker)."""
import os
import sys

WATCHED = ("NEMOSPEC_", "TORCHINDUCTOR_", "TRITON_", "CUDA_", "ATEN_", "OMP_", "MKL_")


def watched_environment() -> dict:
    env = {k: v for k, v in os.environ.items() if k.startswith(WATCHED)}
    torch = sys.modules.get("torch")
    if torch is not None:   # a compiled step's identity holds it: a leaked count re-keys every later step
        env["torch.get_num_threads()"] = str(torch.get_num_threads())
    return env


def _inductor_cache_dirs() -> set:
    """Where TORCHINDUCTOR_CACHE_DIR may be left: the store runtime.compiled points inductor at when
    it compiles for a model, or the default inductor sets at its first use."""
    steps, inductor = sys.modules.get("runtime.compiled.steps"), sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    return {str(steps.cache_dir().resolve()) if steps else None, inductor.default_cache_dir() if inductor else None} - {None}


def changed(before: dict, after: dict) -> str:
    """The variables that differ, each with its value before and after; empty when none does."""
    keys = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if "TORCHINDUCTOR_CACHE_DIR" in keys and after.get("TORCHINDUCTOR_CACHE_DIR") in _inductor_cache_dirs():
        keys.remove("TORCHINDUCTOR_CACHE_DIR")
    return ", ".join(f"{k} ({before.get(k)!r} -> {after.get(k)!r})" for k in keys)
