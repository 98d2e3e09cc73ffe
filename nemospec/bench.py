"""`nemospec bench`: the perf report of the embedded model (or a given checkpoint) for every mode.

For each speculative mode: build its engine directory (timed, sized), then greedy code completions
with and without speculation on the same engines, prompts interleaved so machine noise hits both
(accepted tokens per target forward: mean and histogram; tokens/s; speedup). Peers on the same
model: transformers ``generate`` and transformers assisted generation with the draft_target draft.
Serving: the best mode's engines behind the real Triton server, gRPC streaming with and without
speculation (the per-request ``speculative: false``), and the overhead against offline generation.

Writes ``report.json``, ``report.md`` and PNG plots into ``--output_dir``.
"""
from __future__ import annotations

if __name__ == "__main__":   # a model process: mimalloc first (runtime.allocator), before heavy imports
    from runtime.allocator import preload
    preload()

import hashlib
import json
import platform
import sys
import time
from pathlib import Path

from builder.errors import ArgumentParser, NemospecError

import torch
from rich.console import Console

from nemospec.bench_prompts import PROMPTS, read_prompt_file
from nemospec.machine import cpu_name, l3_bytes, memory_bound_factor
from runtime import allocator
from runtime.compiled import small_linear

_err = Console(stderr=True, highlight=False, soft_wrap=True)

MODES = ("draft_target", "eagle", "eagle3", "mtp", "dflash", "dspark", "dspark_nvfp4", "peagle")
#: a mode's suffix for its engines built with --draft_len_adaptive on (e.g. eagle3_adaptive): each
#: sequence picks its K up to --num_draft_tokens step by step (runtime.adaptive_draft_len)
ADAPTIVE = "_adaptive"
#: a full bench: every mode at --num_draft_tokens, and eagle3 with its K adapted per sequence
DEFAULT_MODES = MODES + ("eagle3" + ADAPTIVE,)
QUICK_MODES = ("eagle3", "dflash")
WIDE_FACTOR_HELP = ("4, or where the 4x model's weights are under 1.5x this CPU's L3, the smallest factor whose "
                    "weights reach that")
