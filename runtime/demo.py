"""`make demo`: make a small checkpoint, build its engine directory, generate from it.

Until the embedded trained model ships, the checkpoint is random (written by our own
``builder.random_checkpoint``) with a tokenizer trained on the local Python standard library, so
the text is gibberish; what the demo shows is the path: checkpoint -> engine -> generation.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from runtime import cli

console = Console(highlight=False)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="build/demo")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--max_new_tokens", type=int, default=48)
    args = p.parse_args(argv)
    work = Path(args.workdir)
    checkpoint, engine = work / "checkpoint", work / "engine"
    if not (checkpoint / "config.json").is_file():
        from builder.random_checkpoint import write_random_checkpoint
        console.rule("1. a small random NemotronH checkpoint (Mamba-2 + attention + MoE + MLP)")
        write_random_checkpoint(checkpoint, "M*ME-M*E", seed=0, tokenizer=True, mtp_pattern="*E")
        console.print(f"wrote {checkpoint}")
    console.rule("2. nemospec build (target + MTP draft: target, verify and draft engines)")
    code = cli.main(["build", "--checkpoint_dir", str(checkpoint), "--output_dir", str(engine),
                     "--max_batch_size", "4", "--max_input_len", "128", "--max_seq_len", "256",
                     "--speculative_decoding_mode", "mtp", "--max_draft_len", "3"])
    if code:
        return code
    generate = ["generate", "--engine_dir", str(engine), "--prompt", args.prompt,
                "--max_new_tokens", str(args.max_new_tokens), "--ignore_eos"]
    console.rule("3. nemospec generate, speculative (random weights: the MTP draft is rarely accepted)")
    console.print(f"prompt: {args.prompt!r}")
    code = cli.main(generate)
    if code:
        return code
    console.rule("4. nemospec generate --no_speculation (the same text, target only)")
    return cli.main(generate + ["--no_speculation"])


if __name__ == "__main__":
    raise SystemExit(main())
