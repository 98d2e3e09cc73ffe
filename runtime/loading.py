"""Open a checkpoint or an engine directory as a runner plus what generation needs to know."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from builder.config import NemotronHConfig
from builder.engine import TORCH_DTYPES
from builder.errors import NemospecError
from builder.models.nemotron_h import NemotronH
from runtime.runner import InterpreterRunner, TensorRTRunner, TorchRunner


@dataclass
class Loaded:
    runner: object
    config: NemotronHConfig
    tokenizer_path: Path | None
    max_seq_len: int
    max_input_len: int
    backend: str


def tensorrt_available() -> bool:
    """A CUDA GPU (seen by torch, which allocates the engine's buffers): where engines execute."""
    return torch.cuda.is_available()


def _device(backend_device):
    return "cuda" if backend_device == "cuda" or (backend_device is None and torch.cuda.is_available()) else "cpu"


def open_checkpoint(checkpoint_dir, dtype="auto", device=None) -> Loaded:
    from builder.checkpoint import load_checkpoint
    config, weights = load_checkpoint(checkpoint_dir)
    name = config.dtype if dtype == "auto" else dtype
    module = NemotronH(config, weights, TORCH_DTYPES[name])
    tok = Path(checkpoint_dir) / "tokenizer.json"
    return Loaded(TorchRunner(module, _device(device)), config, tok if tok.is_file() else None,
                  1 << 30, 1 << 30, "torch")


def open_engine_dir(engine_dir, backend="auto", device=None) -> Loaded:
    engine_dir = Path(engine_dir)
    meta_path = engine_dir / "config.json"
    if not meta_path.is_file():
        raise NemospecError(f"{meta_path}: missing; is {engine_dir} an engine directory built by `nemospec build`?")
    meta = json.loads(meta_path.read_text())
    if "engines" not in meta or "target" not in meta["engines"]:
        raise NemospecError(f"{meta_path}: field 'engines.target' missing; not a nemospec engine directory")
    config = NemotronHConfig.from_dict(meta["model"])
    build = meta["build"]
    if backend == "auto":
        backend = "tensorrt" if tensorrt_available() else "torch"
    if backend == "tensorrt":
        runner = TensorRTRunner(engine_dir)
    elif backend in ("torch", "interpreter"):
        weights = load_file(str(engine_dir / "weights" / "target.safetensors"))
        module = NemotronH(config, weights, TORCH_DTYPES[build["dtype"]])
        runner = (TorchRunner(module, _device(device)) if backend == "torch"
                  else InterpreterRunner(module, meta["engines"]["target"]))
    else:
        raise NemospecError(f"--backend: expected auto, torch, tensorrt or interpreter, got {backend}")
    tok = engine_dir / meta["tokenizer"] if meta.get("tokenizer") else None
    return Loaded(runner, config, tok, build["max_seq_len"], build["max_input_len"], backend)
