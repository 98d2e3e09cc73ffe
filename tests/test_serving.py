"""`nemospec serve`: a REAL Triton Inference Server (the nvidia-pytriton wheel's tritonserver on this
CPU-only machine) serving a small MTP speculative engine directory through the model_repo ensemble.

One server for the module, on loopback ports chosen free at run time, always torn down (the
``serving`` context manager stops it on any exit). The engine directory is built here from a random
checkpoint with a tokenizer (tests/serving_helpers.py). Greedy results are compared with
`nemospec generate` run offline. The `serve` command itself (its CLI, ports, flags): test_serve_command.py.
"""
import functools
import json
import queue
import re
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from serving import cancel, launch, protocol, repository
from serving_helpers import (API_KEY, MAX_QUEUE, NEEDS_TRITON, OPTIONS, PROMPTS, _grpc_inputs, assert_margin,  # noqa: F401
                             engine_dir, generate, grpc_stream, http_post, metric, metric_in, offline, server,
                             settled_metrics, tokenizer)

pytestmark = NEEDS_TRITON


# --- pure helpers ------------------------------------------------------------------------------------
def test_streamed_chunks_never_split_a_utf8_character(tokenizer):
    text = "naïve café — 世界 🙂 done"
    ids = tokenizer.encode(text).ids
    assert len(ids) > len(text.encode()) // 2, "multi-byte characters span several tokens here"
    for step in (1, 2, 3):
        emitted, chunks = [], []
        for i in range(0, len(ids), step):
            new = ids[i:i + step]
            context, prefix = protocol.stream_window(emitted, new)
            chunks.append(protocol.stream_text(tokenizer, context, prefix, finished=i + step >= len(ids)))
            emitted += new
        assert "".join(chunks) == text
        assert all("\ufffd" not in c for c in chunks), chunks


def test_streamed_chunks_of_a_byte_fallback_tokenizer_never_hold_a_replacement_character():
    """Its decoder shows a run of byte tokens that is not valid UTF-8 (one ending inside a character)
    as one U+FFFD per byte: holding back only one sent the others, and the joined stream read
    'a\ufffd\u3042' where the text is 'a\u3042'; a window beginning inside a run showed its characters
    as U+FFFD (the window now reaches back to the run's start)."""
    from sentencepiece_tokenizer import sentencepiece_tokenizer
    tokenizer = sentencepiece_tokenizer()
    byte_ids = protocol.byte_fallback_ids(tokenizer)
    text = "a \u3042a \U0001f642 a\u00e9\u00e9\u3042\u3042 the"     # a run of 10 byte tokens: past the context
    ids = tokenizer.encode(text).ids
    first = ids.index(tokenizer.token_to_id("<0xE3>"))    # the first of \u3042's three bytes
    assert tokenizer.decode(ids) == text and tokenizer.decode(ids[:first + 2]).endswith("\ufffd\ufffd")
    for step in (1, 2, 3):
        emitted, chunks = [], []
        for i in range(0, len(ids), step):
            new = ids[i:i + step]
            context, prefix = protocol.stream_window(emitted, new, byte_ids)
            chunks.append(protocol.stream_text(tokenizer, context, prefix, finished=i + step >= len(ids)))
            emitted += new
        assert "".join(chunks) == text and all("\ufffd" not in c for c in chunks), (step, chunks)


