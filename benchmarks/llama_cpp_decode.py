"""Greedy decode of a GGUF in stock llama.cpp (llama-cpp-python's low-level API), timed, for the
llama.cpp peer (``benchmarks/llama_cpp_peer.py`` runs this in the peer's own venv).

Per prompt and run: the prompt in one batch, then one token per ``llama_decode``, the next id the
argmax of the last logits (what our greedy decode does). Prints one JSON object: the ids generated
per prompt (from the first run) and, per run, the seconds of the whole generation and of the
one-token steps alone.

    python benchmarks/llama_cpp_decode.py --model FILE.gguf --prompts '[[1, 2, 3]]' --new_tokens 64 \
        --threads 2 --runs 3
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of token id lists")
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    import llama_cpp as L

    prompts = json.loads(args.prompts)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(args.model.encode(), mp)
    if not model:
        raise SystemExit(f"{args.model}: llama.cpp could not load the model")
    cp = L.llama_context_default_params()
    cp.n_ctx = max(len(p) for p in prompts) + args.new_tokens + 8
    cp.n_batch = cp.n_ubatch = max(len(p) for p in prompts)
    cp.n_threads = cp.n_threads_batch = args.threads
    cp.type_k = cp.type_v = 0          # an f32 KV cache, as ours
    ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))

    def feed(ids):
        arr = (L.llama_token * len(ids))(*ids)
        if L.llama_decode(ctx, L.llama_batch_get_one(arr, len(ids))) != 0:
            raise SystemExit("llama_decode failed")
        return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).argmax())

    outputs, runs = None, []
    for _ in range(args.runs):
        run_ids, total, steps = [], 0.0, 0.0
        for prompt in prompts:
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
            start = time.perf_counter()
            ids = [feed(prompt)]
            step_start = time.perf_counter()
            while len(ids) < args.new_tokens:
                ids.append(feed([ids[-1]]))
            end = time.perf_counter()
            total, steps = total + end - start, steps + end - step_start
            run_ids.append(ids)
        outputs = outputs or run_ids
        runs.append({"seconds": total, "step_seconds": steps,
                     "steps": sum(args.new_tokens - 1 for _ in prompts)})
    print(json.dumps({"output_ids": outputs, "runs": runs, "system_info": L.llama_print_system_info().decode()}))
    L.llama_free(ctx)
    L.llama_model_free(model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
