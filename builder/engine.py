"""Engine directories: record each network, build it with TensorRT, write everything atomically.

An engine directory is self-contained:

    config.json          model + build configuration, source checkpoint hashes, TensorRT flavour,
                         the speculative mode and draft, and per engine its I/O tensor contract
    target.engine        the target: prefill and decode/verify-free chunks, the draft's features
    verify.engine        (speculative modes) the target scoring K+1 tokens, returning each Mamba
                         layer's chunk inputs (conv inputs, x, B, dt) for the rollback
    draft.engine         (speculative modes) the draft network
    weights/*.safetensors  the weights in the build dtype (the TorchRunner's input)
    tokenizer.json ...   the checkpoint's tokenizer files, when it has them
    (config.json 'files': each engine and weights file's size and sha256, see builder.integrity)
    build_report.json    per engine: layers, bytes, build time, the lowering each op got

The directory is written under a temporary name next to ``output_dir`` and renamed into place
only when everything succeeded, so a failed build leaves nothing behind.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from builder.atomic_dir import atomic_dir
from builder.checkpoint import TORCH_DTYPES, checkpoint_hash, convert_weights, load_checkpoint, load_nvfp4_checkpoint
from builder.errors import BuildError
from builder.integrity import record_files
from builder.models.nemotron_h import NemotronH

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
DTYPE_NAMES.update({torch.int32: "int32", torch.int64: "int64", torch.bool: "bool"})
MODES = ("draft_target", "eagle", "eagle3", "mtp", "dflash", "dspark", "peagle")


@dataclass(frozen=True)
class BuildOptions:
    max_batch_size: int = 8
    max_input_len: int = 512
    max_seq_len: int = 1024
    max_draft_len: int = 0
    dtype: str = "auto"
    speculative_decoding_mode: str | None = None
    # adaptive draft length defaults (runtime.draft_policy; generate/serve may override them)
    draft_len_schedule: str = ""
    draft_confidence_threshold: float = 0.0
    acceptance_rate_threshold: float = 0.0
    acceptance_rate_window_size: int = 8

    def validate(self):
        for name in ("max_batch_size", "max_input_len", "max_seq_len"):
            if getattr(self, name) < 1:
                raise BuildError(f"--{name}: expected a positive number, got {getattr(self, name)}")
        if self.max_draft_len < 0:
            raise BuildError(f"--max_draft_len: expected >= 0, got {self.max_draft_len}")
        if self.max_input_len > self.max_seq_len:
            raise BuildError(f"--max_input_len ({self.max_input_len}) exceeds --max_seq_len ({self.max_seq_len})")
        if self.dtype not in ("auto",) + tuple(TORCH_DTYPES):
            raise BuildError(f"--dtype: expected auto, float32, float16 or bfloat16, got {self.dtype}")
        mode = self.speculative_decoding_mode
        if mode is not None and mode not in MODES:
            raise BuildError(f"--speculative_decoding_mode: expected one of {', '.join(MODES)}, got {mode}")
        if mode is not None and self.max_draft_len < 1:
            raise BuildError(f"--max_draft_len: speculative mode {mode} needs K >= 1, got {self.max_draft_len}")
        if mode is not None and self.max_draft_len + 1 > self.max_input_len:
            raise BuildError(f"--max_draft_len ({self.max_draft_len}) + 1 exceeds --max_input_len ({self.max_input_len})")

    def resolve_dtype(self, checkpoint_dtype: str) -> str:
        return checkpoint_dtype if self.dtype == "auto" else self.dtype


# --- components: one network each -----------------------------------------------------------------
@dataclass
class Component:
    """One engine: its eager module, named inputs (dims may be named), how feeds call the module."""
    name: str
    module: object
    inputs: dict
    call: Callable[[dict], dict]
    profiles: list

    def contract(self, options: BuildOptions, outputs: dict) -> dict:
        ranges = []
        for p in self.profiles:
            shapes = {}
            for name, entry in self.inputs.items():
                dims = ["tokens" if d == "gathered" else d for d in entry["shape"]]
                shapes[name] = [list(_dims(dims, 1, 1, 1)),
                                list(_dims(dims, max(1, options.max_batch_size // 2), max(1, p["max_tokens"] // 2),
                                           max(1, options.max_seq_len // 2))),
                                list(_dims(dims, options.max_batch_size, p["max_tokens"], options.max_seq_len))]
            ranges.append(dict(p, shapes=shapes))
        state = {n[len("past."):]: e for n, e in self.inputs.items() if n.startswith("past.")}
        return {"file": f"{self.name}.engine", "inputs": self.inputs, "outputs": outputs, "state": state,
                "profiles": ranges}


def _dims(dims, batch, tokens, capacity):
    named = {"batch": batch, "tokens": tokens, "context": tokens, "capacity": capacity}
    return tuple(named.get(d, d) if isinstance(d, str) else d for d in dims)


def _chunk_inputs(module, extra=None):
    inputs = {
        "input_ids": {"shape": ["batch", "tokens"], "dtype": "int32"},
        "positions": {"shape": ["batch", "tokens"], "dtype": "int32"},
        "lengths": {"shape": ["batch"], "dtype": "int32"},
        "logit_index": {"shape": ["batch", "gathered"], "dtype": "int32"},
    }
    inputs.update(extra or {})
    for name, (shape, dtype) in module.state_spec("batch", "capacity").items():
        inputs["past." + name] = {"shape": list(shape), "dtype": DTYPE_NAMES[dtype]}
    return inputs


def _chunk_profiles(options: BuildOptions, small: int):
    out = [{"name": "decode", "max_tokens": small}] if small < options.max_input_len else []
    return out + [{"name": "prefill", "max_tokens": options.max_input_len}]


def _state_feeds(feeds):
    return {n[len("past."):]: v for n, v in feeds.items() if n.startswith("past.")}


def _outputs(logits, new_state, extra):
    out = {"logits": logits}
    out.update({"present." + n: v for n, v in new_state.items()})
    out.update(extra)
    return out


def target_component(module: NemotronH, options: BuildOptions, verify=False) -> Component:
    """The target engine (prefill + decode chunks) or, with ``verify``, the K+1-token verify engine."""
    def call(f):
        logits, new_state, features = module.forward(f["input_ids"], f["positions"], f["lengths"], f["logit_index"],
                                                     _state_feeds(f), verify=verify)
        return _outputs(logits, new_state, {"features." + n: v for n, v in features.items()})
    profiles = ([{"name": "verify", "max_tokens": options.max_draft_len + 1}] if verify
                else _chunk_profiles(options, options.max_draft_len + 1))
    return Component("verify" if verify else "target", module, _chunk_inputs(module), call, profiles)


def draft_component(module, options: BuildOptions) -> Component:
    """The draft engine: catch-up/proposal chunks up to K+1 tokens, prompt chunks up to max_input_len."""
    kind = getattr(module, "kind", "draft_target")
    profiles = _chunk_profiles(options, options.max_draft_len + 1)
    if kind == "draft_target":
        def call(f):
            logits, new_state, _ = module.forward(f["input_ids"], f["positions"], f["lengths"], f["logit_index"],
                                                  _state_feeds(f))
            return _outputs(logits, new_state, {})
        return Component("draft", module, _chunk_inputs(module), call, profiles)
    dtype = DTYPE_NAMES[module.dtype]
    hidden = {"hidden": {"shape": ["batch", "tokens", module.hidden_size], "dtype": dtype}}
    aux = {"aux": {"shape": ["batch", "tokens", module.aux_width], "dtype": dtype}} if hasattr(module, "aux_width") else {}
    if kind in ("dflash", "dspark"):
        # context rows (the verified tokens' target features) and the block run in one network
        extra = {"aux": {"shape": ["batch", "context", module.aux_width], "dtype": dtype},
                 "context_positions": {"shape": ["batch", "context"], "dtype": "int32"},
                 "context_lengths": {"shape": ["batch"], "dtype": "int32"}}

        def call(f):
            logits, new_state = module.forward(f["aux"], f["context_positions"], f["context_lengths"], f["input_ids"],
                                               f["positions"], f["lengths"], f["logit_index"], _state_feeds(f))
            return _outputs(logits, new_state, {})
        return Component("draft", module, _chunk_inputs(module, extra), call, profiles)
    if kind == "peagle":
        extra = dict(aux, is_mask={"shape": ["batch", "tokens"], "dtype": "int32"})

        def call(f):
            logits, new_state = module.forward(f["input_ids"], f["aux"], f["is_mask"], f["positions"], f["lengths"],
                                               f["logit_index"], _state_feeds(f))
            return _outputs(logits, new_state, {})
        return Component("draft", module, _chunk_inputs(module, extra), call, profiles)
    if kind == "eagle3":
        extra = {"aux_hidden": {"shape": ["batch", "tokens", module.aux_width],
                                "dtype": dtype},
                 **hidden, "from_target": {"shape": ["batch", "tokens"], "dtype": "int32"}}

        def call(f):
            logits, out, new_state = module.forward(f["input_ids"], f["aux_hidden"], f["hidden"], f["from_target"],
                                                    f["positions"], f["lengths"], f["logit_index"], _state_feeds(f))
            return _outputs(logits, new_state, {"hidden_out": out})
    else:
        extra = hidden

        def call(f):
            logits, out, new_state = module.forward(f["input_ids"], f["hidden"], f["positions"], f["lengths"],
                                                    f["logit_index"], _state_feeds(f))
            return _outputs(logits, new_state, {"hidden_out": out})
    return Component("draft", module, _chunk_inputs(module, extra), call, profiles)


def markov_component(module, options: BuildOptions) -> Component:
    """DSpark's Markov step: one draft row's logits + W2(W1[previous token]) (the FP4 head op)."""
    inputs = {"logits": {"shape": ["batch", "tokens", module.vocab_size], "dtype": "float32"},
              "prev_ids": {"shape": ["batch", "tokens"], "dtype": "int32"}}

    def call(f):
        return {"markov_logits": module.markov_logits(f["logits"], f["prev_ids"])}
    return Component("markov", module, inputs, call, [{"name": "step", "max_tokens": 1}])


def draft_components(module, options: BuildOptions) -> list[Component]:
    """Every engine a draft needs: the draft network, plus DSpark's Markov step when it has one."""
    out = [draft_component(module, options)]
    if getattr(module, "has_markov", False):
        out.append(markov_component(module, options))
    return out