def test_coalesced_events_keep_every_token_and_log_probability():
    """Token events that queued while the dispatcher was sending become one per request, their ids
    and log-probabilities (and their alternatives) joined in order (a merge that let the later event's logprobs replace the
    earlier's returned 15 log-probabilities for 16 tokens under load); control events pass through,
    and an event after a request finished starts a new item."""
    a, b = object(), object()
    items = [(a, [1], False, {"logprobs": [-0.1], "top_logprobs": [[(1, -0.1)]], "speculation": {"steps": 1}}),
             (b, [7], False, {}),
             ("cancel", 9, False, {}),
             (a, [2, 3], False, {"logprobs": [-0.2, -0.3], "top_logprobs": [[(2, -0.2)], [(3, -0.3)]],
                                 "speculation": {"steps": 2}}),
             (a, [4], True, {"logprobs": [-0.4], "finish_reason": "length"}),
             (a, [5], False, {"logprobs": [-0.5]}),
             (b, [8], True, {"finish_reason": "stop"})]
    out = protocol.coalesce_events(items)
    assert [(e if isinstance(e, str) else "ab"[e is b], n, f) for e, n, f, _ in out] == [
        ("a", [1, 2, 3, 4], True), ("b", [7, 8], True), ("cancel", 9, False), ("a", [5], False)]
    assert out[0][3] == {"logprobs": [-0.1, -0.2, -0.3, -0.4], "top_logprobs": [[(1, -0.1)], [(2, -0.2)], [(3, -0.3)]],
                         "speculation": {"steps": 2}, "finish_reason": "length"}
    assert "logprobs" not in out[1][3] and out[1][3]["finish_reason"] == "stop"


def test_word_lists_round_trip():
    """Each element is one word, as TensorRT-LLM's preprocessing reads it: read as comma-separated
    lists, ``","`` was no stop word at all, ``", "`` stopped at the first space and ``'"'`` was dropped."""
    words = protocol.split_words([b"foo,bar", '"a,b"', b"", ",", ", ", '"', "\n", "a\r\nb"])
    assert words == ["foo,bar", '"a,b"', ",", ", ", '"', "\n", "a\r\nb"]
    packed = protocol.pack_word_ids([[1, 2], [3], [4, 5, 6]])
    assert packed.shape == (2, 6) and packed.dtype == np.int32
    assert protocol.unpack_word_ids(packed) == ((1, 2), (3,), (4, 5, 6))
    assert protocol.unpack_word_ids(protocol.pack_word_ids([])) == ()
    for bad, named in ((np.array([[5, 99999], [1, 2]], np.int32), "token id 99999 outside"),
                       (np.array([[5, 6], [2, 1]], np.int32), "end offsets must not decrease"),
                       (np.array([[5, 6], [1, 9]], np.int32), "end offsets must not decrease and stay within the 2 ids, got 9"),
                       (np.array([1, 2, 3], np.int32), "expected int32 [2, N]"),
                       (np.array([[0.5, 1.0], [1, 2]], np.float32), "expected int32 [2, N]")):
        with pytest.raises(ValueError, match=re.escape(f"bad_words_ids: {named}")):
            protocol.unpack_word_ids(bad, "bad_words_ids", vocab=2048)


def test_a_server_is_ready_only_once_its_own_log_shows_every_port_bound(tmp_path):
    """Triton answers ready on HTTP before its metrics service binds, and a loopback port picked for
    its HTTP can be taken by another server that then answers for it: start_server waits for this
    server's own "Started ... at HOST:PORT" lines."""
    log = tmp_path / "tritonserver.log"
    handle = launch.ServerHandle(None, "127.0.0.1", 1, 2, 3, tmp_path, tmp_path, log, [])
    assert not handle.started(5001)                     # no log yet
    log.write_text('I1206 12:00:00.000001 1 grpc_server.cc:2558] "Started GRPCInferenceService at 0.0.0.0:5002"\n'
                   'I1206 12:00:00.000002 1 http_server.cc:4713] "Started HTTPService at 127.0.0.1:5001"\n')
    assert handle.started(5001, 5002) and not handle.started(5001, 5002, 5003)
    with log.open("a") as f:
        f.write('I1206 12:00:00.040000 1 http_server.cc:362] "Started Metrics Service at [::]:5003"\n')
    assert handle.started(5001, 5002, 5003) and not handle.started(50011)


def test_cancel_channel(tmp_path):
    """postprocessing -> speculative: a datagram with the request id to the owning process's socket."""
    import os
    got = []
    for directory in (tmp_path / "c", tmp_path / ("x" * 120)):  # a path too long for sun_path: abstract socket
        close = cancel.cancel_listener(directory, got.append)
        try:
            assert cancel.notify_cancel(directory, cancel.request_key(os.getpid(), 41))
            deadline = time.monotonic() + 5
            while len(got) < 1 + (directory.name != "c") and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            close()
    assert got == [41, 41]
    drained = []                      # a stop's first word: refuse new requests, serve those held
    close = cancel.cancel_listener(tmp_path / "c", got.append, on_drain=lambda: drained.append(True))
    try:
        assert cancel.notify_drain(tmp_path / "c", os.getpid())
        deadline = time.monotonic() + 5
        while not drained and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        close()
    assert drained == [True] and got == [41, 41]
    assert cancel.split_request_key(cancel.request_key(123456, 2**32 + 5)) == (123456, 5)
    assert not cancel.notify_cancel(tmp_path / "c", cancel.request_key(os.getpid(), 1)), "listener closed"


