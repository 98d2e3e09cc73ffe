"""Engine directories: record the network, build it with TensorRT, write everything atomically.

An engine directory is self-contained:

    config.json          model + build configuration, source checkpoint hash, TensorRT flavour,
                         and per engine its I/O tensor contract and optimization profiles
    target.engine        the serialized TensorRT engine
    weights/target.safetensors   the weights converted to the build dtype (the TorchRunner's input)
    tokenizer.json ...   the checkpoint's tokenizer files, when it has them
    build_report.json    layer count, bytes, build time, flavour, the lowering each op got

The directory is written under a temporary name next to ``output_dir`` and renamed into place
only when everything succeeded, so a failed build leaves nothing behind.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from builder.checkpoint import checkpoint_hash, load_checkpoint
from builder.errors import BuildError
from builder.models.nemotron_h import NemotronH

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
DTYPE_NAMES.update({torch.int32: "int32", torch.int64: "int64", torch.bool: "bool"})
CHUNK_INPUTS = ("input_ids", "positions", "lengths", "logit_index")
# Tensors kept in fp32 whatever the build dtype (as transformers keeps them).
FP32_TENSORS = ("A_log", ".D", "gate.weight", "e_score_correction_bias")


@dataclass(frozen=True)
class BuildOptions:
    max_batch_size: int = 8
    max_input_len: int = 512
    max_seq_len: int = 1024
    max_draft_len: int = 0
    dtype: str = "auto"

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

    def resolve_dtype(self, checkpoint_dtype: str) -> str:
        return checkpoint_dtype if self.dtype == "auto" else self.dtype


def convert_weights(weights: dict, dtype: torch.dtype) -> dict:
    """Checkpoint tensors in the build dtype (fp32-only tensors stay fp32), contiguous for saving."""
    out = {}
    for name, w in weights.items():
        keep = any(name.endswith(s) for s in FP32_TENSORS) and w.is_floating_point()
        out[name] = (w.float() if keep else w.to(dtype)).contiguous()
    return out


def profiles(options: BuildOptions) -> list[dict]:
    """Decode/verify chunks (1..max_draft_len+1 tokens) and prefill chunks (..max_input_len)."""
    small = options.max_draft_len + 1
    out = []
    if small < options.max_input_len:
        out.append({"name": "decode", "max_tokens": small})
    out.append({"name": "prefill", "max_tokens": options.max_input_len})
    return out


def _dims(dims, batch, tokens, capacity):
    return tuple(batch if d == "batch" else tokens if d == "tokens" else capacity if d == "capacity" else d
                 for d in dims)


def io_contract(module: NemotronH, options: BuildOptions) -> dict:
    """Symbolic I/O of the target engine: names, dims (named when dynamic) and dtypes."""
    spec = module.state_spec("batch", "capacity")
    inputs = {
        "input_ids": {"shape": ["batch", "tokens"], "dtype": "int32"},
        "positions": {"shape": ["batch", "tokens"], "dtype": "int32"},
        "lengths": {"shape": ["batch"], "dtype": "int32"},
        "logit_index": {"shape": ["batch", "gathered"], "dtype": "int32"},
    }
    state = {}
    for name, (shape, dtype) in spec.items():
        state[name] = {"shape": list(shape), "dtype": DTYPE_NAMES[dtype]}
        inputs["past." + name] = state[name]
    outputs = {"logits": "float32"}
    outputs.update({"present." + n: s["dtype"] for n, s in state.items()})
    shapes = []
    for p in profiles(options):
        ranges = {}
        for name, entry in inputs.items():
            dims = [d if d != "gathered" else "tokens" for d in entry["shape"]]
            lo = _dims(dims, 1, 1, 1)
            opt = _dims(dims, max(1, options.max_batch_size // 2), max(1, p["max_tokens"] // 2),
                        max(1, options.max_seq_len // 2))
            hi = _dims(dims, options.max_batch_size, p["max_tokens"], options.max_seq_len)
            ranges[name] = [list(lo), list(opt), list(hi)]
        shapes.append(dict(p, shapes=ranges))
    return {"file": "target.engine", "inputs": inputs, "outputs": outputs, "state": state, "profiles": shapes}


def record_target(module: NemotronH, contract: dict):
    """Records the target's forward into a TensorRT network; returns the recorder."""
    from builder.backends.trt_backend import NetworkRecorder
    recorder = NetworkRecorder()
    feeds = {}
    for name, entry in contract["inputs"].items():
        shape = [d if isinstance(d, int) else -1 for d in entry["shape"]]
        feeds[name] = recorder.add_input(name, TORCH_DTYPES.get(entry["dtype"], getattr(torch, entry["dtype"])), shape)
    state = {n: feeds["past." + n] for n in contract["state"]}
    logits, new_state, _ = module.forward(feeds["input_ids"], feeds["positions"], feeds["lengths"],
                                       feeds["logit_index"], state)
    recorder.mark_output("logits", logits)
    for name, tensor in new_state.items():
        recorder.mark_output("present." + name, tensor)
    return recorder


def _replace_dir(tmp: Path, final: Path):
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{time.time_ns()}")
        final.rename(old)
    tmp.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def build(checkpoint_dir, output_dir, options: BuildOptions, log=print) -> dict:
    """Builds ENGINE_DIR from a checkpoint; returns the build report. Raises NemospecError subclasses."""
    from builder.backends import trt_build
    from builder.backends.trt_import import FLAVOUR, VERSION

    options.validate()
    started = time.perf_counter()
    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    log(f"[1/4] reading checkpoint {checkpoint_dir}")
    config, weights = load_checkpoint(checkpoint_dir)
    dtype_name = options.resolve_dtype(config.dtype)
    weights = convert_weights(weights, TORCH_DTYPES[dtype_name])
    module = NemotronH(config, weights, TORCH_DTYPES[dtype_name])
    contract = io_contract(module, options)

    log(f"[2/4] recording the network ({config.num_layers} layers: {config.hybrid_override_pattern}, {dtype_name})")
    recorder = record_target(module, contract)
    num_layers = recorder.network.num_layers

    log(f"[3/4] building target.engine with {FLAVOUR} {VERSION} ({num_layers} layers, "
        f"{len(contract['profiles'])} optimization profiles)")
    build_started = time.perf_counter()
    engine_bytes = trt_build.build_engine_bytes(recorder, [p["shapes"] for p in contract["profiles"]])
    build_seconds = time.perf_counter() - build_started

    log(f"[4/4] writing {output_dir}")
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_dir.with_name(f".{output_dir.name}.tmp-{time.time_ns()}")
    try:
        tmp.mkdir()
        (tmp / "target.engine").write_bytes(engine_bytes)
        (tmp / "weights").mkdir()
        save_file(weights, str(tmp / "weights" / "target.safetensors"))
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
            "engines": {"target": contract},
        }
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
        report = {
            "engines": {"target": {
                "layers": num_layers,
                "engine_bytes": len(engine_bytes),
                "weight_bytes": sum(w.numel() * w.element_size() for w in weights.values()),
                "build_seconds": round(build_seconds, 3),
                "profiles": [{"name": p["name"], "max_tokens": p["max_tokens"]} for p in contract["profiles"]],
                "lowerings": dict(recorder.lowerings),
            }},
            "tensorrt": {"flavour": FLAVOUR, "version": VERSION},
            "dtype": dtype_name,
            "total_seconds": round(time.perf_counter() - started, 3),
        }
        (tmp / "build_report.json").write_text(json.dumps(report, indent=2))
        _replace_dir(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report
