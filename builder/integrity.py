"""Engine directory integrity: the size and sha256 of every engine and weights file, recorded in
``config.json`` (``files``) at build time and checked before an engine directory is served or run.

``record_files(directory)`` returns the table the build stores; ``verify_engine_dir(engine_dir,
hashes=...)`` raises a NemospecError (exit 2 from the CLI) naming the first missing, truncated or
altered file. Sizes are cheap and always checked; hashes read every byte (``--verify``: on by default
for ``nemospec serve``, off for ``nemospec generate``). An engine directory built before sizes and
hashes were recorded cannot be checked: ``verify_engine_dir`` returns a message saying so (the
caller prints it) instead of refusing it.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from builder.errors import NemospecError

#: what is recorded: the engines and the weights (tokenizer and config files are small text the
#: loaders parse, and fail loudly on)
PATTERNS = ("*.engine", "weights/*.safetensors")
CHUNK = 1 << 20


def sha256_file(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def record_files(directory) -> dict:
    """{relative path: {"bytes": size, "sha256": hex}} for every engine and weights file."""
    directory = Path(directory)
    return {name: {"bytes": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
            for name in record_names(directory)}


class IntegrityError(NemospecError):
    """A missing, truncated or altered engine directory file (one line naming it)."""


def _check_table(table, meta_path: Path) -> None:
    """The 'files' field holds {name: {"bytes": int, "sha256": hex}}; anything else is a damaged config.json."""
    if not isinstance(table, dict):
        raise IntegrityError(f"{meta_path}: field 'files': expected an object of recorded files, got "
                             f"{type(table).__name__}; rebuild the engine directory with `nemospec build`")
    for name, want in table.items():
        if not (isinstance(want, dict) and isinstance(want.get("bytes"), int) and not isinstance(want["bytes"], bool)
                and isinstance(want.get("sha256"), str)):
            raise IntegrityError(f"{meta_path}: field 'files.{name}': expected {{\"bytes\": integer, \"sha256\": hex}}, "
                                 f"got {want!r}; rebuild the engine directory with `nemospec build`")


def verify_engine_dir(engine_dir, hashes: bool = True) -> str | None:
    """Checks every recorded file's size (and with ``hashes`` its sha256). Returns None when checked,
    or a one-line notice when the directory records nothing to check (built by an older nemospec).
    Raises IntegrityError naming the first bad file, NemospecError for an unreadable config.json."""
    engine_dir = Path(engine_dir)
    meta_path = engine_dir / "config.json"
    if not meta_path.is_file():
        raise NemospecError(f"--engine_dir: {meta_path} missing; is {engine_dir} an engine directory built by "
                            "`nemospec build`?")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise NemospecError(f"{meta_path}: cannot read ({type(e).__name__}: {e}); is {engine_dir} an engine directory "
                            "built by `nemospec build`?") from None
    if isinstance(meta, dict) and "engines" not in meta and "model_type" in meta:   # not two lines: a notice, then this
        raise NemospecError(f"--engine_dir {engine_dir}: holds a checkpoint (config.json model_type "
                            f"{meta['model_type']!r}), not an engine directory; pass it as --checkpoint_dir, or build "
                            "one with `nemospec build`")
    table = meta.get("files") if isinstance(meta, dict) else None
    if not table:
        return (f"{meta_path} records no file sizes or sha256 hashes (built before nemospec recorded them): "
                "engine and weights files not verified; rebuild with `nemospec build` to record them")
    _check_table(table, meta_path)
    unrecorded = sorted(set(record_names(engine_dir)) - set(table))
    if unrecorded:
        raise IntegrityError(f"{engine_dir / unrecorded[0]}: not recorded in {meta_path} 'files' "
                             "(added after the build?); rebuild the engine directory with `nemospec build`")
    for name, want in sorted(table.items()):
        path = engine_dir / name
        if not path.is_file():
            raise IntegrityError(f"{path}: missing (recorded {want['bytes']} bytes at build); rebuild the engine "
                                 "directory with `nemospec build`")
        size = path.stat().st_size
        if size != want["bytes"]:
            what = "truncated" if size < want["bytes"] else "grown"
            raise IntegrityError(f"{path}: {what}: {size} bytes, recorded {want['bytes']} at build; rebuild the "
                                 "engine directory with `nemospec build`")
        if hashes:
            got = sha256_file(path)
            if got != want["sha256"]:
                raise IntegrityError(f"{path}: altered: sha256 {got[:16]}..., recorded {want['sha256'][:16]}... at "
                                     "build; rebuild the engine directory with `nemospec build`")
    return None


def record_names(directory) -> list[str]:
    directory = Path(directory)
    return sorted({p.relative_to(directory).as_posix() for pattern in PATTERNS for p in directory.glob(pattern)
                   if p.is_file()})
