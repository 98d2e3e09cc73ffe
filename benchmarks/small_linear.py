"""The compiled path's small-row GEMM (nemospec::small_linear) against torch's (MKL), side by side.

Measurements in one process, interleaved so machine noise hits both sides alike:
1. products alone: every weight matrix of the embedded target (its real shapes, ~10 MB, cycled so
   each product reads its weights from beyond L2, as a model step does) at M = 1, 2, 3, 5, 9 rows;
2. bf16 products (a bf16 model): the same matrices in bf16, torch's bf16 linear (oneDNN) against the
   kernel's AVX512-BF16 dot products, the fp32 packed products beside them;
3. the embedded target's compiled steps (decode T=1, verify T=3 and T=5), compiled twice: with the
   kernel and with torch's GEMM (``use_small_linear(None)``), ms per step and verify / decode.
4. (``--widened``) the products of a 4x-widened target layer (hidden 768: 3160x768, 768x1536,
   3072x768, 768x3072, 2048x768, 1024x768, 768x1024), two copies each (~92 MB fp32, beyond L3),
   at M = 1, 2, 3, 5 rows: torch against the kernel's fp32 and bf16-weights forms, ms per pass over
   them all and x / 1 row (memory-bound: the kernel reads the weights once per call for all rows).
The kernel runs both ways in each: with its packed weight copies (the default) and row-major
(``nemospec::small_linear_packing(False)``), switched at run time in the same graphs. The products
alone pay a Python dispatch per call (~2.5 us) that a compiled graph's C++ wrapper does not.

The kernel's form (AVX-512 or AVX2, ``runtime.compiled.small_linear.form``) is printed first.

    python benchmarks/small_linear.py [--threads 1] [--blocks 7] [--widened]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __name__ == "__main__":   # timed on the allocator the commands use (runtime.allocator)
    from runtime.allocator import preload
    preload()

import torch  # noqa: E402


def _interleaved(fns: dict, blocks: int, iters: int) -> dict:
    times = {k: [] for k in fns}
    for _ in range(blocks):
        for k, fn in fns.items():
            for _ in range(2):
                fn()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            times[k].append((time.perf_counter() - start) / iters * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def _packing(packed: bool, fn):
    """``fn`` run with the kernel's packed layout on or off (the A/B switch)."""
    def go():
        torch.ops.nemospec.small_linear_packing(packed)
        return fn()
    return go


def products(checkpoint, kernel, blocks: int) -> None:
    from builder.checkpoint import load_checkpoint
    _, tensors = load_checkpoint(checkpoint)
    weights = [tensors[n].float().contiguous() for n in tensors
               if tensors[n].dim() == 2 and "embed" not in n and tensors[n].shape[0] > 4 and "mtp" not in n]
    mb = sum(w.numel() for w in weights) * 4 / 1e6
    print(f"products alone: {len(weights)} weight matrices of the embedded target, {mb:.1f} MB, cycled")
    print(f"{'rows':>5}{'torch ms':>11}{'row-major':>11}{'packed':>9}{'torch/packed':>14}{'row-major/packed':>18}")
    for rows in (1, 2, 3, 5, 9):
        xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}

        def run(fn, packed=True):
            return _packing(packed, lambda: [fn(xs[w.shape[1]], w) for w in weights])
        med = _interleaved({"torch": run(torch.nn.functional.linear), "row-major": run(kernel, False),
                            "packed": run(kernel)}, blocks, 20)
        print(f"{rows:>5}{med['torch']:>11.3f}{med['row-major']:>11.3f}{med['packed']:>9.3f}"
              f"{med['torch'] / med['packed']:>13.2f}x{med['row-major'] / med['packed']:>17.2f}x")
    torch.ops.nemospec.small_linear_packing(True)


def products_bf16(checkpoint, kernel, blocks: int) -> None:
    dots = "AVX512-BF16" if torch.ops.nemospec.small_linear_bf16_hardware() else "fp32 FMAs (no AVX512-BF16)"
    print(f"bf16 products: the kernel's dot products run as {dots}")
    from builder.checkpoint import load_checkpoint
    _, tensors = load_checkpoint(checkpoint)
    weights = [tensors[n].float().contiguous() for n in tensors
               if tensors[n].dim() == 2 and "embed" not in n and tensors[n].shape[0] > 4 and "mtp" not in n]
    halves = [w.bfloat16() for w in weights]
    print(f"bf16 products: the same {len(weights)} matrices in bf16, {sum(w.numel() for w in weights) * 2 / 1e6:.1f} MB")
    print(f"{'rows':>5}{'torch bf16':>12}{'bf16 dot':>10}{'fp32 packed':>13}{'torch/dot':>11}{'fp32/dot':>10}")
    for rows in (1, 2, 3, 5, 9):
        xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
        xh = {k: v.bfloat16() for k, v in xs.items()}
        med = _interleaved({"torch": lambda: [torch.nn.functional.linear(xh[w.shape[1]], w) for w in halves],
                            "dot": lambda: [kernel(xh[w.shape[1]], w) for w in halves],
                            "fp32": lambda: [kernel(xs[w.shape[1]], w) for w in weights]}, blocks, 20)
        print(f"{rows:>5}{med['torch']:>12.3f}{med['dot']:>10.3f}{med['fp32']:>13.3f}"
              f"{med['torch'] / med['dot']:>10.2f}x{med['fp32'] / med['dot']:>9.2f}x")


