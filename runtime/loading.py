"""Open a checkpoint or an engine directory: the target runner, the draft, what generation needs."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from builder.config import NemotronHConfig
from builder.drafts import draft_from_engine_dir
from builder.engine import TORCH_DTYPES, BuildOptions, draft_component, draft_components, target_component
from builder.errors import NemospecError
from builder.models.nemotron_h import NemotronH
from runtime.drafts import EagerDraft
from runtime.engine_runner import EngineDraft, EngineRunner, InterpretedExecutor, TensorRTExecutor
from runtime.proposers import BlockDraftProposer, FeatureDraftProposer, ModelDraftProposer, ParallelDraftProposer
from runtime.runner import TorchRunner

BACKENDS = ("auto", "torch", "tensorrt", "interpreter")


@dataclass
class Loaded:
    runner: object
    config: NemotronHConfig
    tokenizer_path: Path | None
    max_seq_len: int
    max_input_len: int
    backend: str
    speculative: dict | None = None
    max_draft_len: int = 0
    max_batch_size: int = 8
    _proposer: object = field(default=None, repr=False)

    def proposer(self):
        """A fresh proposer for one generate call (None without a speculative mode)."""
        return None if self._proposer is None else self._proposer()


def tensorrt_available() -> bool:
    """A CUDA GPU (seen by torch, which allocates the engine's buffers): where engines execute."""
    return torch.cuda.is_available()


def _device(device):
    return "cuda" if device == "cuda" or (device is None and torch.cuda.is_available()) else "cpu"


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
    if "target" not in meta.get("engines", {}):
        raise NemospecError(f"{meta_path}: field 'engines.target' missing; not a nemospec engine directory")
    if backend not in BACKENDS:
        raise NemospecError(f"--backend: expected one of {', '.join(BACKENDS)}, got {backend}")
    if backend == "auto":
        backend = "tensorrt" if tensorrt_available() else "torch"
    config = NemotronHConfig.from_dict(meta["model"])
    build, spec = meta["build"], meta.get("speculative")
    dtype = TORCH_DTYPES[build["dtype"]]
    device = "cuda" if backend == "tensorrt" else _device(device) if backend == "torch" else "cpu"
    weights = load_file(str(engine_dir / "weights" / "target.safetensors"))
    draft = None
    if spec:
        draft_file = engine_dir / "weights" / "draft.safetensors"
        draft_weights = load_file(str(draft_file)) if draft_file.is_file() else None
        draft = draft_from_engine_dir(spec, config, weights, draft_weights, dtype)
    features = {}
    if draft is not None:
        kind = getattr(draft, "kind", "draft_target")
        features = ({"final_hidden": True} if kind in ("eagle", "mtp")
                    else {} if kind == "draft_target" else {"capture_layers": draft.target_layer_ids
                                                            if hasattr(draft, "target_layer_ids") else draft.aux_layer_ids})
    target = NemotronH(config, weights, dtype, **features)
    options = BuildOptions(**{k: v for k, v in build.items() if k != "dtype"})
    engines = meta["engines"]

    def executor(component):
        return (TensorRTExecutor(engine_dir, engines[component.name]) if backend == "tensorrt"
                else InterpretedExecutor(component))

    if backend == "torch":
        runner = TorchRunner(target, device)
    else:
        runner = EngineRunner(config, dtype, device, executor(target_component(target, options)), engines["target"],
                              executor(target_component(target, options, verify=True)) if spec else None)
    proposer = None
    if draft is not None:
        kind = getattr(draft, "kind", "draft_target")
        chunk = build["max_input_len"]
        if kind == "draft_target":
            if backend == "torch":
                draft_runner = TorchRunner(draft, device)
            else:
                component = draft_component(draft, options)
                draft_runner = EngineRunner(draft.cfg, dtype, device, executor(component), engines["draft"])
            proposer = lambda: ModelDraftProposer(draft_runner, chunk)  # noqa: E731
        else:
            if backend == "torch":
                stepper = EagerDraft(draft, config.vocab_size, device)
            else:
                stepper = EngineDraft(draft, config.vocab_size,
                                      {c.name: executor(c) for c in draft_components(draft, options)},
                                      engines["draft"], device)
            kinds = {"dflash": BlockDraftProposer, "dspark": BlockDraftProposer, "peagle": ParallelDraftProposer}
            make = kinds.get(kind, FeatureDraftProposer)
            proposer = lambda: make(stepper, chunk)  # noqa: E731
    tok = engine_dir / meta["tokenizer"] if meta.get("tokenizer") else None
    return Loaded(runner, config, tok, build["max_seq_len"], build["max_input_len"], backend, spec,
                  build.get("max_draft_len", 0), build["max_batch_size"], proposer)
