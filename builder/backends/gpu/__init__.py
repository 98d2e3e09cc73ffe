"""Triton-lang kernels behind the op surface, for CUDA tensors (the GPU path of ARCHITECTURE.md).

The torch ops in ``torch_backend``/``torch_tree`` stay the reference and the CPU path; an op given
CUDA tensors first asks :func:`dispatch` for a kernel registered under its name. A kernel returns
its result, or ``None`` when the shapes or dtypes are ones it was not written for, after calling
:func:`fallback` (logged once per op and reason), and the torch op runs instead: never a silent
wrong answer. Tests run the kernels on CPU tensors under ``TRITON_INTERPRET=1`` inside
:func:`forced`. ``NEMOSPEC_TRITON_KERNELS=0`` turns the dispatch off.

Modules: ``mamba`` (conv and selective-state updates for 1..K+1 tokens, chain and tree),
``attention`` (query rows over the KV cache, tree and visibility masks), ``nvfp4`` (W4A16 products),
``moe`` (fused routing and the routed experts of a few rows), ``capture`` (the residual add that also
writes a draft's captured hidden state), ``norms`` (RMSNorm and the gated RMSNorm, one launch each).
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
from typing import Callable, Dict, Optional

import torch

from plugins.triton_jit import interpreting, jit  # noqa: F401  (the kernels' modules use gpu.jit)

log = logging.getLogger("nemospec.gpu")

MODULES = ("mamba", "attention", "nvfp4", "moe", "capture", "norms")
_KERNELS: Dict[str, Callable] = {}
_loaded = False
_forced = False
_warned: set = set()
ENABLED = os.environ.get("NEMOSPEC_TRITON_KERNELS", "1") != "0"   # read once: traced graphs see a constant


def register(op: str):
    """Decorator: ``fn(*op_args) -> result | None`` runs ``op`` for CUDA tensors."""
    def wrap(fn):
        _KERNELS[op] = fn
        return fn
    return wrap


def fallback(op: str, reason: str) -> None:
    """Says once per (op, reason) that the torch op runs instead of the kernel."""
    if (op, reason) not in _warned:
        _warned.add((op, reason))
        log.warning("%s: Triton kernel not used (%s); running the torch op", op, reason)


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for name in MODULES:
            try:
                importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{__name__}.{name}":
                    raise


def active(x) -> bool:
    """True when an op on ``x`` should try its kernel: a CUDA tensor, or a CPU one inside forced();
    never while ``torch.compile`` traces (the compiled steps keep inductor's lowering of the torch ops
    until a device run has shown these kernels inside whole-graph captures)."""
    return (ENABLED and isinstance(x, torch.Tensor) and (x.is_cuda or _forced)
            and not torch.compiler.is_compiling())


def dispatch(op: str, *args, **kwargs) -> Optional[object]:
    """The kernel's result for ``op``, or None (no kernel registered, or it declined)."""
    _load()
    kernel = _KERNELS.get(op)
    if kernel is None:
        return None
    try:
        return kernel(*args, **kwargs)
    except Exception as e:  # a Triton that cannot compile it (the device image's is older): torch from now on
        if _forced:          # tests: a kernel's error is the finding
            raise
        del _KERNELS[op]
        fallback(op, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        return None


@contextlib.contextmanager
def forced():
    """Tests: route CPU tensors through the kernels (needs TRITON_INTERPRET=1 set before the kernels
    are jitted; see :func:`jit`)."""
    global _forced
    previous, _forced = _forced, True
    try:
        yield
    finally:
        _forced = previous
