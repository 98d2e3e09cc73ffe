"""Target-only greedy decode against stock llama.cpp on the same model, same prompts, same threads
and dtype; then speculative (eagle3) against llama.cpp's plain decode.

Goals (the widened-target issue): our target-only decode ahead of llama.cpp's; speculative >= 2x
llama.cpp's plain decode. llama.cpp runs from its own venv (``llama-cpp-python`` built from its sdist
with the machine's SIMD, ``gguf`` to write the file; both need numpy >= 2, which the project's venv
cannot hold beside Triton's stub), made once under ``~/.cache/nemospec`` by ``ensure_venv`` (about 8
minutes of compiling on 2 cores). The checkpoint becomes a GGUF by our own converter
(``benchmarks/llama_cpp_gguf.py``). Both sides: fp32 weights and an fp32 KV cache by default
(``--dtype bf16`` writes llama.cpp's matrices as bf16 and runs ours at ``--matmul_precision medium``,
whose products round to bf16 too); one prompt in one batch, then one token per step. Printed: tokens/s
end to end (prompt included) and of the one-token steps alone, medians of ``--runs``, and whether the
greedy ids agree (fp32 should; a divergence is reported with the position, not hidden).

    python benchmarks/llama_cpp_peer.py [--embedded_factor 4] [--threads 2] [--new_tokens 128] [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __name__ == "__main__":   # timed on the allocator the commands use (runtime.allocator)
    from runtime.allocator import preload
    preload()

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from own_venv import make_once  # noqa: E402
PACKAGES = ("llama-cpp-python==0.3.36", "gguf==0.19.0", "safetensors==0.8.0")
CMAKE_ARGS = "-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_OPENMP=ON -DLLAVA_BUILD=OFF -DGGML_CCACHE=OFF"
PROMPTS = ("def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\ndef list_files(path):\n")


def default_venv() -> Path:
    return Path(os.environ.get("NEMOSPEC_LLAMA_CPP_VENV")
                or Path.home() / ".cache" / "nemospec" / "llama-cpp-venv-0.3.36")


def ensure_venv(venv: Path) -> Path:
    """The peer venv's python, made first if missing (llama-cpp-python installed last, then the
    marker). Compiles llama.cpp natively for this CPU, so a venv is per machine."""
    done = venv / ".nemospec-complete"
    make_once(venv, done, [list(PACKAGES[1:]), ["--no-binary", "llama-cpp-python", PACKAGES[0]]],
              f"llama.cpp's venv ({', '.join(PACKAGES)}; compiles llama.cpp, ~6-8 min on 2 cores)",
              env={"CMAKE_ARGS": CMAKE_ARGS, "FORCE_CMAKE": "1"})
    if not done.is_file():
        done.write_text(" ".join(PACKAGES) + "\n")
    return venv / "bin" / "python"


def llama_cpp_decode(python: Path, gguf: Path, prompts, new_tokens: int, threads: int, runs: int) -> dict:
    out = subprocess.run([str(python), str(HERE / "llama_cpp_decode.py"), "--model", str(gguf),
                          "--prompts", json.dumps(prompts), "--new_tokens", str(new_tokens),
                          "--threads", str(threads), "--runs", str(runs)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def first_divergence(a: list[list[int]], b: list[list[int]]):
    for i, (x, y) in enumerate(zip(a, b)):
        for j, (u, v) in enumerate(zip(x, y)):
            if u != v:
                return i, j
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--embedded_factor", type=int, default=4, help="the widened embedded target (1: the small one)")
    ap.add_argument("--checkpoint_dir", help="another NemotronH checkpoint instead of the embedded one")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    ap.add_argument("--mode", default="eagle3", help="the speculative side (none: target-only only)")
    ap.add_argument("--venv", type=Path, default=None)
    ap.add_argument("--workdir", type=Path, default=Path("build/llama_cpp_peer"))
    args = ap.parse_args(argv)

    import torch
    from tokenizers import Tokenizer

    from builder.embedded.sources import resolve_sources
    from runtime.compiled.runner import warm_up
    from runtime.generation import generate
    from runtime.loading import open_checkpoint
    from runtime.speculative import speculative_generate

    torch.set_num_threads(args.threads)
    mode = None if args.mode == "none" else args.mode
    ckpt, draft = resolve_sources(args.checkpoint_dir, mode, embedded="wide" if args.embedded_factor > 1 else "small",
                                  embedded_factor=args.embedded_factor if args.embedded_factor > 1 else None)
    ckpt = Path(ckpt)
    python = ensure_venv(args.venv or default_venv())
    args.workdir.mkdir(parents=True, exist_ok=True)
    gguf = args.workdir / f"{ckpt.parent.name}-{ckpt.name}-{args.dtype}.gguf"
    if not gguf.is_file() or gguf.stat().st_mtime < (ckpt / "config.json").stat().st_mtime:
        subprocess.run([str(python), str(HERE / "llama_cpp_gguf.py"), "--checkpoint_dir", str(ckpt),
                        "--output", str(gguf), "--dtype", args.dtype], check=True)
    prompts = [Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(p).ids for p in PROMPTS]

    precision = "medium" if args.dtype == "bf16" else "highest"
    plain = open_checkpoint(ckpt, backend="compiled", matmul_precision=precision)   # a target with no draft
    spec = open_checkpoint(ckpt, backend="compiled", mode=mode, draft_dir=draft, matmul_precision=precision) \
        if mode else None
    for p in prompts:                       # every step shape compiled (or loaded) before timing
        warm_up(plain, [p])
        if spec:
            warm_up(spec, [p], draft_len=spec.max_draft_len)

    def ours_plain():
        total, steps, ids = 0.0, 0.0, []
        for p in prompts:
            r = generate(plain.runner, [p], args.new_tokens)
            cost = r.extra["cost"].summary()
            total, steps = total + r.seconds, steps + cost["step_ms"] * cost["steps"] / 1e3
            ids.append(r.output_ids[0])
        return total, steps, ids

    def ours_spec():
        runs = [speculative_generate(spec.runner, spec.proposer(), [p], args.new_tokens, spec.max_draft_len,
                                     policy=spec.draft_policy) for p in prompts]
        return sum(r.seconds for r in runs), None, [r.output_ids[0] for r in runs]

    sides = {"llama.cpp": None, "nemospec target-only": ours_plain, **({f"nemospec {mode}": ours_spec} if mode else {})}
    rows = {name: [] for name in sides}
    ids = {}
    for _ in range(args.runs):              # the sides interleaved run by run: the machine's drift hits all
        for name, fn in sides.items():
            if fn is None:
                theirs = llama_cpp_decode(python, gguf, prompts, args.new_tokens, args.threads, 1)
                total, steps, out = theirs["runs"][0]["seconds"], theirs["runs"][0]["step_seconds"], theirs["output_ids"]
            else:
                total, steps, out = fn()
            rows[name].append((total, steps))
            ids.setdefault(name, out)
    tokens = args.new_tokens * len(prompts)
    print(f"model {ckpt} ({args.dtype}), {len(prompts)} prompts x {args.new_tokens} tokens, {args.threads} threads, "
          f"median of {args.runs} interleaved runs")
    for name, values in rows.items():
        steps = [v[1] for v in values if v[1] is not None]
        step_rate = f", one-token steps {(tokens - len(prompts)) / statistics.median(steps):8.1f} tokens/s" if steps else ""
        print(f"{name:24s} {tokens / statistics.median(v[0] for v in values):8.1f} tokens/s end to end{step_rate}")

    def paired(name):                       # the median of each run's own ratio
        return statistics.median(b[0] / a[0] for a, b in zip(rows[name], rows["llama.cpp"]))
    print(f"target-only: nemospec / llama.cpp = {paired('nemospec target-only'):.2f}x (goal > 1)")
    if mode:
        print(f"{mode}: nemospec / llama.cpp plain = {paired('nemospec ' + mode):.2f}x (goal >= 2)")
    ours_ids, theirs_ids = ids["nemospec target-only"], ids["llama.cpp"]
    if mode and ids[f"nemospec {mode}"] != ours_ids:
        raise SystemExit(f"{mode}'s output differs from target-only greedy output (a bug)")
    where = first_divergence(ours_ids, theirs_ids)
    print("greedy ids: identical" if where is None else
          f"greedy ids: first differ in prompt {where[0]} at token {where[1]} (float rounding order; see the ids)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
