"""The speculative model's request tensors read field by field (serving.request_fields), without a
server: the TensorRT-LLM backend's current and older input names, its defaults and neutral values."""
import numpy as np
import pytest

from serving.request_fields import BadInput, parse
from serving.tensors import RENAMED, REQUEST_INPUTS

VOCAB = 100


def _parse(**fields):
    inputs = {"input_ids": np.array([[5, 6, 7]], dtype=np.int32), "max_tokens": np.array([[8]], dtype=np.int32)}
    inputs.update({k: np.array([[v]]) if not isinstance(v, np.ndarray) else v for k, v in fields.items()})
    return parse(inputs, {}, vocab=VOCAB, default_end=frozenset([2]), max_draft_len=4)


def test_each_renamed_input_is_declared_under_both_names():
    declared = {t.name for t in REQUEST_INPUTS}
    assert all(new in declared and old in declared for new, old in RENAMED.items())


@pytest.mark.parametrize("new,old,field", [("seed", "random_seed", "seed"), ("min_tokens", "min_length", "min_length")])
def test_the_backends_current_and_older_names_read_alike(new, old, field):
    assert _parse(**{new: 7})[0][field] == _parse(**{old: 7})[0][field] == 7
    assert _parse(**{new: 7, old: 7})[0][field] == 7
    with pytest.raises(BadInput, match=f"{new}: given beside {old} .* another value"):
        _parse(**{new: 7, old: 8})


def test_an_unseeded_request_takes_the_backends_seed_0():
    """TensorRT-LLM reads a missing seed as 0, so the same sampled request gives the same sample."""
    assert _parse(top_k=40)[0]["seed"] == 0
    assert _parse(top_k=40, seed=np.array([[2**64 - 1]], dtype=np.uint64))[0]["seed"] == 2**64 - 1


def test_token_count_outputs_are_asked_for_by_name():
    options = _parse(return_num_input_tokens=True)[1]
    assert options.return_num_input_tokens and not options.return_num_output_tokens
    assert _parse(return_num_output_tokens=True)[1].return_num_output_tokens


@pytest.mark.parametrize("fields", [
    {"beam_width": 0}, {"num_return_sequences": 0}, {"beam_width": 1},
    {"embedding_bias_words": np.array([[b""]], dtype=object), "embedding_bias_weights": np.array([[0.0]], dtype=np.float32)},
    {"embedding_bias_words": np.zeros((1, 0), dtype=object), "embedding_bias_weights": np.zeros((1, 0), dtype=np.float32)},
    {"embedding_bias_words": np.array([[b"x", b"y"]], dtype=object), "embedding_bias_weights": np.zeros((1, 2), np.float32)},
    {"length_penalty": np.array([[0.0]], np.float32)}, {"length_penalty": np.array([[1.0]], np.float32)},
])
def test_neutral_values_of_unsupported_features_are_accepted(fields):
    """The backend reads a beam width or sequence count of 0 as 1; a bias of no words or 0 weights
    biases nothing (words weighted 0 were refused); a length penalty acts in beam search only, and
    TensorRT-LLM's default is 0 (refused before)."""
    _parse(**fields)


@pytest.mark.parametrize("fields,needle", [
    ({"beam_width": 2}, "beam_width: beam search is not supported"),
    ({"embedding_bias_weights": np.array([[0.0, 1.5]], dtype=np.float32)}, "embedding_bias_weights: embedding bias"),
    ({"embedding_bias_words": np.array([[b"x"]], dtype=object)}, "embedding_bias_words: embedding bias"),
    ({"embedding_bias_words": np.array([[b"x"]], dtype=object), "embedding_bias_weights": np.array([[2.0]], np.float32)},
     "embedding_bias_words: embedding bias"),
    ({"length_penalty": np.array([[2.0]], np.float32)}, "length_penalty: length penalty"),
])
def test_unsupported_features_are_refused_by_name(fields, needle):
    with pytest.raises(BadInput, match=needle):
        _parse(**fields)


def test_a_direct_request_without_its_ids_names_them():
    """The speculative model called directly (as the backend's tensorrt_llm model is) without input_ids."""
    with pytest.raises(BadInput, match="input_ids: required"):
        parse({"max_tokens": np.array([[4]], dtype=np.int32)}, {}, vocab=VOCAB, default_end=frozenset(), max_draft_len=4)
    with pytest.raises(BadInput, match="max_tokens: required"):
        parse({"input_ids": np.array([[4]], dtype=np.int32)}, {}, vocab=VOCAB, default_end=frozenset(), max_draft_len=4)


def test_top_log_probs_need_return_log_probs_and_stay_within_the_schedulers_limit():
    from runtime.scheduler import MAX_TOP_LOGPROBS
    from serving.openai import protocol
    from serving import request_fields
    assert request_fields.MAX_TOP_LOGPROBS == protocol.MAX_TOP_LOGPROBS == MAX_TOP_LOGPROBS
    fields, options = _parse(return_log_probs=True, top_log_probs=np.array([[3]], np.int32))
    assert fields["top_logprobs"] == options.top_log_probs == 3
    with pytest.raises(BadInput, match="top_log_probs: needs return_log_probs"):
        _parse(top_log_probs=np.array([[3]], np.int32))
    with pytest.raises(BadInput, match=f"top_log_probs: expected 0..{MAX_TOP_LOGPROBS}"):
        _parse(return_log_probs=True, top_log_probs=np.array([[MAX_TOP_LOGPROBS + 1]], np.int32))


def test_prompt_ignore_length_reaches_the_request_and_is_checked():
    """TensorRT-LLM's prompt_ignore_length (the first prompt tokens presence and frequency leave out)."""
    assert _parse()[0]["prompt_ignore_length"] == 0
    assert _parse(prompt_ignore_length=np.array([[3]], dtype=np.int32))[0]["prompt_ignore_length"] == 3
    with pytest.raises(BadInput, match=r"prompt_ignore_length: expected a count in 0..2\^30"):
        _parse(prompt_ignore_length=np.array([[-1]], dtype=np.int32))
