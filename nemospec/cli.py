"""`nemospec` command line: build engines, generate text."""
from __future__ import annotations

if __name__ == "__main__":   # a model process: mimalloc first (runtime.allocator), before heavy imports
    import sys
    from nemospec import preload_for
    preload_for(sys.argv[1:])

import errno
import json
import signal
import threading
import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from builder.errors import ArgumentParser, NemospecError
from builder.embedded.sources import add_embedded_args, refuse_embedded_with, resolve_sources
from builder.engine import TREE_STEP_KINDS
from runtime import allocator
from runtime.draft_len import AUTO, draft_len_arg
from runtime.draft_policy import POLICY_FLAGS, add_policy_args, policy_from
from runtime.tree.draft import TREE_FLAGS, add_tree_args, tree_from
from runtime.step_costs import cost_line

err = Console(stderr=True, highlight=False, soft_wrap=True)   # one error, one line: never broken at 80 columns
WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EFBIG)   # a disk that refuses the build
CHECKPOINT_CHUNK = 512   # prefill chunk of a checkpoint run: an engine's default --max_input_len


def add_token_map_arg(p):
    p.add_argument("--speculative_token_map", default=None, metavar="FILE",
                   help="cut the draft's LM head to these target token ids (FR-Spec; SGLang's flag): a .json list, "
                        "whitespace-separated .txt or .pt tensor, e.g. from `nemospec token_map` (eagle3, dflash, "
                        "dspark, peagle)")


def _add_token_map_command(p):
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the embedded model's)")
    p.add_argument("--corpus", nargs="+", required=True, help="local text files or directories to count tokens in")
    p.add_argument("--size", type=int, required=True, help="how many of the most frequent tokens to keep")
    p.add_argument("--output", required=True, help="the token map to write: .json list, .pt tensor, else whitespace-separated text (the formats --speculative_token_map reads)")


def cmd_token_map(args):
    from pathlib import Path
    from builder import embedded
    from builder.token_map import rank_tokens, write_token_map
    if args.size < 1:
        raise NemospecError(f"--size: expected >= 1, got {args.size}")
    tokenizer = Path(args.tokenizer) if args.tokenizer else embedded.target_dir() / "tokenizer.json"
    if not tokenizer.is_file():
        raise NemospecError(f"--tokenizer: {tokenizer}: expected a tokenizer.json file"
                            f"{', got a directory' if tokenizer.is_dir() else ', no such file'}")
    output = Path(args.output)
    if output.is_dir() or not output.parent.is_dir():
        raise NemospecError(f"--output {output}: expected a file path in an existing directory")
    for flag, given in [("--tokenizer", tokenizer), *(("--corpus", Path(c)) for c in args.corpus)]:
        if output.resolve() == given.resolve() or given.is_dir() and output.resolve().is_relative_to(given.resolve()):
            raise NemospecError(f"--output {output}: is or is inside the {flag} {given}, which writing the map "
                                "would replace or join; choose another path")
    ids = rank_tokens(tokenizer, args.corpus, args.size)
    write_token_map(output, ids)
    err.print(f"wrote {len(ids)} token ids (most frequent first) to {args.output}", markup=False)
    return 0


SPECULATIVE_MODES = ("draft_target", "eagle", "eagle3", "mtp", "dflash", "dspark", "peagle")
MODE_ALIASES = {"draft_tokens_external": "draft_target"}   # trtllm-build's name for a separate draft model


def _mode(value: str) -> str:
    return MODE_ALIASES.get(value, value)


