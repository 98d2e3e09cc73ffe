"""The `nemospec serve` command: check the engine directory, start the server under a supervisor
(``serving.supervisor``), print its endpoints, run until a signal.

Exit codes: 0 after SIGINT/SIGTERM; 2 bad input (flags, a missing, truncated or altered engine
directory file) before anything starts; 1 the server could not be started again within 60 s of a
crash; 3 a crash loop (more than --max_restarts restarts within --restart_window seconds)."""
from __future__ import annotations

import signal
import sys
import threading

from builder.errors import NemospecError
from builder.integrity import verify_engine_dir
from runtime.draft_policy import POLICY_FLAGS, add_policy_args
from runtime.sampling import LOGPROBS_MODES
from serving.launch import API_KEY_HEADER, GRPC_API_KEY_HEADER, _client_host, start_server
from serving.limits import LIMITS, add_limit_args, limits_from
from serving.repository import BACKENDS, WARM_UPS
from serving.supervisor import Supervisor, serve_health


def add_serve_args(p) -> None:
    p.add_argument("--engine_dir", required=True, help="engine directory built by `nemospec build` (with tokenizer.json)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 to accept other machines)")
    p.add_argument("--http_port", type=int, default=8000, help="Triton's HTTP/REST port")
    p.add_argument("--grpc_port", type=int, default=8001, help="Triton's gRPC port")
    p.add_argument("--metrics_port", type=int, default=8002, help="Triton's Prometheus metrics port")
    p.add_argument("--health_port", type=int, default=8003,
                   help="the supervisor's readiness endpoint: GET /health/ready is 200 only while a request can be "
                        "served (probe this, not Triton's /v2/health/ready); /metrics: restarts, last cause")
    p.add_argument("--model_repo_dir", default=None, help="where to write the filled model repository (default: a temporary directory)")
    p.add_argument("--fill_only", action="store_true",
                   help="write the model repository to --model_repo_dir, print the tritonserver command that serves "
                        "it, and exit (your own tritonserver, e.g. the NGC image's: TensorRT-LLM's fill_template.py "
                        "step); the model flags below are filled in, the ports and the supervisor are yours")
    p.add_argument("--api_key", default=None,
                   help=f"require the key on the OpenAI frontend ('Authorization: Bearer KEY') and Triton's "
                        f"model-repository and shared-memory endpoints (HTTP header '{API_KEY_HEADER}: KEY', gRPC "
                        f"metadata '{GRPC_API_KEY_HEADER}: KEY'); Triton's inference endpoints stay open")
    p.add_argument("--backend", default="auto", choices=list(BACKENDS),
                   help="auto: TensorRT on a GPU, else compiled: the compiled CPU path, its steps compiled before "
                        "the server reports ready (minutes the first time on a machine, seconds after: they are "
                        "saved); torch: eager, ready at once but several times slower")
    p.add_argument("--torch_threads", type=int, default=0,
                   help="CPU threads of the speculative model's steps (0: a quarter of the cores, at least one)")
    p.add_argument("--warm_up", default="all", choices=list(WARM_UPS),
                   help="compiled path: the steps compiled before the server is ready; all: greedy and sampled, "
                        "one sequence and batches; greedy: greedy requests without penalties, min_tokens or bad "
                        "words (about half the first-time compile); single: those, one sequence at a time (a "
                        "quarter). A request outside what was warmed runs its steps eagerly: exact, slower "
                        "(nemospec_eager_steps_total counts them; the log names each once)")
    p.add_argument("--max_batch_size", type=int, default=None, help="sequences per step (default: the engine's)")
    p.add_argument("--max_queue", type=int, default=64, help="requests waiting beyond the batch; more are refused")
    p.add_argument("--logprobs_mode", default="processed_logprobs", choices=list(LOGPROBS_MODES),
                   help="the log-probabilities requests get (vLLM's --logprobs-mode): processed_logprobs, those "
                        "of the distribution a token was drawn from (after penalties, temperature, top-k, top-p; "
                        "TensorRT-LLM's); raw_logprobs, the model's own log-softmax (vLLM's default)")
    p.add_argument("--openai_port", type=int, default=9000,
                   help="port of the OpenAI-compatible frontend (/v1/completions, /v1/chat/completions; 0: a free "
                        "port); with --api_key it requires 'Authorization: Bearer KEY'")
    p.add_argument("--no_openai", action="store_true", help="serve Triton's endpoints only")
    p.add_argument("--served_model_name", default=None,
                   help="the model name of the OpenAI API (default: the engine directory's name)")
    p.add_argument("--no_verify", dest="verify", action="store_false",
                   help="skip the sha256 check of every engine and weights file before starting (sizes are still "
                        "checked)")
    p.add_argument("--max_restarts", type=int, default=5,
                   help="restarts after a crash allowed within --restart_window; one more is a crash loop (exit 3)")
    p.add_argument("--restart_window", type=float, default=300.0, help="seconds (see --max_restarts)")
    p.add_argument("--stall_timeout", type=float, default=120.0,
                   help="seconds without a scheduler step while requests are in flight after which the speculative "
                        "model counts as hung: not ready, restarted (0: off)")
    p.add_argument("--shutdown_timeout", type=float, default=6.0,
                   help="seconds requests in flight get after SIGTERM/SIGINT; then the server and its stubs are killed")
    p.add_argument("--ready_timeout", type=float, default=600.0,
                   help="seconds the first start may take to report ready (a cold compiled start of a large model "
                        "with --warm_up all can need more); past it, exit 2 with the server log's last lines")
    p.add_argument("--endpoints_json", default=None, metavar="FILE",
                   help="write the endpoint URLs as one JSON object to FILE (whole, before the ready line), for "
                        "scripts that wait for readiness and then connect")
    add_limit_args(p)
    add_policy_args(p, build=False)


