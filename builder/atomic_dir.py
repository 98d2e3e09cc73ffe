"""Writing an output directory so that a failure leaves nothing half-written behind."""
from __future__ import annotations

import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from builder.errors import NemospecError


def _check_replaceable(final: Path, replaceable) -> None:
    """An existing file is never replaced; an existing non-empty directory only where ``replaceable``
    says it is this command's own output (an earlier build), so a mistyped --output_dir cannot
    delete a checkpoint or anything else."""
    if final.is_symlink() and not final.exists():
        raise NemospecError(f"--output_dir {final}: is a symbolic link to a missing path; expected a directory to write")
    if final.is_file() or final.is_symlink() and not final.is_dir():
        raise NemospecError(f"--output_dir {final}: exists and is a file; expected a directory to write")
    if final.is_dir() and replaceable is not None and any(final.iterdir()) and not replaceable(final):
        raise NemospecError(f"--output_dir {final}: exists and holds other files (not an earlier output of "
                            "this command); remove it or choose another directory")


def _check_inputs_outside(final: Path, inputs: dict) -> None:
    """An input under ``final`` would go with the directory it replaces (a checkpoint copied into an
    earlier engine directory was deleted by the build that read it)."""
    for flag, path in inputs.items():
        if path is not None and Path(path).resolve().is_relative_to(final.resolve()):
            raise NemospecError(f"--output_dir {final}: holds the {flag} {path}; choose another directory")


def check_output_dir(final, replaceable=None, inputs: dict | None = None) -> None:
    """What :func:`atomic_dir` refuses, asked before long work (a quantization) rather than after it."""
    final = Path(final)
    _check_inputs_outside(final, inputs or {})
    _check_replaceable(final.resolve() if final.is_symlink() and final.resolve().is_dir() else final, replaceable)


@contextmanager
def atomic_dir(final, replaceable=None, inputs: dict | None = None):
    """Yields a fresh temporary directory next to ``final``; renames it into place when the block
    succeeds (replacing an existing ``final`` that ``replaceable`` accepts), deletes it when the block
    raises or the process is terminated. ``inputs`` ({flag: path}): what the command reads, refused
    when it lies under ``final``."""
    given = final = Path(final)
    if final.is_symlink() and final.resolve().is_dir():
        # a link to a directory (engines kept on another disk) is written through: its target is replaced
        # and the link left pointing at the new directory, not renamed aside and left behind
        final = final.resolve()
    elif not final.name or final.name in (".", ".."):   # "." or "..": the directory they name, by its name
        final = final.resolve()
    _check_inputs_outside(final, inputs or {})
    _check_replaceable(final, replaceable)
    made = _make_parents(final)
    tmp = final.with_name(f".{final.name}.tmp-{time.time_ns()}")
    try:
        tmp.mkdir()
    except OSError as e:
        raise NemospecError(f"--output_dir {given}: cannot write beside it ({e.strerror})") from None
    try:
        yield tmp
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{time.time_ns()}")
            final.rename(old)
        tmp.rename(final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if made is not None:   # the parents this call made: nothing of a failed write stays behind
            shutil.rmtree(made, ignore_errors=True)
        raise


def _make_parents(final: Path) -> Path | None:
    """Makes ``final``'s missing parent directories; returns the outermost one it made (None: none)."""
    missing, parent = [], final.parent
    while not parent.exists() and not parent.is_symlink():
        missing.append(parent)
        parent = parent.parent
    if not parent.is_dir():
        raise NemospecError(f"--output_dir {final}: {parent} is a file; expected a directory")
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except OSError as e:   # the parents made before it go too
            shutil.rmtree(missing[-1], ignore_errors=True)
            raise NemospecError(f"--output_dir {final}: cannot make {directory} ({e.strerror})") from None
    return missing[-1] if missing else None
