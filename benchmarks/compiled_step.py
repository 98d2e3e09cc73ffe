"""Per-step cost of the eager torch path against the compiled one (runtime.compiled), side by side.

On the embedded target and its eagle3 draft, batch 1, after a 64-token prefill (KV capacity 512):
target decode (T=1), verify (T=5, K=4) and the rollback after it, the eagle3 draft's proposal step
(one row) and its catch-up chunk (3 rows, padded to 5 by the compiled path). Per step: median ms of
interleaved blocks, eager / compiled ratio, and how long each compiled step took to compile (or to
load from the cache at $NEMOSPEC_COMPILE_CACHE). Each thread count runs in its own process: inductor
builds its kernels for the thread count it compiles under.

    python benchmarks/compiled_step.py [--threads 1,2] [--blocks 7] [--iters 40]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __name__ == "__main__":   # timed on the allocator the commands use (runtime.allocator)
    from runtime.allocator import preload
    preload()


def _measure(blocks: int, iters: int) -> dict:
    import torch
    from runtime.compiled.shapes import STEP_CALLS
    from builder.embedded.sources import resolve_sources
    from runtime.loading import open_checkpoint
    target_dir, draft_dir = resolve_sources(None, "eagle3", None, None)
    eager = open_checkpoint(target_dir, mode="eagle3", draft_dir=draft_dir, backend="torch")
    comp = open_checkpoint(target_dir, mode="eagle3", draft_dir=draft_dir, backend="compiled")
    ed, cd = eager.proposer().draft, comp.proposer().draft
    torch.manual_seed(0)
    prompt = torch.randint(0, eager.config.vocab_size, (1, 64), dtype=torch.int32)
    pos = torch.arange(64, dtype=torch.int32)[None]
    one, zero = torch.ones(1, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)
    five = torch.arange(5, dtype=torch.int32)[None]

    def target_setup(loaded):
        state = loaded.runner.new_state(1, 512)
        _, state, feats = loaded.runner.forward(prompt, pos, torch.tensor([64], dtype=torch.int32),
                                                torch.tensor([[63]], dtype=torch.int32), state)
        return state, feats["aux_hidden"]

    def steps(loaded, draft):
        r = loaded.runner
        state, aux = target_setup(loaded)
        _, verified, _ = r.forward(prompt[:, :5], pos[:, :5] + 64, torch.tensor([5], dtype=torch.int32), five,
                                   state, verify=True)
        dstate = draft.new_state(1, 512)
        hidden = torch.zeros(1, 1, draft.module.hidden_size, dtype=draft.module.dtype)
        rows3 = aux[:, :3]
        return {
            "decode T=1": lambda: r.forward(prompt[:, :1], pos[:, :1] + 64, one, zero, state),
            "verify T=5": lambda: r.forward(prompt[:, :5], pos[:, :5] + 64, torch.tensor([5], dtype=torch.int32),
                                            five, state, verify=True),
            "rollback T=5": lambda: r.rollback(state, verified, torch.tensor([2])),
            "eagle3 draft step": lambda: draft.step(prompt[:, :1], None, hidden, pos[:, :1] + 64, one, zero, dstate),
            "eagle3 catch-up 3 rows": lambda: draft.step(prompt[:, :3], rows3, None, pos[:, :3] + 64,
                                                         torch.tensor([3], dtype=torch.int32),
                                                         torch.tensor([[2]], dtype=torch.int32), dstate),
        }

    e, c = steps(eager, ed), steps(comp, cd)
    for fn in c.values():            # compile (or load) every step: it compiles on its 2nd call
        for _ in range(STEP_CALLS + 1):
            fn()
    times = {n: {"eager": [], "compiled": []} for n in e}
    for _ in range(blocks):          # interleaved, so load from other work hits both alike
        for n in e:
            for kind, fn in (("eager", e[n]), ("compiled", c[n])):
                for _ in range(3):
                    fn()
                t = time.perf_counter()
                for _ in range(iters):
                    fn()
                times[n][kind].append((time.perf_counter() - t) / iters * 1e3)
    out = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    seconds = {}
    for steps_ in (comp.runner._forward, comp.runner._rollback, cd._steps):
        for key, s in steps_.compile_seconds.items():
            seconds[key] = round(s, 2)
    return {"steps": out, "compile_seconds": seconds, "threads": torch.get_num_threads()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--blocks", type=int, default=7)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        import torch
        torch.set_num_threads(args.child)
        print(json.dumps(_measure(args.blocks, args.iters)))
        return 0
    results = {}
    for n in [int(t) for t in args.threads.split(",")]:
        run = subprocess.run([sys.executable, __file__, "--child", str(n), "--blocks", str(args.blocks),
                              "--iters", str(args.iters)], capture_output=True, text=True,
                             env={**__import__("os").environ, "OMP_NUM_THREADS": str(n)})
        if run.returncode != 0:
            sys.stderr.write(run.stderr)
            return run.returncode
        results[n] = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"{'step (batch 1)':<24}" + "".join(f"{f'{n} thread' + ('s' if n > 1 else ''):>34}" for n in results))
    print(f"{'':<24}" + "".join(f"{'eager ms':>12}{'compiled ms':>12}{'ratio':>10}" for _ in results))
    for name in next(iter(results.values()))["steps"]:
        row = f"{name:<24}"
        for r in results.values():
            s = r["steps"][name]
            row += f"{s['eager']:>12.3f}{s['compiled']:>12.3f}{s['eager'] / s['compiled']:>9.2f}x"
        print(row)
    for n, r in results.items():
        total = sum(r["compile_seconds"].values())
        print(f"compile/load seconds, {n} thread(s): {total:.1f} s in all; "
              + ", ".join(f"{k} {v}" for k, v in r["compile_seconds"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