def test_a_datagram_to_a_listener_that_does_not_read_never_waits(tmp_path):
    """A hung stub's socket fills (10 datagrams here) and a blocking send then waited for good: a
    server's stop, which sends one to each stub first, never ended. A send now fails at once."""
    import os
    import socket
    import threading
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as hung:
        hung.bind(cancel.cancel_socket_path(tmp_path, os.getpid()))
        sent = []
        sender = threading.Thread(target=lambda: sent.extend(cancel.notify_drain(tmp_path, os.getpid()) for _ in range(64)),
                                  daemon=True)
        sender.start()
        sender.join(10)
        assert not sender.is_alive() and len(sent) == 64 and sent[0] and not sent[-1], sent


def test_fill_model_repo(engine_dir, tmp_path):
    repo = repository.fill_model_repo(engine_dir, tmp_path / "repo", max_batch_size=2, max_queue=5,
                                 cancel_dir=tmp_path / "c")
    assert sorted(p.name for p in repo.iterdir()) == sorted(repository.MODELS)
    for name in repository.MODELS:
        text = (repo / name / "config.pbtxt").read_text()
        assert "${" not in text and (repo / name / "1").is_dir()
    spec = (repo / "speculative" / "config.pbtxt").read_text()
    assert "decoupled: true" in spec and str(engine_dir.resolve()) in spec and '"5"' in spec
    threads = f'key: "torch_threads" value: {{ string_value: "{repository.default_torch_threads()}" }}'
    assert threads in spec, "0: the default share of the cores"
    three = repository.fill_model_repo(engine_dir, tmp_path / "r4", torch_threads=3, cancel_dir=tmp_path / "c")
    assert 'key: "torch_threads" value: { string_value: "3" }' in (three / "speculative" / "config.pbtxt").read_text()
    with pytest.raises(Exception, match="--torch_threads"):
        repository.fill_model_repo(engine_dir, tmp_path / "r5", torch_threads=-1)
    with pytest.raises(Exception, match="--max_batch_size"):
        repository.fill_model_repo(engine_dir, tmp_path / "r2", max_batch_size=99)
    assert 'key: "warm_up" value: { string_value: "all" }' in spec
    single = repository.fill_model_repo(engine_dir, tmp_path / "r6", warm_up="single", cancel_dir=tmp_path / "c")
    assert 'key: "warm_up" value: { string_value: "single" }' in (single / "speculative" / "config.pbtxt").read_text()
    with pytest.raises(Exception, match="--warm_up: expected one of all, greedy, single"):
        repository.fill_model_repo(engine_dir, tmp_path / "r7", warm_up="some")
    assert 'key: "logprobs_mode" value: { string_value: "processed_logprobs" }' in spec
    raw = repository.fill_model_repo(engine_dir, tmp_path / "r8", logprobs_mode="raw_logprobs", cancel_dir=tmp_path / "c")
    assert 'key: "logprobs_mode" value: { string_value: "raw_logprobs" }' in (raw / "speculative" / "config.pbtxt").read_text()
    with pytest.raises(Exception, match="--logprobs_mode: expected one of processed_logprobs, raw_logprobs"):
        repository.fill_model_repo(engine_dir, tmp_path / "r9", logprobs_mode="raw")
    (tmp_path / "no_tok").mkdir()
    meta = json.loads((engine_dir / "config.json").read_text())
    meta["tokenizer"] = None
    (tmp_path / "no_tok" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(Exception, match="tokenizer"):
        repository.fill_model_repo(tmp_path / "no_tok", tmp_path / "r3")


# --- the server --------------------------------------------------------------------------------------
def test_http_generate_matches_offline(server, engine_dir, tokenizer):
    """Not streaming, the TensorRT-LLM backend's default returns prompt + completion;
    exclude_input_in_output returns the completion alone."""
    for prompt in PROMPTS[:2]:
        want = offline(engine_dir, prompt, 24)
        status, got = generate(server, text_input=prompt, max_tokens=24, exclude_input_in_output=True)
        assert status == 200, got
        assert got["output_ids"] == want["output_ids"]
        assert got["text_output"] == want["text"]
        assert got["mean_accepted_tokens"] >= 1.0
        assert got["finish_reason"] == "length" and got["total_draft_tokens"] > 0
        status, full = generate(server, text_input=prompt, max_tokens=24)
        prompt_ids = tokenizer.encode(prompt).ids
        assert status == 200 and full["output_ids"] == prompt_ids + want["output_ids"]
        assert full["text_output"] == tokenizer.decode(prompt_ids + want["output_ids"])


def test_grpc_streaming_matches_offline(server, engine_dir):
    for prompt in PROMPTS[1:]:
        want = offline(engine_dir, prompt, 32)
        chunks, ids, mean, error = grpc_stream(server, prompt, 32)
        assert error is None
        assert ids == want["output_ids"] and "".join(chunks) == want["text"]
        assert len(chunks) > 1, "streamed in several responses"
        assert mean == pytest.approx(want["acceptance"]["mean_accepted_tokens"])


def test_http_generate_stream_sse(server, engine_dir):
    """As vLLM's and SGLang's TensorRT-LLM benchmark clients ask (``accumulate_tokens``, which the
    ensemble ignores as TensorRT-LLM's does: a 400 before), each response the step's own text."""
    want = offline(engine_dir, PROMPTS[0], 24)
    status, body = http_post(server, "/v2/models/ensemble/generate_stream",
                             {"text_input": PROMPTS[0], "max_tokens": 24, "stream": True, "accumulate_tokens": True})
    assert status == 200
    events = [json.loads(line[len("data:"):]) for line in body.splitlines() if line.startswith("data:")]
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == want["text"]
    # as the TensorRT-LLM backend: perf metrics only when asked for (and in the final response), so a
    # streamed step costs Triton 5 output tensors, not 22; log probs only when asked for (a 0 would
    # read as probability 1)
    perf = ("arrival_time_ns", "total_draft_tokens", "acceptance_histogram", "mean_accepted_tokens", "finish_reason",
            "kv_cache_alloc_new_blocks")
    assert not any(name in e for e in events[:-1] for name in perf), events[0]
    assert all(name in events[-1] for name in perf) and events[-1]["finish_reason"] == "length"
    assert not any("cum_log_probs" in e or "output_log_probs" in e for e in events)
    assert events[-1]["mean_accepted_tokens"] == pytest.approx(want["acceptance"]["mean_accepted_tokens"])
    status, body = http_post(server, "/v2/models/ensemble/generate_stream",
                             {"text_input": PROMPTS[0], "max_tokens": 24, "stream": True, "return_perf_metrics": True})
    events = [json.loads(line[len("data:"):]) for line in body.splitlines() if line.startswith("data:")]
    assert status == 200 and len(events) > 1
    assert all("arrival_time_ns" in e and "total_draft_tokens" in e for e in events)
    drafted = [e["total_draft_tokens"] for e in events]
    assert drafted == sorted(drafted) and drafted[-1] > drafted[0], "the request's counts so far, per response"
    means = [e["mean_accepted_tokens"] for e in events]   # tokens per verify step so far, from those counts
    hists = [e["acceptance_histogram"] for e in events]
    assert all(len(h) == OPTIONS["max_draft_len"] + 1 for h in hists), "K+1 buckets, as the OpenAI frontend's"
    assert means == pytest.approx([sum((j + 1) * c for j, c in enumerate(h)) / sum(h) if sum(h) else 0.0
                                   for h in hists])
    status, body = http_post(server, "/v2/models/ensemble/generate_stream",
                             {"text_input": PROMPTS[0], "max_tokens": 12, "stream": True, "return_perf_metrics": True,
                              "parameters": {"speculative": False}})
    events = [json.loads(line[len("data:"):]) for line in body.splitlines() if line.startswith("data:")]
    # no verify step: 0 in every response (the streamed ones said 1.0, tokens per callback)
    assert status == 200 and len(events) > 1 and all(e["mean_accepted_tokens"] == 0.0 for e in events), events


def test_speculative_false_gives_the_same_greedy_text(server, engine_dir):
    want = offline(engine_dir, PROMPTS[0], 24)
    status, got = generate(server, text_input=PROMPTS[0], max_tokens=24, parameters={"speculative": False},
                           exclude_input_in_output=True)
    assert status == 200 and got["text_output"] == want["text"] and got["output_ids"] == want["output_ids"]
    assert got["mean_accepted_tokens"] == 0.0, "target only: no verify steps"
    _, ids, _, error = grpc_stream(server, PROMPTS[0], 24, parameters={"speculative": False})
    assert error is None and ids == want["output_ids"]


def test_concurrent_streams_are_batched_and_equal_sequential(server, engine_dir):
    prompts = [f"def f{i}(x, y):" if i % 2 else f"# note {i}\nimport re" for i in range(16)]
    def text_and_ids(result):  # streamed chunk boundaries may differ: a busy server joins steps
        return "".join(result[0]), result[1]

    sequential = [text_and_ids(grpc_stream(server, p, 20)) for p in prompts]
    for p, (_, ids) in zip(prompts, sequential):  # batched with others, a row may round differently
        assert_margin(engine_dir, p, ids)
    before = metric_in(settled_metrics(server), "nemospec_steps_total")
    results = [None] * len(prompts)

    def run(i):
        results[i] = grpc_stream(server, prompts[i], 20)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    elapsed = time.perf_counter() - start
    assert all(r is not None and r[3] is None for r in results), [r and r[3] for r in results]
    assert [text_and_ids(r) for r in results] == sequential
    m = settled_metrics(server, lambda m: metric_in(m, "nemospec_max_batch_seen") > 1)
    assert metric_in(m, "nemospec_max_batch_seen") > 1
    steps = metric_in(m, "nemospec_steps_total") - before
    tokens = sum(len(r[1]) for r in results)
    assert steps < tokens, f"{steps} steps for {tokens} tokens: requests were served together ({elapsed:.1f} s)"


def test_cancel_mid_stream_frees_the_sequence(server):
    """A stream cancelled after its third response is counted cancelled and frees its sequence. The
    140-token stream can finish within a fraction of a second of its first response, before the
    cancel reaches the model (through postprocessing): then it counts completed, and the test tries
    again with a new stream."""
    import tritonclient.grpc as grpcclient

    def outcome(name):
        return metric(server, "nemospec_requests_total", outcome=name)

    for attempt in range(3):
        cancelled, completed = outcome("cancelled"), outcome("completed")
        client = grpcclient.InferenceServerClient(server.grpc_url)
        results = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("ensemble", _grpc_inputs(PROMPTS[0], 140, end_id=-1))
        for _ in range(3):
            result, error = results.get(timeout=60)
            assert error is None
        client.stop_stream(cancel_requests=True)
        client.close()
        deadline = time.monotonic() + 20   # the outcome counters move at once, the gauge within ~0.1 s
        while time.monotonic() < deadline:
            if outcome("cancelled") + outcome("completed") == cancelled + completed + 1:
                break
            time.sleep(0.05)
        if outcome("completed") == completed:
            break
    assert outcome("cancelled") == cancelled + 1, "the stream was cancelled in flight in 3 tries"
    deadline = time.monotonic() + 5
    while metric(server, "nemospec_active_sequences") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "nemospec_active_sequences") == 0


