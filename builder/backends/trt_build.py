"""Building a recorded network into a serialized engine (optimization profiles, builder config)."""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Callable, Mapping, Sequence

from builder.backends.trt_import import FLAVOUR, trt
from builder.errors import BuildError


def build_engine_bytes(recorder, profiles: Sequence[Mapping[str, Sequence]], workspace_bytes: int | None = None,
                       config_hook: Callable | None = None) -> bytes:
    """``bytes`` of the serialized engine (see :func:`build_serialized`)."""
    return bytes(memoryview(build_serialized(recorder, profiles, workspace_bytes, config_hook)))


def build_engine_file(recorder, profiles: Sequence[Mapping[str, Sequence]], path, strip_plan: bool = False) -> int:
    """Build and write the engine to ``path`` straight from TensorRT's buffer (no copy); returns its size.
    ``strip_plan``: weight-stripped and refittable (``STRIP_PLAN`` + ``REFIT_INDIVIDUAL``: only the
    weights the recorder marked refittable are left out)."""
    hook = _strip_flags if strip_plan else None
    serialized = build_serialized(recorder, profiles, config_hook=hook)
    view = memoryview(serialized)
    with open(path, "wb") as f:
        f.write(view)
    size = view.nbytes
    del view, serialized
    return size


def _strip_flags(config) -> None:
    config.set_flag(trt.BuilderFlag.STRIP_PLAN)
    config.set_flag(trt.BuilderFlag.REFIT_INDIVIDUAL)


@functools.lru_cache(maxsize=1)
def probe_strip_plan() -> tuple[bool, str]:
    """(whether a one-matmul network with a refittable weight builds weight-stripped here, why not)."""
    import numpy as np
    logger = trt.Logger(trt.Logger.INTERNAL_ERROR)
    builder = trt.Builder(logger)
    creation = trt.NetworkDefinitionCreationFlag
    network = builder.create_network(1 << int(creation.STRONGLY_TYPED) if hasattr(creation, "STRONGLY_TYPED") else 0)
    x = network.add_input("x", trt.float32, (-1, 16))
    arr = np.ones((16, 16), np.float32)
    weights = trt.Weights(arr)
    const = network.add_constant((16, 16), weights)
    network.set_weights_name(weights, "w")
    network.mark_weights_refittable("w")
    mm = network.add_matrix_multiply(x, trt.MatrixOperation.NONE, const.get_output(0), trt.MatrixOperation.NONE)
    network.mark_output(mm.get_output(0))
    config = builder.create_builder_config()
    _strip_flags(config)
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 16), (1, 16), (2, 16))
    config.add_optimization_profile(profile)
    with _quiet_stderr():  # the failing compiler prints its CUDA check to fd 2 itself
        serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        return False, "a STRIP_PLAN/REFIT build fails here: its compiler needs a CUDA device"
    return True, ""


@contextlib.contextmanager
def _quiet_stderr():
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def build_serialized(recorder, profiles: Sequence[Mapping[str, Sequence]], workspace_bytes: int | None = None,
                     config_hook: Callable | None = None):
    """Build ``recorder.network`` into a serialized engine.

    ``profiles``: one dict per optimization profile, input name -> (min, opt, max) shapes; every
    network input must have a range in every profile. ``config_hook(config)`` may adjust the
    builder config (flags, tactic sources) before the build. Raises :class:`BuildError` on failure.
    """
    network, builder = recorder.network, recorder.builder
    if not profiles:
        raise BuildError("building an engine needs at least one optimization profile")
    config = builder.create_builder_config()
    if workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    names = [network.get_input(i).name for i in range(network.num_inputs)]
    for n, spec in enumerate(profiles):
        missing = [name for name in names if name not in spec]
        unknown = [name for name in spec if name not in names]
        if missing or unknown:
            raise BuildError(f"optimization profile {n}: no shapes for inputs {missing}; unknown inputs {unknown}")
        profile = builder.create_optimization_profile()
        for name in names:
            lo, opt, hi = (tuple(int(d) for d in dims) for dims in spec[name])
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    if config_hook is not None:
        config_hook(config)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BuildError(f"TensorRT ({FLAVOUR}) could not build network {network.name!r} "
                         f"({network.num_layers} layers); its log above says why")
    return serialized
