"""The OpenAI frontend against a recording backend (no Triton): every request field is honoured or
refused with a 400 naming it, numbers past what the ensemble takes are 400s (never a 500 or a wrapped
value), chat renders what the client sent (parts joined as vLLM joins them, vLLM's template options),
and every error body, of any route, is OpenAI's error JSON."""
import json

import pytest
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from serving.openai.app import ModelInfo, create_app
from serving.openai.chat_template import ChatTemplate
from test_openai_answers import TOKENIZER, ScriptedDelta, _call, _events, _ids

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if flavour %}[{{ flavour }}]{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}")


class RecordingBackend:
    """Answers "hello world" and records what each request asked the ensemble for."""
    def __init__(self):
        self.calls = []

    async def ready(self):
        return True

    async def close(self):
        pass

    def stopped(self, delta):
        pass

    async def generate(self, g, max_tokens):
        self.calls.append((g, max_tokens))
        yield ScriptedDelta(_ids("hello"))
        yield ScriptedDelta(_ids(" world"), "length")


class FailingBackend(RecordingBackend):
    """A bug in the backend after ``good`` responses (a real one converts Triton's errors, not bugs)."""
    def __init__(self, good: int):
        super().__init__()
        self.good = good

    async def generate(self, g, max_tokens):
        for _ in range(self.good):
            yield ScriptedDelta(_ids("hello"))
        raise RuntimeError("a bug")


def _app(backend=None, template=TEMPLATE, tokenizer=TOKENIZER):
    backend = backend or RecordingBackend()
    info = ModelInfo("m", tokenizer, 256, 4, ChatTemplate(template) if template else None, 0)
    return create_app(info, backend), backend


def _error(status, raw, want_status, param):
    assert status == want_status, (status, raw)
    error = json.loads(raw)["error"]
    assert error["param"] == param and param in error["message"], error
    return error


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
PROMPT = {"prompt": "p"}


def test_numbers_past_a_double_are_400s_not_500s():
    """A JSON integer too large for a float (10**400) was converted before its range check: an
    OverflowError, a plain-text 500."""
    for field in ("max_tokens", "temperature", "top_k", "seed", "n"):
        app, backend = _app()
        _error(*_call(app, body={**PROMPT, field: 10 ** 400}), 400, field)
        assert not backend.calls


def test_limits_the_ensemble_cannot_take_are_refused_naming_the_field_sent():
    """max_tokens, top_k and min_tokens go to the ensemble as INT32: 2**31 wrapped to -2**31 there
    (its error then quoted a number the client never sent); a limit past max_seq_len is refused here
    naming the field the client used (chat: max_completion_tokens), and a min_tokens above the
    limit is refused as vLLM refuses it."""
    for body, param in (({**PROMPT, "max_tokens": 1 << 31}, "max_tokens"), ({**PROMPT, "top_k": 1 << 31}, "top_k"),
                        ({**PROMPT, "max_tokens": 300}, "max_tokens"),
                        ({**PROMPT, "max_tokens": 8, "min_tokens": 9}, "min_tokens")):
        app, backend = _app()
        error = _error(*_call(app, body=body), 400, param)
        assert not backend.calls, body
        if body.get("max_tokens") == 300:
            assert "max_seq_len 256" in error["message"]
    app, backend = _app()
    error = _error(*_call(app, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 300}), 400,
                   "max_completion_tokens")
    assert "max_seq_len" in error["message"] and not backend.calls
    app, backend = _app()
    status, raw = _call(app, body={**PROMPT, "max_tokens": 255, "min_tokens": 255})
    assert status == 200 and backend.calls[0][1] == 255, raw


