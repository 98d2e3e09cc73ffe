"""TensorRT lowerings of the ops that are plugins (``plugins/``): the hidden-state capture of EAGLE-3
style drafts (``hidden_capture``, and ``capture_buffer``, the zero buffer it writes into, in native
layers) and DSpark's FP4 Markov head (``fp4_markov_head``). The plugin module records each one's
layers: a plugin layer where the TensorRT flavour has plugin layers, native layers otherwise
(``r.lowerings`` says which).
"""
from __future__ import annotations

import torch

from builder.backends.trt_dtypes import torch_dtype
from builder.backends.trt_import import trt
from builder.backends.trt_recorder import _recorder
from builder.errors import BuildError
from plugins import fp4_markov_head as _markov_head_plugin
from plugins import hidden_capture as _hidden_capture_plugin


def capture_buffer(x, n_slots):
    r = _recorder(x)
    with r.op("capture_buffer", "native: fill zeros [..., n_slots*H] (fp32 fill, cast)"):
        t = r.itensor(x)
        if t.shape[-1] < 0:
            raise BuildError("capture_buffer: the hidden size (last dim) must be static")
        dims = [r.dim(t, i) for i in range(r.rank(t) - 1)] + [int(n_slots) * t.shape[-1]]
        return r.wrap(r.cast(r.zeros(dims, torch.float32, "zeros"), torch_dtype(t.dtype), "cast"))


def hidden_capture(residual, delta, buffer, slot):
    """Lowered by the plugin module: a plugin layer where TensorRT has plugin layers, else native
    layers; ``r.lowerings["hidden_capture"]`` says which."""
    r = _recorder(residual, delta, buffer)
    res, buf = r.itensor(residual, "residual"), r.itensor(buffer, "buffer")
    d = None if delta is None else r.itensor(delta, "delta")
    try:
        x, b = _hidden_capture_plugin.lower(r, trt, res, d, buf, int(slot))
    except (TypeError, ValueError) as exc:
        raise BuildError(str(exc)) from exc
    return r.wrap(x), r.wrap(b)


def fp4_markov_head(logits, prev_ids, w1, w2_packed, w2_scale, w2_scale_2):
    """Lowered by the plugin module: a plugin layer where TensorRT has plugin layers, else native
    layers (gather + FP4 block dequantize + matmul + add); ``r.lowerings["fp4_markov_head"]`` says which."""
    r = _recorder(logits, prev_ids)
    lg, ids = r.itensor(logits, "logits"), r.itensor(prev_ids, "prev_ids")
    try:
        out = _markov_head_plugin.lower(r, trt, lg, ids, w1, w2_packed, w2_scale, w2_scale_2)
    except (TypeError, ValueError) as exc:
        raise BuildError(str(exc)) from exc
    return r.wrap(out)
