"""The embedded default model: a tiny NemotronH trained on this project's machines, with a trained
draft of every kind, shipped inside the package (``training/train_embedded.py`` reproduces it).

Commands given no ``--checkpoint_dir`` / ``--draft_dir`` use these directories. ``MANIFEST.json``
records the SHA-256 of every file; :func:`verify` checks them before a build reads the weights.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from builder.errors import CheckpointError

ROOT = Path(__file__).resolve().parent
MANIFEST = ROOT / "MANIFEST.json"
TARGET = "target"
# draft directory of each speculative mode (mtp layers live in the target checkpoint)
DRAFTS = {"draft_target": "draft_target", "eagle": "eagle", "eagle3": "eagle3", "dflash": "dflash",
          "dspark": "dspark", "peagle": "peagle", "mtp": None}
NVFP4_DRAFTS = {"dspark": "dspark_nvfp4"}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest() -> dict:
    if not MANIFEST.is_file():
        raise CheckpointError(f"{MANIFEST}: the embedded default model is missing from this installation "
                              "(run `python -m training.train_embedded` or pass --checkpoint_dir)")
    return json.loads(MANIFEST.read_text())


def verify(name: str) -> Path:
    """The directory of embedded checkpoint ``name`` after checking every file's SHA-256."""
    entry = manifest()["checkpoints"].get(name)
    if entry is None:
        raise CheckpointError(f"{MANIFEST}: no embedded checkpoint named {name}")
    directory = ROOT / name
    for file, digest in entry["files"].items():
        path = directory / file
        if not path.is_file():
            raise CheckpointError(f"{path}: missing file of the embedded {name} checkpoint")
        got = sha256(path)
        if got != digest:
            raise CheckpointError(f"{path}: SHA-256 {got[:16]}... does not match the manifest's {digest[:16]}...")
    return directory


def target_dir() -> Path:
    return verify(TARGET)


def draft_dir(mode: str, quantization: str | None = None) -> Path | None:
    """The embedded draft for ``mode`` (None for mtp: its layers are in the target)."""
    if mode not in DRAFTS:
        raise CheckpointError(f"--speculative_decoding_mode: no embedded draft for mode {mode}")
    # with no NVFP4 copy shipped for the mode, its float draft (the build quantizes it, or names why not)
    name = NVFP4_DRAFTS.get(mode, DRAFTS[mode]) if quantization else DRAFTS[mode]
    return None if name is None else verify(name)


def write_manifest(names: list[str], extra: dict, root: Path = ROOT) -> dict:
    """Records the SHA-256 and size of every file of the named checkpoint directories under ``root``."""
    data = {"checkpoints": {}, **extra}
    for name in names:
        files = sorted(p for p in (root / name).iterdir() if p.is_file())
        data["checkpoints"][name] = {"files": {p.name: sha256(p) for p in files},
                                     "bytes": sum(p.stat().st_size for p in files)}
    data["total_bytes"] = sum(c["bytes"] for c in data["checkpoints"].values())
    (root / MANIFEST.name).write_text(json.dumps(data, indent=1) + "\n")
    return data
