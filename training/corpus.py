"""The training corpus: the running interpreter's standard library sources (PSF licence).

Present on every machine without a download. Files are the top-level ``*.py`` modules of the stdlib,
sorted by name; every 10th file is held out for validation. ``manifest()`` records which files were
read (names, sizes, sha256) so a run can be compared with another interpreter's.
"""
from __future__ import annotations

import hashlib
import platform
import sysconfig
from pathlib import Path

import torch

LICENCE = "Python Software Foundation License Version 2 (the CPython standard library sources)"


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(train, validation): every 10th file (by sorted name) is validation."""
    return [f for i, f in enumerate(files) if i % 10 != 9], [f for i, f in enumerate(files) if i % 10 == 9]


def manifest(files: list[Path]) -> dict:
    return {"source": "python standard library, top-level *.py", "python": platform.python_version(),
            "licence": LICENCE,
            "files": [{"name": f.name, "bytes": f.stat().st_size,
                       "sha256": hashlib.sha256(f.read_bytes()).hexdigest()} for f in files]}


def token_stream(tokenizer, files: list[Path], eos_id: int) -> torch.Tensor:
    """All files tokenized and joined, each ended by ``eos_id``: one long int64 stream."""
    ids: list[int] = []
    for f in files:
        ids.extend(tokenizer.encode(f.read_text(encoding="utf-8", errors="replace")).ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def batches(stream: torch.Tensor, batch: int, length: int, generator: torch.Generator):
    """Endless random windows [batch, length] of the stream."""
    high = stream.numel() - length - 1
    while True:
        starts = torch.randint(0, high, (batch,), generator=generator)
        yield torch.stack([stream[s:s + length] for s in starts.tolist()])