WIDENED = [(3160, 768), (768, 1536), (3072, 768), (768, 3072), (2048, 768), (1024, 768), (768, 1024)]


def widened(blocks: int) -> None:
    ops = torch.ops.nemospec
    weights = [torch.randn(shape) for shape in WIDENED for _ in range(2)]
    print(f"widened products: {len(weights)} matrices (hidden 768, 4x widened), "
          f"{sum(w.numel() for w in weights) * 4 / 1e6:.0f} MB fp32, cycled")
    print(f"{'rows':>5}{'torch ms':>10}{'x1':>6}{'fp32 ms':>9}{'x1':>6}{'bf16w ms':>10}{'x1':>6}{'torch/fp32':>12}")
    one = {}
    for rows in (1, 2, 3, 5):
        xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
        med = _interleaved({"torch": lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights],
                            "fp32": lambda: [ops.small_linear(xs[w.shape[1]], w) for w in weights],
                            "bf16w": lambda: [ops.small_linear_bf16w(xs[w.shape[1]], w) for w in weights]}, blocks, 2)
        one = one or med
        print(f"{rows:>5}" + "".join(f"{med[k]:>{10 if k != 'fp32' else 9}.2f}{med[k] / one[k]:>5.2f}x"
                                     for k in ("torch", "fp32", "bf16w")) + f"{med['torch'] / med['fp32']:>11.2f}x")


def steps(loaded, kernel, blocks: int) -> None:
    from builder.backends import torch_backend
    from runtime.compiled.steps import _own_code
    module, runner = loaded.runner.module, loaded.runner
    torch.manual_seed(0)
    prompt = torch.randint(0, loaded.config.vocab_size, (1, 64), dtype=torch.int32)
    pos = torch.arange(64, dtype=torch.int32)[None]
    with torch.no_grad():
        state = runner.new_state(1, 256)
        _, state, _ = runner.forward(prompt, pos, torch.tensor([64], dtype=torch.int32),
                                     torch.tensor([[63]], dtype=torch.int32), state)
    fns = {}
    for side, k in (("torch", None), ("ours", kernel)):
        torch_backend.use_small_linear(k)
        for t in (1, 3, 5):
            fn = torch.compile(_own_code(module.forward), fullgraph=True, dynamic=False,
                               options={"cpp_wrapper": True})
            args = (prompt[:, :t], pos[:, :t] + 64, torch.tensor([t], dtype=torch.int32),
                    torch.arange(t, dtype=torch.int32)[None], state)
            with torch.no_grad():
                for _ in range(2):
                    fn(*args, verify=t > 1)
            fns[(side, t)] = (fn, args, t > 1)
    torch_backend.use_small_linear(kernel)

    def call(entry, packed=True):
        fn, args, verify = entry
        return _packing(packed, lambda: fn(*args, verify=verify))
    runs = {**{("torch", t): call(fns[("torch", t)]) for t in (1, 3, 5)},
            **{("row-major", t): call(fns[("ours", t)], False) for t in (1, 3, 5)},
            **{("packed", t): call(fns[("ours", t)]) for t in (1, 3, 5)}}
    with torch.no_grad(), torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        med = _interleaved(runs, blocks, 30)
    torch.ops.nemospec.small_linear_packing(True)
    print("compiled target steps (batch 1, 64-token context), ms and / decode")
    print(f"{'step':<12}{'torch':>14}{'row-major':>14}{'packed':>14}{'torch/packed':>14}")
    for t in (1, 3, 5):
        name = "decode T=1" if t == 1 else f"verify T={t}"
        cells = "".join(f"{med[(side, t)]:>7.3f} {med[(side, t)] / med[(side, 1)]:>5.2f}x"
                        for side in ("torch", "row-major", "packed"))
        print(f"{name:<12}{cells}{med[('torch', t)] / med[('packed', t)]:>13.2f}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--blocks", type=int, default=7)
    p.add_argument("--widened", action="store_true", help="also the products of a 4x-widened target layer")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from builder.embedded.sources import resolve_sources
    from runtime.compiled import small_linear
    from runtime.compiled.steps import _configure, cache_dir
    from runtime.loading import open_checkpoint
    if not small_linear.load(cache_dir().parent):
        print("nemospec::small_linear is not available on this CPU (it needs AVX-512F, or AVX2 and FMA)")
        return 1
    _configure()
    kernel = torch.ops.nemospec.small_linear
    target, _ = resolve_sources(None, "eagle3", None, None)
    loaded = open_checkpoint(target, backend="torch")
    print(f"{args.threads} thread(s), kernel form {small_linear.form()}")
    products(target, kernel, args.blocks)
    products_bf16(target, kernel, args.blocks)
    if args.widened:
        widened(args.blocks)
    steps(loaded, kernel, args.blocks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
