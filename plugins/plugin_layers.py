"""When a plugin op gets a real TensorRT plugin layer, and when it lowers to native layers."""
from __future__ import annotations

import importlib.util
import os

NATIVE_ENV = "NEMOSPEC_NATIVE_PLUGINS"  # =1: native layers even where plugin layers exist


def plugin_layers_available(network) -> bool:
    """Whether ``network`` (an INetworkDefinition) accepts our plugin layers: full TensorRT with the
    V3 plugin layer API and its Python plugin package ``tensorrt.plugin``; not tensorrt_rtx."""
    if not (hasattr(network, "add_plugin_v3") and hasattr(network, "add_plugin")):
        return False
    try:
        return importlib.util.find_spec("tensorrt.plugin") is not None
    except (ImportError, ValueError):
        return False


def native_requested(recorder) -> bool:
    """The recorder (e.g. for the CPU interpreter) or the environment asks for native layers."""
    if getattr(recorder, "native_plugins", False):
        return True
    return os.environ.get(NATIVE_ENV, "").lower() in ("1", "true", "yes", "on")
