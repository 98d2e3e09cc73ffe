"""Serving speed: Triton (the model_repo ensemble) against offline generation, measured in one run.

1. single stream: greedy tokens/s of one gRPC streaming request against `nemospec generate` on the
   same engine directory in this process (ratio; goal >= 0.9);
2. aggregate tokens/s with 1, 4 and 16 concurrent gRPC streams (goal: 16 streams >= 4x one stream),
   every level over the same prompt set (stream i sends PROMPTS[i % 4], so the 1-stream level is
   the single-stream line's request) and a fixed number of tokens per stream;
3. the OpenAI-compatible frontend against Triton's gRPC generate_stream at the same concurrency,
   prompts and tokens (output tokens/s ratio; goal >= 0.95 at 1 and 16), and with --aiperf NVIDIA's
   aiperf (its own venv, --aiperf_venv) in chat streaming mode at each level: TTFT, inter-token
   latency, output tokens/s, errors;
4. at each level the same streams target-only (the per-request `speculative: false` on the same
   server): the speculative aggregate over the target-only one (goal at 16 streams >= 1.0; serve's
   --draft_len_schedule, passed with --serve_args, may switch speculation off for large batches).

Outputs are checked equal to offline generation first. Times are wall clock from sending the
request to its final response (what a client sees), medians over --runs. At the concurrency levels
stream i keeps one client across runs on both sides (its gRPC channel, its HTTP keep-alive
connection), as a serving client would, so connection setup is in neither side's numbers.

    python benchmarks/serving.py [--engine_dir E] [--new_tokens 64] [--runs 3] [--streams 1,4,16] [--threads 1]
        [--aiperf] [--aiperf_venv build/aiperf-venv] [--json FILE]

Offline and served single-stream runs alternate, so load from other work on the machine hits both
alike; --threads sets torch's threads here and (OMP_NUM_THREADS) in the server's model process.

Without --engine_dir the embedded trained model's engines for --mode (eagle3) are built first, with
max_batch_size 16 so that 16 streams can share one batch: the wide model by default (the memory-bound
instrument; its served warm-up compiles the batch-1 and batch-2+ steps first, minutes on 2 cores),
``--embedded small`` for the shipped one.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
# this file's own directory comes first on sys.path when it runs as a script, and its name would
# shadow the `serving` package: the checkout first, benchmarks/ (for aiperf_run) last
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE)]
if __name__ == "__main__":   # the offline side on the allocator the server's models use
    from runtime.allocator import preload
    preload()
from nemospec import cli  # noqa: E402
from serving.client import stream_generate  # noqa: E402
from serving.launch import free_port  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Parser(object):", "# utilities\nfrom re import"]


def build_engine(root: Path, mode: str, embedded: str = "wide", factor: int | None = None) -> Path:
    """The embedded trained target (``embedded``: wide, the memory-bound instrument, or small) + its
    ``mode`` draft, max_batch_size 16 (so 16 streams share a batch)."""
    from builder.engine import BuildOptions, build
    from builder.embedded.sources import resolve_sources
    target, draft = resolve_sources(None, mode, embedded=embedded, embedded_factor=factor)
    options = BuildOptions(max_batch_size=16, max_input_len=64, max_seq_len=512, max_draft_len=4,
                           speculative_decoding_mode=mode)
    build(target, root / "engine", options, log=lambda m: None, draft_dir=draft)
    return root / "engine"


def served_backend(serve_args: list[str]) -> str:
    """The backend `nemospec serve` runs with these flags (its `auto` is the compiled path on a CPU):
    offline generation runs on the same one, so the served / offline ratio compares like with like."""
    from runtime.loading import resolve_backend
    from serving.command import add_serve_args
    parser = argparse.ArgumentParser(add_help=False)
    add_serve_args(parser)
    return resolve_backend(parser.parse_known_args(["--engine_dir", "-", *serve_args])[0].backend)


def offline(engine_dir, prompt, new_tokens, backend="auto"):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["generate", "--engine_dir", str(engine_dir), "--prompt", prompt, "--max_new_tokens",
                         str(new_tokens), "--ignore_eos", "--json", "--backend", backend])
    if code:
        raise SystemExit(f"nemospec generate failed with code {code}")
    return json.loads(out.getvalue().strip().splitlines()[-1])


def stream(url, prompt, new_tokens, speculative=True, client=None):
    """One gRPC streaming request: (ids, seconds from send to the final response); ``client``: a
    tritonclient gRPC client to reuse (default: one per request)."""
    result = stream_generate(url, prompt, new_tokens, speculative=speculative, client=client)
    return result.ids, result.seconds


class Clients:
    """One client per stream slot, kept across runs and levels, on both sides alike: slot i reuses its
    gRPC channel (Triton direct) and its HTTP/1.1 keep-alive connection (the OpenAI frontend), so
    neither side pays connection setup per request (a gRPC channel costs far more to make than a
    TCP connection, which would favour the frontend)."""

    def __init__(self):
        self.grpc, self.http = {}, {}

    def grpc_client(self, url, slot):
        if (url, slot) not in self.grpc:
            import tritonclient.grpc as grpcclient
            self.grpc[url, slot] = grpcclient.InferenceServerClient(url)
        return self.grpc[url, slot]

    def http_connection(self, base_url, slot):
        if (base_url, slot) not in self.http:
            import http.client
            from urllib.parse import urlparse
            url = urlparse(base_url)
            self.http[base_url, slot] = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
        return self.http[base_url, slot]

    def close(self):
        for c in [*self.grpc.values(), *self.http.values()]:
            c.close()


def openai_stream(base_url, model, prompt, new_tokens, connection=None):
    """One streamed OpenAI completion (greedy, ignore_eos) read as raw server-sent events (a light
    client, as the gRPC side's): (tokens per the usage chunk, seconds to the last event).
    ``connection``: an http.client.HTTPConnection to reuse (keep-alive; default: one per request)."""
    import http.client
    from urllib.parse import urlparse
    url = urlparse(base_url)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, "ignore_eos": True})
    own = connection is None
    start = time.perf_counter()
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=600) if own else connection
    for attempt in (0, 1):
        try:
            connection.request("POST", f"{url.path}/completions", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            break
        except (http.client.RemoteDisconnected, ConnectionError):   # the server closed an idle keep-alive
            connection.close()
            if attempt:
                raise
    if response.status != 200:
        raise RuntimeError(f"{base_url}: {response.status} {response.read()[:300]!r}")
    tokens = 0
    for line in response:
        if line.startswith(b"data: {") and b'"usage"' in line:
            usage = json.loads(line[6:]).get("usage")
            tokens = usage["completion_tokens"] if usage else tokens
        elif line.startswith(b"data: [DONE]"):
            break
    response.read()              # the end of the chunked body: the connection can carry the next request
    seconds = time.perf_counter() - start
    if own:
        connection.close()
    return [0] * tokens, seconds


def concurrent(url, n, new_tokens, one=None):
    """n streams at once, stream i on PROMPTS[i % 4] (the same set at every level): aggregate
    tokens/s over the wall time. ``one(i, prompt)`` makes stream i's request (default: gRPC to ``url``)."""
    results = [None] * n
    one = one or (lambda i, prompt: stream(url, prompt, new_tokens))

    def run(i):
        results[i] = one(i, PROMPTS[i % len(PROMPTS)])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if any(r is None for r in results):
        raise RuntimeError("a stream failed")
    return sum(len(r[0]) for r in results) / wall


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine_dir", default=None, help="default: build the embedded model's engines for --mode first")
    p.add_argument("--mode", default="eagle3", help="speculative mode of the default engine directory")
    from builder.embedded.sources import add_embedded_args
    add_embedded_args(p, default="wide", given="--engine_dir")
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--streams", default="1,4,16")
    p.add_argument("--threads", type=int, default=1, help="torch threads, offline and in the server")
    p.add_argument("--aiperf", action="store_true", help="also run NVIDIA aiperf (chat, streaming) at each level")
    p.add_argument("--aiperf_venv", default="build/aiperf-venv", help="aiperf's own venv (made once if missing)")
    p.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    p.add_argument("--serve_args", default="", help="extra `nemospec serve` flags, e.g. '--draft_len_schedule 1:4,8:2,16:0'")
    args = p.parse_args()
    from builder.embedded.sources import refuse_embedded_with
    refuse_embedded_with(args, "engine_dir")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)   # inherited by tritonserver's python stubs
    import torch
    torch.set_num_threads(args.threads)
    streams = [int(s) for s in args.streams.split(",")]
    with tempfile.TemporaryDirectory(prefix="nemospec-bench-") as scratch:
        engine_dir = Path(args.engine_dir) if args.engine_dir else build_engine(Path(scratch), args.mode, args.embedded,
                                                                                 args.embedded_factor)
        run(args, engine_dir, streams)


