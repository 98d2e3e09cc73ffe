"""``triton.jit`` made on first use, once per TRITON_INTERPRET setting: importing a kernel's module
needs no GPU, and the CPU tests (TRITON_INTERPRET=1) and a GPU launch each get the kernel object their
mode needs (a function jitted for one mode cannot run in the other). Inside :func:`dry` every launch
is skipped: the launch code runs for the outputs it allocates (a custom op's fake, on fake tensors)."""
from __future__ import annotations

import contextlib
import os

_JITTED: dict = {}
_dry = False


class _NoLaunch:
    """A jitted kernel's stand-in inside :func:`dry`: ``kernel[grid](*args)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **meta: None


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def jit(fn):
    """``triton.jit(fn)`` for the current mode (cached)."""
    if fn is None:
        raise ImportError("Triton kernels need triton (pip install triton==3.9.0)")
    if _dry:
        return _NoLaunch()
    import triton

    key = (fn, interpreting())
    kernel = _JITTED.get(key)
    if kernel is None:
        kernel = _JITTED[key] = triton.jit(fn)
    return kernel


@contextlib.contextmanager
def dry():
    """Launches skipped while inside (see the module's docstring)."""
    global _dry
    previous, _dry = _dry, True
    try:
        yield
    finally:
        _dry = previous