BAD = [
    ({"text_input": "", "max_tokens": 8}, "text_input"),
    ({"text_input": "x = 1", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "x = 1", "max_tokens": -4}, "max_tokens"),
    ({"text_input": "x = 1", "max_tokens": 1000}, "max_seq_len"),
    ({"text_input": "import os\n" * 40, "max_tokens": 8}, "max_input_len"),
    ({"text_input": "x = 1", "max_tokens": 8, "temperature": -0.5}, "temperature"),
    ({"text_input": "x = 1", "max_tokens": 8, "top_p": -0.1}, "top_p"),
    ({"text_input": "x = 1", "max_tokens": 8, "top_p": 1.5}, "top_p"),
    ({"text_input": "x = 1", "max_tokens": 8, "end_id": 100000}, "end_id"),
    ({"text_input": "x = 1", "max_tokens": 8, "parameters": {"speculative": "maybe"}}, "speculative"),
    ({"text_input": "x = 1", "max_tokens": "eight"}, "max_tokens"),   # wrong JSON type: refused before Triton
    # the TensorRT-LLM backend's inputs nemospec accepts only at their neutral value
    ({"text_input": "x = 1", "max_tokens": 8, "beam_width": 2}, "beam_width"),
    ({"text_input": "x = 1", "max_tokens": 8, "num_return_sequences": 3}, "num_return_sequences"),
    ({"text_input": "x = 1", "max_tokens": 8, "return_generation_logits": True}, "return_generation_logits"),
    ({"text_input": "x = 1", "max_tokens": 8, "embedding_bias_words": ["x"], "embedding_bias_weights": [1.0]},
     "embedding_bias"),
    ({"text_input": "x = 1", "max_tokens": 8, "guided_decoding_guide_type": "json"}, "guided_decoding"),
    ({"text_input": "x = 1", "max_tokens": 8, "top_k": -1}, "top_k"),
    ({"text_input": "x = 1", "max_tokens": 8, "num_draft_tokens": 9}, "num_draft_tokens"),
    ({"text_input": "x = 1", "max_tokens": 8, "repetition_penalty": 0.0}, "repetition_penalty"),
]


