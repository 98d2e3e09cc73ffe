"""The one prepared GPU check, for the day a device is lent (one H200, ~15 minutes, no network; its
image: Python 3.12, CUDA torch 2.11, triton 3.6, transformers 5.17, no TensorRT).

Probes what exists (nvidia-smi, torch + CUDA, triton, tensorrt / tensorrt_rtx, transformers, and that
the project's modules import), then, within --budget_s (default 8 minutes), runs what it can:

1. the embedded model on CUDA through the TorchRunner: target-only and the best speculative mode of
   docs/bench/report.json, tokens/s and whether the speculative output equals target-only greedy;
2. the two plugin kernels (hidden_capture, fp4_markov_head; Triton) at full width, timed with CUDA
   events, checked against their torch references, with the bytes they move over the time against the
   device's copy bandwidth (a large clone, measured here);
3. each Triton op of builder/backends/gpu at full width against its torch op (scripts/gpu_kernels.py);
4. where TensorRT is importable: `nemospec build` of the embedded model (plain and --strip_plan) and
   generation with --backend tensorrt against the torch backend;
5. the embedded model widened 16x (hidden 3072, builder.embedded.widen) on the compiled path with CUDA
   graphs: target-only against eagle3, dflash and mtp end to end, exact (section ``wide_model``), and
   eagle3 with the adaptive K up to 8 (``wide_model_adaptive``).

One JSON report (--output). ``--dry_run`` probes only. Run from the checkout root:

    PYTHONPATH=. python scripts/gpu_check.py --output $OUT/gpu_check.json
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FULL_WIDTH_CONFIGS = ("nemotron-h-8b-base-8k", "nemotron-3-nano-30b-a3b-bf16")
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
from gpu_kernels import triton_kernels  # noqa: E402
PROJECT_MODULES = ("builder.checkpoint", "builder.engine", "builder.safetensors_io", "runtime.loading",
                   "runtime.generation", "runtime.speculative", "plugins.hidden_capture", "plugins.fp4_markov_head")


def _version(module: str):
    try:
        m = importlib.import_module(module)
    except Exception as e:  # absent, or broken on this image
        return {"available": False, "error": f"{type(e).__name__}: {e}"[:200]}
    return {"available": True, "version": getattr(m, "__version__", "unknown")}


def probe() -> dict:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = smi.stdout.strip() if smi.returncode == 0 else {"error": smi.stderr.strip()[:200]}
    except (OSError, subprocess.TimeoutExpired) as e:
        out["nvidia_smi"] = {"error": f"{type(e).__name__}: {e}"[:200]}
    for name in ("torch", "triton", "tensorrt", "tensorrt_rtx", "transformers", "safetensors", "numpy"):
        out[name] = _version(name)
    import torch
    out["cuda"] = {"available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["cuda"].update(device=p.name, capability=f"{p.major}.{p.minor}", memory_gb=round(p.total_memory / 2**30, 1))
    out["imports"] = {}
    for m in PROJECT_MODULES:
        try:
            importlib.import_module(m)
            out["imports"][m] = "ok"
        except Exception as e:
            out["imports"][m] = f"{type(e).__name__}: {e}"[:300]
    return out


def _cuda_time(fn, runs: int = 20) -> float:
    import torch
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 1e3 / runs


def embedded_model(deadline: float, device: str = "cuda", new: int = 64, backend: str = "torch",
                   modes: tuple | None = None, tree_nodes: int = 0, factor: int = 1, k: int = 0,
                   policy=None) -> dict:
    """Target-only against each speculative mode of the embedded model (one prompt's pair at a time,
    so both see the same machine), on ``device`` through the eager TorchRunner or ``backend="compiled"``;
    ``factor`` > 1: the embedded model widened that many times (builder.embedded.widen); ``k`` (default
    the bench report's) and ``policy`` (a runtime.draft_policy.DraftPolicy) for the speculative runs."""
    from builder import embedded
    from tokenizers import Tokenizer
    report = json.loads((ROOT / "docs" / "bench" / "report.json").read_text())
    k = k or report["num_draft_tokens"]
    modes = modes or MODES
    tok = Tokenizer.from_file(str(embedded.target_dir() / "tokenizer.json"))
    prompts = [tok.encode(t).ids for t in PROMPTS]
    out = {"k": k, "device": device, "backend": backend, "new_tokens": new, "prompts": len(prompts), "modes": {}}
    if factor > 1:
        out["embedded_factor"] = factor
    if policy is not None and policy.adaptive:
        out["draft_len_adaptive"] = True
    for mode in modes:
        if time.time() > deadline:
            out["modes"][mode] = {"skipped": "budget spent"}
            continue
        try:
            tree = None
            if tree_nodes:
                from runtime.tree.draft import TreeShape, default_topk
                tree = TreeShape(tree_nodes, default_topk(mode), k)
            row = _measure_mode(mode, k, prompts, device, new, backend, deadline, tree, factor, policy)
        except Exception as e:
            row = {"error": f"{type(e).__name__}: {e}"[:400], "trace": traceback.format_exc()[-1500:]}
        out["modes"][mode] = row
        print(f"embedded {backend} {mode}: {json.dumps({k: v for k, v in row.items() if k != 'runs'})}", flush=True)
    return out


def _measure_mode(mode, k, prompts, device, new, backend, deadline, tree=None, factor: int = 1, policy=None) -> dict:
    from builder.embedded.sources import resolve_sources
    from runtime.compiled.steps import COMPILE_LOG
    from runtime.generation import generate
    from runtime.loading import open_checkpoint
    from runtime.speculative import speculative_generate
    t0 = time.perf_counter()
    target, draft = resolve_sources(None, mode, embedded="wide" if factor > 1 else "small",
                                    embedded_factor=factor if factor > 1 else None)
    loaded = open_checkpoint(target, device=device, mode=mode, draft_dir=draft, max_draft_len=k, backend=backend)
    generate(loaded.runner, prompts[:1], 8)
    speculative_generate(loaded.runner, loaded.proposer(), prompts[:1], 8, k, policy=policy)
    row = {"load_and_warm_s": round(time.perf_counter() - t0, 1), "runs": []}
    late, during = len(COMPILE_LOG), []
    for ids in prompts:
        if time.time() > deadline:
            row["stopped"] = "budget"
            break
        if backend == "compiled":   # its graphs for this prompt's shapes compiled before the clock runs
            late = _warm_prompt(loaded, ids, new, k, policy)
        t0 = time.perf_counter()
        plain = generate(loaded.runner, [ids], new)
        _sync(device)
        t1 = time.perf_counter()
        spec = speculative_generate(loaded.runner, loaded.proposer(), [ids], new, k, policy=policy)
        _sync(device)
        t2 = time.perf_counter()
        run = {}
        if tree is not None:   # tree speculation of the same prompt, after the chain
            grown = speculative_generate(loaded.runner, loaded.proposer(), [ids], new, k, tree=tree)
            _sync(device)
            t3 = time.perf_counter()
            run = {"tree_tokens_per_second": round(grown.num_tokens / (t3 - t2), 1),
                   "tree_exact": grown.output_ids == plain.output_ids,
                   "tree_mean_accepted": grown.extra["acceptance"].get("mean_accepted_tokens")}
        during += COMPILE_LOG[late:]
        late = len(COMPILE_LOG)
        row["runs"].append({**run, "target_only_tokens_per_second": round(plain.num_tokens / (t1 - t0), 1),
                            "speculative_tokens_per_second": round(spec.num_tokens / (t2 - t1), 1),
                            "exact": spec.output_ids == plain.output_ids,
                            "mean_accepted": spec.extra["acceptance"].get("mean_accepted_tokens"),
                            "steps_by_draft_len": spec.extra["acceptance"].get("steps_by_draft_len"),
                            "cost": _summary(spec), "target_only_cost": _summary(plain)})
    if during:
        row["compiled_during_timing"] = during
    runs = row["runs"]
    if runs:
        row["exact"] = all(r["exact"] and r.get("tree_exact", True) for r in runs)
        keys = ("target_only_tokens_per_second", "speculative_tokens_per_second", "mean_accepted")
        keys += ("tree_tokens_per_second", "tree_mean_accepted") if tree is not None else ()
        for key in keys:
            row[key] = round(sum(r[key] for r in runs) / len(runs), 3 if "accepted" in key else 1)
        row["speedup"] = round(row["speculative_tokens_per_second"] / row["target_only_tokens_per_second"], 3)
        if tree is not None:
            row["tree"] = {"max_nodes": tree.max_nodes, "topk": tree.topk, "depth": tree.depth}
            row["tree_speedup"] = round(row["tree_tokens_per_second"] / row["target_only_tokens_per_second"], 3)
            row["tree_over_chain"] = round(row["tree_tokens_per_second"] / row["speculative_tokens_per_second"], 3)
    return row


def _warm_prompt(loaded, ids, new, k, policy=None) -> int:
    """The compiled path's warm-up for this prompt (runtime.compiled.runner.warm_up: its steps, every draft
    chain bucket and the plain draft step's; with an adaptive policy every candidate K's); returns the
    compile log's length after it."""
    from runtime.compiled.runner import warm_up
    from runtime.compiled.steps import COMPILE_LOG
    warm_up(loaded, [ids], k, policy=policy)
    return len(COMPILE_LOG)


def _summary(result):
    """A generation's per-step costs (host-timed: on a GPU a part's time lands where the queue drains)."""
    cost = (getattr(result, "extra", None) or {}).get("cost")
    return cost.summary() if hasattr(cost, "summary") else cost


def embedded_model_compiled(deadline: float, device: str = "cuda", new: int = 64) -> dict:
    """The compiled path (runtime.compiled: whole steps through torch.compile) on ``device``, eagle3
    only: its compile is the slowest section, so it runs last."""
    os.environ.setdefault("NEMOSPEC_COMPILE_CACHE", tempfile.mkdtemp(prefix="nemospec-compile-"))
    return embedded_model(deadline, device, new, backend="compiled", modes=("eagle3",))


def wide_model(deadline: float, device: str = "cuda", new: int = 64, modes: tuple = ("eagle3", "dflash", "mtp")) -> dict:
    """The embedded model widened 16x (hidden 3072, ~0.76 B decode parameters: a real-sized model
    with the trained drafts' acceptance), compiled with CUDA graphs, target-only against eagle3,
    dflash and mtp end to end, exact. On ``--device cpu`` (the script's shakedown) widened 2x, eager."""
    os.environ.setdefault("NEMOSPEC_COMPILE_CACHE", tempfile.mkdtemp(prefix="nemospec-compile-"))
    cuda = device != "cpu"
    return embedded_model(deadline, device, new, backend="compiled" if cuda else "torch",
                          modes=modes, factor=16 if cuda else 2)


def wide_model_kernels_in_graphs(deadline: float, device: str = "cuda", new: int = 64) -> dict:
    """``wide_model`` with the Triton kernels inside the compiled steps (NEMOSPEC_KERNELS_IN_GRAPHS=1:
    builder/backends/gpu/graph_ops.py) instead of inductor's lowering of the torch ops: beside the
    ``wide_model`` rows it says which default the compiled CUDA path should have (eagle3 only: its
    compiles are what the budget has left). ``kernel_calls``: how often each kernel's op ran inside
    the graphs."""
    from builder.backends import gpu
    from builder.backends.gpu import graph_ops
    saved = gpu.IN_GRAPHS
    gpu.IN_GRAPHS = True
    graph_ops.CALLS.clear()
    try:
        out = wide_model(deadline, device, new, modes=("eagle3",))
    finally:
        gpu.IN_GRAPHS = saved
    out["kernel_calls"] = dict(graph_ops.CALLS)
    return out


def wide_model_adaptive(deadline: float, device: str = "cuda", new: int = 64) -> dict:
    """``wide_model``'s eagle3 with ``--draft_len_adaptive on`` up to K = 8 (each sequence's K from its
    acceptance and the measured step costs, runtime.adaptive_draft_len), beside the fixed-K rows: where a
    verify of 9 rows costs about what one row does, longer chains should pay more than on a CPU (Zen 4:
    2.18x against 2.07x for K = 4). Warming every candidate K compiles about twice ``wide_model``'s graphs."""
    from runtime.draft_policy import DraftPolicy
    os.environ.setdefault("NEMOSPEC_COMPILE_CACHE", tempfile.mkdtemp(prefix="nemospec-compile-"))
    cuda = device != "cpu"
    return embedded_model(deadline, device, new, backend="compiled" if cuda else "torch", modes=("eagle3",),
                          factor=16 if cuda else 2, k=8, policy=DraftPolicy(8, adaptive=True))


def embedded_model_trees(deadline: float, device: str = "cuda", new: int = 64) -> dict:
    """Tree speculation (16 drafted nodes, issue 14) beside the chain and target-only, eager, for the
    chain drafts and the block drafts: where a step is bound by launches rather than rows, a tree's
    verify costs what a chain's does."""
    return embedded_model(deadline, device, new, modes=("eagle3", "dflash", "mtp"), tree_nodes=16)


def embedded_model_no_cuda_graphs(deadline: float, device: str = "cuda", new: int = 64) -> dict:
    """The compiled path with CUDA graphs off (NEMOSPEC_CUDA_GRAPHS=0; they are on by default on CUDA,
    runtime.compiled.steps.device_options), eagle3: what the graphs save the host's kernel launches."""
    os.environ["NEMOSPEC_CUDA_GRAPHS"] = "0"
    try:
        return embedded_model_compiled(deadline, device, new)
    finally:
        os.environ.pop("NEMOSPEC_CUDA_GRAPHS")


def full_width(deadline: float, device: str = "cuda", configs: tuple = FULL_WIDTH_CONFIGS, graphs: bool = False) -> dict:
    """benchmarks/scale.py's step costs at the shipped widths on ``device`` (one random layer of each kind,
    vocabulary 1024, bf16), eager or (``graphs``) each step replayed as one CUDA graph; the full model's
    decode, verify at K+1 and draft steps composed from them, and the projected speedups (a projection)."""
    import types
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scale
    report = json.loads((ROOT / "docs" / "bench" / "report.json").read_text())
    acceptance = {m: v["cost"]["speculative"]["tokens_per_step"] for m, v in report["modes"].items()}
    args = types.SimpleNamespace(no_builds=True, device=device, graphs=graphs)
    out = {"k": scale.K, "acceptance_source": "docs/bench/report.json", "rows": []}
    with tempfile.TemporaryDirectory() as work:
        for name in configs:
            if time.time() > deadline:
                out["stopped"] = "budget"
                break
            try:
                out["rows"].append(scale.measure_config(name, Path(work), args, acceptance))
            except Exception as e:
                out["rows"].append({"config": name, "error": f"{type(e).__name__}: {e}"[:400],
                                    "trace": traceback.format_exc()[-1500:]})
    return out


def _sync(device) -> None:
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth() -> float:
    """The device's copy bandwidth, bytes/s (read + write of a 256 MiB clone)."""
    import torch
    big = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    return 2 * big.numel() / _cuda_time(lambda: big.clone(), 10)


def plugin_kernels(deadline: float) -> dict:
    """Both Triton kernels at full width, timed and checked against their torch references."""
    import torch
    from builder.nvfp4_format import quantize_nvfp4
    from plugins.fp4_markov_head import fp4_markov_head_reference, fp4_markov_head_triton
    from plugins.hidden_capture import hidden_capture_reference, hidden_capture_triton
    dev = "cuda"
    copy_bw = copy_bandwidth()
    out = {"copy_bandwidth_gb_s": round(copy_bw / 1e9, 1)}
    # hidden capture: 8 sequences x 5 tokens of a 4096-wide residual stream into 3 capture slots
    H, slots = 4096, 3
    res = torch.randn(8, 5, H, dtype=torch.bfloat16, device=dev)
    delta = torch.randn_like(res)
    buf = torch.zeros(8, 5, slots * H, dtype=torch.bfloat16, device=dev)
    want_x, want_buf = hidden_capture_reference(res, delta, buf, 1)
    got_buf = buf.clone()
    got_x = hidden_capture_triton(res, delta, got_buf, 1)
    moved = 4 * res.numel() * res.element_size()  # read residual + delta, write x and the slot
    s = _cuda_time(lambda: hidden_capture_triton(res, delta, buf, 1))
    out["hidden_capture"] = {"shape": list(res.shape), "slots": slots, "us": round(1e6 * s, 2),
                             "gb_s": round(moved / s / 1e9, 1), "of_copy_bandwidth": round(moved / s / copy_bw, 3),
                             "exact": bool(torch.equal(got_x, want_x) and torch.equal(got_buf, want_buf))}
    if time.time() > deadline:
        return out
    # FP4 Markov head: batch 8, one row, a 131072-token vocabulary, rank 256
    V, r = 131072, 256
    logits = torch.randn(8, 1, V, dtype=torch.float32, device=dev)
    prev = torch.randint(0, V, (8, 1), dtype=torch.int32, device=dev)
    w1 = (torch.randn(V, r) * 0.1).to(torch.bfloat16).to(dev)
    packed, scale, scale_2 = (t.to(dev) for t in quantize_nvfp4(torch.randn(V, r) * 0.05))
    want = fp4_markov_head_reference(logits, prev, w1, packed, scale, scale_2)
    got = fp4_markov_head_triton(logits, prev, w1, packed, scale, scale_2)
    moved = 2 * logits.numel() * 4 + packed.numel() + scale.numel() + 8 * r * 2
    s = _cuda_time(lambda: fp4_markov_head_triton(logits, prev, w1, packed, scale, scale_2))
    out["fp4_markov_head"] = {"vocab": V, "rank": r, "batch": 8, "us": round(1e6 * s, 2),
                              "gb_s": round(moved / s / 1e9, 1), "of_copy_bandwidth": round(moved / s / copy_bw, 3),
                              "max_abs_diff": float((got - want).abs().max()),
                              "close": bool(torch.allclose(got, want, rtol=1e-4, atol=1e-3))}
    # the kernel's block sizes, swept once on the device (the default is the first one that fits)
    sweep = []
    for blocks in ((32, 128), (64, 128), (128, 128), (64, 256), (128, 256), (256, 256)):
        if time.time() > deadline:
            break
        try:
            fn = functools.partial(fp4_markov_head_triton, logits, prev, w1, packed, scale, scale_2, blocks=blocks)
            close = bool(torch.allclose(fn(), want, rtol=1e-4, atol=1e-3))
            s = _cuda_time(fn)
            sweep.append({"blocks": list(blocks), "us": round(1e6 * s, 2), "close": close,
                          "of_copy_bandwidth": round(moved / s / copy_bw, 3)})
        except Exception as e:   # a block that does not fit the device: say so, keep sweeping
            sweep.append({"blocks": list(blocks), "error": f"{type(e).__name__}: {str(e)[:120]}"})
    out["fp4_markov_head"]["block_sweep"] = sweep
    return out


def tensorrt_engines(deadline: float) -> dict:
    """Where TensorRT is importable: build the embedded model's engines (plain, --strip_plan) and compare
    --backend tensorrt with --backend torch."""
    try:
        from builder.backends.trt_import import FLAVOUR, VERSION
    except ImportError as e:
        return {"skipped": f"no TensorRT on this machine ({e})"}
    from builder import embedded
    from builder.engine import BuildOptions, build
    from runtime.generation import generate
    from runtime.loading import open_engine_dir
    out = {"flavour": FLAVOUR, "version": VERSION}
    prompts = [[1, 17, 250, 9, 41], [1, 5, 6]]
    with tempfile.TemporaryDirectory() as tmp:
        for strip in (False, True):
            if time.time() > deadline:
                out["stopped"] = "budget"
                break
            key = "strip_plan" if strip else "plain"
            try:
                d = Path(tmp) / key
                t0 = time.perf_counter()
                build(embedded.target_dir(), d, BuildOptions(max_batch_size=4, max_input_len=64, max_seq_len=256,
                                                             strip_plan=strip), log=lambda m: None)
                want = generate(open_engine_dir(d, backend="torch").runner, prompts, 32).output_ids
                t1 = time.perf_counter()
                got = generate(open_engine_dir(d, backend="tensorrt").runner, prompts, 32).output_ids
                out[key] = {"build_s": round(t1 - t0, 1), "exact": got == want,
                            "dir_bytes": sum(p.stat().st_size for p in d.rglob("*") if p.is_file())}
            except Exception as e:
                out[key] = {"error": f"{type(e).__name__}: {e}"[:400]}
    return out


MODES = ("eagle3", "dflash", "mtp", "eagle", "dspark", "peagle", "draft_target")
PROMPTS = ("def __init__(self, name, value=None):\n        self.", "import os\nimport sys\n\n\ndef main(",
           "    for i in range(len(items)):\n        if ", "class Error(Exception):\n    \"\"\"")
# cheapest first; the compiled path's compile is the longest and runs last
SECTIONS = {"plugin_kernels": plugin_kernels,
            "triton_kernels": functools.partial(triton_kernels, copy_bandwidth=copy_bandwidth),
            "embedded_model": embedded_model, "full_width": full_width,
            "tensorrt": tensorrt_engines,
            "full_width_graphs": functools.partial(full_width, configs=FULL_WIDTH_CONFIGS[:1], graphs=True),
            "wide_model": wide_model,
            "wide_model_kernels_in_graphs": wide_model_kernels_in_graphs,
            "wide_model_adaptive": wide_model_adaptive,
            "embedded_model_trees": embedded_model_trees,
            "embedded_model_compiled": embedded_model_compiled,
            "embedded_model_no_cuda_graphs": embedded_model_no_cuda_graphs}
DEVICE_SECTIONS = ("triton_kernels", "embedded_model", "full_width", "full_width_graphs", "wide_model",
                   "wide_model_kernels_in_graphs", "wide_model_adaptive", "embedded_model_trees",
                   "embedded_model_compiled", "embedded_model_no_cuda_graphs")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default="gpu_check.json")
    p.add_argument("--dry_run", action="store_true", help="probe only")
    p.add_argument("--budget_s", type=float, default=480.0, help="stop starting new work after this many seconds")
    p.add_argument("--device", default="cuda", help="cpu runs the model sections here (a shakedown of the script)")
    p.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=list(SECTIONS))
    p.add_argument("--new_tokens", type=int, default=64)
    args = p.parse_args(argv)
    if args.device == "cpu" and "triton_kernels" in args.sections:   # before the probe imports triton: its
        os.environ["TRITON_INTERPRET"] = "1"                        # own @jit helpers (tl.sum) are made then
    started = time.time()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    report = {"created": time.strftime("%Y-%m-%d %H:%M:%S"), "probe": probe(), "dry_run": args.dry_run}
    if not args.dry_run:
        cuda = report["probe"]["cuda"]["available"]
        for name in args.sections:
            fn = SECTIONS[name]
            deadline = started + args.budget_s
            if name in DEVICE_SECTIONS and (cuda or args.device == "cpu"):
                fn = functools.partial(fn, device=args.device,
                                       **({"new": args.new_tokens} if "embedded" in name or name.startswith("wide_model") else {}))
            elif not cuda:
                report[name] = {"skipped": "no CUDA device"}
                continue
            if time.time() > deadline:
                report[name] = {"skipped": "budget spent"}
            else:
                t0 = time.time()
                try:
                    report[name] = fn(deadline)
                except Exception as e:
                    report[name] = {"error": f"{type(e).__name__}: {e}"[:400], "trace": traceback.format_exc()[-1500:]}
                report[name]["seconds"] = round(time.time() - t0, 1)
            Path(args.output).write_text(json.dumps(report, indent=1))   # a run cut short keeps what it measured
    report["seconds"] = round(time.time() - started, 1)
    Path(args.output).write_text(json.dumps(report, indent=1))
    from gpu_check_report import markdown
    Path(args.output).with_suffix(".md").write_text(markdown(report))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
