"""The TensorRT-LLM backend's clients, unchanged: a client written the way that backend's stock
`end_to_end_grpc_client.py` is (our own code): one gRPC stream per request, the inputs it sends
(beam_width, num_return_sequences, exclude_input_in_output, return_log_probs, return_perf_metrics,
penalties, ...) and the outputs it asks for (text_output, log probs, batch/sequence index and every
perf metric)."""
import queue

import numpy as np
import pytest

from serving import launch, tensors
from serving_helpers import NEEDS_TRITON, engine_dir, free_ports, offline, tokenizer  # noqa: F401 (fixtures)

pytestmark = NEEDS_TRITON

PERF = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns",
        "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns", "acceptance_rate",
        "total_accepted_draft_tokens", "total_draft_tokens")


@pytest.fixture(scope="module")
def server(engine_dir):  # noqa: F811
    handle = launch.start_server(engine_dir, **free_ports(), ready_timeout=300)
    try:
        yield handle
    finally:
        handle.stop()


def prepare_inputs(prompt, output_len, streaming, **optional):
    """The stock client's request: always these five, the rest when given."""
    inputs = {"text_input": np.array([[prompt]]).astype(object),
              "max_tokens": np.ones((1, 1), np.int32) * output_len,
              "stream": np.array([[streaming]], dtype=bool),
              "beam_width": np.array([[1]], dtype=np.int32),
              "temperature": np.array([[0.0]], dtype=np.float32),
              "num_return_sequences": np.array([[1]], dtype=np.int32)}
    for name, value in optional.items():
        inputs[name] = value
    return inputs


def run_inference(server, inputs, outputs):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype
    client = grpcclient.InferenceServerClient(server.grpc_url)
    completed = queue.Queue()
    client.start_stream(callback=lambda result, error: completed.put(error or result))
    tensors_in = []
    for name, value in inputs.items():
        t = grpcclient.InferInput(name, value.shape, np_to_triton_dtype(value.dtype))
        t.set_data_from_numpy(value)
        tensors_in.append(t)
    client.async_stream_infer("ensemble", tensors_in, outputs=[grpcclient.InferRequestedOutput(o) for o in outputs],
                              request_id="1")
    client.stop_stream()                                  # waits for the server to close the stream
    results = []
    while not completed.empty():
        results.append(completed.get())
    client.close()
    return results


def test_the_ensemble_declares_every_input_of_the_trtllm_ensemble(server):
    import tritonclient.grpc as grpcclient
    config = grpcclient.InferenceServerClient(server.grpc_url).get_model_config("ensemble", as_json=True)["config"]
    declared = {i["name"]: (i["data_type"], [int(d) for d in i["dims"]]) for i in config["input"]}
    names = ("text_input decoder_text_input max_tokens num_return_sequences bad_words stop_words "
             "exclude_input_in_output end_id pad_id top_k top_p temperature length_penalty repetition_penalty "
             "min_tokens presence_penalty frequency_penalty seed return_log_probs return_context_logits "
             "return_generation_logits return_perf_metrics return_num_input_tokens return_num_output_tokens "
             "beam_width stream prompt_embedding_table "
             "prompt_table_extra_id prompt_vocab_size embedding_bias_words embedding_bias_weights lora_task_id "
             "lora_weights lora_config guided_decoding_guide_type guided_decoding_guide").split()
    assert len(names) == 36 and set(names) <= set(declared)
    assert {"random_seed", "min_length"} <= set(declared)   # the names before May 2025
    assert declared["lora_config"] == ("TYPE_INT32", [-1, 3]) and declared["max_tokens"] == ("TYPE_INT32", [1])
    assert declared["prompt_embedding_table"] == ("TYPE_FP16", [-1, -1])
    outputs = {o["name"] for o in config["output"]}
    assert {"text_output", "cum_log_probs", "output_log_probs", "batch_index", "sequence_index", "num_input_tokens",
            "num_output_tokens", *PERF} <= outputs
    assert {t.name for t in tensors.PASS_OUTPUTS} | {"text_output"} == outputs


def test_non_streaming_returns_prompt_and_completion(server, engine_dir, tokenizer):  # noqa: F811
    prompt = "def fibonacci(n):"
    want = offline(engine_dir, prompt, 16)
    outputs = ["text_output", "cum_log_probs", "output_log_probs", "batch_index", *PERF]
    (result,) = run_inference(server, prepare_inputs(prompt, 16, False, return_log_probs=np.array([[True]]),
                                                     return_perf_metrics=np.array([[True]])), outputs)
    assert not isinstance(result, Exception), result
    assert result.as_numpy("text_output")[0].decode() == tokenizer.decode(tokenizer.encode(prompt).ids
                                                                          + want["output_ids"])
    logprobs = result.as_numpy("output_log_probs")
    assert logprobs.shape == (1, 1, 16) and (logprobs <= 0).all()
    assert result.as_numpy("cum_log_probs").reshape(-1)[0] == pytest.approx(float(logprobs.sum()), rel=1e-5)
    assert int(result.as_numpy("batch_index").reshape(-1)[0]) == 0
    t = {n: int(result.as_numpy(n).reshape(-1)[0]) for n in PERF if n.endswith("_ns")}
    assert 0 < t["arrival_time_ns"] <= t["first_scheduled_time_ns"] <= t["first_token_time_ns"] <= t["last_token_time_ns"]
    drafts = int(result.as_numpy("total_draft_tokens").reshape(-1)[0])
    accepted = int(result.as_numpy("total_accepted_draft_tokens").reshape(-1)[0])
    assert 0 <= accepted <= drafts and drafts > 0
    assert result.as_numpy("acceptance_rate").reshape(-1)[0] == pytest.approx(accepted / drafts)
    (excluded,) = run_inference(server, prepare_inputs(prompt, 16, False,
                                                       exclude_input_in_output=np.array([[True]])), ["text_output"])
    assert excluded.as_numpy("text_output")[0].decode() == want["text"]


