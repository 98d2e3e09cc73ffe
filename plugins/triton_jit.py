"""``triton.jit`` made on first use, once per TRITON_INTERPRET setting: importing a kernel's module
needs no GPU, and the CPU tests (TRITON_INTERPRET=1) and a GPU launch each get the kernel object their
mode needs (a function jitted for one mode cannot run in the other)."""
from __future__ import annotations

import os

_JITTED: dict = {}


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def jit(fn):
    """``triton.jit(fn)`` for the current mode (cached)."""
    if fn is None:
        raise ImportError("Triton kernels need triton (pip install triton==3.9.0)")
    import triton

    key = (fn, interpreting())
    kernel = _JITTED.get(key)
    if kernel is None:
        kernel = _JITTED[key] = triton.jit(fn)
    return kernel