@pytest.mark.parametrize("body,field", BAD, ids=[f"{i}-{f or 'json_type'}" for i, (_, f) in enumerate(BAD)])
def test_bad_input_gets_an_error_and_the_server_keeps_serving(server, engine_dir, body, field):
    status, got = generate(server, **body)
    assert status >= 400 and "error" in got, got
    assert field in got["error"]
    status, good = generate(server, text_input=PROMPTS[0], max_tokens=6, exclude_input_in_output=True)
    assert status == 200 and good["output_ids"] == offline(engine_dir, PROMPTS[0], 6)["output_ids"]


def test_sampling_follows_tensorrt_llms_rule(server, engine_dir):
    """TensorRT-LLM's defaults (temperature 1, top_k 0, top_p 0) and rule: a request samples only with
    top_k > 1 or top_p > 0, so its stock clients, which send a temperature of 1 and neither, get greedy
    output; top_k 40 or top_p 0.95 at a seed sample, reproducibly."""
    want = offline(engine_dir, PROMPTS[0], 24)["output_ids"]
    for extra in ({"temperature": 1.0}, {"temperature": 1.5, "top_p": 0.0}, {"top_k": 1, "temperature": 2.0}, {}):
        status, got = generate(server, text_input=PROMPTS[0], max_tokens=24, exclude_input_in_output=True, **extra)
        assert status == 200 and got["output_ids"] == want, extra
    for extra in ({"top_k": 40, "temperature": 1.5}, {"top_p": 0.95, "temperature": 1.5}):
        runs = [generate(server, text_input=PROMPTS[0], max_tokens=24, exclude_input_in_output=True, random_seed=seed,
                         **extra)[1]["output_ids"] for seed in (1, 1, 2)]
        assert runs[0] == runs[1] and want not in runs[:1] + runs[2:], (extra, runs)


