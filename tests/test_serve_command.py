"""`nemospec serve` as a command: run as a user runs it (endpoints printed and written, SIGINT), the
ports it picks and the errors that name a flag, the measured draft-length schedule, a tokenizer's BOS.
Each test starts its own server on the engine directories of tests/serving_helpers.py."""
import json
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from nemospec import cli
from serving import launch
from serving_helpers import (NEEDS_TRITON, OPTIONS, PROMPTS, draft_target_engine_dir, engine_dir,  # noqa: F401
                             free_ports, generate, metric, offline)

pytestmark = NEEDS_TRITON


def _serve(engine_dir, tmp_path, *flags):
    """`nemospec serve` in a subprocess with an OpenAI frontend, as a user runs it, read up to its
    ready line: (the process, the endpoints it printed, its http/grpc/metrics ports)."""
    for attempt in range(3):  # retried only if a port picked free was taken before the server bound it
        ports = [launch.free_port() for _ in range(3)]
        cmd = [sys.executable, "-m", "nemospec.cli", "serve", "--engine_dir", str(engine_dir),
               "--http_port", str(ports[0]), "--grpc_port", str(ports[1]), "--metrics_port", str(ports[2]),
               "--model_repo_dir", str(tmp_path / "repo"), "--openai_port", "0",
               "--backend", "torch", "--endpoints_json", str(tmp_path / "endpoints.json"), *flags]
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("openai"):
                break
        if lines or attempt == 2:
            break
        stderr = process.communicate(timeout=60)[1]
        assert "already in use" in " ".join(stderr.split()), stderr  # (rich wraps long lines)
    assert any(f"127.0.0.1:{ports[0]}" in line for line in lines), (lines, process.poll())
    for line in process.stderr:   # the ready line comes after the endpoints (stdout, the JSON file)
        if line.startswith("ready;"):
            break
    return process, dict(line.split() for line in lines), ports


