"""The model sections of scripts/gpu_check.py: the embedded model and its widened copy end to end on a
device, target-only against each draft kind, exact, with per-step costs; trees beside their chain and
batches of 1 to 32 sequences on the widened model, where the goals a 2-core CPU's physics caps (a tree
>= 1.10x its chain, 16 streams >= 1.2x target-only: docs/memory_bound.md) are measured on the
hardware they were set for. On ``--device cpu`` each runs as a shakedown (the widened model at 2x,
eager)."""
from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


MODES = ("eagle3", "dflash", "mtp", "eagle", "dspark", "peagle", "draft_target")
PROMPTS = ("def __init__(self, name, value=None):\n        self.", "import os\nimport sys\n\n\ndef main(",
           "    for i in range(len(items)):\n        if ", "class Error(Exception):\n    \"\"\"")


def _sync(device) -> None:
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def embedded_model(deadline: float, device: str = "cuda", new: int = 64, backend: str = "torch",
                   modes: tuple | None = None, tree_nodes: int = 0, factor: int = 1, k: int = 0,
                   policy=None, tree_topk: int = 0) -> dict:
    """Target-only against each speculative mode of the embedded model (one prompt's pair at a time,
    so both see the same machine), on ``device`` through the eager TorchRunner or ``backend="compiled"``;
    ``factor`` > 1: the embedded model widened that many times (builder.embedded.widen); ``k`` (default
    the bench report's) and ``policy`` (a runtime.draft_policy.DraftPolicy) for the speculative runs."""
    report = json.loads((ROOT / "docs" / "bench" / "report.json").read_text())
    k = k or report["num_draft_tokens"]
    modes = modes or MODES
    prompts = _prompt_ids()
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
                tree = TreeShape(tree_nodes, tree_topk or default_topk(mode), k)
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
    if tree is not None:   # the tree kernels' first launches (Triton's JIT) before any timed tree run
        speculative_generate(loaded.runner, loaded.proposer(), prompts[:1], 8, k, tree=tree)
    row = {"load_and_warm_s": round(time.perf_counter() - t0, 1), "runs": []}
    late, during = len(COMPILE_LOG), []
    for ids in prompts:
        if time.time() > deadline:
            row["stopped"] = "budget"
            break
        if backend == "compiled":   # its graphs for this prompt's shapes compiled before the clock runs
            late = _warm_prompt(loaded, ids, new, k, policy, tree)
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


def _warm_prompt(loaded, ids, new, k, policy=None, tree=None) -> int:
    """The compiled path's warm-up for this prompt (runtime.compiled.runner.warm_up: its steps, every draft
    chain bucket and the plain draft step's; with an adaptive policy every candidate K's; with ``tree``
    its tree steps too); returns the compile log's length after it."""
    from runtime.compiled.runner import warm_up
    from runtime.compiled.steps import COMPILE_LOG
    warm_up(loaded, [ids], k, policy=policy)
    if tree is not None:
        warm_up(loaded, [ids], k, tree=tree)
    return len(COMPILE_LOG)


def _summary(result):
    """A generation's per-step costs (host-timed: on a GPU a part's time lands where the queue drains)."""
    cost = (getattr(result, "extra", None) or {}).get("cost")
    return cost.summary() if hasattr(cost, "summary") else cost


def embedded_model_compiled(deadline: float, device: str = "cuda", new: int = 64) -> dict:
    """The compiled path (runtime.compiled: whole steps through torch.compile) on ``device``, eagle3
    only: its compile is the slowest section, so it runs last."""
    return embedded_model(deadline, device, new, backend="compiled", modes=("eagle3",))


def wide_model(deadline: float, device: str = "cuda", new: int = 64, modes: tuple = ("eagle3", "dflash", "mtp")) -> dict:
    """The embedded model widened 16x (hidden 3072, ~0.76 B decode parameters: a real-sized model
    with the trained drafts' acceptance), compiled with CUDA graphs, target-only against eagle3,
    dflash and mtp end to end, exact. On ``--device cpu`` (the script's shakedown) widened 2x, eager."""
    factor, backend = _wide(device)
    return embedded_model(deadline, device, new, backend=backend, modes=modes, factor=factor)


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
    factor, backend = _wide(device)
    return embedded_model(deadline, device, new, backend=backend, modes=("eagle3",), factor=factor, k=8,
                          policy=DraftPolicy(8, adaptive=True))


def embedded_model_trees(deadline: float, device: str = "cuda", new: int = 64) -> dict:
    """Tree speculation (16 drafted nodes, issue 14) beside the chain and target-only, eager, for the
    chain drafts and the block drafts: where a step is bound by launches rather than rows, a tree's
    verify costs what a chain's does."""
    return embedded_model(deadline, device, new, modes=("eagle3", "dflash", "mtp"), tree_nodes=16)


def embedded_model_no_cuda_graphs(deadline: float, device: str = "cuda", new: int = 64) -> dict:
    """The compiled path with CUDA graphs off (NEMOSPEC_CUDA_GRAPHS=0; they are on by default on CUDA,
    runtime.compiled.steps.device_options), eagle3: what the graphs save the host's kernel launches."""
    previous = os.environ.get("NEMOSPEC_CUDA_GRAPHS")
    os.environ["NEMOSPEC_CUDA_GRAPHS"] = "0"
    try:
        return embedded_model_compiled(deadline, device, new)
    finally:
        if previous is None:
            os.environ.pop("NEMOSPEC_CUDA_GRAPHS")
        else:
            os.environ["NEMOSPEC_CUDA_GRAPHS"] = previous



