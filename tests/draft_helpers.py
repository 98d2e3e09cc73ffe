"""Shared by the draft tests: the one-line bad-input check, and a feature draft recorded into a network."""
from __future__ import annotations

import pytest
import torch

from builder.errors import DraftError, NemospecError


def draft_error(fn, *args) -> str:
    """``fn(*args)`` raises a one-line DraftError (exit 2); returns its message."""
    with pytest.raises(DraftError) as info:
        fn(*args)
    message = str(info.value)
    assert isinstance(info.value, NemospecError) and "\n" not in message
    return message


def record_draft(module):
    """An EAGLE / EAGLE-3 draft's forward recorded into a TensorRT network (dynamic batch, rows, cache)."""
    from builder.backends.trt_backend import NetworkRecorder
    rec = NetworkRecorder()
    int32 = torch.int32
    feeds = {n: rec.add_input(n, int32, s) for n, s in
             [("input_ids", (-1, -1)), ("positions", (-1, -1)), ("lengths", (-1,)), ("logit_index", (-1, -1))]}
    state = {n: rec.add_input("past." + n, d, (-1, -1) + tuple(s[2:]))
             for n, (s, d) in module.state_spec(1, 1).items()}
    if module.kind == "eagle3":
        aux = rec.add_input("aux", module.dtype, (-1, -1, module.aux_width))
        hidden = rec.add_input("hidden", module.dtype, (-1, -1, module.hidden_size))
        from_target = rec.add_input("from_target", int32, (-1, -1))
        logits, out, new_state = module.forward(feeds["input_ids"], aux, hidden, from_target, feeds["positions"],
                                                feeds["lengths"], feeds["logit_index"], state)
    else:
        hidden = rec.add_input("hidden", module.dtype, (-1, -1, module.hidden_size))
        logits, out, new_state = module.forward(feeds["input_ids"], hidden, feeds["positions"], feeds["lengths"],
                                                feeds["logit_index"], state)
    rec.mark_output("logits", logits)
    rec.mark_output("hidden_out", out)
    for n, t in new_state.items():
        rec.mark_output("present." + n, t)
    return rec


def record_block_draft(module):
    """A DFlash / DSpark draft's forward (context + block, and the Markov step) recorded into a network."""
    from builder.backends.trt_backend import NetworkRecorder
    I32 = torch.int32
    rec = NetworkRecorder()
    inp = {n: rec.add_input(n, I32, s) for n, s in [("context_positions", (-1, -1)), ("context_lengths", (-1,)),
                                                    ("input_ids", (-1, -1)), ("positions", (-1, -1)),
                                                    ("lengths", (-1,)), ("logit_index", (-1, -1))]}
    aux = rec.add_input("aux", module.dtype, (-1, -1, module.aux_width))
    state = {n: rec.add_input("past." + n, d, (-1, -1) + tuple(s[2:])) for n, (s, d) in module.state_spec(1, 1).items()}
    logits, new_state = module.forward(aux, inp["context_positions"], inp["context_lengths"], inp["input_ids"],
                                       inp["positions"], inp["lengths"], inp["logit_index"], state)
    rec.mark_output("logits", logits)
    for n, t in new_state.items():
        rec.mark_output("present." + n, t)
    if module.kind == "dspark":  # the Markov step of the loop, as its own output
        prev = rec.add_input("prev_ids", I32, (-1, -1))
        rec.mark_output("markov_logits", module.markov_logits(logits, prev))
    return rec


def dynamic_profile(rec) -> dict:
    """An optimization profile for a recorded draft network: batch 1..4, rows 1..64, cache 1..256."""
    profile = {}
    for i in range(rec.network.num_inputs):
        t = rec.network.get_input(i)
        tail = tuple(t.shape[2:])
        if t.name in ("lengths", "context_lengths"):
            profile[t.name] = [(1,), (2,), (4,)]
        elif t.name.startswith("past."):
            profile[t.name] = [(1, 1) + tail, (2, 64) + tail, (4, 256) + tail]
        else:
            profile[t.name] = [(1, 1) + tail, (2, 8) + tail, (4, 64) + tail]
    return profile
