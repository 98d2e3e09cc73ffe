"""A draft's LM head cut to the target tokens that matter (FR-Spec, SGLang's ``--speculative-token-map``).

A one-layer draft spends much of each proposal on its LM head (on the embedded eagle3 draft 393 K of
its 960 K weights; on a 131 K-vocabulary Nemotron draft most of them). Token use is long-tailed, so
a head over the most frequent few thousand tokens proposes what the full head would nearly always
propose, at a fraction of the cost. The kept rows become the draft's vocabulary and ``d2t`` maps
them back (target id = draft id + d2t[draft id]), the layout EAGLE-3 checkpoints already use, so no
model code changes. Speculation stays exact: the target verifies every token, and under sampling
the draft distribution q is simply zero outside the map.

A token map is a file of target token ids (``.json`` list, ``.txt`` whitespace-separated, or a
``.pt`` tensor as SGLang reads it); ``rank_tokens`` makes one from local text with the target's
tokenizer (``nemospec token_map``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections import Counter
from pathlib import Path

import torch

from builder.errors import DraftError

MODES = ("eagle3", "dflash", "dspark", "peagle")   # drafts with a d2t-mapped LM head of their own
# tensors whose rows are the draft vocabulary (the DSpark Markov head's W2 and its NVFP4 block scales)
VOCAB_ROWS = ("lm_head.weight", "markov_head.markov_w2.weight", "markov_head.markov_w2.weight_scale")


def read_token_map(path, vocab_size: int) -> torch.Tensor:
    """Target token ids (int64, in file order) from ``path``; every id in [0, vocab_size), no repeats."""
    path = Path(path)
    if not path.is_file():
        raise DraftError(f"--speculative_token_map: {path}: no such file")
    try:
        if path.suffix == ".pt":
            ids = torch.load(path, map_location="cpu", weights_only=True)
        elif path.suffix == ".json":
            ids = json.loads(path.read_text())
            if isinstance(ids, list) and any(isinstance(t, bool) for t in ids):   # (true would read as id 1)
                raise ValueError("true or false is no token id")
        else:
            ids = [int(t) for t in path.read_text().split()]
        ids = torch.as_tensor(ids)
    except Exception as e:
        raise DraftError(f"--speculative_token_map: {path}: not a list of token ids ({type(e).__name__}: {e})") from e
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise DraftError(f"--speculative_token_map: {path}: expected a non-empty 1-D list of integer token ids, "
                         f"got {tuple(ids.shape)} {ids.dtype}")
    ids = ids.long()
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise DraftError(f"--speculative_token_map: {path}: token id {int(bad[0])} outside the target vocabulary "
                         f"[0, {vocab_size})")
    if torch.unique(ids).numel() != ids.numel():
        raise DraftError(f"--speculative_token_map: {path}: token ids repeat")
    return ids


def write_token_map(path, ids: list[int]) -> None:
    """``ids`` in the format ``read_token_map`` reads by ``path``'s suffix: a .json list, a .pt tensor,
    else whitespace-separated text. Written beside it and renamed over it, so a failed write (a full
    disk) leaves the earlier file as it was and no part of the new one."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if path.suffix == ".pt":
            torch.save(torch.tensor(ids, dtype=torch.int64), temp)
        elif path.suffix == ".json":
            temp.write_text(json.dumps(ids) + "\n")
        else:
            temp.write_text("\n".join(map(str, ids)) + "\n")
        os.replace(temp, path)
    except (OSError, RuntimeError) as e:   # torch.save reports a failed write as RuntimeError
        temp.unlink(missing_ok=True)
        raise DraftError(f"--output {path}: could not be written ({getattr(e, 'strerror', None) or e})") from None


def digest(ids: torch.Tensor) -> str:
    return hashlib.sha256(json.dumps(ids.tolist()).encode()).hexdigest()


def rank_tokens(tokenizer_file, paths, size: int) -> list[int]:
    """The ``size`` most frequent token ids of the text files under ``paths`` (files or directories,
    read as UTF-8 with errors ignored), by count, ties by id."""
    from builder.tokenizer_file import load_tokenizer
    tok = load_tokenizer(tokenizer_file)
    files = []
    for p in map(Path, paths):
        if not p.exists():
            raise DraftError(f"--corpus: {p}: no such file or directory")
        files += sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    if not files:
        raise DraftError(f"--corpus: no files under {', '.join(map(str, paths))}")
    counts = Counter()
    for f in files:
        try:
            text = f.read_text(errors="ignore")
        except OSError as e:
            raise DraftError(f"--corpus: {f}: not readable ({e.strerror})") from None
        counts.update(tok.encode(text, add_special_tokens=False).ids)
    if not counts:
        raise DraftError(f"--corpus: no text in {', '.join(map(str, paths))}: expected text files to count tokens in")
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]


def check_mode(mode) -> None:
    if mode not in MODES:
        raise DraftError(f"--speculative_token_map: {mode} drafts propose from the target's own LM head or "
                         f"vocabulary; a token map applies to {', '.join(MODES)}")


def prune_draft_head(mode, cfg, weights: dict, target_weights: dict, ids: torch.Tensor, where: str):
    """(cfg, weights) of the draft with its vocabulary cut to the target ids ``ids``: the rows of
    every draft-vocabulary tensor whose target id is in the map, in draft-id order, and a new ``d2t``.
    A draft without its own LM head gets the target's rows as one."""
    check_mode(mode)
    head = weights.get("lm_head.weight")
    if head is None:   # the target's head (or its tied embedding) serves the draft: its rows, over the target vocab
        head = target_weights.get("lm_head.weight", target_weights["backbone.embeddings.weight"])
    rows = head.shape[0]
    d2t = weights.get("d2t")
    target_ids = torch.arange(rows) + (d2t.long() if d2t is not None else 0)
    keep = torch.isin(target_ids, ids).nonzero().flatten()
    if keep.numel() == 0:
        raise DraftError(f"--speculative_token_map: {where}: none of its ids is in the draft's vocabulary")
    out = dict(weights, **{"lm_head.weight": head})
    for name in VOCAB_ROWS:
        if name in out:
            out[name] = out[name][keep].contiguous()
    out["d2t"] = (target_ids[keep] - torch.arange(keep.numel())).contiguous()
    changes = {"draft_vocab_size": keep.numel(), "has_d2t": True}
    if any(f.name == "has_lm_head" for f in dataclasses.fields(cfg)):
        changes["has_lm_head"] = True
    return dataclasses.replace(cfg, **changes), out