def cmd_serve(args, out=print) -> int:
    """Runs until SIGINT/SIGTERM (exit 0), a crash loop (3) or a failed restart (1); bad input raises
    NemospecError (exit 2 from the CLI). The server and its stubs are stopped on every path out."""
    def on_signal(signum, frame):
        raise KeyboardInterrupt

    notice = verify_engine_dir(args.engine_dir, hashes=args.verify)  # before anything starts: exit 2 naming a file
    if notice:
        out(f"warning: {notice}", file=sys.stderr)
    limits = limits_from({flag: getattr(args, flag, None) for flag in LIMITS})
    if not 0 < args.shutdown_timeout <= 60:
        raise NemospecError(f"--shutdown_timeout: expected 0 < seconds <= 60, got {args.shutdown_timeout}")
    if not args.ready_timeout > 0:
        raise NemospecError(f"--ready_timeout: expected a positive number of seconds, got {args.ready_timeout}")

    backend = args.backend
    if backend == "auto":   # the library's auto stays eager on the CPU (a quick start for tests and the demo)
        from runtime.loading import resolve_backend
        backend = resolve_backend("auto")
        if backend == "compiled":
            out("backend auto: the compiled path (--backend torch starts at once, eagerly); its steps "
                "compile before the server is ready, minutes the first time on this machine", file=sys.stderr)
    if args.fill_only:
        return fill_only(args, backend, limits, out)

    def start(ready_timeout: float = args.ready_timeout):
        return start_server(args.engine_dir, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                            metrics_port=args.metrics_port, model_repo_dir=args.model_repo_dir, api_key=args.api_key,
                            backend=backend, torch_threads=args.torch_threads, warm_up=args.warm_up,
                            max_batch_size=args.max_batch_size,
                            max_queue=args.max_queue, logprobs_mode=args.logprobs_mode,
                            draft_policy={f: getattr(args, f, None) for f in POLICY_FLAGS},
                            shutdown_timeout=args.shutdown_timeout, limits=limits, ready_timeout=ready_timeout)

    supervisor = Supervisor(start, max_restarts=args.max_restarts, restart_window=args.restart_window,
                            stall_timeout=args.stall_timeout)
    try:
        health = serve_health(supervisor, args.host, args.health_port)
    except OSError as e:
        raise NemospecError(f"--health_port: cannot bind {args.host}:{args.health_port}: {e.strerror or e}") from None
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    started, frontend = False, None
    try:
        out(f"starting tritonserver for {args.engine_dir} ...", file=sys.stderr)
        handle = supervisor.start()
        started = True
        if not args.no_openai:
            frontend = start_openai(args, handle, supervisor.is_ready,
                                    lambda: supervisor.handle.run_dir / "cancel" if supervisor.handle else None,
                                    lambda: supervisor.handle.metrics_url if supervisor.handle else None)
        health_url = f"http://{_client_host(args.host)}:{args.health_port}"
        endpoints = handle.endpoints()
        endpoints = {**{k: v for k, v in endpoints.items() if k in ("http", "grpc", "metrics")},
                     "ready": f"{health_url}/health/ready", "supervisor_metrics": f"{health_url}/metrics",
                     **{k: v for k, v in endpoints.items() if k in ("generate", "generate_stream")},
                     **({"openai": frontend.url} if frontend else {})}
        for name, url in endpoints.items():
            out(f"{name:18s} {url}")
        if args.endpoints_json:
            write_endpoints(args.endpoints_json, endpoints)
        out(f"model repository {handle.repo_dir}; server log {handle.log_path}", file=sys.stderr)
        sys.stdout.flush()   # the endpoint lines are out (stdout) before the ready line (stderr) is
        out("ready; Ctrl-C (SIGINT) or SIGTERM stops the server", file=sys.stderr)
        return supervisor.run()
    except KeyboardInterrupt:
        if started:
            out("stopping tritonserver ...", file=sys.stderr)
        return 0
    finally:
        for s in previous:               # a second signal must not cut the stop short
            signal.signal(s, signal.SIG_IGN)
        # Triton drains (and the supervisor's readiness says stopping) while the OpenAI frontend, which
        # stops taking connections at once, lets its requests in flight end as Triton ends them: it
        # was stopped first, and cut them after 3 s with uvicorn's plain 500 whatever --shutdown_timeout said
        stopper = threading.Thread(target=supervisor.stop, name="nemospec-stop")
        stopper.start()
        if frontend is not None:
            frontend.stop(timeout=args.shutdown_timeout + 10)
        stopper.join()
        health.shutdown()
        health.server_close()
        for s, h in previous.items():
            signal.signal(s, h)


