"""Open a checkpoint or an engine directory: the target runner, the draft, what generation needs."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
from builder.safetensors_io import mmap_tensors as load_file  # memory-mapped: pages read when used

from builder import quantization
from builder.config import NemotronHConfig
from builder.drafts import draft_from_engine_dir
from builder.engine import (TORCH_DTYPES, BuildOptions, check_matmul_precision, draft_component, draft_components,
                            target_component, tree_verify_component)
from builder.errors import NemospecError
from runtime.engine_meta import check_tensorrt_match, read_engine_meta
from builder.models.nemotron_h import NemotronH
from runtime.draft_policy import policy_from
from runtime.drafts import EagerDraft
from runtime.engine_runner import EngineDraft, EngineRunner, InterpretedExecutor, TensorRTExecutor
from runtime.block_proposers import BlockDraftProposer, ParallelDraftProposer
from runtime.proposers import FeatureDraftProposer, ModelDraftProposer
from runtime.placement import place
from runtime.runner import TorchRunner

BACKENDS = ("auto", "torch", "compiled", "tensorrt", "interpreter")
# Under this many generated tokens, loading the compiled graphs (seconds each, even from the on-disk
# cache) costs more than they save (~3 ms per step on the embedded model): `generate --backend auto`
# then runs eagerly.
AUTO_COMPILE_MIN_TOKENS = 2048


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
    draft_policy: object = None       # runtime.draft_policy.DraftPolicy (None: always draft max_draft_len)
    build_options: dict = field(default_factory=dict)   # an engine directory's recorded build options

    def proposer(self):
        """A fresh proposer for one generate call (None without a speculative mode)."""
        return None if self._proposer is None else self._proposer()


def tensorrt_available() -> bool:
    """A CUDA GPU (seen by torch, which allocates the engine's buffers) and full TensorRT to run engines
    on it: where ``auto`` picks engines. A GPU without it (the lent H200's image, or one with only the
    ``tensorrt_rtx`` that `make setup` installs, whose runtime supports RTX GPUs, not Hopper) runs the
    torch paths; ``--backend tensorrt`` still runs tensorrt_rtx engines where that runtime works."""
    if not torch.cuda.is_available():
        return False
    try:
        from builder.backends.trt_import import FLAVOUR
    except ImportError:
        return False
    return FLAVOUR == "tensorrt"


def _device(device):
    return "cuda" if device == "cuda" or (device is None and torch.cuda.is_available()) else "cpu"


PROPOSERS = {"dflash": BlockDraftProposer, "dspark": BlockDraftProposer, "peagle": ParallelDraftProposer}


def _draft_kind(draft) -> str:
    return getattr(draft, "kind", "draft_target")


def _target_features(draft) -> dict:
    kind = _draft_kind(draft)
    if kind in ("eagle", "mtp"):
        return {"final_hidden": True}
    if kind == "draft_target":
        return {}
    return {"capture_layers": draft.target_layer_ids if hasattr(draft, "target_layer_ids") else draft.aux_layer_ids}


def resolve_backend(backend: str, engine_dir: bool = True, tokens: int | None = None) -> str:
    """``auto``: TensorRT for an engine directory where a CUDA GPU and TensorRT are, else the compiled
    path (on the GPU when there is one: on an H200 it ran the embedded model at 845 tokens/s against
    eager's 128-245), or eager torch for a job of fewer than ``AUTO_COMPILE_MIN_TOKENS`` generated
    tokens (``tokens``, when the caller knows it)."""
    if backend not in BACKENDS:
        raise NemospecError(f"--backend: expected one of {', '.join(BACKENDS)}, got {backend}")
    if backend != "auto":
        return backend
    if engine_dir and tensorrt_available():
        return "tensorrt"
    return "torch" if tokens is not None and tokens < AUTO_COMPILE_MIN_TOKENS else "compiled"


def _eager_proposer(draft, vocab_size: int, device, chunk: int, compiled: bool = False, max_draft_len: int = 4,
                    weight_dtype: str = "auto", matmul_precision: str = "highest"):
    """The draft run eagerly, or with ``compiled`` through ``runtime.compiled`` (its short steps
    compiled, its weights rounded to bf16 there with ``weight_dtype="bfloat16"``, its products'
    inputs with ``matmul_precision="medium"``)."""
    if compiled:
        from runtime.compiled.draft import CompiledDraft
        from runtime.compiled.runner import CompiledRunner
        draft = quantization.dequantized_module(draft)   # FP4 weights once, not per call: one graph per step
    if _draft_kind(draft) == "draft_target":
        runner = (CompiledRunner(draft, device, weight_dtype=weight_dtype, matmul_precision=matmul_precision, role="draft")
                  if compiled else TorchRunner(draft, device))
        return lambda: ModelDraftProposer(runner, chunk)
    stepper = (CompiledDraft(draft, vocab_size, device, max_draft_len, weight_dtype, matmul_precision) if compiled
               else EagerDraft(draft, vocab_size, device))
    make = PROPOSERS.get(_draft_kind(draft), FeatureDraftProposer)
    return lambda: make(stepper, chunk)


def place_rollback(target, device) -> None:
    """What the target's host-side rollback reads besides the states (each Mamba layer's A) onto the
    engines' device: the engines hold every weight, and the rollback of their CUDA states met a CPU A
    (the whole module is not moved: it would be a second copy of the model on the GPU)."""
    for kind, _, mixer in target.layers:
        if kind == "mamba":
            mixer.A = mixer.A.to(device)


def _place_modules(device, target, draft=None) -> None:
    """The target's and the draft's weights onto a GPU, once; what they share stays shared."""
    if device != "cpu":
        moved: dict = {}
        for module in (draft, target):
            if module is not None:
                place(module, device, moved)


def open_checkpoint(checkpoint_dir, dtype="auto", device=None, mode=None, draft_dir=None, quantization=None,
                    max_draft_len: int = 4, prefill_chunk: int = 512, backend: str = "torch",
                    draft_weight_dtype: str = "auto", matmul_precision: str = "highest", token_map=None) -> Loaded:
    """Eager (torch) runner of a checkpoint, or with ``backend="compiled"`` (``auto`` on a machine
    without a GPU) the compiled CPU path; with ``mode`` also its draft, read from ``draft_dir``
    (speculative decoding without building engines). ``draft_weight_dtype="bfloat16"``: the compiled
    path's draft multiplies by its weights rounded to bf16; ``matmul_precision="medium"``: the
    compiled path's fp32 products round x and w to bf16 (``BuildOptions.matmul_precision``);
    ``token_map``: the draft's LM head cut to those target tokens (``builder.token_map``)."""
    check_matmul_precision(matmul_precision)
    backend = resolve_backend(backend, engine_dir=False)
    if backend not in ("torch", "compiled"):
        raise NemospecError(f"--backend {backend} needs --engine_dir (build one with `nemospec build`)")
    from builder.checkpoint import check_finite_weights, load_checkpoint
    from builder.drafts import load_draft
    config, weights = load_checkpoint(checkpoint_dir)
    torch_dtype = TORCH_DTYPES[config.dtype if dtype == "auto" else dtype]
    check_finite_weights(checkpoint_dir, weights, torch_dtype)
    device = _device(device)
    draft = spec = proposer = None
    if mode is not None:
        draft = load_draft(mode, config, weights, draft_dir, torch_dtype, log=lambda m: None, quantization=quantization,
                           token_map=token_map, own_storage=backend == "compiled")
        spec = draft.meta
        proposer = _eager_proposer(draft.module, config.vocab_size, device, prefill_chunk, backend == "compiled",
                                   max_draft_len, draft_weight_dtype, matmul_precision)
    module = NemotronH(config, weights, torch_dtype, **(draft.target_features if draft else {}))
    _place_modules(device, module, draft.module if draft else None)
    tok = Path(checkpoint_dir) / "tokenizer.json"
    if backend == "compiled":
        from runtime.compiled.runner import CompiledRunner
        runner = CompiledRunner(module, device, max_draft_len, matmul_precision=matmul_precision)
    else:
        runner = TorchRunner(module, device)
    return Loaded(runner, config, tok if tok.is_file() else None,
                  1 << 30, 1 << 30, backend, spec, max_draft_len if mode else 0, 8, proposer)


def _check_verify_contract(meta: dict, meta_path: Path, config: NemotronHConfig) -> None:
    """A verify engine must keep each Mamba layer's chunk inputs (what the rollback reads); one built
    by an older nemospec returned per-position states instead."""
    verify = meta["engines"].get("verify")
    if verify is None or "mamba" not in config.layer_types:
        return
    if not any(name.endswith(".ssm_x") for name in verify.get("outputs", {})):
        raise NemospecError(f"{meta_path}: engines.verify has no '*.ssm_x' outputs (built by an older nemospec, whose "
                            "verify returned per-position states); rebuild the engine directory with `nemospec build`")


def _check_model_fields(meta_path: Path, config, weights: dict) -> None:
    """The recorded model's sizes against the weights they describe: a damaged vocab_size read ids
    past the embedding (an IndexError from inside torch)."""
    for name, fields in (("backbone.embeddings.weight", ("vocab_size", "hidden_size")),
                         ("backbone.norm_f.weight", ("hidden_size",))):
        want = tuple(getattr(config, f) for f in fields)
        got = tuple(weights[name].shape) if name in weights else None
        if got != want:
            raise NemospecError(f"{meta_path}: field 'model.{'/'.join(fields)}' {list(want)} does not match weights/"
                                f"target.safetensors' {name} {list(got) if got else 'missing'}; rebuild the engine directory")


def open_engine_dir(engine_dir, backend="auto", device=None, matmul_precision: str | None = None) -> Loaded:
    """An engine directory's runner and proposer; ``matmul_precision`` overrides its build's (the
    compiled backend's products)."""
    engine_dir = Path(engine_dir)
    meta_path = engine_dir / "config.json"
    if not meta_path.is_file():
        raise NemospecError(f"{meta_path}: missing; is {engine_dir} an engine directory built by `nemospec build`?")
    meta = read_engine_meta(meta_path, TORCH_DTYPES)
    backend = resolve_backend(backend)
    if backend == "tensorrt":   # once, before any engine is deserialized (TensorRT's own error names neither)
        from builder.backends.trt_import import FLAVOUR, VERSION
        check_tensorrt_match(meta_path, meta, FLAVOUR, VERSION)
    try:
        config = NemotronHConfig.from_dict(meta["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise NemospecError(f"{meta_path}: field 'model': {type(e).__name__}: {e}; rebuild the engine directory") from None
    _check_verify_contract(meta, meta_path, config)
    build, spec = meta["build"], meta.get("speculative")
    if matmul_precision is not None:
        check_matmul_precision(matmul_precision)
        build = dict(build, matmul_precision=matmul_precision)
    dtype = TORCH_DTYPES[build["dtype"]]
    device = "cuda" if backend == "tensorrt" else _device(device) if backend in ("torch", "compiled") else "cpu"
    weights = load_file(str(engine_dir / "weights" / "target.safetensors"))
    if meta.get("weights_format") == quantization.FORMAT_NAME:  # NVFP4 as stored (--strip_plan): dequantized
        weights = quantization.dequantize_tensors(weights, dtype=dtype, where=str(engine_dir / "weights"))
    _check_model_fields(meta_path, config, weights)
    draft = None
    if spec:
        draft_file = engine_dir / "weights" / "draft.safetensors"
        if spec["mode"] != "mtp" and not draft_file.is_file():   # MTP's layers are in the target's file
            raise NemospecError(f"{draft_file}: missing; the engine directory is incomplete, rebuild it")
        draft_weights = load_file(str(draft_file)) if draft_file.is_file() else None
        try:
            draft = draft_from_engine_dir(spec, config, weights, draft_weights, dtype, own_storage=backend == "compiled")
        except (RuntimeError, KeyError, TypeError, ValueError) as e:   # its recorded config and its weights disagree
            raise NemospecError(f"{meta_path}: field 'speculative.draft' does not fit {draft_file.name} "
                                f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); rebuild the engine directory") from None
    target = NemotronH(config, weights, dtype, **(_target_features(draft) if draft is not None else {}))
    if backend in ("torch", "compiled"):
        _place_modules(device, target, draft)
    unknown = sorted(set(build) - {f.name for f in dataclasses.fields(BuildOptions)})
    if unknown:   # BuildOptions(**build) raised a TypeError
        raise NemospecError(f"{meta_path}: field 'build.{unknown[0]}': not a build option of this nemospec (an engine "
                            "directory of a newer version?); rebuild it with this one")
    options = BuildOptions(**{k: v for k, v in build.items() if k != "dtype"})
    engines = meta["engines"]

    def executor(component):
        return (TensorRTExecutor(engine_dir, engines[component.name]) if backend == "tensorrt"
                else InterpretedExecutor(component))

    if backend == "torch":
        runner = TorchRunner(target, device)
    elif backend == "compiled":  # the engine directory's weights and module, compiled for the CPU
        from runtime.compiled.runner import CompiledRunner
        runner = CompiledRunner(target, device, build.get("max_draft_len", 0),
                                matmul_precision=build.get("matmul_precision", "highest"))
    else:
        tree = "tree_verify" in engines   # built with --tree_engines
        runner = EngineRunner(config, dtype, device, executor(target_component(target, options)), engines["target"],
                              executor(target_component(target, options, verify=True)) if spec else None,
                              rollback=target.rollback,
                              tree=executor(tree_verify_component(target, options)) if tree else None,
                              tree_rollback=target.tree_rollback)
        if backend == "tensorrt":   # after the executors, which say first what this machine lacks
            place_rollback(target, device)
    proposer = None
    if draft is not None:
        chunk = build["max_input_len"]
        if backend in ("torch", "compiled"):
            proposer = _eager_proposer(draft, config.vocab_size, device, chunk, backend == "compiled",
                                       build.get("max_draft_len", 0), build.get("draft_weight_dtype", "auto"),
                                       build.get("matmul_precision", "highest"))
        elif _draft_kind(draft) == "draft_target":
            draft_runner = EngineRunner(draft.cfg, dtype, device, executor(draft_component(draft, options)),
                                        engines["draft"], tree=executor(tree_verify_component(draft, options, "draft_tree"))
                                        if tree else None)
            proposer = lambda: ModelDraftProposer(draft_runner, chunk)  # noqa: E731
        else:
            stepper = EngineDraft(draft, config.vocab_size,
                                  {c.name: executor(c) for c in draft_components(draft, options, tree=tree)},
                                  engines["draft"], device)
            make = PROPOSERS.get(_draft_kind(draft), FeatureDraftProposer)
            proposer = lambda: make(stepper, chunk)  # noqa: E731
    tok = engine_dir / meta["tokenizer"] if meta.get("tokenizer") else None
    policy = policy_from(build["max_draft_len"], build) if spec else None
    return Loaded(runner, config, tok, build["max_seq_len"], build["max_input_len"], backend, spec,
                  build.get("max_draft_len", 0), build["max_batch_size"], proposer, policy, dict(build))