@contextlib.contextmanager
def nemospec_serve(engine_dir, extra=()):
    """`nemospec serve` as a user runs it (its own process: the OpenAI frontend does not share this
    process's GIL with the benchmark's client threads); yields its printed endpoints."""
    import signal
    import subprocess
    cmd = [sys.executable, "-m", "nemospec.cli", "serve", "--engine_dir", str(engine_dir), "--http_port",
           str(free_port()), "--grpc_port", str(free_port()), "--metrics_port", str(free_port()), "--openai_port", "0",
           *extra]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               cwd=str(Path(__file__).resolve().parents[1]))
    endpoints = {}
    try:
        for line in process.stdout:
            name, _, url = line.strip().partition(" ")
            endpoints[name] = url.strip()
            if name == "openai":
                break
        if "openai" not in endpoints:
            raise SystemExit(f"nemospec serve did not start (exit {process.wait()})")
        yield endpoints
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)


def metrics_text(url):
    import urllib.request
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def run(args, engine_dir, streams):
    prompt = PROMPTS[0]
    backend = served_backend(args.serve_args.split())
    reference = offline(engine_dir, prompt, args.new_tokens, backend)   # warm-up and the expected ids
    report = {"engine_dir": engine_dir.name, "new_tokens": args.new_tokens, "runs": args.runs, "threads": args.threads}
    extra = args.serve_args.split()
    if "--torch_threads" not in extra:   # the server's steps at the offline loop's thread count
        extra += ["--torch_threads", str(args.threads)]
    report["server_threads"] = int(extra[extra.index("--torch_threads") + 1])
    with nemospec_serve(engine_dir, extra) as endpoints:
        grpc_url, openai_url = endpoints["grpc"], endpoints["openai"]
        import openai
        model = openai.OpenAI(base_url=openai_url, api_key="unused").models.list().data[0].id
        ids, _ = stream(grpc_url, prompt, args.new_tokens)           # warm-up
        if ids != reference["output_ids"]:
            raise SystemExit("served output differs from offline generation")
        offline_runs, single_runs = [], []
        for _ in range(args.runs):
            offline_runs.append(offline(engine_dir, prompt, args.new_tokens, backend)["tokens_per_second"])
            single_runs.append(args.new_tokens / stream(grpc_url, prompt, args.new_tokens)[1])
        offline_tps, single = statistics.median(offline_runs), statistics.median(single_runs)
        clients = Clients()            # one gRPC client / one HTTP connection per stream slot, both sides
        via_grpc = lambda i, p: stream(grpc_url, p, args.new_tokens, client=clients.grpc_client(grpc_url, i))  # noqa: E731
        via_openai = lambda i, p: openai_stream(openai_url, model, p, args.new_tokens,  # noqa: E731
                                                clients.http_connection(openai_url, i))
        target_only = lambda i, p: stream(grpc_url, p, args.new_tokens, speculative=False,  # noqa: E731
                                          client=clients.grpc_client(grpc_url, i))
        for one in (via_grpc, via_openai):  # every slot's client made and used once before timing
            concurrent(None, max(streams), args.new_tokens, one)
        aggregate, frontend_tps, plain_tps, paired = {}, {}, {}, {}
        for n in streams:              # Triton direct, the OpenAI frontend and target-only alternate per run
            direct, front, plain = [], [], []
            for _ in range(args.runs):
                direct.append(concurrent(None, n, args.new_tokens, via_grpc))
                front.append(concurrent(None, n, args.new_tokens, via_openai))
                plain.append(concurrent(None, n, args.new_tokens, target_only))
            aggregate[n], frontend_tps[n], plain_tps[n] = map(statistics.median, (direct, front, plain))
            paired[n] = statistics.median(f / d for f, d in zip(front, direct))   # back-to-back pairs: load drifts cancel
        clients.close()
        aiperf = run_aiperf(args, openai_url, model, engine_dir, streams) if args.aiperf else None
        max_batch = next((line.split()[-1] for line in metrics_text(endpoints["metrics"]).splitlines()
                          if line.startswith("nemospec_max_batch_seen")), "?")
    print(f"engine {engine_dir} ({reference['backend']} backend), {args.new_tokens} new tokens, median of {args.runs}, "
          f"{args.threads} torch thread{'s' if args.threads > 1 else ''}")
    print(f"offline `nemospec generate`        {offline_tps:8.1f} tokens/s")
    print(f"gRPC streaming, one stream          {single:8.1f} tokens/s   ratio {single / offline_tps:.2f} (goal >= 0.9)")
    for n, tps in aggregate.items():
        print(f"gRPC streaming, {n:2d} concurrent      {tps:8.1f} tokens/s   {tps / aggregate[streams[0]]:.2f}x "
              f"{streams[0]} stream{'s' if streams[0] > 1 else ''}; OpenAI frontend {frontend_tps[n]:8.1f} tokens/s "
              f"= {frontend_tps[n] / tps:.2f}x Triton direct (per run pair {paired[n]:.2f}; goal >= 0.95); target-only {plain_tps[n]:8.1f} "
              f"tokens/s: speculative {tps / plain_tps[n]:.2f}x")
    if 16 in aggregate and 1 in aggregate:
        print(f"16 streams / 1 stream: {aggregate[16] / aggregate[1]:.2f}x (goal >= 4); largest batch {max_batch}")
    for row in aiperf or []:
        print(f"aiperf chat streaming, concurrency {row['concurrency']:2d}: {row['output_tokens_per_s']:.1f} output "
              f"tokens/s, TTFT p50 {row['ttft_ms_p50']:.1f} ms, ITL p50 {row['itl_ms_p50']:.2f} ms, errors {row['errors']}")
    report.update(offline_tokens_per_s=offline_tps, single_stream_tokens_per_s=single,
                  triton_direct={str(n): v for n, v in aggregate.items()},
                  openai_frontend={str(n): v for n, v in frontend_tps.items()},
                  openai_over_triton={str(n): frontend_tps[n] / aggregate[n] for n in aggregate},
                  openai_over_triton_paired={str(n): v for n, v in paired.items()},
                  target_only={str(n): v for n, v in plain_tps.items()},
                  speculative_over_target_only={str(n): aggregate[n] / plain_tps[n] for n in aggregate},
                  max_batch_seen=max_batch, aiperf=aiperf)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


def run_aiperf(args, openai_url, model, engine_dir, streams):
    from aiperf_run import ensure_venv, profile
    binary = ensure_venv(Path(args.aiperf_venv).resolve())
    rows = []
    with tempfile.TemporaryDirectory(prefix="nemospec-aiperf-") as artifacts:
        for n in streams:
            rows.append(profile(binary, openai_url.rsplit("/v1", 1)[0], model, engine_dir, n,
                                max(8, 2 * n), 24, args.new_tokens, Path(artifacts) / f"c{n}"))
    return rows


if __name__ == "__main__":
    main()