def test_streaming_with_penalties_and_per_request_k(server, engine_dir):  # noqa: F811
    prompt = "import os\nimport sys\n"
    want = offline(engine_dir, prompt, 24)["text"]
    results = run_inference(server, prepare_inputs(prompt, 24, True, num_draft_tokens=np.array([[1]], np.int32)),
                            ["text_output", "total_draft_tokens", "sequence_index"])
    assert all(not isinstance(r, Exception) for r in results) and len(results) > 1
    assert "".join(r.as_numpy("text_output")[0].decode() for r in results) == want
    steps = int(results[-1].as_numpy("total_draft_tokens").reshape(-1)[0])   # K = 1: one draft per verify
    assert 0 < steps <= 24
    penalised = run_inference(server, prepare_inputs(prompt, 24, True, repetition_penalty=np.array([[2.0]], np.float32),
                                                     presence_penalty=np.array([[0.5]], np.float32)), ["text_output"])
    assert "".join(r.as_numpy("text_output")[0].decode() for r in penalised) != want


def test_neutral_values_pass_and_others_name_the_field(server):
    ok = run_inference(server, prepare_inputs("x = 1", 4, False, length_penalty=np.array([[1.0]], np.float32),
                                              return_context_logits=np.array([[False]]),
                                              lora_task_id=np.array([[0]], np.uint64)), ["text_output"])
    assert not isinstance(ok[0], Exception), ok[0]
    (error,) = run_inference(server, prepare_inputs("x = 1", 4, False, beam_width=np.array([[4]], np.int32)),
                             ["text_output"])
    assert isinstance(error, Exception) and "beam_width" in str(error)


def test_current_names_token_counts_and_log_probs_only_when_asked(server, tokenizer):  # noqa: F811
    """``seed`` / ``min_tokens`` (the backend's names since May 2025) act as ``random_seed`` /
    ``min_length``; an unseeded sampled request samples as seed 0 does (TensorRT-LLM's default);
    ``num_input_tokens`` / ``num_output_tokens`` count the prompt and the ids a response carries;
    log probs are absent unless asked for (a 0 would read as probability 1)."""
    prompt = "def fibonacci(n):"
    sampled = dict(top_k=np.array([[50]], np.int32), temperature=np.array([[1.0]], np.float32),
                   exclude_input_in_output=np.array([[True]]))
    text = lambda results: "".join(r.as_numpy("text_output")[0].decode() for r in results)  # noqa: E731
    ask = lambda **kw: run_inference(server, prepare_inputs(prompt, 12, False, **sampled, **kw), ["text_output"])  # noqa: E731
    unseeded = text(ask())
    assert text(ask()) == unseeded == text(ask(seed=np.array([[0]], np.uint64)))
    assert text(ask(seed=np.array([[7]], np.uint64))) == text(ask(random_seed=np.array([[7]], np.uint64)))
    counts = ["text_output", "output_ids", "num_input_tokens", "num_output_tokens", "cum_log_probs", "output_log_probs"]
    results = run_inference(server, prepare_inputs(prompt, 6, True, min_tokens=np.array([[6]], np.int32),
                                                   return_num_input_tokens=np.array([[True]]),
                                                   return_num_output_tokens=np.array([[True]])), counts)
    assert all(not isinstance(r, Exception) for r in results), results
    assert {int(r.as_numpy("num_input_tokens").reshape(-1)[0]) for r in results} == {len(tokenizer.encode(prompt).ids)}
    assert [int(r.as_numpy("num_output_tokens").reshape(-1)[0]) for r in results] == \
        [r.as_numpy("output_ids").size for r in results] and sum(r.as_numpy("output_ids").size for r in results) == 6
    assert all(r.as_numpy("cum_log_probs") is None and r.as_numpy("output_log_probs") is None for r in results)


def test_top_log_probs_padding_is_json_over_http(server):
    """A distribution cut by top_k gives fewer alternatives than top_log_probs asks: the padding is id
    -1 with the lowest float32 (probability 0). It was -inf, which Triton's HTTP JSON writes as the bare
    token -Infinity: JavaScript's JSON.parse refused the whole answer, text included."""
    import json
    import urllib.request

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    body = {"text_input": "def fibonacci(n):", "max_tokens": 4, "temperature": 0.8, "top_k": 2, "seed": 1,
            "return_log_probs": True, "top_log_probs": 5}
    for path, extra in (("generate", {}), ("generate_stream", {"stream": True})):
        request = urllib.request.Request(f"http://{server.http_url}/v2/models/ensemble/{path}", method="POST",
                                         data=json.dumps({**body, **extra}).encode())
        with urllib.request.urlopen(request, timeout=60) as r:
            raw = r.read().decode()
        answers = [strict(line[len("data: "):]) for line in raw.splitlines() if line.startswith("data: ")] \
            if extra else [strict(raw)]
        for answer in answers:
            ids, values = np.array(answer["output_top_ids"]).reshape(-1, 5), np.array(answer["output_top_log_probs"]).reshape(-1, 5)
            assert (ids[:, :2] >= 0).all() and (ids[:, 2:] == -1).all(), ids        # top_k 2: two alternatives
            assert (values[:, 2:] == np.finfo(np.float32).min).all() and (values[:, :2] <= 0).all()
