"""Where the commands' embedded default comes from: the shipped small model, or its widened copy
(``builder.embedded.widen``) written once into a cache directory on first use."""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

from builder.embedded import DRAFTS, MANIFEST, NVFP4_DRAFTS, TARGET, draft_dir, target_dir
from builder.embedded.widen import widen
from builder.errors import CheckpointError

EMBEDDED_CHOICES = ("small", "wide")
DEFAULT_WIDE_FACTOR = 4


def wide_root(factor: int = DEFAULT_WIDE_FACTOR, log=None) -> Path:
    """The embedded model widened ``factor`` times (``builder.embedded.widen``), written on first use
    under ``$NEMOSPEC_EMBEDDED_CACHE`` (default ``~/.cache/nemospec/embedded``) in a directory named by
    the factor and the shipped manifest's digest, so a retrained model never reads a stale copy."""
    digest = hashlib.sha256(MANIFEST.read_bytes()).hexdigest()[:12] if MANIFEST.is_file() else "missing"
    cache = Path(os.environ.get("NEMOSPEC_EMBEDDED_CACHE") or Path.home() / ".cache" / "nemospec" / "embedded")
    root = cache / f"wide-{factor}-{digest}"
    if not (root / MANIFEST.name).is_file():   # seconds, once: said on stderr, which a --json reader skips
        widen(root, factor, log=log or (lambda line: print(line, file=sys.stderr, flush=True)))
    return root


def _wide_draft(root: Path, mode: str | None, quantization: str | None) -> Path | None:
    if mode is None:
        return None
    if mode not in DRAFTS:
        raise CheckpointError(f"--speculative_decoding_mode: no embedded draft for mode {mode}")
    name = NVFP4_DRAFTS.get(mode, DRAFTS[mode]) if quantization else DRAFTS[mode]
    return None if name is None else root / name


def resolve_sources(checkpoint_dir, mode=None, draft=None, quantization=None, embedded="small",
                    embedded_factor=None):
    """(checkpoint_dir, draft_dir) with the embedded default filled in where neither was given:
    ``embedded="wide"`` (or an ``embedded_factor`` > 1) picks the widened copy (``wide_root``)."""
    if embedded_factor is not None and (isinstance(embedded_factor, bool) or embedded_factor < 1):
        raise CheckpointError(f"--embedded_factor: expected an integer >= 1, got {embedded_factor}")
    if checkpoint_dir is not None:
        if embedded_factor is not None:
            raise CheckpointError("--embedded_factor: applies to the embedded model only; "
                                  f"leave it out with --checkpoint_dir {checkpoint_dir}")
        return checkpoint_dir, draft
    factor = embedded_factor if embedded_factor is not None else (DEFAULT_WIDE_FACTOR if embedded == "wide" else 1)
    if embedded == "small" and embedded_factor not in (None, 1):
        raise CheckpointError(f"--embedded_factor {embedded_factor}: needs --embedded wide (or leave it out)")
    if factor > 1:
        root = wide_root(factor)
        return root / TARGET, draft if draft is not None else _wide_draft(root, mode, quantization)
    if mode is not None and draft is None:
        draft = draft_dir(mode, quantization)
    return target_dir(), draft


class _Given(argparse.Action):
    """Stores the choice and notes that it was given, so that a command can refuse it beside a model of
    the user's own (the default is always set, so its value alone cannot tell)."""
    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.embedded_given = True


def refuse_embedded_with(args, *flags: str) -> None:
    """--embedded picks the embedded model: given beside one of ``flags`` (a model of the user's own)
    it would be silently ignored."""
    if not getattr(args, "embedded_given", False):
        return
    for flag in flags:
        value = getattr(args, flag, None)
        if value is not None:
            raise CheckpointError(f"--embedded {args.embedded}: picks the embedded model; leave it out with --{flag} {value}")


def add_embedded_args(p, default: str = "small", given: str = "--checkpoint_dir",
                      factor_default: str = str(DEFAULT_WIDE_FACTOR)) -> None:
    """--embedded / --embedded_factor: which embedded default a command runs when not ``given`` a model
    (``default``: small for build, generate and serve; wide for bench and the demo, which measure speed;
    ``factor_default``: what the help says the width multiple defaults to)."""
    p.add_argument("--embedded", default=default, choices=EMBEDDED_CHOICES, action=_Given,
                   help=f"with no {given}: the embedded trained model as shipped (small: its weights sit "
                        "in cache) or widened (wide: the same function at --embedded_factor times the width, "
                        "decoding from memory as a served model does; written once under ~/.cache/nemospec)"
                        f" (default {default})")
    p.add_argument("--embedded_factor", type=int, default=None,
                   help=f"the wide embedded model's width multiple (default {factor_default})")
