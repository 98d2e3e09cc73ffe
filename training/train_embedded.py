"""Reproduces the embedded default checkpoints: ``python -m training.train_embedded``.

Stages (each resumable from its output in ``--workdir``):
  tokenizer  byte-level BPE on the stdlib corpus
  target     the NemotronH target (transformers), then its MTP layers by distillation
  data       the target's own greedy continuations of corpus prompts + its hidden states
  drafts     every draft kind distilled from that data
  package    target (fp32, with its MTP layers) + drafts (bf16) + SHA-256 manifest into ``builder/embedded``
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from training import corpus

SEED = 1234


def log(message: str) -> None:
    print(time.strftime("%H:%M:%S"), message, flush=True)


def stage_tokenizer(work: Path, vocab_size: int):
    from tokenizers import Tokenizer

    from builder.random_checkpoint import train_tokenizer

    path = work / "tokenizer.json"
    if not path.is_file():
        train_files, _ = corpus.split_files(corpus.stdlib_files())
        train_tokenizer(vocab_size, train_files).save(str(path))
        log(f"tokenizer: {vocab_size} tokens -> {path}")
    return Tokenizer.from_file(str(path))


def stage_target(work: Path, tokenizer, steps: int, length: int, batch: int):
    from training.target import TARGET_CONFIG, build_target, train

    out = work / "target_fp32"
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(SEED)
    train_files, valid_files = corpus.split_files(corpus.stdlib_files())
    eos = TARGET_CONFIG["eos_token_id"]
    stream = corpus.token_stream(tokenizer, train_files, eos)
    valid = corpus.token_stream(tokenizer, valid_files, eos)
    log(f"corpus: {len(train_files)} train files ({stream.numel()} tokens), {len(valid_files)} validation "
        f"({valid.numel()} tokens)")
    model = build_target(SEED)
    log(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
        f"pattern {TARGET_CONFIG['hybrid_override_pattern']}")
    data = corpus.batches(stream, batch, length + 1, torch.Generator().manual_seed(SEED))
    start = time.time()
    curve = train(model, data, valid, steps, length, log=log)
    tmp = work / "target_fp32.tmp"
    model.save_pretrained(str(tmp))
    tokenizer.save(str(tmp / "tokenizer.json"))
    (tmp / "training.json").write_text(json.dumps({
        "steps": steps, "batch": batch, "length": length, "seed": SEED, "seconds": round(time.time() - start, 1),
        "torch_threads": torch.get_num_threads(), "curve": curve,
        "corpus": corpus.manifest(train_files + valid_files)}, indent=1))
    tmp.rename(out)
    return out


def stage_data(work: Path, target: Path, tokenizer, sequences: int, prompt_len: int, new_tokens: int):
    from training.distill_data import DistillData, make_distill_data
    from training.draft_configs import DFLASH_LAYERS, EAGLE3_LAYERS

    path = work / "distill.safetensors"
    if path.is_file():
        return DistillData.load(path)
    train_files, _ = corpus.split_files(corpus.stdlib_files())
    stream = corpus.token_stream(tokenizer, train_files, 2)
    start = time.time()
    data = make_distill_data(target, stream, sequences, prompt_len, new_tokens,
                             sorted(set(EAGLE3_LAYERS) | set(DFLASH_LAYERS)), SEED + 1, log)
    data.save(path)
    log(f"distillation data: {sequences} sequences in {time.time() - start:.0f} s -> {path}")
    return data


def stage_drafts(work: Path, target: Path, data, kinds: list[str], steps_by_kind: dict, batch: int, lr: float,
                 resume: bool = False):
    """Each kind writes its checkpoint directory and ``curves/<kind>.json`` (so several processes can
    train different kinds at once)."""
    from training import draft_training as dt

    (work / "curves").mkdir(exist_ok=True)
    for kind in kinds:
        out, record = work / kind, work / "curves" / f"{kind}.json"
        done = (out / "config.json").is_file() and record.is_file()
        if done != resume:  # resume: continue the drafts already trained; else: train the missing ones
            continue
        start = time.time()
        seed, steps = SEED + 10 + sorted(dt.ALL_KINDS).index(kind), steps_by_kind[kind]
        if kind == "mtp":
            curve = dt.train_mtp(target, data, out, steps, batch, lr, seed, log)
        elif kind == "draft_target":
            curve = dt.train_draft_target(target, data, out, steps, batch, lr, seed, log)
        else:
            curve = dt.train_speculators_draft(kind, target, data, out, steps, batch, lr, seed, log, resume)
        entry = {"steps": steps, "batch": batch, "lr": lr, "seed": seed, "torch_threads": torch.get_num_threads(),
                 "seconds": round(time.time() - start, 1), "curve": curve}
        if resume:  # a second round continues the first: one curve, steps counted on
            first = json.loads(record.read_text())
            offset = first["steps"]
            entry = {**first, "steps": offset + steps, "seconds": first["seconds"] + entry["seconds"],
                     "rounds": first.get("rounds", [{k: first[k] for k in ("steps", "lr")}]) + [{"steps": steps, "lr": lr}],
                     "curve": first["curve"] + [{**c, "step": c["step"] + offset} for c in curve]}
        record.write_text(json.dumps(entry, indent=1))


def _quantized_copy(src: Path, dst: Path) -> None:
    """An NVFP4 W4A16 copy of a draft (ModelOpt layout; the builder's own draft rules pick the
    linear weights, as ``--quantization nvfp4_w4a16`` would at build time)."""
    from safetensors.torch import load_file, save_file

    from builder.drafts import quantizable
    from builder.quantization import HF_QUANT_CONFIG, QUANT_ALGO, quantize_tensors

    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = load_file(str(src / "model.safetensors"))
    names = quantizable(tensors)
    tensors = quantize_tensors({n: (t.float() if n in names else t) for n, t in tensors.items()}, names)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy2(src / "config.json", tmp / "config.json")
    (tmp / HF_QUANT_CONFIG).write_text(json.dumps({"producer": {"name": "nemospec", "version": "0.1.0"},
                                                   "quantization": {"quant_algo": QUANT_ALGO, "kv_cache_quant_algo": None,
                                                                    "group_size": 16, "exclude_modules": []}}, indent=1))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


def stage_package(work: Path, kinds: list[str]) -> dict:
    """Copies the trained checkpoints into builder/embedded and writes MANIFEST.json."""
    from builder import embedded

    names = []
    target_src = work / "mtp" if (work / "mtp" / "config.json").is_file() else work / "target_fp32"
    for name, src in [(embedded.TARGET, target_src)] + [(k, work / k) for k in kinds if k != "mtp"]:
        dst = embedded.ROOT / name
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("training.json", "generation_config.json"))
        names.append(name)
    if "dspark" in kinds:
        _quantized_copy(work / "dspark", embedded.ROOT / "dspark_nvfp4")
        names.append("dspark_nvfp4")
    target_training = json.loads((work / "target_fp32" / "training.json").read_text())
    drafts = {p.stem: json.loads(p.read_text()) for p in sorted((work / "curves").glob("*.json"))}
    (embedded.ROOT / "TRAINING.json").write_text(json.dumps({"target": target_training, "drafts": drafts}, indent=1))
    data = embedded.write_manifest(names, {"licence": corpus.LICENCE, "seed": SEED,
                                           "python": target_training["corpus"]["python"]})
    log(f"package: {len(names)} checkpoints, {data['total_bytes'] / 2**20:.2f} MiB -> {embedded.ROOT}")
    return data


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="build/train")
    ap.add_argument("--stages", default="tokenizer,target")
    ap.add_argument("--vocab_size", type=int, default=2048)
    ap.add_argument("--target_steps", type=int, default=1500)
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--target_dir", help="skip target training: distill drafts for this checkpoint")
    ap.add_argument("--sequences", type=int, default=3072)
    ap.add_argument("--prompt_len", type=int, default=32)
    ap.add_argument("--new_tokens", type=int, default=96)
    ap.add_argument("--drafts", default="eagle3,dflash,dspark,peagle,eagle,mtp,draft_target")
    ap.add_argument("--draft_steps", type=int, default=800, help="steps for eagle3 and dflash (the goal drafts)")
    ap.add_argument("--other_draft_steps", type=int, default=500, help="steps for the other drafts")
    ap.add_argument("--draft_batch", type=int, default=32)
    ap.add_argument("--draft_lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--resume", action="store_true", help="drafts: continue training the drafts already written")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    stages = args.stages.split(",")
    tokenizer = stage_tokenizer(work, args.vocab_size)
    if "target" in stages:
        stage_target(work, tokenizer, args.target_steps, args.length, args.batch)
    target = Path(args.target_dir) if args.target_dir else None
    if target is None and any(s in stages for s in ("data", "drafts", "package")):
        target = work / "target_fp32"
    data = None
    if "data" in stages or "drafts" in stages:
        data = stage_data(work, target, tokenizer, args.sequences, args.prompt_len, args.new_tokens)
    if "drafts" in stages:
        kinds = args.drafts.split(",")
        steps = {k: args.draft_steps if k in ("eagle3", "dflash") else args.other_draft_steps for k in kinds}
        stage_drafts(work, target, data, kinds, steps, args.draft_batch, args.draft_lr, args.resume)
    if "package" in stages:
        stage_package(work, args.drafts.split(","))


if __name__ == "__main__":
    main()

