"""Symbolic lowering of the op surface: each op records native layers into a TensorRT network.

``builder.functional`` dispatches on ``tensor.backend``; a :class:`SymbolicTensor` recorded by a
:class:`NetworkRecorder` answers with this module, whose op functions have the names and signatures
of ``torch_backend`` (the spec of every op's semantics). The lowerings live by kind: the dense ops and
MoE in ``trt_dense``, the sequence mixers (conv, SSM, KV cache, attention, rope) in ``trt_mixers``,
the plugin ops in ``trt_plugin_ops``; the recorder in ``trt_recorder`` (with its layer vocabulary in
``trt_layers``); the token-tree ops in ``trt_tree`` (``builder.functional`` dispatches those itself).

Every op lowers to native layers only (no plugins, no loops) unless its plugin module lowers it, with
all batch/time/cache/gather dims dynamic: shapes that depend on them are computed in the network
(shape layers, fill, shape arithmetic), never in Python.
"""
from __future__ import annotations

import sys

from builder.backends.trt_dense import (activation, clamp, concat, embedding, gated_rms_norm, gather_rows, linear,
                                        linear_nvfp4, mamba_dt, mask_padding, moe, permute, reshape, rms_norm,
                                        split, to_float32, where)
from builder.backends.trt_mixers import (attention, causal_conv1d, conv_window, kv_cache_update, rope, ssm_scan,
                                         ssm_state)
from builder.backends.trt_plugin_ops import capture_buffer, fp4_markov_head, hidden_capture
from builder.backends.trt_recorder import Recorder

__all__ = [
    "NetworkRecorder",
    # the op surface (same names and signatures as torch_backend)
    "linear", "embedding", "rms_norm", "gated_rms_norm", "activation", "clamp", "to_float32", "split",
    "concat", "reshape", "permute", "gather_rows", "mask_padding", "conv_window", "causal_conv1d", "mamba_dt", "ssm_scan",
    "ssm_state", "kv_cache_update", "attention", "moe", "capture_buffer", "hidden_capture", "rope", "where",
    "linear_nvfp4", "fp4_markov_head",
]


class NetworkRecorder(Recorder):
    """A :class:`~builder.backends.trt_recorder.Recorder` whose symbolic tensors lower their ops
    through this module: what networks are recorded with."""

    backend = sys.modules[__name__]
