"""The OpenAI frontend's answers against a scripted backend (no Triton): what it reports is what was
generated. A stream the server ended without a finish reason is an error, not a 200 "stop"; usage
counts a speculative response's tokens only up to the one that completes a stop string."""
import asyncio
import json

from tokenizers import Tokenizer

from builder import embedded
from serving.openai.app import ModelInfo, create_app
from serving.openai.chat_template import ChatTemplate
from serving.openai.backend import Delta

TOKENIZER = Tokenizer.from_file(str(embedded.target_dir() / "tokenizer.json"))


class ScriptedDelta(Delta):
    """A response with its token ids and their log-probabilities (a real one reads them from its
    Triton result)."""
    def __init__(self, ids, finish_reason="", logprobs=None, alternatives=None):
        super().__init__(TOKENIZER.decode(ids), len(ids), finish_reason)
        self.__dict__["ids"] = list(ids)
        self.__dict__["logprobs"] = list(logprobs if logprobs is not None else [-0.5] * len(ids))
        self.__dict__["alternatives"] = list(alternatives or [])


class ScriptedBackend:
    def __init__(self, responses):
        self.responses, self.stops, self.calls = responses, [], []

    def stopped(self, delta):   # the response a stop string matched in: reported complete to the server
        self.stops.append(delta)

    async def ready(self):
        return True

    async def close(self):
        pass

    async def generate(self, g, max_tokens):
        self.calls.append(g)
        for d in self.responses:
            if d is FAIL:
                raise RuntimeError("the stream broke")
            yield d


FAIL = object()   # a scripted response that breaks the stream


