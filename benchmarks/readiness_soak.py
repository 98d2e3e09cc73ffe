"""Readiness under repeated kill -9: --cycles kill -9 cycles of the speculative model's stub (or of
tritonserver, --kill tritonserver) under `nemospec serve`, each measured as
tests/test_supervisor.py's readiness test measures its two (``serving.readiness_check``).

In each cycle four probers ask every ~10 ms (the supervisor's /health/ready, Triton's
/v2/health/ready and the ensemble's ready through the HTTP guard, the OpenAI frontend's
/health/ready) while one client sends short greedy requests back to back; after 1 s the process is
killed; the cycle ends once a request begun after the kill is served. Reports per cycle and in total:
ready answers while failing (a probe begun after the kill answered 200 and a request begun after
that answer failed; goal 0), requests that failed, the endpoints that said not ready (goal: all
four), seconds from the kill to ready again and to the first request served again.

    python benchmarks/readiness_soak.py --cycles 20 [--engine_dir E] [--backend torch] [--output r.json]

Without --engine_dir the embedded trained model's eagle3 engines are built first (as
benchmarks/soak.py does). The server runs the torch backend unless --backend says otherwise (the
compiled path warms its steps up again after each restart); its crash-loop limit (--max_restarts) is
raised above --cycles.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))   # the checkout first: benchmarks/serving.py would shadow `serving`
from serving import readiness_check  # noqa: E402
from soak import Server, engine_dir_for, print_report  # noqa: E402


def stats(values) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {}
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3), "max": round(max(values), 3)}


def run(args, engine_dir: Path, scratch: Path) -> dict:
    # every cycle is a restart: lift the crash-loop limit (5 within 300 s by default) above them
    server = Server(engine_dir, scratch / "serve.log", args.threads, "--backend", args.backend,
                    "--max_restarts", str(args.cycles + 5))
    log = lambda: Path(server.log_path).read_text()  # noqa: E731
    guard = f"http://{server.http}"
    urls = [f"{server.health}/health/ready", f"{guard}/v2/health/ready", f"{guard}/v2/models/ensemble/ready",
            readiness_check.openai_ready_url(log)]

    def find_pid():
        state = server.state()
        if args.kill == "tritonserver":
            return int(state["tritonserver_pid"])
        return next(int(p) for p, model in state["stub_pids"].items() if model == "speculative")

    cycles = []
    try:
        for n in range(args.cycles):
            deadline = time.monotonic() + 120
            while not server.ready():
                if time.monotonic() > deadline or server.process.poll() is not None:
                    raise SystemExit(f"cycle {n}: not ready again:\n{log()[-3000:]}")
                time.sleep(0.1)
            cycle = readiness_check.kill_cycle(urls, lambda: readiness_check.generate_ok(server.http),
                                               find_pid, server.ready, ready_timeout=120, served_timeout=60)
            row = cycle.summary()
            cycles.append(row)
            print(f"cycle {n + 1:2d}: {row['ready_answers_while_failing']} ready answers while failing, "
                  f"{row['failed_after']}/{row['requests_after']} requests failed, ready again "
                  f"{row['ready_again_s']} s, served again {row['served_again_s']} s, "
                  f"{len(row['said_not_ready'])}/{len(urls)} endpoints said not ready", file=sys.stderr, flush=True)
        restarts = server.state()["restarts"]
    finally:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=60)
        except Exception:
            server.process.kill()
    return {"cycles": len(cycles), "kill": args.kill, "backend": args.backend, "restarts": restarts,
            "ready_answers_while_failing": sum(c["ready_answers_while_failing"] for c in cycles),
            "cycles_with_a_failed_request": sum(1 for c in cycles if c["failed_after"]),
            "cycles_every_endpoint_said_not_ready": sum(1 for c in cycles if len(c["said_not_ready"]) == len(urls)),
            "failed_before_kill": sum(c["failed_before"] for c in cycles),
            "ready_again_s": stats(c["ready_again_s"] for c in cycles),
            "served_again_s": stats(c["served_again_s"] for c in cycles),
            "per_cycle": cycles}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=20)
    p.add_argument("--engine_dir", default=None, help="default: build the embedded model's eagle3 engines first")
    p.add_argument("--kill", choices=("speculative", "tritonserver"), default="speculative",
                   help="the process killed each cycle: the speculative model's stub or tritonserver")
    p.add_argument("--backend", default="torch", help="`nemospec serve --backend`")
    p.add_argument("--threads", type=int, default=1, help="torch threads in the server")
    p.add_argument("--output", default=None, help="also write the report (JSON) here")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="nemospec-readiness-") as scratch:
        scratch = Path(scratch)
        result = run(args, engine_dir_for(args.engine_dir, scratch), scratch)
    print_report(result, args.output)
    goals = {"0 ready answers while failing": result["ready_answers_while_failing"] == 0,
             "every cycle saw a failed request and every endpoint not ready":
                 result["cycles_with_a_failed_request"] == result["cycles_every_endpoint_said_not_ready"] == args.cycles,
             "served again < 60 s every cycle": len(result["per_cycle"]) == args.cycles and all(
                 c["served_again_s"] is not None and c["served_again_s"] < 60 for c in result["per_cycle"])}
    for goal, met in goals.items():
        print(f"{'met   ' if met else 'MISSED'} {goal}", file=sys.stderr)
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