def test_a_prompt_past_max_input_len_is_refused_naming_the_prompt_field():
    """The ensemble refuses it too, but names its own tensor (text_input): the client sent prompt or
    messages (found by the fuzz test)."""
    info = ModelInfo("m", TOKENIZER, 256, 4, ChatTemplate(TEMPLATE), 0, max_input_len=3)
    for path, body, param in (("/v1/completions", {"prompt": "a b c d e f g"}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a b c d e f"}]}, "messages")):
        backend = RecordingBackend()
        error = _error(*_call(create_app(info, backend), path, body), 400, param)
        assert "max_input_len 3" in error["message"] and not backend.calls


def test_n_and_best_of_must_be_integers():
    """JSON true equals 1 in Python: ``n: true`` was taken as one choice."""
    for field in ("n", "best_of"):
        app, _ = _app()
        _error(*_call(app, body={**PROMPT, field: True}), 400, field)
        app, _ = _app()
        assert _call(app, body={**PROMPT, field: 1})[0] == 200


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"min_p": 0.1}, "min_p"),
    ("/v1/completions", {"stop_token_ids": [2]}, "stop_token_ids"),
    ("/v1/completions", {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("/v1/completions", {"skip_special_tokens": False}, "skip_special_tokens"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/completions", {"prompt_logprobs": 0}, "prompt_logprobs"),
    ("/v1/completions", {"max_completion_tokens": 4}, "max_completion_tokens"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("/v1/chat/completions", {"continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ("/v1/completions", {"stop_regex": "wor"}, "stop_regex"),                      # SGLang's
    ("/v1/completions", {"custom_logit_processor": "{}"}, "custom_logit_processor"),
    ("/v1/chat/completions", {"thinking_token_budget": 8}, "thinking_token_budget"),   # vLLM's
    ("/v1/chat/completions", {"repetition_detection": {"max_pattern_size": 4}}, "repetition_detection"),
    ("/v1/completions", {"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("/v1/completions", {"vllm_xargs": {"k": 1}}, "vllm_xargs"),
])
def test_fields_the_server_cannot_honour_are_refused(path, extra, param):
    """Each was accepted and dropped: a 200 answering a different request than the one sent."""
    app, backend = _app()
    _error(*_call(app, path, {**(CHAT if "chat" in path else PROMPT), **extra}), 400, param)
    assert not backend.calls


def test_neutral_values_of_those_fields_are_accepted():
    neutral = {"min_p": 0, "stop_token_ids": [], "skip_special_tokens": True, "logit_bias": {}, "tools": [],
               "tool_choice": "none", "include_stop_str_in_output": False, "response_format": {"type": "text"},
               "user": "u", "metadata": {"k": "v"}, "length_penalty": 1.0, "add_special_tokens": True}
    app, backend = _app()
    status, raw = _call(app, "/v1/chat/completions", {**CHAT, **neutral})
    assert status == 200 and len(backend.calls) == 1, raw


def test_add_special_tokens_is_vllms_chat_false_completions_true():
    """The ensemble's preprocessing tokenizes with the tokenizer's special tokens unless the request
    sends add_special_tokens false: chat does by default (its template writes its own BOS, as vLLM and
    transformers' apply_chat_template leave the tokenizer's out), completions on request; usage counts
    the prompt the model sees."""
    from serving.openai.backend import ensemble_inputs
    with_bos = Tokenizer.from_str(TOKENIZER.to_str())
    bos = with_bos.token_to_id("<s>")
    with_bos.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    app, backend = _app(tokenizer=with_bos)
    cases = [("/v1/chat/completions", CHAT, False), ("/v1/completions", PROMPT, True),
             ("/v1/completions", {**PROMPT, "add_special_tokens": False}, False),
             ("/v1/chat/completions", {**CHAT, "add_special_tokens": True}, True)]
    for path, body, special in cases:
        status, raw = _call(app, path, body)
        g = backend.calls[-1][0]
        sent = {t.name(): t for t in ensemble_inputs(g, 8)}
        assert status == 200 and g.add_special_tokens is special and ("add_special_tokens" in sent) is not special
        prompt_ids = with_bos.encode(g.prompt, add_special_tokens=special).ids
        assert (prompt_ids[0] == bos) is special
        assert json.loads(raw)["usage"]["prompt_tokens"] == len(prompt_ids), (path, body)
    _error(*_call(app, body={**PROMPT, "add_special_tokens": "no"}), 400, "add_special_tokens")


def _chat_prompt(body):
    app, backend = _app()
    status, raw = _call(app, "/v1/chat/completions", body)
    assert status == 200, raw
    return backend.calls[0][0].prompt


def test_text_parts_are_joined_with_a_newline_and_must_be_text():
    """vLLM joins a message's text parts with a newline: joined with nothing, "Hello" and "world"
    reached the model as "Helloworld". A part whose text is null reached it as "None"."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert _chat_prompt({"messages": [{"role": "user", "content": parts}]}) == "<user>Hello\nworld\n<assistant>"
    app, _ = _app()
    bad = {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}
    _error(*_call(app, "/v1/chat/completions", bad), 400, "messages[0].content")


def test_roles_are_openais():
    """A role OpenAI does not define was rendered blindly by the template."""
    app, backend = _app()
    body = {"messages": [{"role": "wizard", "content": "x"}]}
    _error(*_call(app, "/v1/chat/completions", body), 400, "messages[0].role")
    assert not backend.calls
    assert _chat_prompt({"messages": [{"role": "developer", "content": "x"}]}) == "<developer>x\n<assistant>"


def test_a_message_that_is_not_an_object_is_a_400_naming_it():
    """A message of another JSON type (found by the fuzz test: [1]) was unpacked before it was
    checked: a TypeError, a 500."""
    for message in (1, None, "hi", ["user", "hi"]):
        app, backend = _app()
        _error(*_call(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, message]}),
               400, "messages[1]")
        assert not backend.calls


def test_vllms_template_options_are_honoured_or_refused():
    """``add_generation_prompt: false`` and ``chat_template_kwargs`` were dropped: the prompt always
    ended with the generation prompt and the template never saw the kwargs. A kwarg the template does
    not read, or one naming what the server sets, is refused."""
    assert _chat_prompt({**CHAT, "add_generation_prompt": False}) == "<user>hi\n"
    assert _chat_prompt({**CHAT, "chat_template_kwargs": {"flavour": "terse"}}) == "<user>hi\n[terse]<assistant>"
    for kwargs, param in (({"enable_thinking": False}, "chat_template_kwargs.enable_thinking"),
                          ({"messages": []}, "chat_template_kwargs.messages"),
                          ("x", "chat_template_kwargs")):
        app, backend = _app()
        _error(*_call(app, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": kwargs}), 400, param)
        assert not backend.calls


def test_every_error_body_is_openais_error_json():
    """An unknown path or method answered FastAPI's {"detail": ...}; a body nested past the JSON
    parser's depth and a bug in the backend a plain-text 500; a non-string model a 404."""
    app, _ = _app()
    status, raw = _call(app, "/v1/nope", {})
    assert status == 404 and json.loads(raw)["error"]["type"] == "not_found_error", raw
    status, raw = _call(app, "/v1/completions", method="GET")
    assert status == 405 and json.loads(raw)["error"]["type"] == "invalid_request_error", raw
    _error(*_call(app, raw=b"[" * 100000), 400, "body")
    _error(*_call(app, body={**PROMPT, "model": 5}), 400, "model")
    app, _ = _app(FailingBackend(0))
    status, raw = _call(app, body=PROMPT, swallow=True)
    assert status == 500 and json.loads(raw)["error"]["type"] == "server_error", raw
    app, _ = _app()
    assert _call(app, body=PROMPT)[0] == 200          # and the server keeps answering


def test_models_retrieve():
    """``client.models.retrieve(name)`` (GET /v1/models/{id}) was a 404 for the served model too."""
    app, _ = _app()
    status, raw = _call(app, "/v1/models/m", method="GET")
    assert status == 200 and json.loads(raw) == {"id": "m", "object": "model", "created": 0, "owned_by": "nemospec",
                                                 "max_model_len": 256}
    status, raw = _call(app, "/v1/models/other", method="GET")
    assert status == 404 and json.loads(raw)["error"]["param"] == "model"


def test_a_stream_that_fails_midway_ends_with_an_error_event():
    """A bug after the first chunk cut the stream with no error and no [DONE]: a client read the text
    so far as the whole answer."""
    app, _ = _app(FailingBackend(2))
    status, raw = _call(app, body={**PROMPT, "stream": True})
    events = _events(raw)
    assert status == 200 and events[-1]["error"]["code"] == 500, raw
    assert not any(c["finish_reason"] for e in events[:-1] for c in e["choices"])
    assert raw.decode().rstrip().endswith("data: [DONE]")


def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk():
    """vLLM's ``stream_options.continuous_usage_stats`` (aiperf's --per-chunk-usage) was dropped:
    no chunk carried usage, though the client asked for it in each."""
    for path, base in (("/v1/completions", PROMPT), ("/v1/chat/completions", CHAT)):
        app, _ = _app()
        body = {**base, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        status, raw = _call(app, path, body)
        events = _events(raw)
        assert status == 200 and all("usage" in e for e in events), raw
        done = [e["usage"]["completion_tokens"] for e in events]
        assert done == sorted(done) and done[-1] == len(_ids("hello")) + len(_ids(" world")), done
        assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
                   for e in events)
        # include_usage alone: OpenAI's chunks carry "usage": null until the last, which holds the counts
        status, raw = _call(app, path, {**base, "stream": True, "stream_options": {"include_usage": True}})
        events = _events(raw)
        assert status == 200 and all("usage" in e and e["usage"] is None for e in events[:-1]), raw
        assert events[-1]["usage"]["completion_tokens"] == done[-1] and not events[-1]["choices"]


def test_continuous_usage_is_each_choices_own_and_needs_include_usage():
    """With n > 1 each chunk carries its own choice's tokens so far, as vLLM's (every choice's were
    summed into every chunk, so a chunk's count hung on how the choices' responses interleaved); the
    usage chunk sums them. continuous_usage_stats without include_usage adds no usage (vLLM's rule)."""
    hello, world = len(_ids("hello")), len(_ids(" world"))
    for path, base in (("/v1/completions", PROMPT), ("/v1/chat/completions", CHAT)):
        app, _ = _app()
        body = {**base, "n": 2, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        status, raw = _call(app, path, body)
        events, seen = _events(raw), {0: 0, 1: 0}
        assert status == 200, raw
        for e in events[:-1]:
            (c,) = e["choices"]
            text = c["text"] if "text" in c else c["delta"].get("content") or ""
            seen[c["index"]] += {"hello": hello, " world": world, "": 0}[text]
            assert e["usage"]["completion_tokens"] == seen[c["index"]], (path, events)
        assert events[-1]["usage"]["completion_tokens"] == 2 * (hello + world) and not events[-1]["choices"]
        body["stream_options"] = {"continuous_usage_stats": True}
        status, raw = _call(app, path, body)
        assert status == 200 and not any(e.get("usage") for e in _events(raw)), raw


def test_errors_inside_stream_options_name_the_nested_field():
    app, _ = _app()
    body = {**PROMPT, "stream": True, "stream_options": {"include_usage": "yes"}}
    _error(*_call(app, body=body), 400, "stream_options.include_usage")


def test_a_token_id_prompt_is_refused_as_one():
    """A list of token ids was refused as a batch of several prompts."""
    app, _ = _app()
    error = _error(*_call(app, body={"prompt": [1, 2, 3]}), 400, "prompt")
    assert "token-id" in error["message"], error


@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", b'{"prompt": "x = \\ud800", "max_tokens": 4}', "prompt"),
    ("/v1/completions", b'{"prompt": ["\\udfff"], "max_tokens": 4}', "prompt[0]"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["a", "b\\ud83d"]}', "stop[1]"),
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', "model"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud83d"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"\\ud800": 1}}',
     "chat_template_kwargs.\\ud800"),
])
def test_a_lone_surrogate_is_a_400_naming_its_field(path, raw, param):
    """JSON may escape half of a UTF-16 pair (``\\ud800``), which is no Unicode text: the tokenizer
    raised (a 500), and a message quoting it could not be encoded (a 500 in place of the 404 or 400).
    A pair (an emoji written as two escapes) is text and is served."""
    app, _ = _app()
    error = _error(*_call(app, path, raw=raw), 400, param)
    assert "lone surrogate" in error["message"]
    assert _call(app, body={"prompt": "x", "stop": ["\ud83d\ude00"]})[0] == 200     # and the server keeps answering
    assert _call(app, raw=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 4}')[0] == 200


def test_penalties_keep_openais_order_on_a_server_with_tensorrt_llms():
    """The server takes presence and frequency off the temperature-scaled logits (l/T - p, TensorRT-LLM's
    order); OpenAI's and vLLM's come off before the temperature, (l - p)/T: the frontend sends p/T.
    Greedy has no temperature to divide by; the repetition penalty scales, so it goes as it is."""
    from serving.openai import backend
    from serving.openai.protocol import Generation
    from runtime.sampling import GREEDY_BELOW
    assert backend.GREEDY_BELOW == GREEDY_BELOW

    import numpy as np

    def sent(**fields):   # the penalty inputs' values (an InferInput keeps its data as raw bytes)
        inputs = backend.ensemble_inputs(Generation("x", 4, **fields), 4)
        return {t.name(): float(np.frombuffer(t._raw_content, np.float32)[0])
                for t in inputs if t.name().endswith("penalty")}
    assert sent(temperature=0.5, presence_penalty=1.0, frequency_penalty=-0.5, repetition_penalty=1.3) == \
        {"presence_penalty": 2.0, "frequency_penalty": -1.0, "repetition_penalty": pytest.approx(1.3)}
    assert sent(temperature=0.0, presence_penalty=1.0) == {"presence_penalty": 1.0}
    assert sent(temperature=GREEDY_BELOW / 2, presence_penalty=1.0) == {"presence_penalty": 1.0}
    # the server reads the temperature as FP32, under which 1e-5 is below GREEDY_BELOW: greedy there,
    # so the penalty goes unscaled (it went as 1e5, banning every token seen)
    assert np.float32(GREEDY_BELOW) < GREEDY_BELOW
    assert sent(temperature=GREEDY_BELOW, presence_penalty=1.0) == {"presence_penalty": 1.0}

    def ignored(**fields):   # OpenAI's and vLLM's presence and frequency count generated tokens only
        inputs = {t.name(): t for t in backend.ensemble_inputs(Generation("x", 4, **fields), 4)}
        t = inputs.get("prompt_ignore_length")
        return None if t is None else int(np.frombuffer(t._raw_content, np.int32)[0])
    assert ignored(presence_penalty=0.5) == ignored(frequency_penalty=-1.0) == backend.PROMPT_IGNORE_ALL
    assert ignored(repetition_penalty=1.3) is None and ignored() is None


def test_signed_seeds_are_taken_as_vllm_takes_them():
    """vLLM takes any signed 64-bit seed; a negative one was a 400 here. It reaches the ensemble's
    unsigned random_seed in two's complement, so -1 and 2^64 - 1 are one stream."""
    app, backend = _app()
    for seed, sent in ((-1, (1 << 64) - 1), (-(1 << 63), 1 << 63), (7, 7)):
        assert _call(app, body={**PROMPT, "seed": seed})[0] == 200
        assert backend.calls[-1][0].seed == sent
    _error(*_call(app, body={**PROMPT, "seed": -(1 << 63) - 1}), 400, "seed")


def test_an_empty_stream_options_needs_no_stream():
    """vLLM refuses only stream options that ask for something when the answer is not streamed."""
    app, _ = _app()
    assert _call(app, body={**PROMPT, "stream_options": {}})[0] == 200
    _error(*_call(app, body={**PROMPT, "stream_options": {"include_usage": True}}), 400, "stream_options")


def test_a_body_or_prompt_past_the_limits_is_refused_before_it_is_tokenized():
    backend = RecordingBackend()
    info = ModelInfo("m", TOKENIZER, 256, 4, ChatTemplate(TEMPLATE), 0)
    app = create_app(info, backend, limits={"max_body_bytes": 200, "max_prompt_bytes": 20})
    status, raw = _call(app, body={**PROMPT, "pad": "x" * 200})
    assert status == 413 and "--max_body_bytes 200" in json.loads(raw)["error"]["message"]
    _error(*_call(app, body={"prompt": "y" * 21}), 400, "prompt")
    _error(*_call(app, "/v1/chat/completions", body={"messages": [{"role": "user", "content": "y" * 12}]}),
           400, "messages")
    assert _call(app, body={"prompt": "y" * 20})[0] == 200 and len(backend.calls) == 1


def test_a_whole_answer_whose_client_left_is_cancelled():
    """A non-streamed request went on to its full length after the client's timeout, holding a batch
    slot: the frontend now leaves the backend's stream (which cancels the gRPC call) once the client
    has gone."""
    import asyncio

    closed = []

    class EndlessBackend(RecordingBackend):
        async def generate(self, g, max_tokens):
            try:
                while True:
                    yield ScriptedDelta(_ids("x"))
                    await asyncio.sleep(0.01)
            finally:
                closed.append(True)

    app, _ = _app(EndlessBackend())
    messages, received = [], []

    async def receive():
        received.append(asyncio.get_running_loop().time())
        if len(received) == 1:
            return {"type": "http.request", "body": json.dumps(PROMPT).encode(), "more_body": False}
        if received[-1] - received[0] > 0.3:   # the client went away while the answer was being generated
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)              # nothing yet (the app polls with an already cancelled scope)

    async def send(message):
        messages.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
             "scheme": "http", "server": ("test", 80), "client": ("test", 1), "root_path": ""}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
    assert closed == [True]


def test_triton_failures_map_to_statuses_a_client_acts_on():
    """A full queue is a 429 to retry; a dead model process a 503 that says the server is restarting it
    (the raw gRPC text alone read as a crash); a refused field a 400 naming it."""
    from serving.openai.errors import from_triton
    assert from_triton("in ensemble 'ensemble', server busy: 4 requests queued").status == 429
    dead = from_triton("[StatusCode.UNAVAILABLE] Stub process 'speculative_0_0' is not healthy.")
    assert dead.status == 503 and "supervisor restarts it; retry" in dead.message and "speculative_0_0" in dead.message
    assert from_triton("failed to connect to all addresses").status == 503
    assert from_triton("top_k: expected 0..100 (0: no cut), got -1").status == 400
    # a model's own failure, or a failed call, is the server's (a 400 for them told the client its
    # request was wrong, and SDKs do not retry a 400)
    from serving.protocol import FAULT, fault
    assert from_triton(f"speculative{FAULT}generation failed: RuntimeError: x").status == 500
    for model in ("preprocessing", "speculative", "postprocessing"):
        failed = from_triton(f"in ensemble 'ensemble', {fault(model, AttributeError('boom'))}")
        assert failed.status == 500 and failed.kind == "server_error" and "boom" in failed.message
    assert [from_triton(t).status for t in ("INTERNAL: failed to allocate shared memory", "DEADLINE_EXCEEDED: late",
                                            "RESOURCE_EXHAUSTED: out of memory", "UNKNOWN: x")] == [500, 504, 503, 500]
    assert from_triton("Failed to increase the shared memory pool size for key 'x'").status == 500


def test_a_stream_cut_by_a_dead_tritonserver_is_a_503_that_says_so():
    """The supervisor restarts a killed tritonserver; the frontend's gRPC stream then fails with an
    AioRpcError, whose str is a multi-line dump with a debug string: the 503 says what happened in one
    line, with the status and details."""
    import grpc
    from serving.openai.errors import from_triton, grpc_text
    error = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                 details="Stream removed (Socket closed)", debug_error_string="UNKNOWN:Error received")
    assert "debug_error_string" in str(error)
    assert grpc_text(error) == "UNAVAILABLE: Stream removed (Socket closed)"
    cut = from_triton(grpc_text(error))
    assert cut.status == 503 and "\n" not in cut.message and "debug" not in cut.message
    assert "connection to Triton closed mid-request" in cut.message and "retry shortly" in cut.message
    assert grpc_text(ValueError("plain")) == "plain"