def test_wrong_datatype_names_the_field(server):
    chunks, ids, _, error = grpc_stream(server, "x = 1", 4, temperature=(np.array([[0.5]], dtype=np.float64), "FP64"))
    assert error is not None and "temperature" in error and "FP" in error
    chunks, ids, _, error = grpc_stream(server, "x = 1", 4)
    assert error is None and len(ids) == 4


def test_stop_and_bad_words(server, engine_dir, tokenizer):
    want = offline(engine_dir, PROMPTS[0], 24, "--ignore_eos")["output_ids"]
    # a token whose text encodes back to itself, as a stop word: output ends right after it
    index = next(i for i, t in enumerate(want[2:], 2) if tokenizer.decode([t]).strip(" ,\"") == tokenizer.decode([t])
                 and tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False).ids == [t]
                 and t not in want[:i])
    word = tokenizer.decode([want[index]])
    status, got = generate(server, text_input=PROMPTS[0], max_tokens=24, end_id=-1, stop_words=[word],
                           exclude_input_in_output=True)
    assert status == 200 and got["output_ids"] == want[:index + 1], (word, got)
    # the same token as end_id: the ids end with it, the text does not (TensorRT-LLM's backend returns
    # neither, vLLM ids with it and text without); a stop word's text stays
    assert got["text_output"] == tokenizer.decode(want[:index + 1])
    status, got = generate(server, text_input=PROMPTS[0], max_tokens=24, end_id=want[index], exclude_input_in_output=True)
    assert status == 200 and got["output_ids"] == want[:index + 1] and got["text_output"] == tokenizer.decode(want[:index])
    chunks, ids, _, error = grpc_stream(server, PROMPTS[0], 24, end_id=want[index])
    assert error is None and ids == want[:index + 1] and "".join(chunks) == tokenizer.decode(want[:index])
    first = tokenizer.decode([want[0]])
    if tokenizer.encode(first, add_special_tokens=False).ids == [want[0]]:
        status, got = generate(server, text_input=PROMPTS[0], max_tokens=4, end_id=-1, bad_words=[first],
                               exclude_input_in_output=True)
        assert status == 200 and got["output_ids"][0] != want[0]


