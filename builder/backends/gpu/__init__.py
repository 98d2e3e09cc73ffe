"""Triton-lang kernels behind the op surface, for CUDA tensors (the GPU path of ARCHITECTURE.md).

The torch ops in ``torch_backend``/``torch_tree`` stay the reference and the CPU path; an op given
CUDA tensors first asks :func:`dispatch` for a kernel registered under its name. Each kernel has a
``check`` (why it declines these arguments, or None: shapes, dtypes and devices only) and a ``run``
(the launch). A declined call is logged once per op and reason by :func:`fallback`, and the torch op
runs instead: never a silent wrong answer. Tests run the kernels on CPU tensors under
``TRITON_INTERPRET=1`` inside :func:`forced`. ``NEMOSPEC_TRITON_KERNELS=0`` turns the dispatch off.

Inside ``torch.compile`` (the compiled steps) the torch ops are traced and inductor lowers them,
unless ``NEMOSPEC_KERNELS_IN_GRAPHS=1``: then an op whose kernel takes its (static) shapes is traced as
the custom op ``torch.ops.nemospec.<op>`` (``graph_ops``), which launches the kernel from inside the
step's graph and its CUDA graph. Off by default until a device run measures it against inductor's
lowering (scripts/gpu_check.py's ``wide_model_kernels_in_graphs``).

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
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

from plugins.triton_jit import interpreting, jit  # noqa: F401  (the kernels' modules use gpu.jit)

log = logging.getLogger("nemospec.gpu")

MODULES = ("mamba", "attention", "nvfp4", "moe", "capture", "norms")
_KERNELS: Dict[str, "Kernel"] = {}
_loaded = False
_forced = False
_reference = 0          # > 0 inside reference(): the torch ops run whatever the tensors
_warned: set = set()
ENABLED = os.environ.get("NEMOSPEC_TRITON_KERNELS", "1") != "0"   # read once: traced graphs see a constant
IN_GRAPHS = os.environ.get("NEMOSPEC_KERNELS_IN_GRAPHS", "0") not in ("", "0")


@dataclass
class Kernel:
    """One op's kernel: ``run(*op_args)`` launches it on arguments ``check(*op_args)`` took (None);
    ``schema`` is its custom op's signature for the compiled steps (``graph_ops``)."""
    op: str
    run: Callable
    check: Callable
    schema: str
    fake: Optional[Callable] = None          # the outputs' metadata, where the torch op's is not traceable
    custom_op: Optional[Callable] = None     # torch.ops.nemospec.<op>, once graph_ops defined it
    kinds: tuple = ()                        # the schema's argument kinds, for graph_ops.fits


def register(op: str, schema: str, check: Callable, fake: Optional[Callable] = None):
    """Decorator on ``run``: the kernel for ``op``, taking what ``check`` does not decline. ``fake``
    (outputs like the kernel's, from the arguments' metadata) stands in for the torch op while a step
    is traced, where that op checks values (the NVFP4 global scale) that fake tensors do not have."""
    def wrap(run):
        _KERNELS[op] = Kernel(op, run, check, schema, fake)
        return run
    return wrap


def fallback(op: str, reason: str) -> None:
    """Says once per (op, reason) that the torch op runs instead of the kernel."""
    if (op, reason) not in _warned:
        _warned.add((op, reason))
        log.warning("%s: Triton kernel not used (%s); running the torch op", op, reason)


def load() -> None:
    """Imports the kernels' modules and defines their custom ops (before any step is traced)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for name in MODULES:
            try:
                importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{__name__}.{name}":
                    raise
        from builder.backends.gpu import graph_ops
        graph_ops.define(_KERNELS.values(), fallback, reference)


def active(x) -> bool:
    """True when an op on ``x`` should try its kernel: a CUDA tensor, or a CPU one inside forced();
    while ``torch.compile`` traces, only with IN_GRAPHS."""
    return (ENABLED and not _reference and isinstance(x, torch.Tensor) and (x.is_cuda or _forced)
            and (IN_GRAPHS or not torch.compiler.is_compiling()))


def dispatch(op: str, *args) -> Optional[object]:
    """The kernel's result for ``op``, or None (no kernel registered, or it declined). While a step is
    traced: the kernel's custom op, or None (the torch op is traced)."""
    load()
    kernel = _KERNELS.get(op)
    if kernel is None:
        return None
    if torch.compiler.is_compiling():
        from builder.backends.gpu import graph_ops
        return graph_ops.call(kernel, args)
    reason = kernel.check(*args)
    if reason is not None:
        fallback(op, reason)
        return None
    try:
        return kernel.run(*args)
    except Exception as e:  # a Triton that cannot compile it (the device image's is older): torch from now on
        if _forced:          # tests: a kernel's error is the finding
            raise
        del _KERNELS[op]
        fallback(op, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
        return None


def graph_state() -> str:
    """What decides which ops a traced step holds (part of a compiled step's identity)."""
    return f"kernels={ENABLED} in_graphs={IN_GRAPHS} forced={_forced}"


@contextlib.contextmanager
def reference():
    """The torch ops run inside, the kernels off (a custom op's fake and its declined calls)."""
    global _reference
    _reference += 1
    try:
        yield
    finally:
        _reference -= 1


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
