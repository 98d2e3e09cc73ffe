"""Serving speed: Triton (the model_repo ensemble) against offline generation, measured in one run.

1. single stream: greedy tokens/s of one gRPC streaming request against `nemospec generate` on the
   same engine directory in this process (ratio; goal >= 0.9);
2. aggregate tokens/s with 1, 4 and 16 concurrent gRPC streams (goal: 16 streams >= 4x one stream).

Outputs are checked equal to offline generation first. Times are wall clock from sending the
request to its final response (what a client sees), medians over --runs.

    python benchmarks/serving.py [--engine_dir E] [--new_tokens 64] [--runs 3] [--streams 1,4,16] [--threads 1]

Offline and served single-stream runs alternate, so load from other work on the machine hits both
alike; --threads sets torch's threads here and (OMP_NUM_THREADS) in the server's model process.

Without --engine_dir the embedded trained model's engines for --mode (eagle3) are built first, with
max_batch_size 16 so that 16 streams can share one batch.
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


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nemospec import cli  # noqa: E402
from serving.client import stream_generate  # noqa: E402
from serving.launch import free_port, serving  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Parser(object):", "# utilities\nfrom re import"]


def build_engine(root: Path, mode: str) -> Path:
    """The embedded trained target + its ``mode`` draft, max_batch_size 16 (so 16 streams share a batch)."""
    from builder.engine import BuildOptions, build
    from builder.embedded import resolve_sources
    target, draft = resolve_sources(None, mode)
    options = BuildOptions(max_batch_size=16, max_input_len=64, max_seq_len=512, max_draft_len=4,
                           speculative_decoding_mode=mode)
    build(target, root / "engine", options, log=lambda m: None, draft_dir=draft)
    return root / "engine"


def offline(engine_dir, prompt, new_tokens):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["generate", "--engine_dir", str(engine_dir), "--prompt", prompt, "--max_new_tokens",
                         str(new_tokens), "--ignore_eos", "--json"])
    if code:
        raise SystemExit(f"nemospec generate failed with code {code}")
    return json.loads(out.getvalue().strip().splitlines()[-1])


def stream(url, prompt, new_tokens):
    """One gRPC streaming request: (ids, seconds from send to the final response)."""
    result = stream_generate(url, prompt, new_tokens)
    return result.ids, result.seconds


def concurrent(url, n, new_tokens):
    """n streams at once with different prompts: aggregate tokens/s over the wall time."""
    results = [None] * n

    def run(i):
        results[i] = stream(url, PROMPTS[i % len(PROMPTS)] + f" # {i}", new_tokens)

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
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--streams", default="1,4,16")
    p.add_argument("--threads", type=int, default=1, help="torch threads, offline and in the server")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)   # inherited by tritonserver's python stubs
    import torch
    torch.set_num_threads(args.threads)
    streams = [int(s) for s in args.streams.split(",")]
    with tempfile.TemporaryDirectory(prefix="nemospec-bench-") as scratch:
        engine_dir = Path(args.engine_dir) if args.engine_dir else build_engine(Path(scratch), args.mode)
        run(args, engine_dir, streams)


def run(args, engine_dir, streams):
    prompt = PROMPTS[0]
    reference = offline(engine_dir, prompt, args.new_tokens)            # warm-up and the expected ids
    ports = dict(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    with serving(engine_dir, **ports) as server:
        ids, _ = stream(server.grpc_url, prompt, args.new_tokens)        # warm-up
        if ids != reference["output_ids"]:
            raise SystemExit("served output differs from offline generation")
        offline_runs, single_runs = [], []
        for _ in range(args.runs):
            offline_runs.append(offline(engine_dir, prompt, args.new_tokens)["tokens_per_second"])
            single_runs.append(args.new_tokens / stream(server.grpc_url, prompt, args.new_tokens)[1])
        offline_tps, single = statistics.median(offline_runs), statistics.median(single_runs)
        aggregate = {n: statistics.median(concurrent(server.grpc_url, n, args.new_tokens) for _ in range(args.runs))
                     for n in streams}
        max_batch = next((line.split()[-1] for line in server.metrics().splitlines()
                          if line.startswith("nemospec_max_batch_seen")), "?")
    print(f"engine {engine_dir} ({reference['backend']} backend), {args.new_tokens} new tokens, median of {args.runs}, "
          f"{args.threads} torch thread{'s' if args.threads > 1 else ''}")
    print(f"offline `nemospec generate`        {offline_tps:8.1f} tokens/s")
    print(f"gRPC streaming, one stream          {single:8.1f} tokens/s   ratio {single / offline_tps:.2f} (goal >= 0.9)")
    for n, tps in aggregate.items():
        print(f"gRPC streaming, {n:2d} concurrent      {tps:8.1f} tokens/s   {tps / aggregate[streams[0]]:.2f}x "
              f"{streams[0]} stream{'s' if streams[0] > 1 else ''}")
    if 16 in aggregate and 1 in aggregate:
        print(f"16 streams / 1 stream: {aggregate[16] / aggregate[1]:.2f}x (goal >= 4); largest batch {max_batch}")


if __name__ == "__main__":
    main()
