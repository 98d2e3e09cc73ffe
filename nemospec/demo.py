"""`make demo`: the embedded trained NemotronH and one of its drafts, built, served and streamed.

1. build the target, verify and draft engines for MODE (eagle3 by default);
2. start the Triton server on them (model_repo ensemble, real tritonserver);
3. stream a code completion through gRPC, printing the text as it arrives;
4. measure through the same server: tokens/s and acceptance with speculation, and target-only
   (the per-request ``speculative: false``) on the same engines;
5. stop the server; then offline on the same engines, where a step's time goes (draft, verify,
   accept + rollback, host) beside a target-only step, and the speedup those costs predict.
"""
from __future__ import annotations

if __name__ == "__main__":   # a model process: mimalloc first (runtime.allocator), before heavy imports
    from runtime.allocator import preload
    preload()

import os
import time
from pathlib import Path

from rich.console import Console

from builder.errors import ArgumentParser
from nemospec.bench import MODES, PROMPTS, WIDE_FACTOR_HELP, build_mode_engines

console = Console(highlight=False)


def offline_cost_line(engine_dir: Path, prompt: str, max_new_tokens: int, backend: str) -> str:
    import torch
    from builder.tokenizer_file import load_tokenizer

    from runtime.compiled.runner import warm_up
    from runtime.step_costs import cost_line
    from runtime.generation import generate
    from runtime.loading import open_engine_dir
    from runtime.speculative import speculative_generate
    from runtime.step_costs import cost_model
    from serving.repository import default_torch_threads
    torch.set_num_threads(default_torch_threads())   # as the server ran: its saved steps load here
    loaded = open_engine_dir(engine_dir, backend)     # the backend the server ran
    ids = load_tokenizer(loaded.tokenizer_path).encode(prompt).ids
    k = loaded.max_draft_len
    warm_up(loaded, [ids], k)
    for _ in range(2):  # the second pair is measured (warm)
        runs = [speculative_generate(loaded.runner, loaded.proposer(), [ids], max_new_tokens, k,
                                     policy=loaded.draft_policy),
                generate(loaded.runner, [ids], max_new_tokens)]
    spec, plain = (r.extra["cost"].summary() for r in runs)
    cost = cost_model(spec, plain)
    return (f"{loaded.backend} backend: {runs[0].tokens_per_second:.1f} vs {runs[1].tokens_per_second:.1f} tokens/s "
            f"target-only = {runs[0].tokens_per_second / runs[1].tokens_per_second:.2f}x measured\n" + cost_line(cost))


def openai_chat(engine_dir: Path, grpc_url: str) -> str:
    """One chat completion through the OpenAI frontend (as `nemospec serve` runs it), with the
    request's usage and vLLM-style speculative metrics."""
    import json
    import urllib.request

    from serving.openai.server import OpenAIFrontend
    frontend = OpenAIFrontend(engine_dir, grpc_url, port=0).start()
    try:
        body = {"model": frontend.info.name, "max_tokens": 48, "temperature": 0,
                "messages": [{"role": "user", "content": "a function that reverses a list"}]}
        request = urllib.request.Request(f"{frontend.url}/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=120) as r:
            reply = json.loads(r.read())
    finally:
        frontend.stop()
    spec = reply["metrics"]["speculative_decoding"]
    return (f"{frontend.url}  ->  {reply['choices'][0]['message']['content']!r}\n"
            f"usage {reply['usage']}; mean acceptance length {spec['mean_acceptance_length']:.2f}, "
            f"draft acceptance rate {spec['draft_acceptance_rate']:.2f}")


def main(argv=None):
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="build/demo")
    p.add_argument("--mode", default=os.environ.get("MODE") or "eagle3", choices=MODES)
    p.add_argument("--prompt", default=PROMPTS[1])
    p.add_argument("--max_new_tokens", type=int, default=96)
    from builder.embedded.sources import add_embedded_args
    # wide: the memory-bound instrument, served on the compiled path warmed for one greedy stream
    # (~2.3 minutes from a cold cache on a 2-core Zen 4); EMBEDDED=small make demo serves the shipped one eagerly
    add_embedded_args(p, default=os.environ.get("EMBEDDED") or "wide", factor_default=WIDE_FACTOR_HELP)
    args = p.parse_args(argv)
    from serving.client import stream_generate
    from serving.launch import free_port, serving

    if args.embedded == "wide" and args.embedded_factor is None:   # past this CPU's L3, as the bench widens it
        from nemospec.machine import l3_bytes, memory_bound_factor
        args.embedded_factor = memory_bound_factor(l3_bytes())
    which = "embedded target" if args.embedded == "small" else f"embedded target widened {args.embedded_factor}x"
    console.rule(f"1. nemospec build: {which} + {args.mode} draft (target, verify and draft engines)")
    start = time.perf_counter()
    engine_dir, report = build_mode_engines(None, args.mode, Path(args.workdir), 4, embedded_model=args.embedded,
                                            embedded_factor=args.embedded_factor)
    sizes = ", ".join(f"{n} {e['engine_bytes'] / 2**20:.1f} MiB" for n, e in report["engines"].items())
    console.print(f"built {engine_dir} in {time.perf_counter() - start:.0f} s: {sizes}")

    console.rule("2. nemospec serve (tritonserver + model_repo ensemble)")
    ports = dict(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    # the wide model serves on the compiled path (eagerly it decodes ~3x slower and its verify costs 2x a
    # decode), warmed for what the demo sends (greedy, one stream: a quarter of a full warm-up)
    backend = "torch" if args.embedded == "small" else "compiled"
    with serving(engine_dir, backend=backend, warm_up="single", ready_timeout=1200, **ports) as server:
        console.print(f"serving: gRPC {server.grpc_url}, HTTP {server.http_url}, metrics {server.metrics_url}")
        console.rule("3. a code completion streamed over gRPC (greedy)")
        console.print(args.prompt, end="", style="bold")
        spec = stream_generate(server.grpc_url, args.prompt, args.max_new_tokens, end_id=None,
                               on_text=lambda chunk: console.print(chunk, end="", style="green"))
        console.print()
        console.rule("4. the same request with and without speculation, through the server")
        plain = stream_generate(server.grpc_url, args.prompt, args.max_new_tokens, end_id=None, speculative=False)
        spec = stream_generate(server.grpc_url, args.prompt, args.max_new_tokens, end_id=None)
        same = "identical" if spec.ids == plain.ids else "DIFFERENT (a bug)"
        console.print(f"{args.mode}: {len(spec.ids)} tokens, {spec.tokens_per_second:.1f} tokens/s, mean accepted "
                      f"tokens per target forward {spec.mean_accepted_tokens:.2f} (K=4)")
        console.print(f"target only: {len(plain.ids)} tokens, {plain.tokens_per_second:.1f} tokens/s")
        console.print(f"speedup {spec.tokens_per_second / plain.tokens_per_second:.2f}x; outputs {same}")
        console.rule("5. the OpenAI-compatible API beside it (POST /v1/chat/completions)")
        console.print(openai_chat(engine_dir, server.grpc_url), markup=False)
        console.rule("6. stopping the server")
    console.rule("7. offline on the same engines: where a step's time goes")
    console.print(offline_cost_line(engine_dir, args.prompt, args.max_new_tokens, backend))
    console.print("done")
    return 0 if spec.ids == plain.ids else 1


if __name__ == "__main__":
    raise SystemExit(main())
