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
   graphs: target-only against eagle3, dflash and mtp end to end, exact (section ``wide_model``);
   batches of 1, 8, 16 and 32 sequences (``wide_model_batches``); trees beside their chain and
   ``--max_tree_nodes auto``'s choice (``wide_model_trees``); eagle3 with the adaptive K up to 8
   (``wide_model_adaptive``). The model sections are in scripts/gpu_models.py.

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
import shutil
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
from gpu_models import (embedded_model, embedded_model_compiled, embedded_model_no_cuda_graphs,  # noqa: E402
                        embedded_model_trees, wide_model, wide_model_adaptive, wide_model_batches,
                        wide_model_kernels_in_graphs, wide_model_trees)
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
                t1 = time.perf_counter()
                want = generate(open_engine_dir(d, backend="torch").runner, prompts, 32).output_ids
                got = generate(open_engine_dir(d, backend="tensorrt").runner, prompts, 32).output_ids
                out[key] = {"build_s": round(t1 - t0, 1), "exact": got == want,
                            "dir_bytes": sum(p.stat().st_size for p in d.rglob("*") if p.is_file())}
            except Exception as e:
                out[key] = {"error": f"{type(e).__name__}: {e}"[:400]}
    return out


# cheapest first; the compiled path's compile is the longest and runs last
SECTIONS = {"plugin_kernels": plugin_kernels,
            "triton_kernels": functools.partial(triton_kernels, copy_bandwidth=copy_bandwidth),
            "embedded_model": embedded_model, "full_width": full_width,
            "tensorrt": tensorrt_engines,
            "full_width_graphs": functools.partial(full_width, configs=FULL_WIDTH_CONFIGS[:1], graphs=True),
            "wide_model": wide_model,
            "wide_model_batches": wide_model_batches,
            "wide_model_trees": wide_model_trees,
            "wide_model_kernels_in_graphs": wide_model_kernels_in_graphs,
            "wide_model_adaptive": wide_model_adaptive,
            "embedded_model_trees": embedded_model_trees,
            "embedded_model_compiled": embedded_model_compiled,
            "embedded_model_no_cuda_graphs": embedded_model_no_cuda_graphs}
DEVICE_SECTIONS = ("triton_kernels", "embedded_model", "full_width", "full_width_graphs", "wide_model",
                   "wide_model_batches", "wide_model_trees",
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
    # the model sections compile into a store of this run's own, removed after (set here, in the
    # script's process: a section called from a test must not repoint the caller's store)
    own_store = None
    if not os.environ.get("NEMOSPEC_COMPILE_CACHE"):
        own_store = os.environ["NEMOSPEC_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="nemospec-compile-")
    try:
        return _run(args)
    finally:
        if own_store:
            os.environ.pop("NEMOSPEC_COMPILE_CACHE", None)
            shutil.rmtree(own_store, ignore_errors=True)


def _run(args) -> int:
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