def _call(app, path="/v1/completions", body=None, method="POST", raw=None, swallow=False):
    """One request through the ASGI app: (status, body bytes). ``swallow``: the app re-raises an
    unexpected exception after answering it (Starlette's server-error path); keep the answer."""
    messages, sent = [], []
    data = raw if raw is not None else json.dumps(body).encode() if body is not None else b""

    async def receive():
        if not sent:
            sent.append(True)
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.sleep(3600)

    async def send(message):
        messages.append(message)

    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "http_version": "1.1", "scheme": "http",
             "server": ("test", 80), "client": ("test", 1), "root_path": ""}
    try:
        asyncio.run(app(scope, receive, send))
    except RuntimeError:
        if not swallow:
            raise
    status = next(m["status"] for m in messages if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")


def _post(app, body: dict, path: str = "/v1/completions"):
    """One POST through the ASGI app: (status, body bytes)."""
    return _call(app, path, body)


def _app(responses):
    info = ModelInfo("m", TOKENIZER, 256, 4, None, 0)
    return create_app(info, ScriptedBackend(responses))


def _ids(text):
    return TOKENIZER.encode(text).ids


def test_a_generation_ended_without_a_finish_reason_is_an_error():
    partial = [ScriptedDelta(_ids("def f(x):"))]         # then the stream closes: no final response
    status, body = _post(_app(partial), {"prompt": "p", "max_tokens": 16})
    assert status == 500 and "without finishing" in json.loads(body)["error"]["message"], body
    status, body = _post(_app(partial), {"prompt": "p", "max_tokens": 16, "stream": True})
    events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
    assert "error" in events[-1] and not any(e.get("choices", [{}])[0].get("finish_reason") for e in events[:-1])


def test_usage_counts_up_to_the_token_that_completes_a_stop_string():
    first, step = _ids("def f(x):\n"), _ids("    return x\n\nprint(f(2))")
    cut = next(n for n in range(1, len(step) + 1) if "\n\n" in TOKENIZER.decode(step[:n]))
    assert cut < len(step)           # the step's response carries tokens past the stop
    responses = [ScriptedDelta(first), ScriptedDelta(step), ScriptedDelta(_ids(" more"), "length")]
    for stream in (False, True):
        backend = ScriptedBackend(responses)
        status, body = _post(create_app(ModelInfo("m", TOKENIZER, 256, 4, None, 0), backend),
                             {"prompt": "p", "max_tokens": 64, "stop": "\n\n", "stream": stream,
                              "stream_options": {"include_usage": True} if stream else None})
        assert backend.stops == [responses[1]]    # the request reported complete to the server, once
        assert status == 200, body
        if stream:
            events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
            text = "".join(c["text"] for e in events for c in e["choices"])
            usage, reason = events[-1]["usage"], [c["finish_reason"] for e in events for c in e["choices"]][-1]
        else:
            out = json.loads(body)
            text, usage, reason = out["choices"][0]["text"], out["usage"], out["choices"][0]["finish_reason"]
        assert text == "def f(x):\n    return x" and reason == "stop"
        assert usage["completion_tokens"] == len(first) + cut, (usage, len(first), cut)


def _events(body: bytes) -> list:
    return [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]


def test_logprobs_are_the_chosen_tokens_up_to_the_stop():
    """completions ``logprobs: 0`` and chat ``logprobs: true``: each returned token with the
    log-probability the server sent for it, in order, ending at the token that completes the stop
    string; streamed, each chunk carries its tokens'."""
    first, step = _ids("def f(x):\n"), _ids("    return x\n\nprint(f(2))")
    cut = next(n for n in range(1, len(step) + 1) if "\n\n" in TOKENIZER.decode(step[:n]))
    lps = [-0.25 * (i + 1) for i in range(len(first) + len(step))]
    responses = [ScriptedDelta(first, logprobs=lps[:len(first)]), ScriptedDelta(step, logprobs=lps[len(first):])]
    kept_ids, kept_lps = first + step[:cut], lps[:len(first) + cut]
    pieces = [TOKENIZER.decode([t]) for t in kept_ids]
    body = {"prompt": "p", "max_tokens": 64, "stop": "\n\n", "logprobs": 0}
    status, raw = _post(_app(responses), body)
    got = json.loads(raw)["choices"][0]["logprobs"]
    assert status == 200 and got["tokens"] == pieces and got["token_logprobs"] == kept_lps
    assert got["text_offset"] == [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    assert got["top_logprobs"] == [{p: lp} for p, lp in zip(pieces, kept_lps)]
    status, raw = _post(_app(responses), {**body, "stream": True})
    chunks = [c["logprobs"] for e in _events(raw) for c in e["choices"] if c["logprobs"]]
    assert [t for c in chunks for t in c["tokens"]] == pieces
    assert [o for c in chunks for o in c["text_offset"]] == got["text_offset"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stop": "\n\n", "logprobs": True}
    info = ModelInfo("m", TOKENIZER, 256, 4, ChatTemplate("{{ messages[0]['content'] }}"), 0)
    status, raw = _post(create_app(info, ScriptedBackend(responses)), chat, "/v1/chat/completions")
    content = json.loads(raw)["choices"][0]["logprobs"]["content"]
    assert status == 200 and [c["token"] for c in content] == pieces and [c["logprob"] for c in content] == kept_lps
    assert all(c["top_logprobs"] == [] and bytes(c["bytes"]).decode() == c["token"] for c in content)
    status, raw = _post(_app(responses), {**body, "logprobs": None})
    assert status == 200 and json.loads(raw)["choices"][0]["logprobs"] is None


def test_top_logprobs_are_the_alternatives_the_server_sent():
    """chat ``top_logprobs`` N (with ``logprobs: true``) and completions ``logprobs`` N: each token's
    alternatives as the server sent them, most probable first (completions: beside the chosen token,
    as vLLM's); N past 20 or chat's without ``logprobs: true`` is a 400 naming the field."""
    ids = _ids("def f(x):")
    alternatives = [[(t, -0.1), ((t + 1) % 100, -2.5)] for t in ids]
    responses = [ScriptedDelta(ids, "length", alternatives=alternatives)]
    info = ModelInfo("m", TOKENIZER, 256, 4, ChatTemplate("{{ messages[0]['content'] }}"), 0)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "logprobs": True, "top_logprobs": 2}
    status, raw = _post(create_app(info, ScriptedBackend(responses)), chat, "/v1/chat/completions")
    content = json.loads(raw)["choices"][0]["logprobs"]["content"]
    assert status == 200 and len(content) == len(ids)
    for c, top in zip(content, alternatives):
        assert [(a["token"], a["logprob"]) for a in c["top_logprobs"]] == [(TOKENIZER.decode([t]), v) for t, v in top]
        assert all(bytes(a["bytes"]) == TOKENIZER.decode([t]).encode() for a, (t, _) in zip(c["top_logprobs"], top))
    status, raw = _post(_app(responses), {"prompt": "p", "max_tokens": 64, "logprobs": 2})
    got = json.loads(raw)["choices"][0]["logprobs"]
    assert status == 200 and got["top_logprobs"] == [
        {TOKENIZER.decode([t]): -0.5, TOKENIZER.decode([(t + 1) % 100]): -2.5} for t in ids]
    for refused, path, field in (({"prompt": "p", "logprobs": 21}, "/v1/completions", "logprobs"),
                                 ({**chat, "top_logprobs": 21}, "/v1/chat/completions", "top_logprobs"),
                                 ({**chat, "logprobs": False}, "/v1/chat/completions", "top_logprobs")):
        status, raw = _post(create_app(info, ScriptedBackend(responses)), refused, path)
        assert status == 400 and json.loads(raw)["error"]["param"] == field, raw


def test_stop_strings_wait_for_min_tokens():
    """With ``min_tokens``, a stop string in the first tokens does not end the text (vLLM's rule);
    one after them does."""
    early, late = _ids("a\n\nb"), _ids(" c\n\nd")
    responses = [ScriptedDelta(early), ScriptedDelta(late), ScriptedDelta(_ids(" e"), "length")]
    body = {"prompt": "p", "max_tokens": 64, "stop": "\n\n"}
    status, raw = _post(_app(responses), body)
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == "a"
    status, raw = _post(_app(responses), {**body, "min_tokens": len(early)})
    out = json.loads(raw)["choices"][0]
    assert status == 200 and out["text"] == "a\n\nb c" and out["finish_reason"] == "stop", out


def test_logprobs_of_tokens_that_split_a_character():
    """A byte-level token can be one byte of a character: chat's ``bytes`` are that byte (they
    were the replacement character's three, so a client could not join the text again), and
    completions' ``text_offset`` counts the characters before each token, whole or split, also
    when a stream's response ends inside a character."""
    text = "é ü ß naïve → 日本"
    ids = _ids(text)
    assert len(ids) > len(text) and "\ufffd" in TOKENIZER.decode(ids[:1])    # the tokenizer splits characters
    cut = next(i for i in range(1, len(ids)) if TOKENIZER.decode(ids[:i]).endswith("\ufffd"))  # mid-character
    responses = [ScriptedDelta(ids[:cut]), ScriptedDelta(ids[cut:], "length")]
    info = ModelInfo("m", TOKENIZER, 256, 4, ChatTemplate("{{ messages[0]['content'] }}"), 0)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "logprobs": True}
    status, raw = _post(create_app(info, ScriptedBackend(responses)), chat, "/v1/chat/completions")
    content = json.loads(raw)["choices"][0]["logprobs"]["content"]
    assert status == 200 and b"".join(bytes(c["bytes"]) for c in content).decode("utf-8") == text
    body = {"prompt": "p", "max_tokens": 64, "logprobs": 0}
    # each token's offset: the whole characters of the text its predecessors' bytes make
    want = [len(TOKENIZER.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
    for stream in (False, True):
        status, raw = _post(_app(responses), {**body, "stream": stream})
        chunks = ([json.loads(raw)["choices"][0]["logprobs"]] if not stream else
                  [c["logprobs"] for e in _events(raw) for c in e["choices"] if c["logprobs"]])
        assert status == 200 and [o for c in chunks for o in c["text_offset"]] == want, stream


def _as_the_server_sends(tokenizer, prompt_ids, groups, finish="length"):
    """Responses holding ``groups`` of ids, each with the text the speculative model and the
    postprocessing model give it (its window of the prompt and the ids sent before)."""
    from serving import protocol
    byte_ids, responses, emitted = protocol.byte_fallback_ids(tokenizer), [], []
    for i, group in enumerate(groups):
        last = i == len(groups) - 1
        context, prefix = protocol.stream_window(protocol.text_history(prompt_ids, emitted), group, byte_ids)
        responses.append(ScriptedDelta(group, finish if last else ""))
        responses[-1].text = protocol.stream_text(tokenizer, context, prefix, finished=last)
        emitted += group
    return responses


def test_a_sentencepiece_answer_reads_as_it_does_after_the_prompt():
    """A SentencePiece-style decoder strips a text's first space, so the answer's first token decoded
    alone lost it: 'the cat' + '\u2581a \u2581cat' answered 'a cat' (the prompt and the answer then
    join as 'the cata cat'). The server's text is now the answer as it reads after the prompt,
    streamed or whole, as vLLM primes its detokenizer with the prompt (the oracle: the decode of
    prompt + answer less the prompt's)."""
    from sentencepiece_tokenizer import sentencepiece_tokenizer
    from serving import protocol
    tokenizer = sentencepiece_tokenizer()
    prompt = tokenizer.encode("the cat").ids
    answer = tokenizer.encode("a cat the \u3042 cat", add_special_tokens=False).ids
    want = tokenizer.decode(prompt + answer)[len(tokenizer.decode(prompt)):]
    assert want.startswith(" a cat")
    for groups in ([answer], [answer[:1], answer[1:5], answer[5:]], [[t] for t in answer]):
        assert "".join(d.text for d in _as_the_server_sends(tokenizer, prompt, groups)) == want, groups
    before = protocol.prompt_context(prompt, protocol.byte_fallback_ids(tokenizer))    # a whole answer
    assert protocol.stream_text(tokenizer, before + answer, len(before), finished=True) == want
    assert protocol.answer_text(tokenizer, prompt, answer) == want                     # nemospec generate's
    assert tokenizer.decode(answer) == want[1:]   # what it answered before


def test_logprobs_of_a_sentencepiece_tokenizer_read_as_the_text_does():
    """Decoded alone, every SentencePiece token lost its space: 'the', 'cat', 'the' with text_offset
    [0, 3, 6] for 'the cat the', and chat bytes that joined to 'thecatthe'. Each token now reads as
    it does in the answer, the first too (it follows the prompt); across a stream's responses too,
    and with byte-fallback tokens splitting a character."""
    from sentencepiece_tokenizer import sentencepiece_tokenizer
    tokenizer = sentencepiece_tokenizer()
    text = " the cat the \u3042 cat"
    ids = tokenizer.encode(text[1:]).ids
    info = ModelInfo("m", tokenizer, 256, 4, ChatTemplate("{{ messages[0]['content'] }}"), 0)
    want = [len(tokenizer.decode(ids[:i]).rstrip("\ufffd")) + (i > 0) for i in range(len(ids))]
    for stream in (False, True):
        responses = _as_the_server_sends(tokenizer, tokenizer.encode("cat").ids, (ids[:2], ids[2:5], ids[5:]))
        assert "".join(d.text for d in responses) == text   # the second response ends mid-character
        chat = {"messages": [{"role": "user", "content": "cat"}], "max_tokens": 64, "logprobs": True, "stream": stream}
        status, raw = _post(create_app(info, ScriptedBackend(responses)), chat, "/v1/chat/completions")
        content = ([c for e in _events(raw) for ch in e["choices"] if ch.get("logprobs") for c in ch["logprobs"]["content"]]
                   if stream else json.loads(raw)["choices"][0]["logprobs"]["content"])
        assert status == 200 and b"".join(bytes(c["bytes"]) for c in content).decode("utf-8") == text, stream
        assert [c["token"] for c in content[:3]] == [" the", " cat", " the"], stream
        status, raw = _post(create_app(info, ScriptedBackend(responses)),
                            {"prompt": "cat", "max_tokens": 64, "logprobs": 0, "stream": stream})
        chunks = ([json.loads(raw)["choices"][0]["logprobs"]] if not stream else
                  [c["logprobs"] for e in _events(raw) for c in e["choices"] if c["logprobs"]])
        assert [o for c in chunks for o in c["text_offset"]] == want, stream
        assert [t for c in chunks for t in c["tokens"]][:3] == [" the", " cat", " the"], stream


def test_a_stop_after_a_long_run_of_byte_tokens_counts_the_same_in_any_responses():
    """The frontend decoded a response's tokens after the last 4 responses only; a run of byte
    tokens that began before them then read as U+FFFD, the stop was not found among the tokens, and
    usage counted the whole response (11 tokens for a stop completed by the 10th: one token a
    response, then the 10th with the 11th). It now decodes after the ids themselves, as the server does."""
    from sentencepiece_tokenizer import sentencepiece_tokenizer
    tokenizer = sentencepiece_tokenizer()
    ids = tokenizer.encode("\u65e5\u672c\u8a9e a cat").ids     # '\u2581' then 9 byte tokens: 3 characters
    through = next(n for n in range(len(ids) + 1) if "\u8a9e" in tokenizer.decode(ids[:n]))
    info = ModelInfo("m", tokenizer, 256, 4, None, 0)
    for groups in ([[t] for t in ids[:through - 1]] + [ids[through - 1:through + 1], ids[through + 1:]],
                   [ids[:7], ids[7:through], ids[through:through + 2], ids[through + 2:]]):
        for stream in (False, True):
            responses = _as_the_server_sends(tokenizer, tokenizer.encode("p").ids, groups)
            body = {"prompt": "p", "max_tokens": 64, "stop": "\u8a9e", "logprobs": 0, "stream": stream,
                    **({"stream_options": {"include_usage": True}} if stream else {})}
            status, raw = _post(create_app(info, ScriptedBackend(responses)), body)
            out = _events(raw) if stream else [json.loads(raw)]
            tokens = [t for e in out for c in e["choices"] if c.get("logprobs") for t in c["logprobs"]["tokens"]]
            text = "".join(c["text"] for e in out for c in e["choices"])
            assert (status, text, out[-1]["usage"]["completion_tokens"], len(tokens)) == (
                200, " \u65e5\u672c", through, through), (groups, stream)


def test_min_tokens_arms_stop_strings_at_a_token_whatever_the_responses_hold():
    """``min_tokens`` arms the stop strings from the token past it on, as vLLM decides per token: the
    answer is the same whether the server sent one token a response, a speculative step's several, or
    joined responses while the client was slow (streamed and whole answers once differed when a
    response crossed min_tokens: a fuzz test's flaky failure)."""
    ids = _ids("x = a + b + c + d")           # 'x', ' =', ' a', ' +', ' b', ...: each past the first has ' '
    groupings = [[ids], [ids[:1], ids[1:]], [ids[:2], ids[2:5], ids[5:]], [[t] for t in ids]]
    for min_tokens, text, used in ((0, "x", 2), (2, "x =", 3), (4, "x = a +", 5)):
        answers = set()
        for groups in groupings:
            responses = [ScriptedDelta(g) for g in groups[:-1]] + [ScriptedDelta(groups[-1], "length")]
            for stream in (False, True):
                body = {"prompt": "p", "max_tokens": 64, "stop": " ", "min_tokens": min_tokens, "stream": stream,
                        "stream_options": {"include_usage": True} if stream else None}
                status, raw = _post(_app(responses), body)
                assert status == 200, raw
                if stream:
                    events = _events(raw)
                    answers.add(("".join(c["text"] for e in events for c in e["choices"]),
                                 events[-1]["usage"]["completion_tokens"]))
                else:
                    out = json.loads(raw)
                    answers.add((out["choices"][0]["text"], out["usage"]["completion_tokens"]))
        assert answers == {(text, used)}, (min_tokens, answers)


def test_metrics_are_vllms_names_beside_the_servers_own_and_open_as_vllms_are():
    """/metrics on the OpenAI port (a 404 before): Triton's text with the families that mean what
    vLLM's do renamed; without an API key, as vLLM serves it; a 503 while Triton's cannot be read."""
    import http.server
    import threading
    from prometheus_client.parser import text_string_to_metric_families
    triton = ('# HELP nemospec_spec_decode_num_drafts_total Draft proposals\n'
              '# TYPE nemospec_spec_decode_num_drafts_total counter\n'
              'nemospec_spec_decode_num_drafts_total{model="speculative",version="1"} 12\n'
              '# HELP nemospec_inter_token_latency_seconds ITL\n# TYPE nemospec_inter_token_latency_seconds histogram\n'
              'nemospec_inter_token_latency_seconds_count{model="speculative",version="1"} 3\n'
              'nemospec_inter_token_latency_seconds_sum{model="speculative",version="1"} 0.25\n'
              'nemospec_inter_token_latency_seconds_bucket{model="speculative",version="1",le="+Inf"} 3\n')

    class Triton(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(triton.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Triton)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        info = ModelInfo("mine", TOKENIZER, 256, 4, None, 0)
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        status, raw = _call(create_app(info, ScriptedBackend([]), api_key="k", metrics_url=lambda: url), "/metrics",
                            method="GET")
    finally:
        server.shutdown()
        server.server_close()
    samples = {s.name: s for f in text_string_to_metric_families(raw.decode()) for s in f.samples}
    assert status == 200 and raw.decode().endswith(triton)
    assert samples["vllm:spec_decode_num_drafts_total"].value == 12
    assert samples["vllm:spec_decode_num_drafts_total"].labels == {"model_name": "mine", "engine": "0"}
    assert not any(n.startswith("vllm:inter_token") for n in samples)   # ours is per interval, vLLM's per token
    status, raw = _call(create_app(info, ScriptedBackend([]), metrics_url=url), "/metrics", method="GET")
    assert status == 503 and url in raw.decode()                           # Triton gone: the scrape fails


def test_n_choices_are_a_request_each_seeded_as_vllm_seeds_them():
    """``n`` > 1 was a 400. Each choice is a request of its own (vLLM's parallel sampling), choice i
    seeded seed + i; usage counts the prompt once and every choice's tokens; a stream carries each
    choice's chunks under its index, each with one finish reason, then one usage chunk."""
    ids = _ids("def f(x):\n    return x")
    for stream in (False, True):
        backend = ScriptedBackend([ScriptedDelta(ids[:3]), ScriptedDelta(ids[3:], "length")])
        body = {"prompt": "p", "max_tokens": 64, "n": 3, "seed": 5, "stream": stream, "logprobs": 0,
                **({"stream_options": {"include_usage": True}} if stream else {})}
        status, raw = _post(create_app(ModelInfo("m", TOKENIZER, 256, 4, None, 0), backend), body)
        assert status == 200 and [g.seed for g in backend.calls] == [5, 6, 7] and {g.n for g in backend.calls} == {3}
        events = _events(raw) if stream else [json.loads(raw)]
        texts, reasons, tokens = {}, {}, {}
        for e in events:
            for c in e["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                tokens[c["index"]] = tokens.get(c["index"], 0) + len((c["logprobs"] or {}).get("tokens", []))
                if c["finish_reason"]:
                    assert c["index"] not in reasons, "one finish reason a choice"
                    reasons[c["index"]] = c["finish_reason"]
        want = TOKENIZER.decode(ids)
        assert texts == {i: want for i in range(3)} and reasons == {i: "length" for i in range(3)}, (texts, reasons)
        assert tokens == {i: len(ids) for i in range(3)}
        assert events[-1]["usage"]["completion_tokens"] == 3 * len(ids) and not (stream and events[-1]["choices"])
    for chat in (False, True):    # one choice failing ends the answer with an error, never a whole-looking one
        backend = ScriptedBackend([ScriptedDelta(ids[:3]), FAIL, ScriptedDelta(ids[3:], "length")])
        body = {"max_tokens": 64, "n": 2, "stream": True,
                **({"messages": [{"role": "user", "content": "p"}]} if chat else {"prompt": "p"})}
        info = ModelInfo("m", TOKENIZER, 256, 4, ChatTemplate("{{ messages[0]['content'] }}"), 0)
        status, raw = _call(create_app(info, backend), "/v1/chat/completions" if chat else "/v1/completions", body)
        events = _events(raw)
        assert status == 200 and "error" in events[-1] and not any(
            c["finish_reason"] for e in events[:-1] for c in e.get("choices", [])), events
    status, raw = _post(_app([ScriptedDelta(ids, "length")]), {"prompt": "p", "n": 2, "best_of": 2})
    assert status == 200 and len(json.loads(raw)["choices"]) == 2


def test_a_client_gone_mid_stream_closes_every_choices_stream():
    """A client that leaves an ``n`` = 3 stream: each choice's Triton stream is closed (which cancels
    its request on the server), none left reading."""
    closed = []

    class Endless(ScriptedBackend):
        async def generate(self, g, max_tokens):
            try:
                while True:
                    await asyncio.sleep(0.005)
                    yield ScriptedDelta(_ids(" x"))
            finally:
                closed.append(g.seed)

    sent, body = [], json.dumps({"prompt": "p", "n": 3, "seed": 1, "stream": True, "max_tokens": 100}).encode()

    async def receive():
        if not sent:
            sent.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(0.3)                   # chunks of every choice flow, then the client leaves
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
             "scheme": "http", "server": ("test", 80), "client": ("test", 1), "root_path": ""}

    async def main():
        await create_app(ModelInfo("m", TOKENIZER, 256, 4, None, 0), Endless([]))(scope, receive, send)
        await asyncio.sleep(0.05)
    asyncio.run(main())
    chunks = b"".join(m.get("body", b"") for m in sent[1:] if isinstance(m, dict)).decode()
    assert {e["choices"][0]["index"] for e in _events(chunks.encode())} == {0, 1, 2}, chunks[:500]
    assert sorted(closed) == [1, 2, 3], closed


def test_vllms_tokenizer_endpoints_count_as_the_answers_do():
    """vLLM's /tokenize (a prompt, or a chat rendered as the chat endpoint renders it) and
    /detokenize, open without the API key as vLLM's are; /version. The oracle: the tokenizer itself
    and the usage a completion reports for the same prompt."""
    info = ModelInfo("m", TOKENIZER, 256, 4, ChatTemplate("<{{ messages[0]['role'] }}>{{ messages[0]['content'] }}"), 0)
    app = create_app(info, ScriptedBackend([ScriptedDelta(_ids(" x"), "length")]), api_key="k")
    status, raw = _call(app, "/tokenize", {"prompt": "def f(x):", "return_token_strs": True})
    answer = json.loads(raw)
    assert status == 200 and answer["tokens"] == _ids("def f(x):") and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == 256 and answer["token_strs"] == [TOKENIZER.id_to_token(t) for t in answer["tokens"]]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    status, raw = _call(app, "/tokenize", chat)
    assert status == 200 and json.loads(raw)["tokens"] == TOKENIZER.encode("<user>hi", add_special_tokens=False).ids
    app = create_app(info, ScriptedBackend([ScriptedDelta(_ids(" x"), "length")]))
    usage = json.loads(_call(app, "/v1/chat/completions", {**chat, "max_tokens": 4})[1])["usage"]
    assert usage["prompt_tokens"] == json.loads(_call(app, "/tokenize", chat)[1])["count"]
    status, raw = _call(app, "/detokenize", {"tokens": _ids("def f(x):")})
    assert status == 200 and json.loads(raw) == {"prompt": "def f(x):"}
    for bad_tokens in ([1, "a"], [TOKENIZER.get_vocab_size()], "1 2"):
        status, raw = _call(app, "/detokenize", {"tokens": bad_tokens})
        assert status == 400 and json.loads(raw)["error"]["param"] == "tokens", raw
    status, raw = _call(app, "/version", method="GET")
    assert status == 200 and json.loads(raw)["version"]


def test_the_responses_api_is_the_chat_path_stateless_and_says_so():
    """POST /v1/responses: instructions and input rendered as chat messages; the answer one assistant
    message (``incomplete`` at max_output_tokens, as OpenAI's); a stream's events in OpenAI's order;
    what needs a stored response, tools or non-text parts is a 400 naming the field."""
    info = ModelInfo("m", TOKENIZER, 256, 4, ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"), 0)
    ids = _ids("def f(x):")
    backend = ScriptedBackend([ScriptedDelta(ids[:2]), ScriptedDelta(ids[2:], "length")])
    body = {"model": "m", "instructions": "be brief", "max_output_tokens": len(ids),
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}, {"type": "input_text", "text": "there"}]}]}
    status, raw = _call(create_app(info, backend), "/v1/responses", body)
    answer = json.loads(raw)
    assert status == 200 and backend.calls[0].prompt == "<system>be brief<user>hi\nthere", backend.calls[0].prompt
    assert backend.calls[0].max_tokens == len(ids) and answer["object"] == "response"
    assert answer["status"] == "incomplete" and answer["incomplete_details"] == {"reason": "max_output_tokens"}
    assert answer["output"][0]["content"][0]["text"] == TOKENIZER.decode(ids)
    assert answer["usage"]["output_tokens"] == len(ids) and answer["usage"]["input_tokens"] == len(
        TOKENIZER.encode("<system>be brief<user>hi\nthere", add_special_tokens=False).ids)
    backend = ScriptedBackend([ScriptedDelta(ids[:2]), ScriptedDelta(ids[2:], "stop")])
    status, raw = _call(create_app(info, backend), "/v1/responses", {"input": "hi", "stream": True})
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"], kinds
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"].endswith(".delta")) == events[-1]["response"]["output"][0][
        "content"][0]["text"] == TOKENIZER.decode(ids)
    # a failure mid-stream ends with OpenAI's terminal response.failed (a bare error event closed nothing)
    status, raw = _call(create_app(info, ScriptedBackend([ScriptedDelta(ids[:2]), FAIL])), "/v1/responses",
                        {"input": "hi", "stream": True}, swallow=True)
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events[-3:]] == ["response.output_text.delta", "error", "response.failed"], events
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] and failed["output"][0]["status"] == "incomplete"
    assert failed["error"]["code"] == "server_error"      # OpenAI's names, not the HTTP status
    assert failed["output"][0]["content"][0]["text"] == TOKENIZER.decode(ids[:2])
    for field, value in (("previous_response_id", "resp_1"), ("tools", [{"type": "function", "name": "f"}]),
                         ("reasoning", {"effort": "low"}), ("text", {"format": {"type": "json_object"}}),
                         ("input", [{"type": "function_call_output", "call_id": "c", "output": "x"}]),
                         ("max_completion_tokens", 4)):
        status, raw = _call(create_app(info, ScriptedBackend([])), "/v1/responses", {"input": "hi", field: value})
        assert status == 400 and json.loads(raw)["error"]["param"].startswith(field), (field, raw)
    for body, param in (({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                         "input[0].content[0]"),
                        ({"input": [{"role": 5, "content": "x"}]}, "input[0].role"),
                        ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),   # named as sent
                        ({"input": "hi", "max_output_tokens": -3}, "max_output_tokens")):
        status, raw = _call(create_app(info, ScriptedBackend([])), "/v1/responses", body)
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == param and "max_completion" not in error["message"], raw