def _stop(process):
    """A server a failed assertion left running: stopped the clean way first."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_cli_serve_draft_target_engine_and_sigint(draft_target_engine_dir, tmp_path):
    """`nemospec serve` as a user runs it, on a draft_target engine directory: the served greedy
    output equals offline generation; SIGINT stops the server and exits 0."""
    engine_dir = draft_target_engine_dir
    process, printed, ports = _serve(engine_dir, tmp_path, "--max_batch_size", "2")
    try:
        openai_url = printed["openai"]
        assert json.loads((tmp_path / "endpoints.json").read_text()) == printed
        assert {"http", "grpc", "ready", "openai"} <= set(printed)
        with urllib.request.urlopen(f"{openai_url}/models", timeout=10) as r:
            assert json.loads(r.read())["data"][0]["id"] == "engine_dt"
        with urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/v2/health/ready", timeout=10) as r:
            assert r.status == 200
        assert (tmp_path / "repo" / "speculative" / "config.pbtxt").is_file()
        want = offline(engine_dir, PROMPTS[0], 24)
        assert want["acceptance"]["mean_accepted_tokens"] > 1.0, "the noisy-copy draft agrees often"
        request = urllib.request.Request(f"http://127.0.0.1:{ports[0]}/v2/models/ensemble/generate", method="POST",
                                         data=json.dumps({"text_input": PROMPTS[0], "max_tokens": 24,
                                                              "exclude_input_in_output": True}).encode())
        with urllib.request.urlopen(request, timeout=120) as r:
            got = json.loads(r.read())
        assert got["output_ids"] == want["output_ids"] and got["text_output"] == want["text"]
        assert got["mean_accepted_tokens"] == pytest.approx(want["acceptance"]["mean_accepted_tokens"])
        deadline = time.monotonic() + 10   # vLLM's names; the model publishes its counters every 0.1 s
        while True:
            with urllib.request.urlopen(openai_url.removesuffix("/v1") + "/metrics", timeout=10) as r:
                text = r.read().decode()
            drafts = re.search(r'^vllm:spec_decode_num_drafts_total\{engine="0",model_name="engine_dt"\} (\S+)', text, re.M)
            if drafts is None or float(drafts.group(1)) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert drafts is not None and float(drafts.group(1)) > 0, text
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/v2/health/ready", timeout=2)
    finally:
        _stop(process)


def test_sigterm_lets_openai_streams_in_flight_end_whole(engine_dir, tmp_path):
    """SIGTERM with OpenAI streams running and queued behind them (one sequence at a time, so the
    last ends seconds after the signal): each ends whole, every token and [DONE], and serve exits 0;
    a request sent meanwhile is refused (503, "the server is shutting down"), and the HTTP port's
    readiness probes say so (they answered Triton's 200 through the drain). Before: Triton 2.51's
    gRPC endpoint, once signalled, delivered no stream response, so every stream but the one ending
    hung until the server was killed at --shutdown_timeout and then read as a crash (and before
    that, the frontend was stopped first: uvicorn cut every request 3 s after the signal); and the
    frontend cancelled each stream after its final response, which left its ensemble request held
    in Triton, whose exit then waited for the kill."""
    import threading
    import openai
    process, printed, _ = _serve(engine_dir, tmp_path, "--max_batch_size", "1", "--shutdown_timeout", "40")
    client = openai.OpenAI(base_url=printed["openai"], api_key="none", max_retries=0, timeout=90)
    model, tokens, streams = client.models.list().data[0].id, 150, 16
    first, ends = threading.Event(), {}

    def stream(i):
        try:
            chunks = list(client.completions.create(
                model=model, prompt=f"x{i} =", max_tokens=tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, timeout=90))
            first.set()
            ends[i] = (time.monotonic(), [c.choices[0].finish_reason for c in chunks if c.choices][-1],
                       chunks[-1].usage.completion_tokens)
        except Exception as e:   # what the old order gave: the stream cut
            ends[i] = (time.monotonic(), f"{type(e).__name__}: {e}", 0)
            first.set()

    try:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        assert first.wait(60)       # the first sequence has ended; the others run or wait their turn
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.5)             # a new request meanwhile is refused: 503, the stop's message
        late = urllib.request.Request(printed["generate"], method="POST",
                                      data=json.dumps({"text_input": "y =", "max_tokens": 4}).encode())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(late, timeout=60)
        assert refused.value.code == 503 and "shutting down" in refused.value.read().decode()
        for path in ("/v2/health/ready", "/v2/models/ensemble/ready"):   # Triton said 200 all through the drain
            with pytest.raises(urllib.error.HTTPError) as not_ready:
                urllib.request.urlopen(printed["http"] + path, timeout=10)
            assert not_ready.value.code == 503 and "shutting down" in not_ready.value.read().decode(), path
        for t in threads:
            t.join(120)
        assert process.wait(timeout=120) == 0
        exited = time.monotonic() - signalled
        assert sorted(ends) == list(range(streams))
        assert [(reason, n) for _, reason, n in ends.values()] == [("length", tokens)] * streams, \
            {i: (round(end - signalled, 1), reason[:60], n) for i, (end, reason, n) in sorted(ends.items())}
        last = max(end for end, _, _ in ends.values()) - signalled
        assert last > 3.5, f"every stream ended {last:.1f} s after the signal: not long enough to tell"
        assert exited < last + 15, f"serve exited {exited:.1f} s after the signal, its last stream ended at {last:.1f} s"
    finally:
        _stop(process)


def test_a_triton_port_taken_while_the_models_load_is_picked_again(engine_dir, monkeypatch):
    """The loopback port picked for Triton's own HTTP is only bound once the models have loaded; taken
    meanwhile by another process, Triton exits, and start_server starts it again on another port
    behind the same guard instead of failing on a port the user never chose."""
    import os
    import socket
    ports = free_ports()
    seen, files_of = set(), launch.shared_memory_files   # the stubs' shared memory of both Tritons
    monkeypatch.setattr(launch, "shared_memory_files", lambda pids: (found := files_of(pids), seen.update(found))[0])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picks, real = iter([taken.getsockname()[1]]), launch.free_port
        monkeypatch.setattr(launch, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
        handle = launch.start_server(engine_dir, **ports, backend="torch", ready_timeout=300)
    try:
        first = (handle.run_dir / "tritonserver.log").read_text(errors="replace")
        assert "already in use" in first and handle.log_path.name == "tritonserver.1.log"
        request = urllib.request.Request(f"http://{handle.http_url}/v2/models/ensemble/generate", method="POST",
                                         data=json.dumps({"text_input": PROMPTS[0], "max_tokens": 4}).encode())
        with urllib.request.urlopen(request, timeout=120) as r:
            assert r.status == 200 and json.loads(r.read())["text_output"]
        assert "nemospec_" in handle.metrics()
    finally:
        handle.stop()
    assert not handle.run_dir.exists()
    # the first Triton exited by itself before it was ready, leaving its stubs' files: removed too
    assert len(seen) >= 2 * len(handle.stubs) and not [f for f in seen if os.path.exists(f)], seen


def test_triton_ports_taken_at_every_pick_are_named_not_reported_as_a_crash(engine_dir, monkeypatch):
    """The last pick taken too: start_server killed that Triton itself, so the error names the port,
    not the signal it was killed with (one pick allowed, so one Triton starts)."""
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port, ports = taken.getsockname()[1], free_ports()
        monkeypatch.setattr(launch, "TRITON_PORT_TRIES", 1)
        monkeypatch.setattr(launch, "free_port", lambda host="127.0.0.1": port)
        with pytest.raises(launch.NemospecError) as error:
            launch.start_server(engine_dir, **ports, backend="torch", ready_timeout=300)
    assert str(error.value) == (f"tritonserver's own HTTP port: each of the 1 free loopback ports picked for it "
                                f"was taken before it bound it (the last {port})")


@pytest.mark.parametrize("flag", ["grpc_port", "metrics_port"])
def test_a_taken_grpc_or_metrics_port_is_an_error_naming_the_flag(engine_dir, flag):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = free_ports()   # picked while the taken port is held: none of them can be it
        ports[flag] = taken.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(launch.NemospecError) as error:
            launch.start_server(engine_dir, **ports, backend="torch", ready_timeout=300)
    assert str(error.value) == f"--{flag}: 127.0.0.1:{ports[flag]} is already in use"
    assert time.monotonic() - start < 5, "refused before tritonserver loads its models"


def test_draft_len_schedule_auto_is_measured_before_serving(draft_target_engine_dir):
    """--draft_len_schedule auto: the speculative model measures each batch size up to the server's
    max batch (1, 2) before it is ready, logs the schedule it keeps, and serves the target's greedy
    output whatever K it chose."""
    engine_dir = draft_target_engine_dir
    for attempt in range(3):
        try:
            handle = launch.start_server(engine_dir, **free_ports(), backend="torch", max_batch_size=2,
                                         draft_policy={"draft_len_schedule": "auto"}, ready_timeout=300)
            break
        except Exception as e:
            if "already in use" not in str(e) or attempt == 2:
                raise
    try:
        log = handle.log_path.read_text(errors="replace")
        line = next(ln for ln in log.splitlines() if "--draft_len_schedule auto:" in ln)
        schedule = line.split("--draft_len_schedule auto:")[1].split()[0]
        assert [b for b, _ in (item.split(":") for item in schedule.split(","))] == ["1", "2"], line
        assert all(0 <= int(k) <= OPTIONS["max_draft_len"] for _, k in (i.split(":") for i in schedule.split(",")))
        for item in schedule.split(","):   # and exported as a gauge per batch size
            batch, k = item.split(":")
            assert metric(handle, "nemospec_draft_len_schedule", max_batch_size=batch) == int(k)
        want = offline(engine_dir, PROMPTS[0], 24)
        request = urllib.request.Request(f"http://{handle.http_url}/v2/models/ensemble/generate", method="POST",
                                         data=json.dumps({"text_input": PROMPTS[0], "max_tokens": 24,
                                                          "exclude_input_in_output": True}).encode())
        with urllib.request.urlopen(request, timeout=120) as r:
            assert json.loads(r.read())["output_ids"] == want["output_ids"]
    finally:
        handle.stop()


def test_cli_serve_bad_engine_dir(tmp_path, capsys):
    assert cli.main(["serve", "--engine_dir", str(tmp_path)]) == 2
    assert "--engine_dir" in capsys.readouterr().err


def test_add_special_tokens_false_leaves_the_tokenizers_bos_out(engine_dir, tmp_path):
    """Most checkpoints' tokenizers add a BOS: preprocessing adds it to a prompt unless the request
    sends add_special_tokens false (the OpenAI frontend does for chat, whose rendered template writes
    its own: the model would otherwise see two)."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    bos_engine = tmp_path / "engine"
    shutil.copytree(engine_dir, bos_engine)
    tok = Tokenizer.from_file(str(bos_engine / "tokenizer.json"))
    bos = tok.id_to_token(1)
    tok.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 1)])
    tok.save(str(bos_engine / "tokenizer.json"))
    prompt_ids = tok.encode("def f(x):", add_special_tokens=False).ids
    with launch.serving(bos_engine, **free_ports()) as handle:
        outputs = {}
        for special in (True, False):
            status, got = generate(handle, text_input="def f(x):", max_tokens=1, add_special_tokens=special)
            assert status == 200, got
            outputs[special] = got["output_ids"]
    assert outputs[True][:len(prompt_ids) + 1] == [1] + prompt_ids
    assert outputs[False][:len(prompt_ids)] == prompt_ids and outputs[False][0] != 1
