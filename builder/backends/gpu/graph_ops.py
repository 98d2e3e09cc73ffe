"""The Triton kernels as custom ops (``torch.ops.nemospec.<op>``), so a compiled step can hold them:
dynamo cannot trace a kernel's launch code (allocations, a Python-side grid, the jitted function), so
a traced step sees one opaque op per kernel, which inductor calls from the step's graph (and its CUDA
graph replays). Used only with ``NEMOSPEC_KERNELS_IN_GRAPHS=1`` (see the package's docstring).

* ``call`` runs while a step is traced: the kernel's ``check`` on the shapes, dtypes and devices,
  and the argument types against its schema; the custom op where both pass, else None and the torch
  op is traced (a prefill chunk past a kernel's rows, a float64 input, an int where the schema has a
  bool).
* A step's batch and cache dims may be symbolic (one graph serves every batch of two or more), and
  its guards are not checked per call, so the trace-time check holds for the traced sizes only: the
  op's implementation checks again on the real arguments and runs the torch op where the kernel
  declines them (more rows than it was written for), said once in the log.
* The op's fake (what tracing sees) is the torch op itself on the fake arguments, with the kernels
  off (the package's ``reference``), or the kernel's own ``fake`` where the torch op checks values (the NVFP4
  ops' global scale): it keeps symbolic sizes symbolic, where the launch code's grid arithmetic
  would fix them to the traced values. The kernels' outputs equal the torch op's in shape and dtype
  (their tests); both sides return them contiguous, and an output that is an input (hidden capture
  with no delta returns the residual) as a copy: a custom op's outputs may not alias its inputs.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch

NAMESPACE = "nemospec"
CALLS: Counter = Counter()     # op -> times its custom op ran (not traced): which kernels a graph launched
_LIB = None
_GPU: dict = {}                # the package's fallback (log once) and reference (kernels off), given to define()


def _kind(t) -> str:
    """A schema argument's type as one of the kinds :func:`fits` knows."""
    text = str(t)
    return {"Tensor": "tensor", "Optional[Tensor]": "tensor?", "int": "int", "Optional[int]": "int?",
            "float": "float", "Optional[float]": "float?", "bool": "bool", "str": "str", "Optional[str]": "str?",
            "List[int]": "int[]"}.get(text, text)


def reference_op(op: str):
    """The torch op a kernel stands behind (``torch_backend``'s, or ``torch_tree``'s for the tree ops)."""
    from builder.backends import torch_backend, torch_tree
    return getattr(torch_tree, op, None) or getattr(torch_backend, op)


def define(kernels: Iterable, fallback, reference) -> None:
    """Defines each kernel's custom op once per process (its schema, implementation and fake);
    ``fallback(op, reason)`` logs a declined call, ``reference()`` turns the kernels off."""
    global _LIB
    _GPU.update(fallback=fallback, reference=reference)
    if _LIB is None:
        _LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
    for kernel in kernels:
        if kernel.custom_op is not None:
            continue
        schema = torch._C.parse_schema(f"{NAMESPACE}::{kernel.op}{kernel.schema}")
        kernel.kinds = tuple(_kind(a.type) for a in schema.arguments)
        _LIB.define(f"{kernel.op}{kernel.schema}")
        _LIB.impl(kernel.op, _implementation(kernel), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{kernel.op}", _fake(kernel), lib=_LIB)
        kernel.custom_op = getattr(getattr(torch.ops, NAMESPACE), kernel.op)


def _own(out, args):
    """``out`` with every tensor contiguous and none an input (a copy where it is one)."""
    inputs = [a for a in args if isinstance(a, torch.Tensor)]

    def fresh(t):
        if any(t is a or torch._C._is_alias_of(t, a) for a in inputs):
            return t.clone(memory_format=torch.contiguous_format)
        return t.contiguous()
    return tuple(fresh(t) for t in out) if isinstance(out, tuple) else fresh(out)


def _reference(op: str, args):
    """The torch op on ``args`` with the kernels off, in the forms it takes while a step is traced
    (``torch.compiler.is_compiling()``, which AOT autograd calls a fake with down): no data-dependent
    branch, which fake tensors cannot take and a CUDA graph cannot capture (a host sync)."""
    flag = getattr(torch.compiler, "_is_compiling_flag", None)   # torch's own switch; a torch without it: eager forms
    if flag is not None:
        torch.compiler._is_compiling_flag = True
    try:
        with _GPU["reference"]():
            return reference_op(op)(*args)
    finally:
        if flag is not None:
            torch.compiler._is_compiling_flag = flag


def _implementation(kernel):
    def implementation(*args):
        reason = kernel.check(*args)
        if reason is not None:   # sizes the traced ones stood for, but the kernel was not written for
            _GPU["fallback"](kernel.op, f"{reason}, in a compiled step")
            return _own(_reference(kernel.op, args), args)
        CALLS[kernel.op] += 1
        return _own(kernel.run(*args), args)
    return implementation


def _fake(kernel):
    def fake(*args):
        if kernel.fake is not None:
            return _own(kernel.fake(*args), args)
        return _own(_reference(kernel.op, args), args)
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
