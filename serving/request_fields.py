"""The speculative model's request tensors -> a scheduler Request, field by field.

Every input of the TensorRT-LLM backend's ensemble is accepted by name (``serving.tensors``): those
a speculative NemotronH server implements are read; the others (beam search, several sequences,
prompt tables, embedding bias, LoRA, guided decoding, logits outputs, encoder input) are accepted at
their neutral value and refused with an error naming the field otherwise. Kept free of Triton so
tests reach it directly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20   # runtime.scheduler.MAX_TOP_LOGPROBS (tested equal): kept free of the runtime here


class BadInput(ValueError):
    """One line naming the field and what was expected."""


@dataclass
class Options:
    """What the response needs beyond the scheduler's request."""
    stream: bool = False
    exclude_input_in_output: bool = False   # the TensorRT-LLM backend's default: prompt + completion
    return_log_probs: bool = False
    return_perf_metrics: bool = False
    return_acceptance: bool = False          # the acceptance counts in every streamed response
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    top_log_probs: int = 0                   # alternatives per token (output_top_ids / output_top_log_probs)


# (field, what it does, the neutral values accepted)
NEUTRAL = {   # (the backend reads a 0 beam width or sequence count as 1)
    "beam_width": ("beam search", (1, 0)),
    "num_return_sequences": ("several sequences per request", (1, 0)),
    "length_penalty": ("length penalty (beam search only)", (1.0, 0.0)),   # 0: TensorRT-LLM's default
    "return_context_logits": ("context logits outputs", (False,)),
    "return_generation_logits": ("generation logits outputs", (False,)),
    "prompt_vocab_size": ("prompt tuning", (0,)),
    "prompt_table_extra_id": ("prompt tuning", (0,)),
    "lora_task_id": ("LoRA", (0,)),
}
ABSENT = {  # accepted only when absent or empty (bias weights: or all 0, which bias nothing)
    "decoder_text_input": "encoder-decoder input",
    "prompt_embedding_table": "prompt tuning",
    "embedding_bias_words": "embedding bias",
    "embedding_bias_weights": "embedding bias",
    "lora_weights": "LoRA",
    "lora_config": "LoRA",
    "guided_decoding_guide_type": "guided decoding",
    "guided_decoding_guide": "guided decoding",
}


def _scalar(inputs, name, default=None):
    array = inputs.get(name)
    if array is None:
        return default
    array = np.asarray(array)
    if array.size != 1:
        raise BadInput(f"{name}: expected one value, got {array.size}")
    value = array.reshape(-1)[0]
    return value.item() if hasattr(value, "item") else value


FP32_1E_6 = float(np.float32(1e-6))   # the FP32 input's 1e-6 (just under it), so 1e-6 itself passes


def _number(inputs, name, default, *, integer=False, low=None, high=None, what=""):
    value = _scalar(inputs, name, default)
    if value is None:
        return None
    if isinstance(value, (bytes, str)):
        raise BadInput(f"{name}: expected a number, got {value!r}")
    value = int(value) if integer else float(value)
    if not math.isfinite(value) or (low is not None and value < low) or (high is not None and value > high):
        raise BadInput(f"{name}: expected {what or f'a value in [{low}, {high}]'}, got {value}")
    return value


def _flag(inputs, name, default=False) -> bool:
    value = _scalar(inputs, name, default)
    if isinstance(value, (bool, np.bool_)) or value in (0, 1):
        return bool(value)
    raise BadInput(f"{name}: expected true or false, got {value!r}")


def _empty(array, zeros: bool = False) -> bool:
    """No value, only empty strings, or (``zeros``) only zeros."""
    array = np.asarray(array)
    if array.size == 0:
        return True
    if array.dtype == object:
        return all((v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)) == "" for v in array.reshape(-1))
    return zeros and not array.any()


def check_unsupported(inputs) -> None:
    for name, (what, neutral) in NEUTRAL.items():
        value = _scalar(inputs, name)
        if value is not None and value not in neutral:
            raise BadInput(f"{name}: {what} is not supported by nemospec; expected {neutral[0]}, got {value!r}")
    zero_bias = "embedding_bias_weights" in inputs and _empty(inputs["embedding_bias_weights"], zeros=True)
    for name, what in ABSENT.items():
        if name == "embedding_bias_words" and zero_bias:   # words weighted 0 bias nothing
            continue
        if name in inputs and not _empty(inputs[name], zeros=name == "embedding_bias_weights"):
            raise BadInput(f"{name}: {what} is not supported by nemospec; leave it out")