def _add_build_args(p):
    p.add_argument("--checkpoint_dir", default=None,
                   help="Hugging Face NemotronH checkpoint (safetensors); default: the embedded trained model")
    p.add_argument("--output_dir", required=True, help="engine directory to write")
    p.add_argument("--max_batch_size", type=int, default=8, help="sequences per step")
    p.add_argument("--max_input_len", type=int, default=512, help="longest prefill chunk; generate splits a longer prompt into chunks, serve refuses it")
    p.add_argument("--max_seq_len", type=int, default=1024, help="prompt + generated tokens")
    p.add_argument("--max_draft_len", type=int, default=None,
                   help="K: draft tokens verified per step (default: 4 with a speculative mode, else 0)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="auto keeps the checkpoint's dtype")
    p.add_argument("--speculative_decoding_mode", default=None, type=_mode, choices=SPECULATIVE_MODES,
                   help="build a draft and a verify engine beside the target (trtllm-build's "
                        "draft_tokens_external is draft_target)")
    p.add_argument("--quantization", default=None, choices=["nvfp4_w4a16"],
                   help="quantize a block draft's (dflash, dspark, peagle) linear layers (ModelOpt NVFP4 W4A16) "
                        "while building")
    p.add_argument("--draft_dir", default=None,
                   help="draft checkpoint (every mode but mtp); default with the embedded model: its trained draft")
    add_token_map_arg(p)
    p.add_argument("--strip_plan", action="store_true",
                   help="one copy of the weights for every engine of the directory (weights/*.safetensors): "
                        "refittable engines refit at load where TensorRT builds them (a GPU), else the weights "
                        "become engine inputs bound at load (tensorrt_rtx without a GPU)")
    p.add_argument("--max_host_memory_gb", type=float, default=0.0,
                   help="refuse (exit 2) a build whose estimated peak host memory exceeds this (default: available)")
    p.add_argument("--num_layers", type=int, default=0, help="a trial build of the first N layers (default: all)")
    p.add_argument("--draft_weight_dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the compiled CPU path's draft multiplies by its weights rounded to this (bfloat16: half "
                        "the bytes per proposal; the output is the target's either way). auto: the model's dtype")
    p.add_argument("--matmul_precision", default="highest", choices=["highest", "medium"],
                   help="the compiled CPU path's fp32 products (torch.set_float32_matmul_precision's names): "
                        "medium rounds activations and weights to bf16 and sums the exact products in fp32 "
                        "(AVX512-BF16 dot products: half the weight bytes, twice the multiply-adds per instruction)")
    add_embedded_args(p)
    add_policy_args(p, build=True)
    add_tree_args(p, build=True)


def _parser():
    parser = ArgumentParser(prog="nemospec", description="TensorRT engines and speculative decoding for NemotronH")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_build_args(sub.add_parser("build", help="build an engine directory from a checkpoint"))

    g = sub.add_parser("generate", help="generate from a checkpoint or an engine directory")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--checkpoint_dir", help="default (neither given): the embedded trained model")
    src.add_argument("--engine_dir")
    inp = g.add_mutually_exclusive_group(required=True)
    inp.add_argument("--prompt", action="append", help="text prompt (repeat for a batch); needs tokenizer.json")
    inp.add_argument("--input_ids", action="append", help="comma-separated token ids (repeat for a batch)")
    g.add_argument("--max_new_tokens", type=int, required=True)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling cut (1: none)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--end_id", type=int, default=None, help="stop token (default: the config's eos_token_id)")
    g.add_argument("--ignore_eos", action="store_true")
    g.add_argument("--no_speculation", action="store_true", help="run the target alone (same engine directory)")
    g.add_argument("--num_draft_tokens", type=draft_len_arg, default=None,
                   help="draft tokens per step, at most the engine's --max_draft_len (default: that); auto: the K "
                        "whose measured step costs and acceptance predict the most tokens/s on this machine "
                        "(one short calibration run of each side on the first prompt)")
    g.add_argument("--backend", default="auto", choices=["auto", "torch", "compiled", "tensorrt", "interpreter"],
                   help="auto: TensorRT on a GPU, else compiled (torch for fewer than 2048 generated tokens, where "
                        "loading compiled steps costs more than it saves); torch: the eager reference; compiled: "
                        "short steps through torch.compile, cached on disk; interpreter: the engine's network, "
                        "recorded again from the directory's weights, evaluated layer by layer on the CPU (slow, a "
                        "check that the built network computes what the eager model does)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="with --checkpoint_dir: the eager dtype")
    g.add_argument("--matmul_precision", default=None, choices=["highest", "medium"],
                   help="the compiled backend's fp32 products (default: the engine directory's build option, "
                        "else highest); medium: from bf16-rounded activations and weights, fp32 sums")
    g.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    g.add_argument("--verify", action="store_true",
                   help="with --engine_dir: check every engine and weights file's sha256 against config.json "
                        "(sizes are always checked)")
    g.add_argument("--trace", default=None, metavar="FILE",
                   help="speculation trace: one JSON line per verify step per sequence (proposed ids, accepted, "
                        "bonus, K, draft/verify ms)")
    add_policy_args(g, build=False)
    add_tree_args(g, build=False)
    g.add_argument("--speculative_decoding_mode", default=None, type=_mode, choices=SPECULATIVE_MODES,
                   help="with a checkpoint: speculate eagerly with this draft (no engines needed)")
    g.add_argument("--draft_dir", default=None, help="with a checkpoint: the draft (default with the embedded model: "
                                                     "its trained draft)")
    g.add_argument("--max_draft_len", type=int, default=None, help="with a checkpoint and a draft: K (default: 4)")
    add_token_map_arg(g)
    add_embedded_args(g)
    from serving.command import add_serve_args
    add_serve_args(sub.add_parser("serve", help="serve an engine directory with Triton Inference Server"))
    _add_quantize_args(sub.add_parser("quantize", help="write an NVFP4 (ModelOpt W4A16) checkpoint"))
    _add_token_map_command(sub.add_parser("token_map", help="rank a tokenizer's tokens by frequency in local text "
                                                            "(a --speculative_token_map file)"))
    from nemospec.bench import add_bench_args
    add_bench_args(sub.add_parser("bench", help="perf report: acceptance, tokens/s, peers, serving, build"))
    parser.commands = sub.choices    # command -> its parser, which names an unknown flag as its own
    return parser


def cmd_bench(args):
    from nemospec.bench import cmd_bench as bench
    return bench(args)


def cmd_serve(args):
    from serving.command import cmd_serve as serve
    return serve(args)



def cmd_build(args):
    from builder.engine import BuildOptions, build
    refuse_embedded_with(args, "checkpoint_dir")
    args.checkpoint_dir, args.draft_dir = resolve_sources(args.checkpoint_dir, args.speculative_decoding_mode,
                                                          args.draft_dir, args.quantization, args.embedded,
                                                          args.embedded_factor)
    if args.max_draft_len is None:
        args.max_draft_len = 4 if args.speculative_decoding_mode else 0
    elif args.max_draft_len and not args.speculative_decoding_mode and not (
            args.quantization or args.speculative_token_map or args.draft_dir or args.tree_engines):   # each says so itself
        raise NemospecError(f"--max_draft_len {args.max_draft_len}: draft tokens need a --speculative_decoding_mode")
    if args.speculative_decoding_mode:
        policy_from(args.max_draft_len, vars(args))  # a bad flag exits 2 before anything is built
    else:   # recorded unchecked, they would surprise whoever later serves the directory with a draft
        given = [f for f, (_, default, _) in {**POLICY_FLAGS, **TREE_FLAGS}.items() if getattr(args, f) != default]
        if given:
            raise NemospecError(f"--{given[0]} {getattr(args, given[0])}: sets how a draft speculates; it needs a "
                                "--speculative_decoding_mode")
    options = BuildOptions(args.max_batch_size, args.max_input_len, args.max_seq_len, args.max_draft_len, args.dtype,
                           args.speculative_decoding_mode, **{f: getattr(args, f) for f in POLICY_FLAGS},
                           **{f: getattr(args, f) for f in TREE_FLAGS}, tree_engines=args.tree_engines,
                           strip_plan=args.strip_plan, max_host_memory_gb=args.max_host_memory_gb,
                           num_layers=args.num_layers, draft_weight_dtype=args.draft_weight_dtype,
                           matmul_precision=args.matmul_precision)
    with err.status("building ...") as status:
        def log(message):
            status.update(message)
            err.print(message)
        try:
            report = build(args.checkpoint_dir, args.output_dir, options, log, draft_dir=args.draft_dir,
                           draft_quantization=args.quantization, token_map=args.speculative_token_map)
        except OSError as e:   # a full or read-only disk while writing (the half-written directory is gone)
            if e.errno not in WRITE_ERRORS:
                raise
            raise NemospecError(f"--output_dir {args.output_dir}: {e.strerror}"
                                + (f" writing {Path(e.filename).name}" if e.filename else "")) from None
    from rich.table import Table
    table = Table(title=f"built {args.output_dir}")
    table.add_column("engine")
    table.add_column("layers", justify="right")
    table.add_column("MiB", justify="right")
    table.add_column("build s", justify="right")
    table.add_column("profiles")
    for name, t in report["engines"].items():
        table.add_row(name, str(t["layers"]), f"{t['engine_bytes'] / 2**20:.2f}", f"{t['build_seconds']:.1f}",
                      ", ".join(f"{p['name']} <= {p['max_tokens']} tokens" for p in t["profiles"]))
    err.print(table)
    weights = ", ".join(f"{n} {b / 2**20:.2f} MiB" for n, b in report["weight_bytes"].items())
    err.print(f"TensorRT {report['tensorrt']['flavour']} {report['tensorrt']['version']}, {report['dtype']}, "
              f"mode {report['speculative_decoding_mode'] or 'none'}, weights {weights}, "
              f"{report['total_seconds']:.1f} s total")
    lowerings: dict[str, dict[str, list[str]]] = {}
    for engine, t in report["engines"].items():
        for op, how in t["lowerings"].items():
            lowerings.setdefault(op, {}).setdefault(how, []).append(engine)
    err.print("lowerings:")
    for op in sorted(lowerings):
        for how, engines in lowerings[op].items():
            where = "" if len(engines) == len(report["engines"]) else f" [{', '.join(engines)}]"
            err.print(f"  {op}: {how}{where}", markup=False)
    return 0


def _prompts(args, tokenizer):
    if args.input_ids:
        try:
            return [[int(t) for t in s.split(",") if t.strip()] for s in args.input_ids]
        except ValueError:
            raise NemospecError("--input_ids: expected comma-separated integers, e.g. 1,2,3") from None
    if tokenizer is None:
        raise NemospecError("--prompt: this model has no tokenizer.json; pass --input_ids instead")
    return [tokenizer.encode(p).ids for p in args.prompt]



def cmd_generate(args):
    from runtime.generation import check_request, generate
    from runtime.loading import open_checkpoint, open_engine_dir
    from runtime.step_costs import cost_model
    for flag in ("checkpoint_dir", "engine_dir", "draft_dir"):
        if getattr(args, flag) == "":
            raise NemospecError(f"--{flag}: expected a directory, got an empty path")
    if args.draft_dir and args.engine_dir is None and not args.speculative_decoding_mode:
        raise NemospecError(f"--draft_dir {args.draft_dir}: a draft needs --speculative_decoding_mode (its kind)")
    from runtime.draft_policy import POLICY_FLAGS
    if args.engine_dir is None and not args.speculative_decoding_mode:   # as build refuses them: not ignored
        for flag in ("max_draft_len", "speculative_token_map", *POLICY_FLAGS):
            if getattr(args, flag, None) is not None:
                raise NemospecError(f"--{flag}: applies to a draft; this run is target-only (add "
                                    "--speculative_decoding_mode)")
    refuse_embedded_with(args, "engine_dir", "checkpoint_dir")
    if args.engine_dir is None:
        args.checkpoint_dir, args.draft_dir = resolve_sources(args.checkpoint_dir, args.speculative_decoding_mode,
                                                              args.draft_dir, None, args.embedded, args.embedded_factor)
    elif args.speculative_decoding_mode or args.draft_dir or args.speculative_token_map or args.max_draft_len is not None:
        raise NemospecError("--speculative_decoding_mode/--draft_dir/--speculative_token_map/--max_draft_len: an engine "
                            "directory already holds its draft and K; these go with --checkpoint_dir")
    if args.max_draft_len is None:
        args.max_draft_len = 4
    from runtime.loading import resolve_backend
    backend = resolve_backend(args.backend, engine_dir=args.checkpoint_dir is None,
                              tokens=args.max_new_tokens * len(args.prompt or args.input_ids or [None]))
    if args.checkpoint_dir:
        if backend in ("tensorrt", "interpreter"):
            raise NemospecError(f"--backend {backend} needs --engine_dir (build one with `nemospec build`)")
        if args.speculative_decoding_mode and not 1 <= args.max_draft_len < CHECKPOINT_CHUNK:
            raise NemospecError(f"--max_draft_len: expected 1..{CHECKPOINT_CHUNK - 1} (a verify's K+1 rows run as one "
                                f"{CHECKPOINT_CHUNK}-row chunk), got {args.max_draft_len}")
        loaded = open_checkpoint(args.checkpoint_dir, args.dtype, mode=args.speculative_decoding_mode,
                                 draft_dir=args.draft_dir, max_draft_len=args.max_draft_len, backend=backend,
                                 matmul_precision=args.matmul_precision or "highest",
                                 token_map=args.speculative_token_map)
    else:
        from builder.integrity import verify_engine_dir
        notice = verify_engine_dir(args.engine_dir, hashes=args.verify)
        if notice:
            err.print(f"warning: {notice}", markup=False)
        loaded = open_engine_dir(args.engine_dir, backend, matmul_precision=args.matmul_precision)
    tokenizer = None
    if loaded.tokenizer_path is not None:
        from builder.tokenizer_file import load_tokenizer
        tokenizer = load_tokenizer(loaded.tokenizer_path)
    prompts = _prompts(args, tokenizer)
    if args.engine_dir and len(prompts) > loaded.max_batch_size:   # its TensorRT profiles end there
        raise NemospecError(f"--prompt/--input_ids: {len(prompts)} prompts exceed the engine directory's max_batch_size "
                            f"{loaded.max_batch_size} (rebuild with a larger --max_batch_size, or send fewer)")
    if not 0 <= args.temperature < float("inf"):   # NaN fails both
        raise NemospecError(f"--temperature: expected a finite number >= 0, got {args.temperature}")
    if args.seed is not None and not 0 <= args.seed < 2 ** 64:
        raise NemospecError(f"--seed: expected an integer in [0, 2^64), got {args.seed}")
    if not 0 < args.top_p <= 1:
        raise NemospecError(f"--top_p: expected a value in (0, 1], got {args.top_p}")
    if args.end_id is not None and not 0 <= args.end_id < loaded.config.vocab_size:
        raise NemospecError(f"--end_id: expected a token id in [0, {loaded.config.vocab_size}), got {args.end_id}")
    eos = loaded.config.eos_token_id
    end_ids = set() if args.ignore_eos else (
        {args.end_id} if args.end_id is not None else set(eos if isinstance(eos, tuple) else [] if eos is None else [eos]))
    chunk = loaded.max_input_len if loaded.max_input_len < (1 << 30) else CHECKPOINT_CHUNK
    speculate = loaded.speculative is not None and not args.no_speculation
    auto_k = args.num_draft_tokens == AUTO
    k = loaded.max_draft_len if args.num_draft_tokens is None or auto_k else args.num_draft_tokens
    auto_nodes = args.tree and args.max_tree_nodes == "auto"
    if auto_k and (not speculate or args.tree):
        raise NemospecError("--num_draft_tokens auto: picks a chain's K; this run is "
                            + ("a tree run (size trees with --max_tree_nodes)" if args.tree else "target-only"))
    if args.num_draft_tokens is not None and not auto_k and not loaded.speculative:
        raise NemospecError(f"--num_draft_tokens: {args.engine_dir or 'this model'} does not speculate "
                            "(built without --speculative_decoding_mode)")
    if args.num_draft_tokens is not None and not auto_k and not 1 <= k <= loaded.max_draft_len:
        raise NemospecError(f"--num_draft_tokens: expected 1..{loaded.max_draft_len} (the engine's max_draft_len), got {k}")
    if args.trace is not None and not speculate:
        raise NemospecError("--trace: traces speculative decoding; this run is target-only")
    tree = None
    if args.tree:
        if not speculate:
            raise NemospecError("--tree: tree speculation needs a speculative run (a draft, no --no_speculation)")
        engines = loaded.backend not in ("torch", "compiled")
        if engines and getattr(loaded.runner, "tree", None) is None:
            raise NemospecError(f"--tree: on --backend {loaded.backend} the engine directory needs its tree engines "
                                "(tree_verify.engine): rebuild it with `nemospec build --tree_engines`, or use "
                                "--backend torch or compiled")
        try:
            tree = tree_from(k, loaded.build_options, args, loaded.speculative.get("mode"))
        except ValueError as e:
            raise NemospecError(str(e)) from None
        if args.checkpoint_dir and tree.max_nodes >= chunk:   # an engine directory's recorded size bounds it
            raise NemospecError(f"--max_tree_nodes: expected at most {chunk - 1} (a tree verify's root and nodes run "
                                f"as one {chunk}-row chunk), got {tree.max_nodes}")
        if engines and loaded.speculative.get("mode") in TREE_STEP_KINDS and tree.topk > tree.max_nodes:
            raise NemospecError(f"--tree_topk: expected at most {tree.max_nodes} (--max_tree_nodes: the draft_tree "
                                f"engine's widest frontier) on --backend {loaded.backend}, got {tree.topk}")
    try:   # a request the engine cannot serve is refused before any step compiles
        check_request(prompts, args.max_new_tokens, loaded.max_seq_len, loaded.config.vocab_size)
    except ValueError as e:
        raise NemospecError(str(e)) from None
    trace_file, trace_failed = None, []
    if args.trace is not None:
        try:
            trace_file = open(args.trace, "w", encoding="utf-8")
        except OSError as e:
            raise NemospecError(f"--trace {args.trace}: cannot write ({e.strerror})") from None

    def write_trace(record):   # a write that fails (a full disk) ends the trace, not the generation
        if not trace_failed:
            try:
                trace_file.write(json.dumps(record) + "\n")
            except OSError as e:
                trace_failed.append(e)
    # the run's policy: the warm-ups compile what it verifies (a confidence stop's shorter chunks)
    run_policy = (lambda kk: policy_from(kk, loaded.build_options, args)) if speculate else (lambda kk: None)
    try:
        if loaded.backend == "compiled":  # compile (or load from the cache) the steps this run uses, untimed
            from runtime.compiled.runner import warm_up
            warm_up(loaded, prompts, k if speculate else 0, tree, policy=run_policy(k), max_seq_len=loaded.max_seq_len,
                    prefill_chunk=chunk)
        if auto_nodes:   # each candidate size (and the chain) on the first prompt; keep the fastest
            from runtime.tree.sizing import calibrate_tree, describe as describe_tree

            def warm(shape):
                if loaded.backend == "compiled":
                    warm_up(loaded, prompts[:1], k, shape, max_seq_len=loaded.max_seq_len, prefill_chunk=chunk)
            tree_choice = calibrate_tree(loaded, prompts[0], k, tree, tree.max_nodes, warm=warm,
                                         max_seq_len=loaded.max_seq_len, prefill_chunk=chunk)
            err.print(describe_tree(tree_choice), markup=False)
            size = tree_choice["max_tree_nodes"]
            tree = None if size is None else replace(tree, max_nodes=size)
            if loaded.backend == "compiled":
                warm_up(loaded, prompts, k, tree, max_seq_len=loaded.max_seq_len, prefill_chunk=chunk)
        if auto_k:   # measure both sides on the first prompt, pick K, then warm that K's steps
            from runtime.draft_len import calibrate, describe
            choice = calibrate(loaded, prompts[0], k, max_seq_len=loaded.max_seq_len, prefill_chunk=chunk)
            err.print(describe(choice), markup=False)
            k = choice["k"]
            if loaded.backend == "compiled":
                warm_up(loaded, prompts, k, None, policy=run_policy(k), max_seq_len=loaded.max_seq_len,
                        prefill_chunk=chunk)
        if speculate:
            from runtime.speculative import speculative_generate
            policy = run_policy(k)
            if policy.auto_schedule:   # this run's batch size: measure both sides, keep K or turn speculation off
                from runtime.draft_len import calibrate_schedule, describe_schedule
                schedule_choice = calibrate_schedule(
                    loaded, prompts, k, [len(prompts)], max_seq_len=loaded.max_seq_len, prefill_chunk=chunk,
                    warm=None if loaded.backend != "compiled" else lambda kk, batch: warm_up(
                        loaded, batch, kk, None, policy=run_policy(kk), max_seq_len=loaded.max_seq_len,
                        prefill_chunk=chunk))
                err.print(describe_schedule(schedule_choice), markup=False)
                policy.schedule = schedule_choice["schedule"]
            result = speculative_generate(loaded.runner, loaded.proposer(), prompts, args.max_new_tokens, k,
                                          temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                          end_ids=end_ids, max_seq_len=loaded.max_seq_len, prefill_chunk=chunk,
                                          policy=policy, trace=None if trace_file is None else write_trace, tree=tree)
        else:
            result = generate(loaded.runner, prompts, args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed, end_ids=end_ids, max_seq_len=loaded.max_seq_len,
                              prefill_chunk=chunk)
    except ValueError as e:
        raise NemospecError(str(e)) from None
    finally:
        if trace_file is not None:
            try:
                trace_file.close()
            except OSError as e:
                trace_failed.append(e)
    # an end id ends the ids but not the text, and the text reads as it does after the prompt, as
    # the server answers (serving.md, `end_id` and `text_output`)
    from serving.protocol import answer_text
    texts = ([answer_text(tokenizer, p, o[:-1] if o and o[-1] in end_ids else o)
              for p, o in zip(prompts, result.output_ids)] if tokenizer else None)
    if not args.json:
        for i, ids in enumerate(result.output_ids):
            print(texts[i] if texts else ",".join(map(str, ids)))
    mode = loaded.speculative["mode"] if speculate else "target only"
    err.print(f"{result.num_tokens} tokens in {result.seconds:.3f} s = {result.tokens_per_second:.1f} tokens/s "
              f"({loaded.backend} backend, {mode})")
    cost = {"target_only": result.extra["cost"].summary()}
    if speculate:
        a = result.extra["acceptance"]
        by_k = {int(n): c for n, c in a.get("steps_by_draft_len", {}).items() if c}
        # the K the steps verified (a schedule, an adaptive K or a confidence stop moves it off the one asked for)
        used = f"K={k}" if set(by_k) <= {k} else "steps by K " + ", ".join(f"{n}: {c}" for n, c in sorted(by_k.items()))
        err.print(f"mean accepted tokens per verify forward {a['mean_accepted_tokens']:.2f} ({used}), "
                  f"histogram {a['histogram']}")
        if tree is not None:
            t = a["tree"]
            err.print(f"tree: {tree.max_nodes} nodes, top-{tree.topk}, depth {tree.depth}; steps by size "
                      f"{t['steps_by_size']}, accepted depth {t['steps_by_accepted_depth']}, "
                      f"{t['accepted_off_chain']} paths off the draft's top chain")
        # the target-only step beside it: a short greedy run of the same prompts (the same batch) on
        # the same runner, so both sides' steps carry as many rows
        plain = generate(loaded.runner, prompts, min(32, args.max_new_tokens), max_seq_len=loaded.max_seq_len,
                         prefill_chunk=chunk)
        cost = cost_model(result.extra["cost"].summary(), plain.extra["cost"].summary())
        err.print(cost_line(cost), markup=False)
    if args.json:
        from runtime.compiled import small_linear
        single = len(prompts) == 1
        record = {
            "output_ids": result.output_ids[0] if single else result.output_ids,
            "num_tokens": result.num_tokens,
            "tokens_per_second": round(result.tokens_per_second, 1),
            "seconds": round(result.seconds, 6),   # to the microsecond: finer is noise
            "num_target_forwards": result.num_target_forwards,
            "backend": loaded.backend,
            "allocator": allocator.active(),
            # the small-row kernel's form the compiled steps ran (small_linear.form()), None: torch's GEMM
            "small_linear": small_linear.form() if loaded.backend == "compiled" else None,
        }
        record["cost"] = cost
        if speculate:
            record["acceptance"] = result.extra["acceptance"]
            record["num_draft_tokens"] = k
            if auto_k:
                record["draft_len_auto"] = choice
            if auto_nodes:
                record["tree_auto"] = tree_choice
            if policy.auto_schedule:
                record["draft_len_schedule_auto"] = schedule_choice
        if texts is not None:
            record["text"] = texts[0] if single else texts
        print(json.dumps(record))
    if trace_failed:   # the generation above stands; the part-written trace goes
        if Path(args.trace).is_file():   # never a device (/dev/full) or anything else the path names
            Path(args.trace).unlink()
        raise NemospecError(f"--trace {args.trace}: could not be written ({trace_failed[0].strerror}); removed it, "
                            "the output above is complete")
    return 0


def _add_quantize_args(p):
    p.add_argument("--checkpoint_dir", required=True, help="bf16/fp16/fp32 NemotronH checkpoint (safetensors)")
    p.add_argument("--output_dir", required=True, help="NVFP4 checkpoint directory to write")
    p.add_argument("--format", default="nvfp4_w4a16", choices=["nvfp4_w4a16"],
                   help="NVFP4 weights (ModelOpt layout), 16-element FP8 block scales, activations unquantized")
    p.add_argument("--exclude_modules", default="",
                   help="comma-separated module names or wildcards kept in high precision, besides ModelOpt's "
                        "defaults (lm_head, conv1d, routers, mtp.*)")


def cmd_quantize(args):
    from builder.quantize_checkpoint import quantize_checkpoint
    exclude = [p.strip() for p in args.exclude_modules.split(",") if p.strip()]
    summary = quantize_checkpoint(args.checkpoint_dir, args.output_dir, exclude, log=err.print)
    err.print(f"wrote {summary['output_dir']}: {len(summary['quantized'])} linear weights in NVFP4, "
              f"{summary['bytes_before'] / 2**20:.2f} -> {summary['bytes_after'] / 2**20:.2f} MiB; "
              f"kept in high precision: {', '.join(summary['excluded']) or 'none'}", markup=False)
    return 0


def _terminate_as_exit(signum, frame):
    """SIGTERM, and SIGHUP (the terminal closed, the ssh session dropped), unwind like Ctrl-C, so an
    output directory being written is removed (atomic_dir)."""
    raise SystemExit(128 + signum)


def main(argv=None):
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:   # "nemospec build: error: ... (see nemospec build --help)", not the top-level parser's
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in ("build", "quantize", "token_map") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate_as_exit)
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:   # nohup's choice stands
            signal.signal(signal.SIGHUP, _terminate_as_exit)
    try:
        return {"build": cmd_build, "generate": cmd_generate, "serve": cmd_serve,
                "quantize": cmd_quantize, "bench": cmd_bench, "token_map": cmd_token_map}[args.command](args)
    except NemospecError as e:
        err.print(f"error: {e}", markup=False)
        return 2
    except KeyboardInterrupt:
        err.print("interrupted", markup=False)
        return 130


def build_main(argv=None):
    """`nemospec-build`: the same as `nemospec build`."""
    return main(["build"] + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
