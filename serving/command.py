"""The `nemospec serve` command: start the server, print its endpoints, run until a signal."""
from __future__ import annotations

import sys
import time
import signal

from runtime.draft_policy import POLICY_FLAGS, add_policy_args
from serving.launch import API_KEY_HEADER, GRPC_API_KEY_HEADER, start_server
from serving.repository import BACKENDS


def add_serve_args(p) -> None:
    p.add_argument("--engine_dir", required=True, help="engine directory built by `nemospec build` (with tokenizer.json)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 to accept other machines)")
    p.add_argument("--http_port", type=int, default=8000)
    p.add_argument("--grpc_port", type=int, default=8001)
    p.add_argument("--metrics_port", type=int, default=8002)
    p.add_argument("--model_repo_dir", default=None, help="where to write the filled model repository (default: a temporary directory)")
    p.add_argument("--api_key", default=None,
                   help=f"require the key on the model-repository and shared-memory endpoints (HTTP header "
                        f"'{API_KEY_HEADER}: KEY', gRPC metadata '{GRPC_API_KEY_HEADER}: KEY')")
    p.add_argument("--backend", default="auto", choices=list(BACKENDS),
                   help="auto: TensorRT on a GPU, else torch; compiled: the compiled CPU path (its first requests "
                        "wait for the compiles)")
    p.add_argument("--max_batch_size", type=int, default=None, help="sequences per step (default: the engine's)")
    p.add_argument("--max_queue", type=int, default=64, help="requests waiting beyond the batch; more are refused")
    p.add_argument("--openai_port", type=int, default=9000,
                   help="port of the OpenAI-compatible frontend (/v1/completions, /v1/chat/completions; 0: a free "
                        "port); with --api_key it requires 'Authorization: Bearer KEY'")
    p.add_argument("--no_openai", action="store_true", help="serve Triton's endpoints only")
    p.add_argument("--served_model_name", default=None,
                   help="the model name of the OpenAI API (default: the engine directory's name)")
    add_policy_args(p, build=False)


def cmd_serve(args, out=print) -> int:
    """Runs until SIGINT/SIGTERM (exit 0) or until tritonserver dies (exit 1); bad input raises
    NemospecError (exit 2 from the CLI). The child is stopped on every path out."""
    def on_signal(signum, frame):
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    handle = frontend = None
    try:
        out(f"starting tritonserver for {args.engine_dir} ...", file=sys.stderr)
        handle = start_server(args.engine_dir, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                              metrics_port=args.metrics_port, model_repo_dir=args.model_repo_dir, api_key=args.api_key,
                              backend=args.backend, max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                              draft_policy={f: getattr(args, f, None) for f in POLICY_FLAGS})
        if not args.no_openai:
            frontend = start_openai(args, handle)
        for name, url in {**handle.endpoints(), **({"openai": frontend.url} if frontend else {})}.items():
            out(f"{name:16s} {url}")
        out(f"model repository {handle.repo_dir}; server log {handle.log_path}", file=sys.stderr)
        out("ready; Ctrl-C (SIGINT) or SIGTERM stops the server", file=sys.stderr)
        sys.stdout.flush()
        while handle.alive():
            time.sleep(0.5)
        out(f"tritonserver exited with code {handle.process.returncode}; last log lines:\n{handle.log_tail()}",
            file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if handle is not None:
            out("stopping tritonserver ...", file=sys.stderr)
        return 0
    finally:
        if frontend is not None:
            frontend.stop()
        if handle is not None:
            handle.stop()
        for s, h in previous.items():
            signal.signal(s, h)


def start_openai(args, handle):
    """The OpenAI frontend for a started server (sends its requests to the server's gRPC port)."""
    from serving.openai.server import OpenAIFrontend
    headers = {GRPC_API_KEY_HEADER: args.api_key} if args.api_key else None
    return OpenAIFrontend(args.engine_dir, handle.grpc_url, args.host, args.openai_port, args.api_key, headers,
                          model_name=args.served_model_name).start()