def _either(inputs, name: str, older: str) -> str:
    """Which of a field's two names (``serving.tensors.RENAMED``) the request used; both only with
    the same value."""
    if name in inputs and older in inputs:
        if _scalar(inputs, name) != _scalar(inputs, older):
            raise BadInput(f"{name}: given beside {older} (its older name) with another value; send one")
    return name if name in inputs else older


def parse(inputs: dict, parameters: dict, *, vocab: int, default_end, max_draft_len: int):
    """inputs: request tensor name -> array (absent ones missing) -> (Request fields, Options)."""
    check_unsupported(inputs)
    for required in ("input_ids", "max_tokens"):
        if required not in inputs:
            raise BadInput(f"{required}: required (the ensemble makes input_ids from text_input)")
    ids = np.asarray(inputs["input_ids"])
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise BadInput(f"text_input: expected one prompt per request row, got shape {list(ids.shape)}")
    end_id = _number(inputs, "end_id", None, integer=True, low=-1, high=vocab - 1,
                     what=f"a token id below the vocabulary size {vocab} (or -1 for none)")
    _number(inputs, "pad_id", 0, integer=True, low=-1, high=vocab - 1, what=f"a token id below {vocab}")
    # TensorRT-LLM's default seed is 0: an unseeded sampled request samples the same way every time
    seed = _scalar(inputs, _either(inputs, "seed", "random_seed"), 0)
    speculative = parameters.get("speculative", True)
    if isinstance(speculative, str) and speculative.lower() in ("true", "false"):
        speculative = speculative.lower() == "true"
    if not isinstance(speculative, bool):
        raise BadInput(f"speculative: expected true or false, got {speculative!r}")
    fields = dict(
        prompt_ids=[int(t) for t in ids[0]],
        max_new_tokens=int(_scalar(inputs, "max_tokens")),
        temperature=_number(inputs, "temperature", 1.0, low=0.0, what="a finite number >= 0"),
        top_p=_number(inputs, "top_p", 0.0, low=0.0, high=1.0, what="a value in [0, 1] (0: no nucleus cut)"),
        top_k=_number(inputs, "top_k", 0, integer=True, low=0, high=vocab, what=f"0..{vocab} (0: no cut)"),
        min_length=_number(inputs, _either(inputs, "min_tokens", "min_length"), 0, integer=True, low=0, high=1 << 30,
                           what="a count in 0..2^30"),
        repetition_penalty=_number(inputs, "repetition_penalty", 1.0, low=FP32_1E_6, high=1e6,
                                   what="a number in [1e-6, 1e6] (1: none)"),
        presence_penalty=_number(inputs, "presence_penalty", 0.0, low=-1e6, high=1e6, what="a number in [-1e6, 1e6]"),
        frequency_penalty=_number(inputs, "frequency_penalty", 0.0, low=-1e6, high=1e6, what="a number in [-1e6, 1e6]"),
        prompt_ignore_length=_number(inputs, "prompt_ignore_length", 0, integer=True, low=0, high=1 << 30,
                                     what="a count in 0..2^30"),
        seed=int(seed),
        end_ids=default_end if end_id is None else frozenset() if end_id < 0 else frozenset([end_id]),
        speculative=speculative,
        logprobs=_flag(inputs, "return_log_probs"),
        top_logprobs=_number(inputs, "top_log_probs", 0, integer=True, low=0, high=MAX_TOP_LOGPROBS,
                             what=f"0..{MAX_TOP_LOGPROBS} alternatives per token"),
        max_draft=_number(inputs, "num_draft_tokens", None, integer=True, low=0, high=max_draft_len,
                          what=f"0..{max_draft_len} (the engine's max_draft_len)"),
    )
    if fields["top_logprobs"] and not fields["logprobs"]:
        raise BadInput("top_log_probs: needs return_log_probs true")
    # TensorRT-LLM's rule (its defaults: temperature 1, top_k 0, top_p 0): a request samples only
    # with top_k > 1 or top_p > 0; with neither it is greedy at any temperature
    if fields["top_k"] <= 1 and fields["top_p"] == 0:
        fields["temperature"] = 0.0
    if fields["top_p"] == 0:
        fields["top_p"] = 1.0     # no nucleus cut (the runtime's value for it)
    options = Options(stream=_flag(inputs, "stream"), exclude_input_in_output=_flag(inputs, "exclude_input_in_output"),
                      return_log_probs=fields["logprobs"], return_perf_metrics=_flag(inputs, "return_perf_metrics"),
                      return_acceptance=_flag(inputs, "return_acceptance"),
                      return_num_input_tokens=_flag(inputs, "return_num_input_tokens"),
                      return_num_output_tokens=_flag(inputs, "return_num_output_tokens"),
                      top_log_probs=fields["top_logprobs"])
    return fields, options