def add_bench_args(p) -> None:
    p.add_argument("--output_dir", default="build/bench", help="report directory to write")
    p.add_argument("--checkpoint_dir", default=None, help="target checkpoint (default: the embedded model)")
    p.add_argument("--draft_dir", default=None,
                   help="the draft checkpoint of the one mode in --modes (default: the embedded model's trained "
                        "draft of that kind, which fits the embedded target only; mtp needs none)")
    p.add_argument("--modes", default=None, help=f"comma-separated, each optionally with {ADAPTIVE} (default: {','.join(DEFAULT_MODES)})")
    p.add_argument("--num_draft_tokens", type=int, default=4, help="K (block drafts: K drafted tokens per block)")
    p.add_argument("--adaptive_max_draft_len", type=int, default=8,
                   help=f"the K up to which a mode named with {ADAPTIVE} (e.g. eagle3{ADAPTIVE}) adapts each sequence's K")
    p.add_argument("--max_new_tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--prompts", type=int, default=None,
                   help=f"how many prompts (default: all; the built-in ones are {len(PROMPTS)} code completions)")
    p.add_argument("--prompt_file", default=None, metavar="FILE",
                   help="your own prompts, one JSON line each: a string or {\"prompt\": ...} (vLLM's custom dataset "
                        "format); the engines are sized to the longest")
    p.add_argument("--runs", type=int, default=2, help="timed runs per prompt (median)")
    p.add_argument("--no_serving", action="store_true", help="skip the Triton measurement")
    p.add_argument("--no_peers", action="store_true",
                   help="skip transformers' generate and assisted generation, which load the target in fp32 "
                        "(4 bytes a parameter: 32 GB for an 8B)")
    p.add_argument("--strip_plan", action="store_true",
                   help="build each mode's engines with `build --strip_plan`: one copy of the weights, which a "
                        "full-size target's build needs to fit in memory")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--serving_threads", type=int, default=None,
                   help="the served model's torch threads (default: the server's, a quarter of the cores: "
                        "the rest serve Triton, its stubs and the client)")
    p.add_argument("--draft_weight_dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="engines built with this --draft_weight_dtype (the compiled path's draft weights)")
    p.add_argument("--matmul_precision", default="highest", choices=["highest", "medium"],
                   help="engines built with this --matmul_precision (the compiled path's fp32 products, both sides)")
    p.add_argument("--speculative_token_map", default=None, metavar="FILE",
                   help="engines of the modes it applies to (eagle3, dflash, dspark, peagle) built with their draft's "
                        "LM head cut to these target token ids (see `nemospec token_map`)")
    p.add_argument("--backend", default=None, choices=["torch", "compiled"],
                   help="offline runs: compiled (default; the fastest exact CPU path, for both sides of every "
                        "ratio) or torch (eager; the default with --quick, which must not wait for compiles)")
    p.add_argument("--tree", action="store_true",
                   help="also run tree speculation beside each mode's chain, interleaved")
    p.add_argument("--max_tree_nodes", type=int, default=16, help="with --tree: drafted nodes per verify")
    p.add_argument("--tree_topk", type=int, default=0,
                   help="with --tree: children per expanded node (0 = by draft kind: 8 block drafts, 4 chain drafts)")
    p.add_argument("--tree_depth", type=int, default=0, help="with --tree: deepest node (0 = --num_draft_tokens)")
    from builder.embedded.sources import add_embedded_args
    add_embedded_args(p, default="wide", factor_default=WIDE_FACTOR_HELP)
    p.add_argument("--quick", action="store_true",
                   help=f"small: modes {','.join(QUICK_MODES)}, 2 prompts x 24 tokens, 1 run (for tests)")


def _log(message: str) -> None:
    _err.print(message, markup=False)


def build_mode_engines(checkpoint, mode: str, root: Path, k: int, draft_weight_dtype: str = "auto",
                       matmul_precision: str = "highest", token_map=None, embedded_model: str = "small",
                       embedded_factor: int | None = None, draft_dir=None, max_input_len: int = 256,
                       max_seq_len: int = 512, strip_plan: bool = False) -> tuple[Path, dict]:
    """Engines of ``mode`` under ``root/engines``: over ``checkpoint`` (or the embedded model,
    ``embedded_model`` small or wide, at ``embedded_factor``) with ``draft_dir``, by default the
    embedded model's trained draft of that kind."""
    from builder import embedded
    from builder.engine import BuildOptions, build
    from builder.embedded.sources import resolve_sources
    from builder.token_map import MODES as MAPPED_MODES
    adaptive = mode.endswith(ADAPTIVE)
    mode = mode.removesuffix(ADAPTIVE)
    quant = "nvfp4_w4a16" if mode.endswith("_nvfp4") else None
    base = mode.removesuffix("_nvfp4")
    target, draft = resolve_sources(checkpoint, base, draft_dir, quant, embedded_model, embedded_factor)
    if checkpoint is not None and draft is None and base not in ("mtp",):
        draft = embedded.draft_dir(base, quant)
    out = root / "engines" / (mode + (ADAPTIVE if adaptive else ""))
    options = BuildOptions(max_batch_size=4, max_input_len=max_input_len, max_seq_len=max_seq_len, max_draft_len=k, dtype="auto",
                           speculative_decoding_mode=base, draft_weight_dtype=draft_weight_dtype,
                           matmul_precision=matmul_precision, draft_len_adaptive=adaptive, strip_plan=strip_plan)
    report = build(target, out, options, log=lambda m: None, draft_dir=draft,
                   draft_quantization=quant if draft is None or not (Path(draft) / "hf_quant_config.json").is_file()
                   else None, token_map=token_map if base in MAPPED_MODES else None)
    return out, report


def portable_path(path, root: Path) -> str:
    """A path as a report may print it: relative to the report directory or the package (the
    embedded model), else just its name; never the absolute path of the machine it ran on."""
    from builder import embedded
    path = Path(path).resolve()
    for base in (Path(root).resolve(), embedded.ROOT.parent.parent):
        if path.is_relative_to(base):
            return str(path.relative_to(base))
    return path.name


def _factor(embedded_model: str, factor: int | None) -> int:
    from builder.embedded.sources import DEFAULT_WIDE_FACTOR
    return factor if factor is not None else (DEFAULT_WIDE_FACTOR if embedded_model == "wide" else 1)


def _lower_median(values, key=None):
    """The median of an odd count, the lower of the middle two of an even one (the faster of 2 runs):
    one statistic for every timed side of the report (bench_report.run_statistic names it)."""
    return sorted(values, key=key)[(len(values) - 1) // 2]


def _timed(fn, runs: int):
    """The median run (``_lower_median``), its seconds and every run: the median's step costs are the
    ones its time is made of, so the cost model explains the run it sits beside (the costs of the
    last run beside the median time had moved mtp's gap by 0.05-0.26); every run's output is checked."""
    results = [fn() for _ in range(runs)]
    median = _lower_median(results, key=lambda r: r.seconds)
    return median, median.seconds, results


def _check_equal(runs, want, what: str) -> int:
    """Each run's output ids equal ``want`` (target-only greedy); the number compared."""
    for r in runs:
        if r.output_ids != want:
            raise RuntimeError(f"{what} output differs from target-only greedy")
    return len(runs)


def _offline(engine_dir: Path, prompts: list[list[int]], new_tokens: int, k: int, runs: int,
             backend: str = "compiled", tree=None) -> dict:
    """Per prompt (batch 1): speculative then target-only on the same engines and backend, interleaved
    (the compiled path's steps are compiled, or loaded from its cache, before anything is timed);
    with ``tree`` (a TreeShape) also tree speculation, interleaved with both."""
    from runtime.generation import generate
    from runtime.loading import open_engine_dir
    from runtime.speculative import speculative_generate
    from runtime.step_costs import StepCosts, cost_model, with_prefill
    from runtime.compiled.runner import warm_up
    from runtime.compiled.steps import COMPILE_LOG
    loaded = open_engine_dir(engine_dir, backend)
    policy = loaded.draft_policy        # the engines' recorded policy (an adaptive K: each of its lengths)
    warm_up(loaded, prompts[:1], k)
    speculative_generate(loaded.runner, loaded.proposer(), prompts[:1], 8, k, policy=policy)   # allocations, caches
    generate(loaded.runner, prompts[:1], 8)
    trees = _TreeRuns(loaded, tree, k) if tree is not None else None
    compiled_before = len(COMPILE_LOG)
    from runtime.compiled.small_linear import moe_counts
    moe_before = moe_counts()
    spec_s = plain_s = 0.0
    tokens = forwards = 0
    hist: dict[str, int] = {}
    lengths: dict[str, int] = {}          # verify steps by the K they drafted (an adaptive policy's choices)
    spec_costs, plain_costs = StepCosts(), StepCosts()
    # each side's prefill, timed on its own (a one-token run: the prompt, and the draft's pass over it), so
    # that the prediction with prefill is one: it was the run's time outside its steps, which made the
    # prediction the measured speedup by construction
    prefill = {"speculative": 0.0, "target_only": 0.0}
    # speculative (chain and tree) runs checked against target-only greedy; target-only runs against
    # each other; what they output
    compared, repeats, digest = 0, 0, hashlib.sha256()
    for ids in prompts:
        spec, s, spec_runs = _timed(lambda: speculative_generate(loaded.runner, loaded.proposer(), [ids], new_tokens,
                                                                 k, policy=policy), runs)
        plain, t, plain_runs = _timed(lambda: generate(loaded.runner, [ids], new_tokens), runs)
        repeats += _check_equal(plain_runs, plain.output_ids, f"{engine_dir}: a target-only")
        compared += _check_equal(spec_runs, plain.output_ids, f"{engine_dir}: speculative")
        digest.update(json.dumps(plain.output_ids).encode())
        if trees is not None:
            compared += trees.run(ids, new_tokens, runs, plain.output_ids, engine_dir)
        spec_s, plain_s, tokens = spec_s + s, plain_s + t, tokens + spec.num_tokens
        spec_costs.merge(spec.extra["cost"])
        plain_costs.merge(plain.extra["cost"])
        prefill["speculative"] += _timed(lambda: speculative_generate(loaded.runner, loaded.proposer(), [ids], 1, k,
                                                                      policy=policy), runs)[1]
        prefill["target_only"] += _timed(lambda: generate(loaded.runner, [ids], 1), runs)[1]
        a = spec.extra["acceptance"]
        forwards += a["num_verify_forwards"]
        for n, c in a["histogram"].items():
            hist[n] = hist.get(n, 0) + c
        for n, c in a["steps_by_draft_len"].items():
            lengths[n] = lengths.get(n, 0) + c
    total = sum(hist.values())
    mean = sum(int(n) * c for n, c in hist.items()) / total if total else 0.0
    out = {"mean_accepted_tokens": round(mean, 3), "histogram": hist, "verify_forwards": forwards,
           "steps_by_draft_len": dict(sorted(lengths.items(), key=lambda kv: int(kv[0]))),
           "draft_len_adaptive": bool(policy is not None and policy.adaptive), "max_draft_len": k,
           "tokens": tokens, "tokens_per_second": round(tokens / spec_s, 1),
           "target_only_tokens_per_second": round(tokens / plain_s, 1), "speedup": round(plain_s / spec_s, 3),
           "exact": True, "outputs_compared": compared, "target_only_repeats_compared": repeats,
           "output_ids_sha256": digest.hexdigest(),
           "cost": with_prefill(cost_model(spec_costs.summary(), plain_costs.summary()),
                                               {side: 1e3 * v / len(prompts) for side, v in prefill.items()},
                                               new_tokens)}
    # the K these measured costs and acceptances pick (runtime.draft_len, `generate --num_draft_tokens auto`):
    # they read every step as drafting K, so not for runs whose steps drafted several lengths
    from runtime.draft_len import acceptance_rates, choose, costs_from, is_block_draft
    if set(lengths) - {str(k), k}:
        out["draft_len_auto"] = {"not_applicable": f"steps drafted {', '.join(map(str, sorted(map(int, lengths))))} "
                                                   "tokens, not K each"}
    else:
        rates = acceptance_rates(hist, k)
        best, predicted = choose(costs_from(spec_costs.summary(), plain_costs.summary(), k, is_block_draft(loaded.proposer()),
                                            getattr(loaded.runner, "verify_buckets", ())), rates)
        out["draft_len_auto"] = {"k": best, "predicted": predicted, "rates": [round(a, 3) for a in rates]}
    if moe_before is not None and getattr(loaded.config, "n_routed_experts", 0):
        # a decode's MoE layers read top-k experts, a verify's the union over its rows (timed runs only)
        calls, experts = (moe_counts() - moe_before).tolist()
        out["moe_experts_read"] = {"experts": loaded.config.n_routed_experts,
                                   "per_call_by_rows": {str(n): round(experts[n] / calls[n], 2)
                                                        for n in range(1, len(calls)) if calls[n]}}
    if trees is not None:
        out["tree"] = trees.summary(spec_s, plain_s, mean, plain_costs)
    late = COMPILE_LOG[compiled_before:]
    if late:   # a warm-up gap: these seconds are inside the timings above
        out["compiled_during_timing"] = late
        print(f"WARNING: {engine_dir.name}: {len(late)} step(s) compiled or loaded inside the timed runs "
              f"(the warm-up missed them; this mode's timings include them): {'; '.join(late)}",
              file=sys.stderr, flush=True)
    return out


class _TreeRuns:
    """Tree speculation beside a mode's chain runs: the same prompts, interleaved, output checked."""

    def __init__(self, loaded, shape, k):
        from runtime.speculative import speculative_generate
        from runtime.step_costs import StepCosts
        self.loaded, self.shape = loaded, shape
        self.run_one = lambda ids, n: speculative_generate(loaded.runner, loaded.proposer(), [ids], n, k, tree=shape)
        from runtime.compiled.runner import warm_up
        if not warm_up(loaded, [[0, 1, 2]], k, shape):   # compiled: its tree shapes, a draft's queued rows too
            self.run_one([0, 1, 2], 8)                   # eager: allocations and caches
        self.seconds, self.tokens, self.costs = 0.0, 0, StepCosts()
        self.hist, self.sizes, self.depths, self.off_chain = {}, {}, {}, 0

    def run(self, ids, new_tokens, runs, want, engine_dir) -> int:
        """Times the tree on one prompt; returns the runs checked against ``want``."""
        result, seconds, results = _timed(lambda: self.run_one(ids, new_tokens), runs)
        checked = _check_equal(results, want, f"{engine_dir}: tree speculative")
        self.seconds += seconds
        self.tokens += result.num_tokens
        self.costs.merge(result.extra["cost"])
        a = result.extra["acceptance"]
        for key, into in (("histogram", self.hist),):
            for n, c in a[key].items():
                into[n] = into.get(n, 0) + c
        for key, into in (("steps_by_size", self.sizes), ("steps_by_accepted_depth", self.depths)):
            for n, c in a["tree"][key].items():
                into[n] = into.get(n, 0) + c
        self.off_chain += a["tree"]["accepted_off_chain"]
        return checked

    def summary(self, chain_seconds, plain_seconds, chain_mean, plain_costs) -> dict:
        from runtime.step_costs import cost_model
        total = sum(self.hist.values())
        mean = sum(int(n) * c for n, c in self.hist.items()) / total if total else 0.0
        return {"max_nodes": self.shape.max_nodes, "topk": self.shape.topk, "depth": self.shape.depth,
                "mean_accepted_tokens": round(mean, 3), "over_chain_accepted": round(mean - chain_mean, 3),
                "tokens_per_second": round(self.tokens / self.seconds, 1),
                "over_chain": round(chain_seconds / self.seconds, 3), "speedup": round(plain_seconds / self.seconds, 3),
                "histogram": self.hist, "steps_by_size": self.sizes, "steps_by_accepted_depth": self.depths,
                "accepted_off_chain": self.off_chain, "exact": True,
                "cost": cost_model(self.costs.summary(), plain_costs.summary())}


def _peers(target_dir: Path, draft_dir: Path | None, prompts: list[list[int]], new_tokens: int, runs: int) -> dict:
    """transformers generate (greedy) and assisted generation with the draft_target draft."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    out: dict = {}
    seconds, tokens = 0.0, 0
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False)   # warm, as our side is
        for ids in prompts:
            x = torch.tensor([ids])
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                y = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
                times.append(time.perf_counter() - start)
            seconds += _lower_median(times)
            tokens += y.shape[1] - x.shape[1]
    out["transformers_generate"] = {"tokens_per_second": round(tokens / seconds, 1), "tokens": tokens}
    if draft_dir is None:
        out["transformers_assisted"] = {"error": "no draft_target draft"}
        return out
    assistant = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            y = model.generate(torch.tensor([prompts[0]]), max_new_tokens=new_tokens, do_sample=False,
                               assistant_model=assistant)
            out["transformers_assisted"] = {"tokens_per_second": round((y.shape[1] - len(prompts[0])) /
                                                                       (time.perf_counter() - start), 1)}
    except Exception as e:  # transformers refuses assisted generation for stateful (Mamba) models
        out["transformers_assisted"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    return out


def _serving(engine_dir: Path, texts: list[str], new_tokens: int, runs: int, offline_tps: float,
             backend: str = "compiled", threads: int = 0) -> dict:
    from serving.client import stream_generate
    from serving.launch import free_port, serving
    ports = dict(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    spec_s = plain_s = 0.0
    tokens = 0
    pooled = {}   # steps that kept i drafts, over every request: the mean pooled as offline's is
    # the offline runs' path (compiled: warmed up before the server is ready); the server's threads
    with serving(engine_dir, backend=backend, torch_threads=threads, ready_timeout=1200, **ports) as server:
        stream_generate(server.grpc_url, texts[0], 8)                     # warm-up
        for text in texts:   # per prompt, each side's median run (_lower_median), as offline takes it
            pairs = []
            for _ in range(runs):
                a = stream_generate(server.grpc_url, text, new_tokens)
                b = stream_generate(server.grpc_url, text, new_tokens, speculative=False)
                if a.ids != b.ids:
                    raise RuntimeError("served speculative output differs from served target-only output")
                pairs.append((a, b))
                for kept, count in enumerate(a.histogram):
                    pooled[kept] = pooled.get(kept, 0) + count
            spec_s += _lower_median([a.seconds for a, _ in pairs])
            plain_s += _lower_median([b.seconds for _, b in pairs])
            tokens += len(pairs[0][0].ids)
    tps = tokens / spec_s
    from serving.repository import default_torch_threads
    return {"mode": json.loads((engine_dir / "config.json").read_text())["speculative"]["mode"],
            "backend": backend, "torch_threads": threads or default_torch_threads(),
            "engine_dir": portable_path(engine_dir, engine_dir.parent.parent), "tokens_per_second": round(tps, 1),
            "target_only_tokens_per_second": round(tokens / plain_s, 1), "speedup": round(plain_s / spec_s, 3),
            "mean_accepted_tokens": round(sum((kept + 1) * c for kept, c in pooled.items()) / max(1, sum(pooled.values())), 3),
            "offline_tokens_per_second": offline_tps, "served_over_offline": round(tps / offline_tps, 3)}


def _check_draft_dir(draft_dir, modes) -> None:
    """``--draft_dir`` names one draft, so it goes with one mode that has a separate draft."""
    if draft_dir is None:
        return
    if len(modes) != 1:
        raise NemospecError(f"--draft_dir: one draft is for one mode; got --modes {','.join(modes)}")
    if modes[0].removesuffix(ADAPTIVE) == "mtp":
        raise NemospecError("--draft_dir: mtp speculates with the target's own MTP layers; leave --draft_dir out")
    if not Path(draft_dir).is_dir():
        raise NemospecError(f"--draft_dir {draft_dir}: expected a draft checkpoint directory")


def _check_counts(args) -> None:
    """Counts that must be positive, named before anything runs (a negative --threads was torch's traceback)."""
    for flag in ("threads", "runs", "prompts", "max_new_tokens", "num_draft_tokens"):
        value = getattr(args, flag, None)
        if value is not None and value < 1 and not (flag == "threads" and value == 0):
            raise NemospecError(f"--{flag}: expected an integer >= 1, got {value}")


def run_bench(args) -> dict:
    from builder.tokenizer_file import load_tokenizer

    from builder.embedded.sources import refuse_embedded_with, resolve_sources
    from nemospec.bench_report import write_report
    _check_counts(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    quick = args.quick
    modes = tuple(args.modes.split(",")) if args.modes else (QUICK_MODES if quick else DEFAULT_MODES)
    unknown = [m for m in modes if m.removesuffix(ADAPTIVE) not in MODES]
    if unknown:
            raise NemospecError(f"--modes: unknown mode(s) {', '.join(unknown)}; expected some of {', '.join(MODES)}, "
                             f"each optionally with {ADAPTIVE}")
    _check_draft_dir(getattr(args, "draft_dir", None), modes)
    new_tokens = 24 if quick else args.max_new_tokens
    backend = args.backend or ("torch" if quick else "compiled")
    runs = 1 if quick else args.runs
    k = args.num_draft_tokens
    tree = None
    if getattr(args, "tree", False):
        from runtime.tree.draft import TreeShape, default_topk
        try:
            tree = {mode: TreeShape(args.max_tree_nodes, args.tree_topk or min(default_topk(mode), args.max_tree_nodes),
                                    args.tree_depth or min(k, args.max_tree_nodes))
                    for mode in modes}
        except ValueError as e:
                    raise NemospecError(str(e)) from None
    root = Path(args.output_dir)
    if root.exists() and not root.is_dir():
            raise NemospecError(f"--output_dir {root}: exists and is a file; expected a report directory")
    embedded_model, factor = getattr(args, "embedded", "small"), getattr(args, "embedded_factor", None)
    refuse_embedded_with(args, "checkpoint_dir")
    if embedded_model == "wide" and factor is None and not args.checkpoint_dir and not quick:
        factor = memory_bound_factor(l3_bytes())
        if factor != _factor("wide", None):
            _log(f"bench: the wide model at {factor}x (--embedded_factor): the {_factor('wide', None)}x model's "
                 f"weights are under 1.5x this CPU's {l3_bytes() / 2**20:.0f} MiB L3, and the bench measures a "
                 "target that decodes from memory")
    target_dir, _ = resolve_sources(args.checkpoint_dir, None, None, None, embedded_model, factor)
    tokenizer = load_tokenizer(Path(target_dir) / "tokenizer.json")
    prompt_file = getattr(args, "prompt_file", None)
    texts = read_prompt_file(prompt_file) if prompt_file else list(PROMPTS)
    texts = texts[:2 if quick else getattr(args, "prompts", None) or len(texts)]
    prompts = [tokenizer.encode(t).ids for t in texts]
    if not all(prompts):
        raise NemospecError(f"--prompt_file {prompt_file}: prompt {[bool(p) for p in prompts].index(False) + 1} "
                            f"has no tokens")
    # engines long enough for every prompt and its completion (the defaults fit the built-in ones)
    lengths = {"max_input_len": max(256, max(map(len, prompts))),
               "max_seq_len": max(512, max(map(len, prompts)) + new_tokens + k + 1)}
    root.mkdir(parents=True, exist_ok=True)   # after the sources and prompts resolve: no directory left behind
    report: dict = {"created": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": quick, "num_draft_tokens": k,
                    "max_new_tokens": new_tokens, "prompts": len(prompts), "runs": runs,
                    "prompt_file": portable_path(prompt_file, root) if prompt_file else None,
                    "machine": {"cpu_threads": torch.get_num_threads(), "platform": platform.platform(),
                                "python": platform.python_version(), "torch": torch.__version__,
                                "allocator": allocator.active(), "l3_bytes": l3_bytes(), "cpu": cpu_name(),
                                "cuda": torch.cuda.is_available()},
                    "embedded": None if args.checkpoint_dir else {"model": embedded_model, "factor": _factor(embedded_model, factor)},
                    "model": portable_path(target_dir, root), "backend": backend,
                    "draft": portable_path(args.draft_dir, root) if getattr(args, "draft_dir", None) else None,
                    "draft_weight_dtype": getattr(args, "draft_weight_dtype", "auto"),
                    "matmul_precision": getattr(args, "matmul_precision", "highest"),
                    "token_map": portable_path(args.speculative_token_map, root)
                    if getattr(args, "speculative_token_map", None) else None, "modes": {}}
    for mode in modes:
        _log(f"bench: {mode}: building engines")
        mode_k = getattr(args, "adaptive_max_draft_len", 8) if mode.endswith(ADAPTIVE) else k
        engine_dir, build = build_mode_engines(args.checkpoint_dir, mode, root, mode_k, args.draft_weight_dtype,
                                               getattr(args, "matmul_precision", "highest"),
                                               getattr(args, "speculative_token_map", None), embedded_model, factor,
                                               getattr(args, "draft_dir", None), **lengths,
                                               strip_plan=getattr(args, "strip_plan", False))
        engines = {n: {"bytes": e["engine_bytes"], "layers": e["layers"], "build_seconds": round(e["build_seconds"], 1)}
                   for n, e in build["engines"].items()}
        _log(f"bench: {mode}: generating ({len(prompts)} prompts x {new_tokens} tokens, with and without speculation)")
        entry = _offline(engine_dir, prompts, new_tokens, mode_k, runs, backend, tree.get(mode) if tree else None)
        entry.update(engine_dir=portable_path(engine_dir, root), build_seconds=round(build["total_seconds"], 1),
                     engine_bytes=sum(e["bytes"] for e in engines.values()), engines=engines,
                     weight_bytes=build.get("weight_bytes", {}))
        report.setdefault("target_weight_bytes", build.get("weight_bytes", {}).get("target"))
        report["modes"][mode] = entry
        _log(f"bench: {mode}: mean accepted {entry['mean_accepted_tokens']:.2f}, {entry['tokens_per_second']} vs "
             f"{entry['target_only_tokens_per_second']} tokens/s ({entry['speedup']:.2f}x)")
        if "tree" in entry:
            t = entry["tree"]
            _log(f"bench: {mode} tree ({t['max_nodes']} nodes): mean accepted {t['mean_accepted_tokens']:.2f} "
                 f"({t['over_chain_accepted']:+.2f} vs chain), {t['tokens_per_second']} tokens/s "
                 f"({t['over_chain']:.2f}x the chain, {t['speedup']:.2f}x target-only)")
    # the small-row kernel's form the compiled runs used (runtime.compiled.small_linear), None: torch's GEMM
    report["machine"]["small_linear"] = small_linear.form() if backend == "compiled" else None
    if not getattr(args, "no_peers", False):
        _log("bench: peers (transformers generate, assisted generation)")
        draft_target = (resolve_sources(None, "draft_target", None, None, embedded_model, factor)[1]
                        if args.checkpoint_dir is None else None)
        if getattr(args, "draft_dir", None) and modes[0].removesuffix(ADAPTIVE) == "draft_target":
            draft_target = Path(args.draft_dir)   # assisted generation with the user's own draft model
        report["peers"] = _peers(Path(target_dir), draft_target, prompts, new_tokens, runs)
    best = max(report["modes"], key=lambda m: report["modes"][m]["speedup"])
    report["best_mode"] = best
    if not args.no_serving:
        _log(f"bench: serving the best mode ({best}) through Triton")
        try:
            report["serving"] = _serving(root / report["modes"][best]["engine_dir"], texts, new_tokens, runs,
                                         report["modes"][best]["tokens_per_second"], backend, args.serving_threads or 0)
        except Exception as e:   # the offline results stand; the report says what failed
            report["serving"] = {"mode": best, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            _log(f"bench: serving failed: {report['serving']['error']}")
    write_report(report, root)
    _log(f"bench: wrote {root / 'report.json'}, {root / 'report.md'} and plots")
    return report


def cmd_bench(args) -> int:
    report = run_bench(args)
    return 1 if "error" in report.get("serving", {}) else 0


def main(argv=None):
    p = ArgumentParser(prog="nemospec bench", description=__doc__.splitlines()[0])
    add_bench_args(p)
    return cmd_bench(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
