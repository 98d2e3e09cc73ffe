"""Put a built model module on a device.

Modules bind their weights as plain tensor attributes when they are built (from memory-mapped
checkpoint tensors, on the CPU). Running them eagerly on a GPU moves every tensor they hold, nested
layers, lists and dicts included, once; a tensor shared by two modules (a draft's embedding viewing the
target's) stays shared when both are placed with the same ``moved`` memo.
"""
from __future__ import annotations

import torch

_CONTAINERS = (list, tuple, dict)


def place(obj, device, moved: dict | None = None):
    """``obj`` with every tensor it holds on ``device``; model objects are changed in place."""
    device = torch.device(device)
    moved = {} if moved is None else moved
    return _place(obj, device, moved, set())


def _place(obj, device, moved, seen):
    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            return obj
        key = id(obj)
        if key not in moved:
            moved[key] = (obj, obj.to(device))   # the source is kept so its id is not reused
        return moved[key][1]
    if isinstance(obj, dict):
        new = {k: _place(v, device, moved, seen) for k, v in obj.items()}
        return obj if all(new[k] is v for k, v in obj.items()) else new
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        new = [_place(v, device, moved, seen) for v in obj]
        return obj if all(a is b for a, b in zip(new, obj)) else type(obj)(new)
    if _is_model_object(obj) and id(obj) not in seen:
        seen.add(id(obj))
        for name, value in vars(obj).items():
            new = _place(value, device, moved, seen)
            if new is not value:   # configs (frozen) hold no tensors and are never written
                setattr(obj, name, new)
    return obj


def _is_model_object(obj) -> bool:
    """One of our modules (builder.models, plugins): plain objects holding tensors."""
    return hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("builder", "plugins") \
        and not isinstance(obj, type)


def devices(obj) -> set:
    """Every device a model object's tensors are on (what a test of ``place`` checks)."""
    found: set = set()

    def walk(o, seen):
        if isinstance(o, torch.Tensor):
            found.add(o.device)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v, seen)
        elif isinstance(o, _CONTAINERS):
            for v in o:
                walk(v, seen)
        elif _is_model_object(o) and id(o) not in seen:
            seen.add(id(o))
            for v in vars(o).values():
                walk(v, seen)
    walk(obj, set())
    return found