def test_bad_word_ids_sent_to_the_model_fail_that_request_alone(server, engine_dir):
    """Triton serves the ensemble's inner models too: word ids outside the vocabulary sent straight to
    the speculative model are a 400 naming the field, and a request in flight beside it (same batch)
    still finishes exactly (an IndexError in the batched step had failed them all)."""
    def count(name, **labels):   # both counters move at once (not on the ~0.1 s publishing tick)
        return metric(server, f"nemospec_requests_{name}", **labels)

    for attempt in range(3):   # the good request must still be running when the bad ones are answered
        received, completed = count("received_total"), count("total", outcome="completed")
        results = queue.Queue()
        good = threading.Thread(target=lambda: results.put(generate(server, text_input=PROMPTS[0], max_tokens=40,
                                                                    exclude_input_in_output=True)))
        good.start()
        deadline = time.monotonic() + 30
        while count("received_total") == received and time.monotonic() < deadline:
            time.sleep(0.01)
        for name in ("bad_words_ids", "stop_words_ids"):
            status, text = http_post(server, "/v2/models/speculative/generate",
                                     {"input_ids": [5, 6], "max_tokens": 4, name: [[99999], [1]]})
            assert status == 400 and f"{name}: token id 99999 outside the vocabulary" in text, (status, text)
        beside = count("total", outcome="completed") == completed
        good.join(180)
        status, got = results.get_nowait()
        if beside:
            break
    assert beside, "the good request was in flight beside the bad ones (3 tries)"
    assert status == 200 and got["output_ids"] == offline(engine_dir, PROMPTS[0], 40)["output_ids"]


def test_queue_full_is_refused_clearly(server, engine_dir):
    """More requests than batch + queue at once: the extra ones get a clear error, the rest finish."""
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    n = OPTIONS["max_batch_size"] + MAX_QUEUE + 24   # a surplus that arrives before 24 requests finish
    for i in range(n):
        client.async_stream_infer("ensemble", _grpc_inputs(f"x{i} = 1", 60, stream=False, end_id=-1),
                                  request_id=str(i))
    errors, done = [], 0
    for _ in range(n):
        result, error = results.get(timeout=180)
        if error is not None:
            errors.append(str(error))
        else:
            done += 1
    client.stop_stream()
    client.close()
    assert errors and all("max_queue" in e for e in errors), errors[:3]
    # the scheduler admits queued requests between steps, so how many ran at once varies; the free
    # batch slots and a full queue's worth were served (a burst at an idle server was refused while
    # slots were free)
    assert done >= OPTIONS["max_batch_size"] + MAX_QUEUE and done + len(errors) == n
    status, good = generate(server, text_input=PROMPTS[0], max_tokens=6, exclude_input_in_output=True)
    assert status == 200 and good["output_ids"] == offline(engine_dir, PROMPTS[0], 6)["output_ids"]


