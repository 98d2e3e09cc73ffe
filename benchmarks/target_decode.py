"""Greedy decode tokens/s: our target-only path against transformers' generate (with cache), CPU.

Same checkpoint, same prompts, same process, interleaved runs; prints the median of each and the
ratio. Goal ("speculation pays"): ours >= 5x transformers, same threads. ``--backend compiled`` (the
default) is the fastest exact CPU path, warmed up (compiled or loaded from the cache) before
timing; ``torch`` the eager reference. Outputs are checked identical, so the speed compares equal work.

    python benchmarks/target_decode.py [--checkpoint_dir DIR] [--backend compiled|torch] [--new_tokens 64]
        [--runs 5] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import NemotronHForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __name__ == "__main__":   # timed on the allocator the commands use (runtime.allocator)
    from runtime.allocator import preload
    preload()
from runtime.compiled.runner import warm_up  # noqa: E402
from runtime.generation import generate  # noqa: E402
from runtime.loading import open_checkpoint  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint_dir", help="default: a random tiny MoE checkpoint made here")
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", choices=("compiled", "torch"), default="compiled")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ckpt = args.checkpoint_dir
    if ckpt is None:
        from builder.random_checkpoint import write_random_checkpoint
        ckpt = write_random_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "ME*EM-M*-")
    ours = open_checkpoint(ckpt, backend=args.backend).runner
    config = ours.config
    theirs = NemotronHForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    theirs.generation_config.eos_token_id = None
    prompt = torch.randint(3, config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()

    def run_ours():
        return generate(ours, [prompt], args.new_tokens).output_ids[0]

    def run_theirs():
        with torch.no_grad():
            out = theirs.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    if run_ours() != run_theirs():
        sys.exit("outputs differ: the comparison would be meaningless")
    warm_up(SimpleNamespace(runner=ours), [prompt])          # every step shape compiled before timing
    times = {f"nemospec {args.backend}": [], "transformers generate": []}
    for _ in range(args.runs):
        for name, fn in ((f"nemospec {args.backend}", run_ours), ("transformers generate", run_theirs)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    rate = {k: args.new_tokens / statistics.median(v) for k, v in times.items()}
    for k, v in rate.items():
        print(f"{k:24s} {v:8.1f} tokens/s (median of {args.runs})")
    ratio = rate[f"nemospec {args.backend}"] / rate["transformers generate"]
    print(f"ratio ours/transformers: {ratio:.2f}x (goal >= 5x), {args.threads} thread(s)")


if __name__ == "__main__":
    main()
