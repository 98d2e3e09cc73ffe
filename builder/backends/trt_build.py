"""Building a recorded network into a serialized engine (optimization profiles, builder config)."""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

from builder.backends.trt_import import FLAVOUR, trt
from builder.errors import BuildError


def build_engine_bytes(recorder, profiles: Sequence[Mapping[str, Sequence]], workspace_bytes: int | None = None,
                       config_hook: Callable | None = None) -> bytes:
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
    return bytes(memoryview(serialized))
