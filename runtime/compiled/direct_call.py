"""A compiled step called at its innermost function, past the Python layers around it.

An ``aot_compile``d step runs dynamo's bytecode (which gathers the module's ~70 weights and the
state dicts into one flat list), AOT autograd's runtime wrapper (mutations, aliases) and inductor's
Python wrapper (a tensor made from every size argument) before the C++ graph starts: ~80 us of a
0.4 ms decode on the embedded target, paid on every call, by target-only and speculative steps
alike. ``record`` watches two ordinary calls and writes down what fills each input of the
innermost function (a tensor the caller passed, a weight, or a dynamic size of a tensor passed)
and what each returned tensor is (an output of the innermost function, or a tensor passed). A
``DirectCall`` then builds that list and calls the innermost function itself.

It is an optimisation that must never change a result, so anything the recording cannot explain
keeps the ordinary call: an input it cannot place, a size two kinds of dimension share, a result
that is a new view, an input the wrapper writes after the graph (a version counter moved), or two
recordings that disagree. ``NEMOSPEC_DIRECT_CALLS=0`` turns it off (A/B, debugging).
"""
from __future__ import annotations

import os
import threading

import torch
from torch._inductor import output_code

_LOCK = threading.Lock()


def enabled() -> bool:
    return os.environ.get("NEMOSPEC_DIRECT_CALLS", "1") != "0"


class Unexplained(Exception):
    """The recording met something a direct call could not reproduce."""


def _spec(value):
    """How a call's argument or result is laid out: a tensor, a dict or tuple/list of such values,
    or anything else (an int, a flag, None: part of the step's key; a direct call checks it)."""
    if isinstance(value, torch.Tensor):
        return "T"
    if isinstance(value, dict):
        return ("D", tuple((k, _spec(v)) for k, v in value.items()))
    if isinstance(value, (tuple, list)):
        return ("S", tuple(_spec(v) for v in value))
    return ("X", value)


def _leaves(spec, value, out: list) -> None:
    """Appends the tensors of ``value`` laid out as ``spec``; ``LookupError`` when it is laid out
    otherwise (other keys, lengths or values of its non-tensor parts)."""
    if spec == "T":
        if not isinstance(value, torch.Tensor):
            raise LookupError("not a tensor")
        out.append(value)
    elif spec[0] == "D":
        if len(value) != len(spec[1]):
            raise LookupError("dict keys changed")
        for k, s in spec[1]:
            _leaves(s, value[k], out)
    elif spec[0] == "S":
        if len(value) != len(spec[1]):
            raise LookupError("sequence length changed")
        for s, v in zip(spec[1], value):
            _leaves(s, v, out)
    elif not (value is spec[1] or (type(value) is type(spec[1]) and value == spec[1])):
        raise LookupError("a non-tensor argument changed")


def _constants(spec) -> set:
    """The non-tensor values in a layout."""
    if spec == "T":
        return set()
    if spec[0] == "D":
        return set().union(*(_constants(s) for _, s in spec[1]))
    if spec[0] == "S":
        return set().union(*(_constants(s) for s in spec[1]))
    return {spec[1]}


def _dynamic_dims(t: torch.Tensor) -> set:
    return set(getattr(t, "_dynamo_weak_dynamic_indices", ())) | set(getattr(t, "_dynamo_dynamic_indices", ()))


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


class DirectCall:
    """The recorded plan of one compiled step as one generated function: ``__call__(args, kwargs)``
    returns what the ordinary call returns, or raises ``LookupError`` when the arguments are laid
    out otherwise than recorded (other dict keys, another non-tensor argument)."""

    def __init__(self, graph, arg_spec, inputs, results, result_spec):
        names: dict = {"LookupError": LookupError, "graph": graph.current_callable, "size": self._size}
        self._sizes: dict[int, torch.Tensor] = {}
        lines, leaves = [], []

        def constant(value):
            name = f"c{len(names)}"
            names[name] = value
            return name

        def flatten(spec, expr):
            if spec == "T":
                leaves.append(f"l{len(leaves)}")
                lines.append(f"{leaves[-1]} = {expr}")
            elif spec[0] in "DS":
                lines.append(f"if len({expr}) != {len(spec[1])}: raise LookupError('layout')")
                for i, item in enumerate(spec[1]):
                    key, sub = item if spec[0] == "D" else (i, item)
                    flatten(sub, f"{expr}[{constant(key)}]")
            else:
                c = constant(spec[1])
                lines.append(f"if not ({expr} is {c} or (type({expr}) is type({c}) and {expr} == {c})): "
                             "raise LookupError('argument')")

        def build(spec, it):
            if spec == "T":
                kind, j = next(it)
                return f"outs[{j}]" if kind == 0 else leaves[j]
            if spec[0] == "D":
                return "{" + ", ".join(f"{constant(k)}: {build(s, it)}" for k, s in spec[1]) + "}"
            if spec[0] == "S":
                return "(" + "".join(f"{build(s, it)}, " for s in spec[1]) + ")"
            return constant(spec[1])

        flatten(arg_spec, "call")
        flat = [leaves[a] if kind == 0 else constant(a) if kind == 1 else f"size({leaves[a]}.shape[{b}])"
                for kind, a, b in inputs]
        lines.append(f"outs = graph([{', '.join(flat)}])")
        lines.append(f"return {build(result_spec, iter(results))}")
        source = "def direct(call):\n    try:\n" + "".join(f"        {line}\n" for line in lines) + \
                 "    except (KeyError, IndexError, TypeError) as e:\n        raise LookupError(str(e)) from None\n"
        exec(compile(source, "<nemospec direct call>", "exec"), names)
        self._call = names["direct"]

    def _size(self, value: int) -> torch.Tensor:
        t = self._sizes.get(value)
        if t is None:
            t = self._sizes[value] = torch.tensor(value)
        return t

    def __call__(self, args, kwargs):
        return self._call((args, kwargs))


