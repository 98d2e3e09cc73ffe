"""The ensemble's tensors, one table: names, types and shapes as the TensorRT-LLM backend's ensemble
declares them (``all_models/inflight_batcher_llm/ensemble``), so its stock clients work unchanged.

``fill_model_repo`` writes the ``input``/``output`` lists and the ensemble's maps of the four model
configs from these tables; the models read their own config for the pass-through outputs. Inputs go
to ``preprocessing`` (text) or ``speculative`` (everything else, which it implements or refuses by
name); outputs other than the text come from ``speculative`` and pass through ``postprocessing``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str                 # Triton TYPE_* without the prefix
    dims: tuple = (1,)
    optional: bool = True
    ragged: bool = False       # allow_ragged_batch

    def pbtxt(self, name: str | None = None) -> str:
        dims = ", ".join(str(d) for d in self.dims)
        extra = (" optional: true" if self.optional else "") + (" allow_ragged_batch: true" if self.ragged else "")
        return f'  {{ name: "{name or self.name}" data_type: TYPE_{self.dtype} dims: [ {dims} ]{extra} }}'


# preprocessing's inputs: ensemble name -> preprocessing name
TEXT_INPUTS = {
    "text_input": ("QUERY", Tensor("text_input", "STRING", optional=False)),
    "max_tokens": ("REQUEST_OUTPUT_LEN", Tensor("max_tokens", "INT32", optional=False)),
    "bad_words": ("BAD_WORDS_DICT", Tensor("bad_words", "STRING", (-1,))),
    "stop_words": ("STOP_WORDS_DICT", Tensor("stop_words", "STRING", (-1,))),
    # vLLM's: false tokenizes the prompt without the tokenizer's special tokens (a rendered chat
    # template writes its own BOS; a second would precede it)
    "add_special_tokens": ("ADD_SPECIAL_TOKENS", Tensor("add_special_tokens", "BOOL")),
}

# the speculative model's request inputs, in the TensorRT-LLM ensemble's order (num_draft_tokens is
# that backend's tensorrt_llm-model input, exposed here as the per-request K; return_acceptance is
# nemospec's: the request's acceptance counts in every streamed response, not only the last), then
# the older names of two of them
REQUEST_INPUTS = (
    Tensor("decoder_text_input", "STRING"),
    Tensor("num_return_sequences", "INT32"),
    Tensor("exclude_input_in_output", "BOOL"),
    Tensor("end_id", "INT32"),
    Tensor("pad_id", "INT32"),
    Tensor("top_k", "INT32"),
    Tensor("top_p", "FP32"),
    Tensor("temperature", "FP32"),
    Tensor("length_penalty", "FP32"),
    Tensor("repetition_penalty", "FP32"),
    Tensor("min_tokens", "INT32"),
    Tensor("presence_penalty", "FP32"),
    Tensor("frequency_penalty", "FP32"),
    Tensor("prompt_ignore_length", "INT32"),
    Tensor("seed", "UINT64"),
    Tensor("return_log_probs", "BOOL"),
    Tensor("return_context_logits", "BOOL"),
    Tensor("return_generation_logits", "BOOL"),
    Tensor("return_perf_metrics", "BOOL"),
    Tensor("return_num_input_tokens", "BOOL"),
    Tensor("return_num_output_tokens", "BOOL"),
    Tensor("beam_width", "INT32"),
    Tensor("stream", "BOOL"),
    Tensor("prompt_embedding_table", "FP16", (-1, -1)),
    Tensor("prompt_table_extra_id", "UINT64"),
    Tensor("prompt_vocab_size", "INT32"),
    Tensor("embedding_bias_words", "STRING", (-1,)),
    Tensor("embedding_bias_weights", "FP32", (-1,)),
    Tensor("lora_task_id", "UINT64"),
    Tensor("lora_weights", "FP16", (-1, -1), ragged=True),
    Tensor("lora_config", "INT32", (-1, 3), ragged=True),
    Tensor("guided_decoding_guide_type", "STRING", ragged=True),
    Tensor("guided_decoding_guide", "STRING", ragged=True),
    Tensor("num_draft_tokens", "INT32"),
    Tensor("return_acceptance", "BOOL"),
    # nemospec's: with return_log_probs, each token's this many most probable tokens (0..20)
    Tensor("top_log_probs", "INT32"),
    # the backend's names before May 2025 (``seed``, ``min_tokens`` since): clients of either work
    Tensor("random_seed", "UINT64"),
    Tensor("min_length", "INT32"),
)

#: a newer input name -> the older one it stands for (``serving.request_fields`` reads either)
RENAMED = {"seed": "random_seed", "min_tokens": "min_length"}

# outputs of speculative that postprocessing passes through unchanged (text_output is made there)
PASS_OUTPUTS = (
    Tensor("output_ids", "INT32", (-1,), optional=False),
    Tensor("cum_log_probs", "FP32", (-1,), optional=False),
    Tensor("output_log_probs", "FP32", (-1, -1), optional=False),
    Tensor("batch_index", "INT32", optional=False),
    Tensor("sequence_index", "INT32", optional=False),
    Tensor("kv_cache_alloc_new_blocks", "INT32", optional=False),
    Tensor("kv_cache_reused_blocks", "INT32", optional=False),
    Tensor("kv_cache_alloc_total_blocks", "INT32", optional=False),
    Tensor("arrival_time_ns", "INT64", optional=False),
    Tensor("first_scheduled_time_ns", "INT64", optional=False),
    Tensor("first_token_time_ns", "INT64", optional=False),
    Tensor("last_token_time_ns", "INT64", optional=False),
    Tensor("acceptance_rate", "FP32", optional=False),
    Tensor("total_accepted_draft_tokens", "INT32", optional=False),
    Tensor("total_draft_tokens", "INT32", optional=False),
    # with return_num_input_tokens / return_num_output_tokens: the prompt's tokens, and the output
    # ids this response carries (as the backend counts them)
    Tensor("num_input_tokens", "INT32", optional=False),
    Tensor("num_output_tokens", "INT32", optional=False),
    # with top_log_probs N: each output token's N most probable tokens [1, tokens, N] and their log probs
    Tensor("output_top_ids", "INT32", (-1, -1), optional=False),
    Tensor("output_top_log_probs", "FP32", (-1, -1), optional=False),
    # nemospec's own: the request's verify steps by drafts kept (vLLM's acceptance_histogram), tokens
    # gained per verify, and why it ended ("length", "stop", "" while streaming)
    Tensor("acceptance_histogram", "INT32", (-1,), optional=False),
    Tensor("mean_accepted_tokens", "FP32", optional=False),
    Tensor("finish_reason", "STRING", optional=False),
    # the request's key (serving.cancel): the OpenAI frontend reports a request it ended at a stop
    # string, which it matches on the text, as complete rather than cancelled
    Tensor("request_key", "INT64", optional=False),
)


def _lines(tensors, rename=lambda t: t.name) -> str:
    return ",\n".join(t.pbtxt(rename(t)) for t in tensors)


def template_fields() -> dict:
    """The generated parts of the four config.pbtxt templates."""
    text = [t for _, t in TEXT_INPUTS.values()]
    pass_in = lambda t: f"PASS_{t.name}"  # noqa: E731
    pass_out = lambda t: f"OUT_{t.name}"  # noqa: E731
    output_text = Tensor("text_output", "STRING", (-1,), optional=False)
    return {
        "ensemble_inputs": _lines(text + list(REQUEST_INPUTS)),
        "ensemble_outputs": _lines([output_text] + list(PASS_OUTPUTS)),
        "preprocessing_map": "\n".join(f'      input_map {{ key: "{key}" value: "{name}" }}'
                                       for name, (key, _) in TEXT_INPUTS.items()),
        "speculative_request_inputs": _lines(REQUEST_INPUTS),
        "speculative_request_map": "\n".join(f'      input_map {{ key: "{t.name}" value: "{t.name}" }}'
                                             for t in REQUEST_INPUTS),
        "speculative_pass_outputs": _lines(PASS_OUTPUTS),
        "speculative_pass_map": "\n".join(f'      output_map {{ key: "{t.name}" value: "_{t.name}" }}'
                                          for t in PASS_OUTPUTS),
        "postprocessing_pass_inputs": _lines([Tensor(t.name, t.dtype, t.dims) for t in PASS_OUTPUTS], pass_in),
        "postprocessing_pass_outputs": _lines(PASS_OUTPUTS, pass_out),
        "postprocessing_pass_map": "\n".join(
            f'      input_map {{ key: "PASS_{t.name}" value: "_{t.name}" }}\n'
            f'      output_map {{ key: "OUT_{t.name}" value: "{t.name}" }}' for t in PASS_OUTPUTS),
    }