def record(component: Component, native_plugins: bool = False):
    """Records a component's forward into a TensorRT network; returns (recorder, output dtypes).

    ``native_plugins`` lowers plugin ops to native layers even where plugin layers exist (the CPU
    interpreter evaluates native layers only).
    """
    from builder.backends.trt_backend import NetworkRecorder
    recorder = NetworkRecorder(name=component.name)
    recorder.native_plugins = native_plugins
    feeds = {}
    for name, entry in component.inputs.items():
        shape = [d if isinstance(d, int) else -1 for d in entry["shape"]]
        feeds[name] = recorder.add_input(name, TORCH_DTYPES.get(entry["dtype"]) or getattr(torch, entry["dtype"]), shape)
    outputs = component.call(feeds)
    for name, tensor in outputs.items():
        recorder.mark_output(name, tensor)
    return recorder, {name: DTYPE_NAMES[t.dtype] for name, t in outputs.items()}


# --- the build ------------------------------------------------------------------------------------
def build(checkpoint_dir, output_dir, options: BuildOptions, log=print, draft_dir=None,
          draft_quantization=None) -> dict:
    """Builds ENGINE_DIR from a checkpoint (and a draft); returns the build report.

    Raises NemospecError subclasses for bad input, before anything is written.
    """
    from builder import drafts
    from builder.backends import trt_build
    from builder.backends.trt_import import FLAVOUR, VERSION

    options.validate()
    mode = options.speculative_decoding_mode
    started = time.perf_counter()
    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    log(f"reading checkpoint {checkpoint_dir}")
    from builder import quantization  # an NVFP4 checkpoint keeps its linears packed: FP4 constants in the engine
    if quantization.is_nvfp4_checkpoint(checkpoint_dir):
        config, weights = load_nvfp4_checkpoint(checkpoint_dir, keep_quantized=True)
    else:
        config, weights = load_checkpoint(checkpoint_dir)
    dtype_name = options.resolve_dtype(config.dtype)
    dtype = TORCH_DTYPES[dtype_name]
    weights = convert_weights(weights, dtype)
    if draft_quantization and not mode:
        raise BuildError("--quantization: quantizes the draft; it needs --speculative_decoding_mode")
    draft = drafts.load_draft(mode, config, weights, draft_dir, dtype, log, draft_quantization) if mode else None
    target = NemotronH(config, weights, dtype, **(draft.target_features if draft else {}))
    components = [target_component(target, options)]
    if draft:
        components += [target_component(target, options, verify=True), *draft_components(draft.module, options)]

    contracts, report_engines, blobs = {}, {}, {}
    for n, component in enumerate(components, 1):
        log(f"[{n}/{len(components)}] recording {component.name} network")
        recorder, outputs = record(component)
        contract = component.contract(options, outputs)
        layers = recorder.network.num_layers
        log(f"[{n}/{len(components)}] building {component.name}.engine with {FLAVOUR} {VERSION} "
            f"({layers} layers, {len(contract['profiles'])} optimization profiles)")
        t0 = time.perf_counter()
        blobs[component.name] = trt_build.build_engine_bytes(recorder, [p["shapes"] for p in contract["profiles"]])
        contracts[component.name] = contract
        report_engines[component.name] = {
            "layers": layers,
            "engine_bytes": len(blobs[component.name]),
            "build_seconds": round(time.perf_counter() - t0, 3),
            "profiles": [{"name": p["name"], "max_tokens": p["max_tokens"]} for p in contract["profiles"]],
            "lowerings": dict(recorder.lowerings),
        }
        del recorder

    log(f"writing {output_dir}")
    weight_files = {"target": quantization.dequantize_weights(weights)}  # the TorchRunner's, in the build dtype
    if draft and draft.weights is not None:
        weight_files["draft"] = draft.weights
    with atomic_dir(output_dir) as tmp:
        for name, blob in blobs.items():
            (tmp / f"{name}.engine").write_bytes(blob)
        (tmp / "weights").mkdir()
        for name, tensors in weight_files.items():
            save_file(tensors, str(tmp / "weights" / f"{name}.safetensors"))
        tokenizer = [f for f in TOKENIZER_FILES if (checkpoint_dir / f).is_file()]
        for f in tokenizer:
            shutil.copy2(checkpoint_dir / f, tmp / f)
        meta = {
            "format": "nemospec-engine-dir/1",
            "source": {"checkpoint_dir": str(checkpoint_dir.resolve()), "sha256": checkpoint_hash(checkpoint_dir)},
            "model": config.to_dict(),
            "build": dict(asdict(options), dtype=dtype_name),
            "tensorrt": {"flavour": FLAVOUR, "version": VERSION},
            "tokenizer": "tokenizer.json" if "tokenizer.json" in tokenizer else None,
            "speculative": draft.meta if draft else None,
            "engines": contracts,
            "files": record_files(tmp),   # sizes + sha256, checked by serve/generate (builder.integrity)
        }
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
        weight_bytes = {n: sum(w.numel() * w.element_size() for w in t.values()) for n, t in weight_files.items()}
        report = {
            "engines": report_engines,
            "weight_bytes": weight_bytes,
            "speculative_decoding_mode": mode,
            "tensorrt": {"flavour": FLAVOUR, "version": VERSION},
            "dtype": dtype_name,
            "total_seconds": round(time.perf_counter() - started, 3),
        }
        (tmp / "build_report.json").write_text(json.dumps(report, indent=2))
    return report