def _plan(inner_inputs, inner_outputs, result, leaves):
    """(input plan, result plan, result spec) of one watched call; raises ``Unexplained``."""
    by_id = {id(t): j for j, t in enumerate(leaves)}
    storages = {t.untyped_storage().data_ptr() for t in leaves if t.numel()}
    inputs = []
    for x in inner_inputs:
        if isinstance(x, torch.Tensor):
            j = by_id.get(id(x))
            if j is not None:
                inputs.append((0, j, 0))
            elif x.numel() and x.untyped_storage().data_ptr() in storages:
                raise Unexplained("an input derived from a passed tensor")
            else:
                inputs.append((1, x, 0))         # a weight: the same tensor every call (checked twice)
        elif isinstance(x, int) and not isinstance(x, bool):
            found = [(j, d) for j, t in enumerate(leaves) for d in sorted(_dynamic_dims(t))
                     if d < t.dim() and t.shape[d] == x]
            if not found or len({d == 0 for _, d in found}) > 1:
                raise Unexplained(f"size {x} not placed")
            inputs.append((2, *found[0]))
        else:
            raise Unexplained(f"input of type {type(x).__name__}")
    result_spec = _spec(result)
    if _constants(result_spec) - {None}:
        raise Unexplained("a result that is not a tensor")   # it could depend on the inputs
    produced = []
    _leaves(result_spec, result, produced)
    out_ids = {id(t): j for j, t in enumerate(inner_outputs) if isinstance(t, torch.Tensor)}
    results = []
    for r in produced:
        if id(r) in out_ids:
            results.append((0, out_ids[id(r)]))
        elif id(r) in by_id:
            results.append((1, by_id[id(r)]))
        else:   # the wrapper's view of a passed tensor: the tensor itself when the view is all of it
            same = [j for j, t in enumerate(leaves) if _same_view(r, t)]
            if not same:
                raise Unexplained("a result that is a new view")
            results.append((1, same[0]))
    return inputs, results, result_spec


def record(call, args, kwargs):
    """Runs ``call(*args, **kwargs)`` (the ordinary compiled call) once, watching its one innermost
    graph call. Returns (its result, its plan or None when the call could not be explained). Two
    plans of one step must be ``same_plan`` before a ``DirectCall`` is made of them."""
    arg_spec = _spec((args, kwargs))
    leaves = []
    _leaves(arg_spec, (args, kwargs), leaves)
    seen = []
    original = output_code.CompiledFxGraph.__call__
    me = threading.get_ident()

    def spy(graph, inputs):
        if threading.get_ident() != me:
            return original(graph, inputs)
        kept = list(inputs)
        outputs = original(graph, inputs)
        seen.append((graph, kept, outputs, [t._version for t in leaves]))
        return outputs

    with _LOCK:
        output_code.CompiledFxGraph.__call__ = spy
        try:
            result = call(*args, **kwargs)
        finally:
            output_code.CompiledFxGraph.__call__ = original
    if len(seen) != 1 or not isinstance(seen[0][2], (list, tuple)):
        return result, None
    graph, inner_inputs, inner_outputs, versions = seen[0]
    if [t._version for t in leaves] != versions:   # the wrapper wrote an input after the graph
        return result, None
    try:
        inputs, results, result_spec = _plan(inner_inputs, list(inner_outputs), result, leaves)
    except (Unexplained, LookupError, TypeError):   # TypeError: an unhashable non-tensor result
        return result, None
    return result, (graph, arg_spec, inputs, results, result_spec)


def same_plan(a, b) -> bool:
    """Two recordings of one step agree: the same graph, layouts, and the same weight tensors."""
    if a is None or b is None:
        return False
    return (a[0] is b[0] and a[1] == b[1] and a[3] == b[3] and a[4] == b[4] and len(a[2]) == len(b[2])
            and all(x[0] == y[0] and (x[1] is y[1] if x[0] == 1 else x[1:] == y[1:]) for x, y in zip(a[2], b[2])))
