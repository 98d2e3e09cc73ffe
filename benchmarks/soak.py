"""Soak: mixed traffic against `nemospec serve` on loopback for --minutes, with one deliberate kill -9
of the speculative model's stub in the middle.

Traffic (--concurrency client threads): gRPC streaming and HTTP generate, greedy and sampled, random
prompt lengths up to max_input_len, ~10% streams cancelled mid-stream, ~5% malformed requests (each
must get an error naming its field). Clients, like a load balancer, send only while the supervisor's
/health/ready is 200. Every greedy answer is checked against offline generation (`nemospec generate`,
one prompt at a time). Reports requests per kind, errors by cause (those overlapping the kill
window apart), p50/p99 latency, the RSS of every process at start (after warm-up), 10 s after the
restart and at the end (growth: each process against its first snapshot), active
sequences after the run, the kill's time to not-ready and to serving again, and SIGTERM's exit time.

    python benchmarks/soak.py --minutes 2 [--engine_dir E] [--concurrency 4] [--output soak.json]

Without --engine_dir the embedded trained model's eagle3 engines are built first (as
benchmarks/serving.py does). Goals (10-minute run): 0 unexpected errors, 0 wrong greedy answers, 0
active sequences at the end, RSS growth < 10% after warm-up, recovery from the kill < 60 s.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import numpy as np  # noqa: E402

from nemospec import cli  # noqa: E402
from serving.health import is_ready, process_alive  # noqa: E402
from serving.launch import free_port  # noqa: E402

MIX = {"grpc_greedy": 0.30, "grpc_sampled": 0.20, "http_greedy": 0.20, "http_sampled": 0.15, "grpc_cancelled": 0.10,
       "malformed": 0.05}
WORDS = ("def", "return", "import", "class", "self", "for", "in", "range", "if", "else", "print", "value", "x", "y",
         "data", "=", "(", ")", ":", "\n", "#", "list", "dict", "None", "True", "while", "with", "open", "file", "+")
MALFORMED = [({"text_input": "", "max_tokens": 8}, "text_input"), ({"text_input": "x", "max_tokens": 0}, "max_tokens"),
             ({"text_input": "x", "max_tokens": 8, "temperature": -1.0}, "temperature"),
             ({"text_input": "x", "max_tokens": 8, "top_p": 2.0}, "top_p"),
             ({"text_input": "x", "max_tokens": 100000}, "max_seq_len"),
             ({"text_input": "x", "max_tokens": 8, "stop_words": ["ab"] * 40}, "max_stop_words"),
             ({"text_input": "x", "max_tokens": 8, "end_id": -7}, "end_id"),
             (b"\xff\xfe not utf-8", "text_input")]          # bytes: invalid UTF-8 over gRPC


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class Server:
    """`nemospec serve` as a child process on free loopback ports."""

    def __init__(self, engine_dir, log_path, threads, *extra):
        self.ports = {k: free_port() for k in ("http_port", "grpc_port", "metrics_port", "health_port")}
        cmd = [sys.executable, "-m", "nemospec.cli", "serve", "--engine_dir", str(engine_dir),
               *[a for k, v in self.ports.items() for a in (f"--{k}", str(v))], "--openai_port", "0", *extra]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), env=env)
        self.http = f"127.0.0.1:{self.ports['http_port']}"
        self.grpc = f"127.0.0.1:{self.ports['grpc_port']}"
        self.health = f"http://127.0.0.1:{self.ports['health_port']}"
        deadline = time.monotonic() + 600
        while not self.ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"serve did not become ready:\n{Path(log_path).read_text()[-3000:]}")
            time.sleep(0.2)

    def ready(self) -> bool:
        return is_ready(f"{self.health}/health/ready", timeout=2)

    def state(self) -> dict:
        with urllib.request.urlopen(f"{self.health}/health", timeout=5) as r:
            return json.loads(r.read())

    def processes(self) -> dict:
        """{role: pid}: the serve process, tritonserver and each model's stub."""
        s = self.state()
        return {"serve": self.process.pid, "tritonserver": s["tritonserver_pid"],
                **{f"stub:{model}": int(pid) for pid, model in s["stub_pids"].items()}}

    def metric(self, name) -> float | None:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['metrics_port']}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + "{") or line.startswith(name + " "):
                    return float(line.split()[-1])
        return None


