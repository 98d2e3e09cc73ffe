"""The TensorRT flavour this process uses: full ``tensorrt`` when importable, else ``tensorrt_rtx``.

Full TensorRT (data-centre GPUs, plugin layers) cannot be installed on CPU-only machines; the
``tensorrt_rtx`` wheel builds engines ahead of time with no GPU. Both expose the same network API for
the native layers our lowerings use.
"""
from __future__ import annotations

try:  # pragma: no cover - depends on the machine
    import tensorrt as trt  # type: ignore[import-not-found]

    FLAVOUR = "tensorrt"
except ImportError:  # pragma: no cover - the usual case on CPU-only machines
    import tensorrt_rtx as trt  # type: ignore[import-not-found,no-redef]

    FLAVOUR = "tensorrt_rtx"

VERSION: str = getattr(trt, "__version__", "unknown")

#: whether networks of this flavour accept custom plugin layers (``INetworkDefinition.add_plugin_v3``)
HAS_PLUGIN_LAYERS: bool = hasattr(trt.INetworkDefinition, "add_plugin_v3")

__all__ = ["trt", "FLAVOUR", "VERSION", "HAS_PLUGIN_LAYERS"]
