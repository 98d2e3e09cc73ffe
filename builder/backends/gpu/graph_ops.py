"""The Triton kernels as custom ops (``torch.ops.nemospec.<op>``), so a compiled step can hold them:
dynamo cannot trace a kernel's launch code (allocations, a Python-side grid, the jitted function), so
a traced step sees one opaque op per kernel, which inductor calls from the step's graph (and its CUDA
graph replays). Used only with ``NEMOSPEC_KERNELS_IN_GRAPHS=1`` (see the package's docstring).

* ``call`` runs while a step is traced: the kernel's ``check`` on the (static) shapes, dtypes and
  devices, and the argument types against its schema; the custom op where both pass, else None and
  the torch op is traced (a prefill chunk past a kernel's rows, a float64 input, a Python float
  where the schema has a tensor).
* The op's implementation is the kernel's ``run``; its fake (what tracing sees) is the same ``run``
  with every launch skipped (``plugins.triton_jit.dry``), so the outputs' shapes, dtypes and strides
  are the ones the launch code allocates, not a second description of them that could drift.
* An output that is an input (hidden capture with no delta returns the residual) is copied: a
  custom op's outputs may not alias its inputs.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch

from plugins import triton_jit

NAMESPACE = "nemospec"
CALLS: Counter = Counter()     # op -> times its custom op ran (not traced): which kernels a graph launched
_LIB = None


def _kind(t) -> str:
    """A schema argument's type as one of the kinds :func:`fits` knows."""
    text = str(t)
    return {"Tensor": "tensor", "Optional[Tensor]": "tensor?", "int": "int", "Optional[int]": "int?",
            "float": "float", "Optional[float]": "float?", "bool": "bool", "str": "str", "Optional[str]": "str?",
            "List[int]": "int[]"}.get(text, text)


def define(kernels: Iterable) -> None:
    """Defines each kernel's custom op once per process (its schema, ``run``, the dry-run fake)."""
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
    for kernel in kernels:
        if kernel.custom_op is not None:
            continue
        schema = torch._C.parse_schema(f"{NAMESPACE}::{kernel.op}{kernel.schema}")
        kernel.kinds = tuple(_kind(a.type) for a in schema.arguments)
        _LIB.define(f"{kernel.op}{kernel.schema}")
        _LIB.impl(kernel.op, _implementation(kernel.op, kernel.run), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{kernel.op}", _fake(kernel.run), lib=_LIB)
        kernel.custom_op = getattr(getattr(torch.ops, NAMESPACE), kernel.op)


def _unaliased(out, args):
    inputs = [a for a in args if isinstance(a, torch.Tensor)]

    def fresh(t):
        return t.clone() if any(t is a or torch._C._is_alias_of(t, a) for a in inputs) else t
    return tuple(fresh(t) for t in out) if isinstance(out, tuple) else fresh(out)


def _implementation(op, run):
    def implementation(*args):
        CALLS[op] += 1
        return _unaliased(run(*args), args)
    return implementation


def _fake(run):
    def fake(*args):
        with triton_jit.dry():
            return _unaliased(run(*args), args)
    return fake


def fits(kinds: tuple, args: tuple) -> bool:
    """True when ``args`` have the schema's kinds (a bool is no int; an int is a float)."""
    if len(args) > len(kinds):
        return False
    for kind, a in zip(kinds, args):
        if kind.endswith("?") and a is None:
            continue
        kind = kind.rstrip("?")
        if kind == "tensor":
            ok = isinstance(a, torch.Tensor)
        elif kind == "int":
            ok = isinstance(a, int) and not isinstance(a, bool)
        elif kind == "float":
            ok = isinstance(a, (int, float)) and not isinstance(a, bool)
        elif kind == "bool":
            ok = isinstance(a, bool)
        elif kind == "str":
            ok = isinstance(a, str)
        elif kind == "int[]":
            ok = isinstance(a, (tuple, list)) and all(isinstance(d, int) and not isinstance(d, bool) for d in a)
        else:
            ok = False
        if not ok:
            return False
    return True


def coerce(kinds: tuple, args: tuple) -> tuple:
    """``args`` as the schema takes them (a tuple of ints as a list, an int given for a float as a float)."""
    return tuple(list(a) if k == "int[]" else float(a) if k.rstrip("?") == "float" and a is not None else a
                 for k, a in zip(kinds, args))


def call(kernel, args: tuple):
    """While a step is traced: the kernel's custom op on ``args``, or None (the torch op is traced)."""
    if kernel.custom_op is None or not fits(kernel.kinds, args) or kernel.check(*args) is not None:
        return None
    return kernel.custom_op(*coerce(kernel.kinds, args))