def offline_greedy(engine_dir, prompt, max_tokens):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["generate", "--engine_dir", str(engine_dir), "--prompt", prompt, "--max_new_tokens",
                         str(max_tokens), "--json"])
    if code:
        raise SystemExit(f"nemospec generate failed with code {code} for {prompt!r}")
    return json.loads(out.getvalue().strip().splitlines()[-1])["output_ids"]


def random_prompt(rng, tokenizer, max_input_len) -> str:
    n = rng.randint(1, max_input_len)
    words = [rng.choice(WORDS) for _ in range(n)]
    while words and len(tokenizer.encode(" ".join(words)).ids) > max_input_len:
        words = words[: max(1, len(words) * 3 // 4)] if len(words) > 1 else []
    return " ".join(words) or "x"


# --- one request of each kind: (ok, cause or None, output ids or None) ----------------------------------
def grpc_request(url, prompt, max_tokens, *, temperature=0.0, seed=None, cancel_after=None, text_bytes=None):
    import tritonclient.grpc as grpcclient
    values = [("text_input", np.array([[text_bytes if text_bytes is not None else prompt.encode()]], dtype=object), "BYTES"),
              ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
              ("stream", np.array([[True]], dtype=bool), "BOOL")]
    if temperature:
        values += [("temperature", np.array([[temperature]], dtype=np.float32), "FP32"),
                   ("top_p", np.array([[1.0]], dtype=np.float32), "FP32"),   # TensorRT-LLM's rule: else greedy
                   ("random_seed", np.array([[seed]], dtype=np.uint64), "UINT64")]
    inputs = []
    for name, array, dtype in values:
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        inputs.append(t)
    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    ids, responses = [], 0
    try:
        client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
        while True:
            try:
                result, error = results.get(timeout=120)
            except queue.Empty:
                return False, "hang (no response for 120 s)", None
            if error is not None:
                return False, str(error), None
            if result.as_numpy("output_ids") is not None:
                ids += result.as_numpy("output_ids").reshape(-1).tolist()
                responses += 1
            if cancel_after is not None and responses >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return True, None, None
            if result.get_response().parameters["triton_final_response"].bool_param:
                return True, None, ids
    finally:
        with contextlib.suppress(Exception):
            client.stop_stream()
            client.close()


def http_request(url, body):
    data = json.dumps(body).encode()
    request = urllib.request.Request(f"http://{url}/v2/models/ensemble/generate", data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            got = json.loads(r.read())
        ids = got["output_ids"]
        return True, None, ids if isinstance(ids, list) else [ids]
    except urllib.error.HTTPError as e:
        return False, json.loads(e.read() or b"{}").get("error", f"HTTP {e.code}"), None
    except (OSError, ValueError) as e:
        return False, f"{type(e).__name__}: {e}", None


def cause_of(message: str) -> str:
    m = message.lower()
    for needle, cause in (("not healthy", "stub not healthy"), ("unavailable", "connection (UNAVAILABLE)"),
                          ("connection", "connection refused/reset"), ("shutting down", "server shutting down"),
                          ("max_queue", "queue full"), ("hang", "hang"), ("timed out", "timeout")):
        if needle in m:
            return cause
    return message[:80]


# --- the run ------------------------------------------------------------------------------------------
def soak(args, engine_dir, scratch):
    from tokenizers import Tokenizer
    meta = json.loads((engine_dir / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(engine_dir / meta["tokenizer"]))
    max_input_len, max_seq_len = int(meta["build"]["max_input_len"]), int(meta["build"]["max_seq_len"])
    rng = random.Random(args.seed)
    greedy_tokens = min(24, max_seq_len - max_input_len)
    greedy = [random_prompt(rng, tokenizer, max_input_len) for _ in range(args.greedy_prompts)]
    print(f"offline greedy answers for {len(greedy)} prompts ...", file=sys.stderr, flush=True)
    expected = {p: offline_greedy(engine_dir, p, greedy_tokens) for p in greedy}
    server = Server(engine_dir, scratch / "serve.log", args.threads)
    records, lock = [], threading.Lock()
    deadline = time.monotonic() + args.minutes * 60
    warm_at = time.monotonic() + min(30.0, args.minutes * 60 * 0.1)
    kill_at = time.monotonic() + args.minutes * 60 / 2
    events = {}

    def one(kind, wrng):
        prompt = random_prompt(wrng, tokenizer, max_input_len)
        tokens = wrng.randint(4, max(4, min(48, max_seq_len - max_input_len)))
        seed = wrng.randrange(2**32)
        if kind == "grpc_greedy" or kind == "http_greedy":
            prompt = wrng.choice(greedy)
            ok, cause, ids = (grpc_request(server.grpc, prompt, greedy_tokens) if kind == "grpc_greedy" else
                              http_request(server.http, {"text_input": prompt, "max_tokens": greedy_tokens,
                                                         "exclude_input_in_output": True}))
            if ok and ids != expected[prompt]:
                return False, "wrong greedy answer", None
            return ok, cause, ids
        if kind == "grpc_sampled":
            return grpc_request(server.grpc, prompt, tokens, temperature=0.8, seed=seed)
        if kind == "http_sampled":
            return http_request(server.http, {"text_input": prompt, "max_tokens": tokens, "temperature": 0.8, "top_p": 1.0,
                                              "random_seed": seed})
        if kind == "grpc_cancelled":
            return grpc_request(server.grpc, prompt, max(tokens, 32), cancel_after=2)
        body, field = wrng.choice(MALFORMED)
        ok, cause, _ = (grpc_request(server.grpc, "", 8, text_bytes=body) if isinstance(body, bytes) else
                        http_request(server.http, body))
        if ok:
            return False, f"malformed request accepted (wanted an error naming {field})", None
        return (True, None, None) if field in cause else (False, cause, None)

    def worker(index):
        wrng = random.Random(args.seed * 1000 + index)
        kinds, weights = list(MIX), list(MIX.values())
        while time.monotonic() < deadline:
            if not server.ready():           # a load balancer sends nothing to a replica that is not ready
                time.sleep(0.2)
                continue
            kind = wrng.choices(kinds, weights)[0]
            start = time.monotonic()
            ok, cause, _ = one(kind, wrng)
            with lock:
                records.append({"kind": kind, "ok": ok, "cause": None if ok else cause_of(cause), "start": start,
                                "end": time.monotonic()})

    def killer():
        while time.monotonic() < kill_at:
            time.sleep(0.1)
        pid = server.processes()["stub:speculative"]
        os.kill(pid, signal.SIGKILL)
        events["kill_at"] = killed = time.monotonic()
        while server.ready() and time.monotonic() - killed < 30:
            time.sleep(0.05)
        events["not_ready_s"] = time.monotonic() - killed
        while not server.ready() and time.monotonic() - killed < 120:
            time.sleep(0.1)
        events["recovered_at"] = time.monotonic()
        events["recovery_s"] = events["recovered_at"] - killed
        while time.monotonic() < min(deadline, events["recovered_at"] + 10):   # the restarted processes warm up
            time.sleep(0.2)
        rss["after_restart"] = rss_snapshot()

    def rss_snapshot():  # by role: the processes the kill restarted are compared with their predecessors
        return {role: {"pid": pid, "kib": rss_kib(pid)} for role, pid in server.processes().items()}

    rss = {}
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.concurrency)]
    for t in threads:
        t.start()
    kill_thread = threading.Thread(target=killer, daemon=True)
    kill_thread.start()
    while time.monotonic() < warm_at:
        time.sleep(0.2)
    rss_start = rss_snapshot()
    for t in threads:
        t.join(timeout=args.minutes * 60 + 300)
    kill_thread.join(timeout=180)
    rss_end = rss_snapshot()
    active = None
    for _ in range(50):                  # the gauge follows the scheduler within ~0.1 s
        active = server.metric("nemospec_active_sequences")
        queued = server.metric("nemospec_queued_requests")
        if active == 0 and queued == 0:
            break
        time.sleep(0.1)
    processes = list(server.processes().values())
    server.process.send_signal(signal.SIGTERM)
    stop_start = time.monotonic()
    code = server.process.wait(timeout=60)
    sigterm_s = time.monotonic() - stop_start
    left = [pid for pid in processes if process_alive(pid)]
    return report(records, events, rss_start, rss.get("after_restart", {}), rss_end, active, sigterm_s, code, left,
                  len(expected))


def report(records, events, rss_start, rss_restart, rss_end, active, sigterm_s, code, left, greedy_prompts) -> dict:
    window = (events.get("kill_at", float("inf")), events.get("recovered_at", float("inf")) + 1.0)
    kinds = {}
    for kind in MIX:
        mine = [r for r in records if r["kind"] == kind]
        latencies = sorted(r["end"] - r["start"] for r in mine if r["ok"])
        kinds[kind] = {"requests": len(mine), "ok": sum(r["ok"] for r in mine),
                       "p50_s": round(statistics.median(latencies), 3) if latencies else None,
                       "p99_s": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 3)
                       if latencies else None}
    unexpected, at_kill = {}, {}
    for r in records:
        if not r["ok"]:
            bucket = at_kill if r["start"] <= window[1] and r["end"] >= window[0] else unexpected
            bucket[r["cause"]] = bucket.get(r["cause"], 0) + 1
    growth = {}       # against the same process: its first snapshot (at start, or after the restart)
    for role, end in rss_end.items():
        first = next((snap[role] for snap in (rss_start, rss_restart) if (snap.get(role) or {}).get("pid") == end["pid"]),
                     None)
        if first and first["kib"] and end["kib"]:
            growth[role] = round(100.0 * (end["kib"] - first["kib"]) / first["kib"], 1)
    return {"requests": len(records), "kinds": kinds, "errors_unexpected": unexpected, "errors_at_kill": at_kill,
            "wrong_greedy_answers": unexpected.get("wrong greedy answer", 0) + at_kill.get("wrong greedy answer", 0),
            "greedy_prompts_checked": greedy_prompts,
            "kill": {k: round(v, 2) for k, v in events.items() if k.endswith("_s")},
            "rss_kib_start": rss_start, "rss_kib_after_restart": rss_restart, "rss_kib_end": rss_end,
            "rss_growth_percent": growth,
            "active_sequences_after": active, "sigterm_exit_s": round(sigterm_s, 2), "exit_code": code,
            "processes_left": left}


def engine_dir_for(given: str | None, scratch: Path) -> Path:
    """``--engine_dir``, or the (small) embedded model's eagle3 engines built under ``scratch``."""
    if given:
        return Path(given)
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "benchmarks" / "serving.py")
    bench_serving = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_serving)
    return bench_serving.build_engine(scratch, "eagle3", embedded="small")   # faults, not speed: the quick model