def fill_only(args, backend: str, limits: dict, out=print) -> int:
    """``--fill_only``: the repository that ``serve`` would run, kept where the user names, and the
    command line of a tritonserver that serves it. Its models add the checkout to their own sys.path
    (the ``nemospec_root`` parameter), so that server's Python backend needs only nemospec's
    dependencies (docker/Dockerfile installs them in the NGC image)."""
    import shlex
    from pathlib import Path

    from serving.launch import restricted_api_args
    from serving.repository import ROOT, fill_model_repo
    if not args.model_repo_dir:
        raise NemospecError("--fill_only: needs --model_repo_dir DIR, the directory to write the model repository to")
    repo = fill_model_repo(args.engine_dir, Path(args.model_repo_dir).resolve(), backend=backend,
                           torch_threads=args.torch_threads, warm_up=args.warm_up, max_batch_size=args.max_batch_size,
                           max_queue=args.max_queue, logprobs_mode=args.logprobs_mode,
                           draft_policy={f: getattr(args, f, None) for f in POLICY_FLAGS}, limits=limits)
    out(f"model repository {repo} (models preprocessing, speculative, postprocessing, ensemble; nemospec from {ROOT})")
    restricted = "".join(" " + shlex.quote(a) for a in restricted_api_args(args.api_key))   # --api_key's
    out(f"tritonserver --model-repository {shlex.quote(str(repo))} --model-control-mode none --strict-model-config true"
        f"{restricted}")
    return 0


def write_endpoints(path, endpoints: dict) -> None:
    """The endpoint URLs as JSON, written to a temporary file and renamed: a reader never sees half."""
    import json
    import os
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(json.dumps(endpoints, indent=1) + "\n")
    os.replace(tmp, path)


def start_openai(args, handle, ready=None, cancel_dir=None, metrics_url=None):
    """The OpenAI frontend for a started server (sends its requests to the server's gRPC port, which a
    restart keeps); ``ready``: the supervisor's truthful readiness, which its /health/ready joins;
    ``cancel_dir`` and ``metrics_url``: callables giving the running server's side-channel directory
    and metrics URL (a restart moves the directory); ``metrics_url`` defaults to ``handle``'s."""
    from serving.openai.server import OpenAIFrontend
    headers = {GRPC_API_KEY_HEADER: args.api_key} if args.api_key else None
    return OpenAIFrontend(args.engine_dir, handle.grpc_url, args.host, args.openai_port, args.api_key, headers,
                          ready=ready, model_name=args.served_model_name, cancel_dir=cancel_dir,
                          limits={flag: getattr(args, flag, None) for flag in LIMITS},
                          graceful_seconds=args.shutdown_timeout + 5,
                          metrics_url=metrics_url or handle.metrics_url).start()