def test_models_run_on_mimalloc(server):
    """The Python-backend stubs that run the models were started with mimalloc preloaded
    (runtime.allocator, via serving.tritonserver.server_env)."""
    assert "speculative" in server.stubs.values(), server.stubs
    for pid, model in server.stubs.items():
        assert "libmimalloc" in Path(f"/proc/{pid}/maps").read_text(), model


def test_metrics_exported(server):
    tokens_before = metric(server, "nemospec_generated_tokens_total")
    assert generate(server, text_input=PROMPTS[0], max_tokens=4)[0] == 200
    m = settled_metrics(server, lambda m: metric_in(m, "nemospec_generated_tokens_total") > tokens_before)
    for name in ("nemospec_steps_total", "nemospec_accepted_tokens_total", "nemospec_verify_rows_total",
                 "nemospec_generated_tokens_total", "nemospec_active_sequences", "nemospec_draft_seconds_total",
                 "nemospec_verify_seconds_total", "nemospec_draft_latency_seconds_count",
                 "nemospec_verify_latency_seconds_count", "nemospec_accepted_tokens_per_step_count"):
        assert any(k.startswith(name + "{") for k in m), name
    value = functools.partial(metric_in, m)
    assert value("nemospec_generated_tokens_total") > tokens_before
    assert value("nemospec_accepted_tokens_total") >= value("nemospec_verify_rows_total") > 0
    # the speculative-decoding families dashboards read (vLLM's and TensorRT-LLM's, nemospec_ prefix)
    drafts = value("nemospec_spec_decode_num_drafts_total")
    draft_tokens = value("nemospec_spec_decode_num_draft_tokens_total")
    accepted = value("nemospec_spec_decode_num_accepted_tokens_total")
    assert drafts == value("nemospec_verify_rows_total") and draft_tokens >= drafts > 0
    assert accepted == value("nemospec_accepted_tokens_total") - drafts  # gained = accepted + one bonus
    per_position = [value("nemospec_spec_decode_num_accepted_tokens_per_pos_total", position=str(j))
                    for j in range(OPTIONS["max_draft_len"])]
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)
    assert value("nemospec_prompt_tokens_total") > 0
    # every request handed to the model ends in one outcome (the supervisor's stall check reads the gap)
    deadline = time.monotonic() + 10     # a cancelled request of an earlier test may still be ending
    while True:
        received = metric(server, "nemospec_requests_received_total")
        ended = sum(metric(server, "nemospec_requests_total", outcome=o)
                    for o in ("completed", "cancelled", "rejected", "failed"))
        if received == ended or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert received == ended > 0, (received, ended)
    for name in ("nemospec_e2e_request_latency_seconds_count", "nemospec_time_to_first_token_seconds_count",
                 "nemospec_inter_token_latency_seconds_count"):
        assert any(k.startswith(name + "{") for k in m), name


def test_api_key_guards_model_repository_only(server):
    status, body = http_post(server, "/v2/repository/index", {})
    assert status == 403 and "restricted" in body, (status, body)
    status, body = http_post(server, "/v2/repository/index", {}, headers={launch.API_KEY_HEADER: "wrong"})
    assert status == 403
    status, body = http_post(server, "/v2/repository/index", {}, headers={launch.API_KEY_HEADER: API_KEY})
    assert status == 200 and "ensemble" in body
    status, body = http_post(server, "/v2/repository/models/ensemble/unload", {}, headers={launch.API_KEY_HEADER: API_KEY})
    assert status != 200, "model control mode none: no remote unload"
    with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=10) as r:
        assert r.status == 200
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException, match="restricted"):
        client.get_model_repository_index()
    index = client.get_model_repository_index(headers={launch.GRPC_API_KEY_HEADER: API_KEY})
    assert {m.name for m in index.models} == set(repository.MODELS)
    assert client.is_server_ready()