def test_a_choice_refused_before_streaming_is_the_answers_status_and_every_stream_closes():
    """n = 3 streamed, one choice refused at once (a full queue: 429) while the others still prefill:
    the read of the others' first responses was still running when their streams were closed, so
    the answer became a 500 (``aclose(): asynchronous generator is already running``)."""
    from serving.openai.errors import APIError
    closed = []

    class OneRefused(ScriptedBackend):
        async def generate(self, g, max_tokens):
            try:
                if g.seed == 1:
                    raise APIError(429, "server busy")
                await asyncio.sleep(0.1)
                while True:
                    yield ScriptedDelta(_ids(" x"))
                    await asyncio.sleep(0.01)
            finally:
                closed.append(g.seed)

    status, raw = _call(create_app(ModelInfo("m", TOKENIZER, 256, 4, None, 0), OneRefused([])), "/v1/completions",
                        {"prompt": "p", "n": 3, "seed": 1, "stream": True, "max_tokens": 100})
    assert status == 429 and "server busy" in raw.decode() and sorted(closed) == [1, 2, 3], (status, raw, closed)


def test_a_choice_whose_stream_is_cancelled_ends_the_answer_with_an_error():
    """A choice's gRPC call cancelled under it (CancelledError, not an Exception) left the merge of
    the choices waiting for it forever: no error event, no [DONE]."""
    class Cancelled(ScriptedBackend):
        async def generate(self, g, max_tokens):
            yield ScriptedDelta(_ids(" x"))
            if g.seed == 2:
                raise asyncio.CancelledError()
            yield ScriptedDelta(_ids(" y"), "length")

    async def main():
        app = create_app(ModelInfo("m", TOKENIZER, 256, 4, None, 0), Cancelled([]))
        return await asyncio.wait_for(asyncio.to_thread(_call, app, "/v1/completions",
                                                        {"prompt": "p", "n": 2, "seed": 1, "stream": True}), 10)
    status, raw = asyncio.run(main())
    assert status == 200 and "error" in _events(raw)[-1] and raw.decode().endswith("data: [DONE]\n\n"), raw