def _wide(device: str) -> tuple[int, str]:
    """(factor, backend) of a widened-model section: 16x compiled with CUDA graphs on a GPU, 2x eager on
    the CPU's shakedown."""
    return (16, "compiled") if device != "cpu" else (2, "torch")


def wide_model_trees(deadline: float, device: str = "cuda", new: int = 64, nodes: int = 8, topk: int = 2,
                     cap: int = 16) -> dict:
    """Trees against their chain on the widened model (the goal: >= 1.10x the chain for eagle3 and
    dflash, sized by the cost model), compiled where the chain is: each prompt's chain, then a tree of
    ``nodes`` nodes and top-``topk`` (the size that came closest on a CPU: 1.04x there), each warmed
    before the clock; then ``--max_tree_nodes auto``'s calibration for eagle3 up to ``cap`` nodes
    (runtime.tree.sizing), whose choice says which tree, if any, this device should run."""
    factor, backend = _wide(device)
    out = embedded_model(deadline, device, new, backend=backend, modes=("eagle3", "dflash"), factor=factor,
                         tree_nodes=nodes, tree_topk=topk)
    if time.time() < deadline:
        try:
            out["sizing"] = _tree_sizing(device, backend, factor, out["k"], cap, new)
        except Exception as e:
            out["sizing"] = {"error": f"{type(e).__name__}: {e}"[:400], "trace": traceback.format_exc()[-1500:]}
    return out


def _tree_sizing(device, backend, factor, k, cap, new) -> dict:
    from builder.embedded.sources import resolve_sources
    from runtime.compiled.runner import warm_up
    from runtime.loading import open_checkpoint
    from runtime.tree.draft import TreeShape, default_topk
    from runtime.tree.sizing import calibrate_tree
    target, draft = resolve_sources(None, "eagle3", embedded="wide", embedded_factor=factor)
    loaded = open_checkpoint(target, device=device, mode="eagle3", draft_dir=draft, max_draft_len=k, backend=backend)
    prompt = _prompt_ids()[0]
    choice = calibrate_tree(loaded, prompt, k, TreeShape(cap, default_topk("eagle3"), k), cap, new_tokens=new,
                            warm=lambda shape: warm_up(loaded, [prompt], k, shape))
    return {"mode": "eagle3", "cap": cap, **choice}


def _prompt_ids() -> list[list[int]]:
    from builder import embedded
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(embedded.target_dir() / "tokenizer.json"))
    return [tok.encode(t).ids for t in PROMPTS]


BATCHES = (1, 8, 16, 32)


def wide_model_batches(deadline: float, device: str = "cuda", new: int = 64, batches: tuple = BATCHES,
                       mode: str = "eagle3") -> dict:
    """Many sequences at once on the widened model (the goal: 16 streams >= 1.2x target-only, which two
    CPU cores cannot give: at 16 rows their products are bound by the multiply-adds, docs/memory_bound.md):
    for each batch size, the bench's prompts cycled into one batch, target-only against ``mode`` at the
    bench's K and at K = 1, exact, each side's steps warmed before the clock."""
    from builder.embedded.sources import resolve_sources
    from runtime.compiled.runner import warm_up
    from runtime.compiled.steps import COMPILE_LOG
    from runtime.generation import generate
    from runtime.loading import open_checkpoint
    from runtime.speculative import speculative_generate
    factor, backend = _wide(device)
    report = json.loads((ROOT / "docs" / "bench" / "report.json").read_text())
    k = report["num_draft_tokens"]
    out = {"mode": mode, "k": k, "device": device, "backend": backend, "embedded_factor": factor, "new_tokens": new,
           "rows": []}
    try:
        target, draft = resolve_sources(None, mode, embedded="wide", embedded_factor=factor)
        loaded = open_checkpoint(target, device=device, mode=mode, draft_dir=draft, max_draft_len=k, backend=backend)
    except Exception as e:
        return {**out, "error": f"{type(e).__name__}: {e}"[:400], "trace": traceback.format_exc()[-1500:]}
    prompts = _prompt_ids()
    for b in batches:
        if time.time() > deadline:
            out["stopped"] = "budget"
            break
        batch = [prompts[i % len(prompts)] for i in range(b)]
        try:
            for kk in dict.fromkeys((k, 1)):
                warm_up(loaded, batch, kk)
            late = len(COMPILE_LOG)
            t0 = time.perf_counter()
            plain = generate(loaded.runner, batch, new)
            _sync(device)
            t1 = time.perf_counter()
            row = {"batch": b, "target_only_tokens_per_second": round(plain.num_tokens / (t1 - t0), 1),
                   "target_only_cost": _summary(plain), "by_k": {}}
            for kk in dict.fromkeys((k, 1)):
                t1 = time.perf_counter()
                spec = speculative_generate(loaded.runner, loaded.proposer(), batch, new, kk)
                _sync(device)
                rate = spec.num_tokens / (time.perf_counter() - t1)
                row["by_k"][str(kk)] = {"speculative_tokens_per_second": round(rate, 1),
                                        "speedup": round(rate / row["target_only_tokens_per_second"], 3),
                                        "exact": spec.output_ids == plain.output_ids,
                                        "mean_accepted": spec.extra["acceptance"].get("mean_accepted_tokens"),
                                        "cost": _summary(spec)}
            if len(COMPILE_LOG) > late:
                row["compiled_during_timing"] = COMPILE_LOG[late:]
        except Exception as e:
            row = {"batch": b, "error": f"{type(e).__name__}: {e}"[:400], "trace": traceback.format_exc()[-1500:]}
        out["rows"].append(row)
        print(f"wide batches {b}: {json.dumps({key: v for key, v in row.items() if 'cost' not in key})}"[:400], flush=True)
    return out