def print_report(result: dict, output: str | None) -> None:
    """Prints the report as JSON, and writes it to ``output`` if given."""
    text = json.dumps(result, indent=2)
    print(text)
    if output:
        Path(output).write_text(text + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, required=True)
    p.add_argument("--engine_dir", default=None, help="default: build the embedded model's eagle3 engines first")
    p.add_argument("--concurrency", type=int, default=4, help="client threads")
    p.add_argument("--greedy_prompts", type=int, default=12, help="distinct greedy prompts checked against offline")
    p.add_argument("--threads", type=int, default=1, help="torch threads, offline and in the server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="also write the report (JSON) here")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="nemospec-soak-") as scratch:
        scratch = Path(scratch)
        result = soak(args, engine_dir_for(args.engine_dir, scratch), scratch)
    print_report(result, args.output)
    goals = {"0 unexpected errors": not result["errors_unexpected"], "0 wrong greedy answers": not result["wrong_greedy_answers"],
             "0 active sequences after": result["active_sequences_after"] == 0,
             "RSS growth < 10%": all(g < 10 for g in result["rss_growth_percent"].values()),
             "recovery < 60 s": result["kill"].get("recovery_s", 1e9) < 60,
             "SIGTERM exit < 10 s, nothing left": result["sigterm_exit_s"] < 10 and not result["processes_left"]}
    for goal, met in goals.items():
        print(f"{'met   ' if met else 'MISSED'} {goal}", file=sys.stderr)
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
