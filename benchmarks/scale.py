"""Scale: builds and eager step costs at the widths NVIDIA ships, and the projected speculative speedup.

For each config in benchmarks/configs (or --configs): one-layer random slices of each layer kind
(``builder.random_checkpoint --pattern``, vocabulary 1024) are built with ``nemospec build`` in a
child process (build seconds, peak RSS from wait4, engine bytes vs weight bytes; the plain build only
where the memory estimate fits --max_rss_gb, the --strip_plan build always), and stepped eagerly in bf16
on the CPU (decode T=1, verify T=K+1, batch 1 and 8). The full model's step is projected from them:
sum over the pattern of each kind's block cost, plus the LM head at the full vocabulary. Draft steps
at that width are composed from the same measurements (labelled): eagle3 = fc(3H->H) + one attention
block + one MLP block at T=1 + a 32k-vocabulary head, per proposal; dflash = two (attention + MLP)
blocks over the K+1-token block + fc(5H->H) + the 32k head on K rows, once per step; mtp (configs with
MTP layers) = eh_proj(2H->H) + its attention and MoE blocks + the full head, per proposal. The
projected speedup is the cost model of runtime/step_costs.py: tokens_per_step x decode / (draft +
verify), with tokens_per_step the embedded model's measured acceptance (docs/bench/report.json) --
a projection, not a measurement. --whole builds whole models (structure-only weights) with --strip_plan,
--first CONFIG:N the first N layers (e.g. the fewest that hold each of the config's layer kinds).

    python benchmarks/scale.py --output_dir docs/bench/scale [--configs nemotron-h-8b-base-8k] [--whole ...] [--first ...]
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from builder import build_memory  # noqa: E402
from builder.checkpoint import load_checkpoint  # noqa: E402
from builder.engine import BuildOptions, target_component  # noqa: E402
from builder.models.nemotron_h import NemotronH  # noqa: E402
from builder.shaped_checkpoint import read_source_config, sliced_config, write_shaped_checkpoint  # noqa: E402

CONFIGS = ROOT / "benchmarks" / "configs"
LETTERS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
K = 4
BATCHES = (1, 8)
DRAFT_VOCAB = 32768
GIB = 2 ** 30


def child_build(ckpt: Path, out: Path, strip: bool) -> dict:
    """`nemospec build` in a child process: seconds, peak RSS (GNU time), engine and directory bytes."""
    # /usr/bin/time execs the build from a tiny process: the child's ru_maxrss would otherwise count this
    # (large) process's image, which a forked child holds until it execs
    rss_file = out.with_name(out.name + ".rss")
    cmd = ["/usr/bin/time", "-f", "%M", "-o", str(rss_file), sys.executable, "-m", "nemospec.cli", "build",
           "--checkpoint_dir", str(ckpt), "--output_dir", str(out), "--max_batch_size", "8", "--max_input_len", "16",
           "--max_seq_len", "256"] + (["--strip_plan"] if strip else [])
    t0 = time.perf_counter()
    run = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200"))
    seconds = time.perf_counter() - t0
    if run.returncode != 0:
        err = run.stderr.strip()
        return {"error": err.splitlines()[-1] if err else f"exit {run.returncode}"}
    peak_kb = int(rss_file.read_text().split()[-1])
    rss_file.unlink()
    report = json.loads((out / "build_report.json").read_text())
    engines = sum(e["engine_bytes"] for e in report["engines"].values())
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": round(seconds, 1), "build_seconds": round(sum(e["build_seconds"] for e in report["engines"].values()), 1),
            "peak_rss_gb": round(peak_kb / 2 ** 20, 2), "engine_bytes": engines,
            "weight_bytes": sum(report["weight_bytes"].values()), "dir_bytes": total,
            "estimate_gb": round(report["memory_estimate"]["peak_bytes"] / GIB, 2)}


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _time(fn, runs: int = 3, device="cpu") -> float:
    """Median seconds of ``fn`` (a GPU's queue drained before the clock stops)."""
    fn()
    _sync(device)
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _graphed(fn):
    """``fn`` captured once as a CUDA graph and replayed: the GPU's own time, no launch per op. A step
    that waits on the GPU from the host (``.item()``, a data-dependent shape) cannot be captured: one
    call under CUDA's sync check finds that first, before a failed capture could leave the device
    unusable for what follows."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@torch.inference_mode()
def step_costs(ckpt: Path, device="cpu", graphs: bool = False) -> dict:
    """Eager bf16 seconds of the one-layer slice: {"batch": {"tokens": s}} for T=1 and T=K+1; with
    ``graphs`` (CUDA) each step replayed as one CUDA graph instead ({"error": ...} where it cannot be
    captured)."""
    from runtime.placement import place
    config, weights = load_checkpoint(ckpt)
    module = place(NemotronH(config, weights, torch.bfloat16), device)
    comp = target_component(module, BuildOptions(max_batch_size=8, max_input_len=16, max_seq_len=64))
    out = {}
    for b in BATCHES:
        out[str(b)] = {}
        for t in (1, K + 1):
            state = {"past." + k: torch.zeros(s, dtype=d, device=device) for k, (s, d) in module.state_spec(b, 64).items()}
            feeds = {"input_ids": torch.randint(0, config.vocab_size, (b, t), dtype=torch.int32, device=device),
                     "positions": torch.arange(8, 8 + t, dtype=torch.int32, device=device).repeat(b, 1),
                     "lengths": torch.full((b,), t, dtype=torch.int32, device=device),
                     "logit_index": torch.arange(t, dtype=torch.int32, device=device).repeat(b, 1), **state}
            step = functools.partial(comp.call, feeds)
            if graphs:
                try:
                    step = _graphed(step)
                except Exception as e:   # a host sync inside the step: not capturable
                    return {"error": f"{type(e).__name__}: {e}"[:300]}
            out[str(b)][str(t)] = _time(step, device=device)
    return out


@torch.inference_mode()
def linear_cost(rows: int, inner: int, out: int, device="cpu") -> float:
    x = torch.randn(rows, inner, dtype=torch.bfloat16, device=device)
    w = torch.randn(out, inner, dtype=torch.bfloat16, device=device) * 0.01
    return _time(lambda: torch.nn.functional.linear(x, w), device=device)


def measure_config(name: str, work: Path, args, acceptance: dict) -> dict:
    raw = read_source_config(CONFIGS / f"{name}.json")
    _, config = sliced_config(raw, where=name)
    quantize = "nvfp4_w4a16" if "nvfp4" in name else None
    pattern = config.hybrid_override_pattern
    kinds = sorted(set(pattern) | {"*", "-"}, key="M*-E".index)  # + attention and MLP for the draft layers
    row = {"config": name, "layers": len(pattern), "pattern_counts": {LETTERS[k]: pattern.count(k) for k in "M*-E"},
           "quantized": quantize, "kinds": {}}
    for letter in kinds:
        kind = LETTERS[letter]
        ckpt = work / f"{name}-{kind}"
        write_shaped_checkpoint(CONFIGS / f"{name}.json", ckpt, vocab_size=1024, pattern=letter, mtp=False,
                                quantize=quantize, log=lambda m: None)
        device = getattr(args, "device", "cpu")
        entry = {"steps": step_costs(ckpt, device)}
        if getattr(args, "graphs", False):
            entry["graph_steps"] = step_costs(ckpt, device, graphs=True)
        if letter in pattern and not args.no_builds:
            cfg, w = load_checkpoint(ckpt)
            est = build_memory.estimate(cfg, w, 0, BuildOptions())
            del w
            entry["plain"] = child_build(ckpt, work / "e", False) if est.peak_bytes <= args.max_rss_gb * GIB else \
                {"skipped": f"estimate {est.peak_bytes / GIB:.1f} GiB > {args.max_rss_gb} GiB"}
            entry["strip_plan"] = child_build(ckpt, work / "e", True)
        row["kinds"][kind] = entry
        shutil.rmtree(ckpt, ignore_errors=True)
        print(f"{name} {kind}: {json.dumps(entry)}", flush=True)
    # each slice's time also holds what every slice runs once (embedding, final norm, a 1024-row head,
    # the call): two MLP layers against one give it, taken off each layer in the projection
    ckpt = work / f"{name}-two-mlp"
    write_shaped_checkpoint(CONFIGS / f"{name}.json", ckpt, vocab_size=1024, pattern="--", mtp=False,
                            quantize=quantize, log=lambda m: None)
    row["two_mlp"] = {"steps": step_costs(ckpt, getattr(args, "device", "cpu"))}
    if getattr(args, "graphs", False):
        row["two_mlp"]["graph_steps"] = step_costs(ckpt, args.device, graphs=True)
    shutil.rmtree(ckpt, ignore_errors=True)
    row["projection"] = project(config, raw, row, acceptance, getattr(args, "device", "cpu"))
    if all("error" not in k.get("graph_steps", {"error": None}) for k in row["kinds"].values()):
        row["graph_projection"] = project(config, raw, row, acceptance, args.device, "graph_steps")
    row["bandwidth_projection"] = bandwidth_projection(config, acceptance)
    return row


def project(config, raw: dict, row: dict, acceptance: dict, device="cpu", steps: str = "steps") -> dict:
    H, V = config.hidden_size, config.vocab_size
    kinds = row["kinds"]
    linear = functools.partial(linear_cost, device=device)
    out = {}
    two = row.get("two_mlp", {}).get(steps)
    for b in BATCHES:
        def fixed(t):   # what a one-layer slice runs besides its layer: 2 x (one MLP) - (two MLPs)
            if not two or "error" in two or "mlp" not in kinds:
                return 0.0
            return max(0.0, 2 * kinds["mlp"][steps][str(b)][str(t)] - two[str(b)][str(t)])

        def block(kind, t):
            return kinds[kind][steps][str(b)][str(t)] - fixed(t)
        counts = row["pattern_counts"]
        body = {t: sum(counts[k] * block(k, t) for k in counts if counts[k]) for t in (1, K + 1)}
        decode = body[1] + fixed(1) + linear(b, H, V)
        verify = body[K + 1] + fixed(K + 1) + linear(b * (K + 1), H, V)
        attn_mlp = {t: block("attention", t) + block("mlp", t) for t in (1, K + 1)}
        drafts = {"eagle3": K * (linear(b, 3 * H, H) + attn_mlp[1] + linear(b, H, DRAFT_VOCAB)),
                  "dflash": 2 * attn_mlp[K + 1] + linear(b * (K + 1), 5 * H, H) + linear(b * K, H, DRAFT_VOCAB)}
        if config.num_nextn_predict_layers > 0:
            mtp_layers = sum(block(k, 1) for k in config.mtp_layer_types if k in kinds)
            drafts["mtp"] = K * (linear(b, 2 * H, H) + mtp_layers + linear(b, H, V))
        modes = {}
        for mode, draft in drafts.items():
            tps = acceptance[mode]
            modes[mode] = {"draft_ms": round(1e3 * draft, 3), "tokens_per_step": tps,
                           "projected_speedup": round(tps * decode / (draft + verify), 2)}
        out[str(b)] = {"decode_ms": round(1e3 * decode, 3), "verify_ms": round(1e3 * verify, 3),
                  "verify_over_decode": round(verify / decode, 2), "modes": modes}
    return out


def bandwidth_projection(config, acceptance: dict, bandwidth: float = 4.8e12, item: int = 2) -> dict:
    """The memory-bound regime of a GPU (default: an H200's 4.8 TB/s HBM): a step costs the bytes of the
    weights it reads / bandwidth. Decode reads the dense weights and the experts routed to (top-k per
    token, at most E); a verify of K+1 tokens per sequence reads the same dense bytes and the union of
    its tokens' experts (upper bound: distinct). bf16 weights; a model, labelled as one."""
    from builder.checkpoint import block_tensors
    H, V = config.hidden_size, config.vocab_size

    def kind_bytes(kind):
        t = block_tensors(config, kind, "x")
        expert = sum(2 * s[0] * s[1] for n, s in t.items() if ".experts.0." in n) if kind == "moe" else 0
        dense = sum(item * _numel(s) for n, s in t.items() if ".experts." not in n)
        return dense, expert * item // 2

    def body(tokens):
        total = 0
        for kind in config.layer_types:
            dense, expert = kind_bytes(kind)
            total += dense + expert * min(config.n_routed_experts, tokens * config.num_experts_per_tok) * (kind == "moe")
        return total + 2 * item * V * H  # embeddings row gather is tiny; the LM head is read once
    out = {}
    for b in BATCHES:
        decode, verify = body(b) / bandwidth, body(b * (K + 1)) / bandwidth
        attn, _ = kind_bytes("attention")
        mlp = item * 2 * H * config.intermediate_size
        drafts = {"eagle3": K * item * (3 * H * H + attn / item + mlp / item + DRAFT_VOCAB * H) / bandwidth,
                  "dflash": item * (2 * (attn + mlp) / item + 5 * H * H + DRAFT_VOCAB * H) / bandwidth}
        if config.num_nextn_predict_layers > 0:
            mtp = sum(kind_bytes(k)[0] + kind_bytes(k)[1] * min(config.n_routed_experts, b * config.num_experts_per_tok)
                      for k in config.mtp_layer_types)
            drafts["mtp"] = K * (item * 2 * H * H + mtp + item * V * H) / bandwidth
        out[str(b)] = {"decode_ms": round(1e3 * decode, 3), "verify_ms": round(1e3 * verify, 3),
                       "verify_over_decode": round(verify / decode, 2),
                       "modes": {m: {"draft_ms": round(1e3 * d, 3), "tokens_per_step": acceptance[m],
                                     "projected_speedup": round(acceptance[m] * decode / (d + verify), 2)}
                                 for m, d in drafts.items()}}
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def whole_build(name: str, work: Path, num_layers: int | None = None) -> dict:
    """A --strip_plan build of the whole model, or of its first ``num_layers`` (vocabulary 1024), from
    structure-only weights (NVFP4 configs quantized: packed zeros, unit scales)."""
    ckpt = work / f"{name}-whole"
    write_shaped_checkpoint(CONFIGS / f"{name}.json", ckpt, num_layers, vocab_size=1024 if num_layers else None,
                            quantize="nvfp4_w4a16" if "nvfp4" in name else None, fill="zeros", mtp=False,
                            log=lambda m: None)
    try:
        extra = {"num_layers": num_layers} if num_layers else {}
        return dict(child_build(ckpt, work / "e", True), config=name, fill="zeros (structure only)", **extra)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(work / "e", ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output_dir", default=str(ROOT / "docs" / "bench" / "scale"))
    p.add_argument("--configs", nargs="*", default=[c.stem for c in sorted(CONFIGS.glob("*.json"))])
    p.add_argument("--whole", nargs="*", default=[], help="configs to build whole (structure-only, --strip_plan)")
    p.add_argument("--first", nargs="*", default=[], metavar="CONFIG:N",
                   help="build the first N layers of a config (structure-only, --strip_plan, vocabulary 1024)")
    p.add_argument("--max_rss_gb", type=float, default=7.0, help="plain builds only where the estimate fits")
    p.add_argument("--no_builds", action="store_true")
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = json.loads((ROOT / "docs" / "bench" / "report.json").read_text())
    acceptance = {m: v["cost"]["speculative"]["tokens_per_step"] for m, v in report["modes"].items()}
    work = Path(args.workdir or tempfile.mkdtemp(prefix="scale-"))
    rows, whole = [], []
    try:
        for name in args.configs:
            rows.append(measure_config(name, work, args, acceptance))
            (out / "scale.json").write_text(json.dumps({"rows": rows, "whole": whole}, indent=1))
        for name in args.whole + args.first:
            config, _, n = name.partition(":")
            whole.append(whole_build(config, work, int(n) if n else None))
            print(json.dumps(whole[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"created": time.strftime("%Y-%m-%d %H:%M:%S"), "threads": 1, "k": K, "acceptance_source":
              "docs/bench/report.json (embedded model, K=4)", "rows": rows, "whole": whole}
    (out / "scale.json").write_text(json.dumps(result, indent=1))
    from benchmarks.scale_report import write_markdown, write_plot
    write_markdown(result, out / "scale.md")
    write_plot(result, out / "scale.png")
    print((out / "scale.md").read_text())


if __name__ == "__main__":
    main()
