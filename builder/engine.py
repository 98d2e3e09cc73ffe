"""Engine directories: record each network, build it with TensorRT, write everything atomically.

An engine directory is self-contained:

    config.json          model + build configuration, source checkpoint hashes, TensorRT flavour,
                         the speculative mode and draft, and per engine its I/O tensor contract
    target.engine        the target: prefill and decode/verify-free chunks, the draft's features
    verify.engine        (speculative modes) the target scoring K+1 tokens, returning each Mamba
                         layer's chunk inputs (conv inputs, x, B, dt) for the rollback
    draft.engine         (speculative modes) the draft network
    tree_verify.engine   (--tree_engines) the target scoring a token tree of up to max_tree_nodes + 1
                         rows (parents and ancestor mask as inputs), keeping the same rollback inputs
    draft_tree.engine    (--tree_engines, chain drafts) the draft's step over a tree frontier (eagle,
                         eagle3, mtp: rows written at given slots, attending where ``visible`` says;
                         draft_target: the draft NemotronH's own tree forward)
    weights/*.safetensors  the weights in the build dtype, written once (the TorchRunner's input, and
                         with --strip_plan every engine's: they hold no weights; an NVFP4 target's
                         then stays packed, config.json 'weights_format', dequantized at load)
    refit_map.json       (--strip_plan) per engine: each weight -> the safetensors tensors that fill it
    tokenizer.json ...   the checkpoint's tokenizer files, when it has them
    (config.json 'files': each engine and weights file's size and sha256, see builder.integrity)
    build_report.json    per engine: layers, bytes, build time, the lowering each op got

The directory is written under a temporary name next to ``output_dir`` and renamed into place
only when everything succeeded, so a failed build leaves nothing behind.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from builder.atomic_dir import atomic_dir
from builder.checkpoint import (TORCH_DTYPES, check_finite_weights, checkpoint_hash, convert_weights,
                                load_checkpoint, load_nvfp4_checkpoint)
from builder.errors import BuildError
from builder.integrity import record_files
from builder.models.nemotron_h import NemotronH
from builder.tokenizer_file import load_tokenizer, read_tokenizer_config

def is_engine_dir(path) -> bool:
    """Whether ``path`` holds an engine directory `nemospec build` wrote (its config.json's format)."""
    try:
        return str(json.loads((Path(path) / "config.json").read_text()).get("format", "")).startswith(
            "nemospec-engine-dir/")
    except (OSError, ValueError, AttributeError):
        return False


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
    draft_len_adaptive: bool = False
    # tree speculation defaults (runtime.tree.draft; generate/serve --tree turns it on)
    max_tree_nodes: int = 16
    tree_topk: int = 0          # 0: by draft kind (runtime.tree.draft.default_topk)
    tree_depth: int = 0                 # 0: max_draft_len
    tree_engines: bool = False          # also build tree_verify.engine (+ draft_tree.engine): --tree on TensorRT
    # scale: weight-stripped refittable engines, a host-memory limit, a trial build of the first layers
    strip_plan: bool = False
    max_host_memory_gb: float = 0.0     # 0: the machine's available memory
    num_layers: int = 0                 # 0: every layer
    # the compiled CPU path's draft: its products by weights rounded to bf16 (half the bytes per
    # proposal; the speculative output is the target's either way). auto: the model's dtype.
    draft_weight_dtype: str = "auto"
    # the compiled CPU path's fp32 products (torch.set_float32_matmul_precision's names): highest as
    # given; medium rounds x and w to bf16 and sums the exact products in fp32 (AVX512-BF16 dot products)
    matmul_precision: str = "highest"

    def validate(self):
        for name in ("max_batch_size", "max_input_len", "max_seq_len"):
            if getattr(self, name) < 1:
                raise BuildError(f"--{name}: expected a positive number, got {getattr(self, name)}")
        if self.max_draft_len < 0:
            raise BuildError(f"--max_draft_len: expected >= 0, got {self.max_draft_len}")
        if self.max_input_len > self.max_seq_len:
            raise BuildError(f"--max_input_len ({self.max_input_len}) exceeds --max_seq_len ({self.max_seq_len})")
        if self.max_tree_nodes < 1 or self.tree_topk < 0 or self.tree_depth < 0:
            raise BuildError(f"--max_tree_nodes: expected >= 1, --tree_topk and --tree_depth >= 0 (0: the default); got "
                             f"{self.max_tree_nodes}, {self.tree_topk}, {self.tree_depth}")
        for flag in ("tree_topk", "tree_depth"):   # as runtime.tree.draft.TreeShape: never fillable past the nodes
            if getattr(self, flag) > self.max_tree_nodes:
                raise BuildError(f"--{flag}: expected at most --max_tree_nodes ({self.max_tree_nodes}), "
                                 f"got {getattr(self, flag)}")
        for flag, value in (("--max_host_memory_gb", self.max_host_memory_gb), ("--num_layers", self.num_layers)):
            if not 0 <= value < float("inf"):   # (NaN fails it too)
                raise BuildError(f"{flag}: expected a finite number >= 0 (0: the default), got {value}")
        if self.dtype not in ("auto",) + tuple(TORCH_DTYPES):
            raise BuildError(f"--dtype: expected auto, float32, float16 or bfloat16, got {self.dtype}")
        if self.draft_weight_dtype not in ("auto", "float32", "bfloat16"):
            raise BuildError(f"--draft_weight_dtype: expected auto, float32 or bfloat16, got {self.draft_weight_dtype}")
        check_matmul_precision(self.matmul_precision)
        mode = self.speculative_decoding_mode
        if mode is not None and mode not in MODES:
            raise BuildError(f"--speculative_decoding_mode: expected one of {', '.join(MODES)}, got {mode}")
        if mode is not None and self.max_draft_len < 1:
            raise BuildError(f"--max_draft_len: speculative mode {mode} needs K >= 1, got {self.max_draft_len}")
        if self.tree_engines and mode is None:
            raise BuildError("--tree_engines: builds tree verify engines for a draft; it needs --speculative_decoding_mode")
        if mode is not None and self.max_draft_len + 1 > self.max_input_len:
            raise BuildError(f"--max_draft_len ({self.max_draft_len}) + 1 exceeds --max_input_len ({self.max_input_len})")

    def resolve_dtype(self, checkpoint_dtype: str) -> str:
        return checkpoint_dtype if self.dtype == "auto" else self.dtype


MATMUL_PRECISIONS = ("highest", "medium")


def check_matmul_precision(value: str) -> None:
    if value not in MATMUL_PRECISIONS:
        raise BuildError(f"--matmul_precision: expected {' or '.join(MATMUL_PRECISIONS)}, got {value}")


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


TREE_STEP_KINDS = ("draft_target", "eagle", "eagle3", "mtp")   # drafts with a tree step (block drafts: none)
TREE_INPUTS = {"parents": {"shape": ["batch", "tokens"], "dtype": "int32"},
               "ancestors": {"shape": ["batch", "tokens", "tokens"], "dtype": "bool"}}


def tree_verify_component(module: NemotronH, options: BuildOptions, name: str = "tree_verify") -> Component:
    """A NemotronH scoring a token tree in one forward (row 0 the root; parents and ancestor mask as
    in ``runtime.tree.paths``): the target's tree verify, or (``name="draft_tree"``) a draft_target
    draft's tree step. One profile of up to max_tree_nodes + 1 rows."""
    def call(f):
        logits, new_state, features = module.forward(f["input_ids"], f["positions"], f["lengths"], f["logit_index"],
                                                     _state_feeds(f), verify=True, tree=(f["parents"], f["ancestors"]))
        return _outputs(logits, new_state, {"features." + n: v for n, v in features.items()})
    return Component(name, module, _chunk_inputs(module, TREE_INPUTS), call,
                     [{"name": "tree", "max_tokens": options.max_tree_nodes + 1}])


def draft_tree_component(module, options: BuildOptions) -> Component:
    """A chain draft's step over a tree frontier (``runtime.tree.draft.feature_expand``): row (b, f)
    is a node's token with its parent's ``hidden_out``, RoPE at ``positions`` (eagle, eagle3), KV
    written at ``slots``, attending to the cache rows ``visible`` [B, F, S] marks. Frontiers hold up
    to max_tree_nodes rows."""
    kind = getattr(module, "kind", "draft_target")
    if kind == "draft_target":
        return tree_verify_component(module, options, "draft_tree")
    if kind not in TREE_STEP_KINDS:
        raise ValueError(f"draft kind {kind}: a block draft grows its tree from its one block forward (no tree step)")
    dtype = DTYPE_NAMES[module.dtype]
    extra = {"hidden": {"shape": ["batch", "tokens", module.hidden_size], "dtype": dtype},
             "slots": {"shape": ["batch", "tokens"], "dtype": "int32"},
             "visible": {"shape": ["batch", "tokens", "capacity"], "dtype": "bool"}}

    def call(f):
        ids, hidden, positions, slots, visible = (f[n] for n in ("input_ids", "hidden", "positions", "slots", "visible"))
        lengths, index, state = f["lengths"], f["logit_index"], _state_feeds(f)
        if kind == "eagle3":
            logits, out, new = module.forward(ids, None, hidden, None, positions, lengths, index, state,
                                              tree=(slots, visible))
        elif kind == "eagle":
            logits, out, new = module.forward(ids, hidden, positions, lengths, index, state, tree=(slots, visible))
        else:  # mtp: no RoPE, a row's cache row is its slot
            logits, out, new = module.forward(ids, hidden, slots, lengths, index, state, visible=visible)
        return _outputs(logits, new, {"hidden_out": out})
    return Component("draft_tree", module, _chunk_inputs(module, extra), call,
                     [{"name": "tree", "max_tokens": options.max_tree_nodes}])


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


def draft_components(module, options: BuildOptions, tree: bool = False) -> list[Component]:
    """Every engine a draft needs: the draft network, plus DSpark's Markov step when it has one, and
    with ``tree`` a chain draft's tree step (block drafts grow trees from their block forward)."""
    out = [draft_component(module, options)]
    if getattr(module, "has_markov", False):
        out.append(markov_component(module, options))
    if tree and getattr(module, "kind", "draft_target") in TREE_STEP_KINDS:
        out.append(draft_tree_component(module, options))
    return out


def record(component: Component, native_plugins: bool = False, refit=None, refit_method: str = "refit"):
    """Records a component's forward into a TensorRT network; returns (recorder, output dtypes).

    ``native_plugins`` lowers plugin ops to native layers even where plugin layers exist (the CPU
    interpreter evaluates native layers only). ``refit`` (a :class:`builder.refit.Provenance`) names
    and marks refittable every constant viewing the engine directory's weights (``--strip_plan``), or with
    ``refit_method="inputs"`` makes each such weight a static-shape network input instead.
    """
    from builder.backends.trt_backend import NetworkRecorder
    recorder = NetworkRecorder(name=component.name)
    recorder.native_plugins = native_plugins
    recorder.refit, recorder.refit_method = refit, refit_method
    feeds = {}
    for name, entry in component.inputs.items():
        shape = [d if isinstance(d, int) else -1 for d in entry["shape"]]
        feeds[name] = recorder.add_input(name, TORCH_DTYPES.get(entry["dtype"]) or getattr(torch, entry["dtype"]), shape)
    outputs = component.call(feeds)
    for name, tensor in outputs.items():
        recorder.mark_output(name, tensor)
    return recorder, {name: DTYPE_NAMES[t.dtype] for name, t in outputs.items()}


# --- the build ------------------------------------------------------------------------------------
def first_layers(config, weights: dict, n: int):
    """(config, weights) of the first ``n`` layers of the pattern (``--num_layers``, a trial build);
    embeddings, final norm, LM head and ``mtp.*`` are kept."""
    import dataclasses
    if not 1 <= n <= config.num_layers:
        raise BuildError(f"--num_layers: expected 1..{config.num_layers} (the checkpoint's layers), got {n}")
    keep = {n_: w for n_, w in weights.items()
            if not n_.startswith("backbone.layers.") or int(n_.split(".")[2]) < n}
    return dataclasses.replace(config, layer_types=config.layer_types[:n]), keep


def strip_plan_supported() -> tuple[bool, str]:
    """Whether this TensorRT builds weight-stripped refittable engines here (tensorrt_rtx 1.7 does not
    without a GPU: its Myelin compiler fails a CUDA check for any REFIT/STRIP_PLAN flag)."""
    from builder.backends.trt_build import probe_strip_plan
    return probe_strip_plan()


def _write_weights(path: Path, tensors: dict) -> None:
    from builder.checkpoint import storage_order
    from builder.safetensors_io import write_safetensors
    order = storage_order(tensors)
    write_safetensors(path, {n: (tensors[n].dtype, tuple(tensors[n].shape)) for n in order}, tensors.__getitem__)


def build(checkpoint_dir, output_dir, options: BuildOptions, log=print, draft_dir=None,
          draft_quantization=None, token_map=None) -> dict:
    """Builds ENGINE_DIR from a checkpoint (and a draft); returns the build report.

    Raises NemospecError subclasses for bad input, before anything is written. Tensors are read
    memory-mapped; each engine is written as soon as it is built; the weights are written once
    (``weights/*.safetensors``) and the engines are built from that file's mapping, so a constant is a
    view of its bytes (NVFP4: packed, with ``strip_plan``) (and, with ``strip_plan``, refit from them at load: ``refit_map.json``).
    """
    from builder import build_memory, drafts
    from builder import token_map as token_maps
    from builder.backends import trt_build
    from builder.backends.trt_import import FLAVOUR, VERSION
    from builder.refit import Provenance, write_refit_map

    options.validate()
    mode = options.speculative_decoding_mode
    started = time.perf_counter()
    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    if (checkpoint_dir / "tokenizer.json").is_file():   # a damaged one fails now, not every later generate
        load_tokenizer(checkpoint_dir / "tokenizer.json")
    if (checkpoint_dir / "tokenizer_config.json").is_file():   # and its chat template, not the served chat later
        read_tokenizer_config(checkpoint_dir / "tokenizer_config.json")
    log(f"reading checkpoint {checkpoint_dir} (memory-mapped)")
    from builder import quantization  # an NVFP4 checkpoint keeps its linears packed: FP4 constants in the engine
    quantized = quantization.is_nvfp4_checkpoint(checkpoint_dir)
    if quantized:
        config, weights = load_nvfp4_checkpoint(checkpoint_dir, keep_quantized=True)
    else:
        config, weights = load_checkpoint(checkpoint_dir)
    dtype_name = options.resolve_dtype(config.dtype)
    dtype = TORCH_DTYPES[dtype_name]
    check_finite_weights(checkpoint_dir, weights, dtype)
    if options.num_layers:
        config, weights = first_layers(config, weights, options.num_layers)
    weights = convert_weights(weights, dtype)
    if draft_quantization and not mode:
        raise BuildError("--quantization: quantizes the draft; it needs --speculative_decoding_mode")
    if token_map and not mode:
        raise BuildError("--speculative_token_map: cuts a draft's LM head; it needs --speculative_decoding_mode")
    if draft_dir is not None and not mode:
        raise BuildError(f"--draft_dir {draft_dir}: a draft needs --speculative_decoding_mode (its kind)")
    # argument errors before gigabytes of weights are written (the draft itself loads after them)
    # as vLLM's max_model_len (TensorRT refused 1e9 with its own log, the flag unnamed)
    if options.max_seq_len > config.max_position_embeddings and os.environ.get("NEMOSPEC_ALLOW_LONG_MAX_SEQ_LEN") != "1":
        raise BuildError(f"--max_seq_len {options.max_seq_len}: beyond the checkpoint's max_position_embeddings "
                         f"{config.max_position_embeddings}; expected at most that (NEMOSPEC_ALLOW_LONG_MAX_SEQ_LEN=1 "
                         "builds it anyway)")
    if mode and mode != "mtp":
        drafts.need_draft_dir(mode, draft_dir)
    if token_map is not None and mode:
        token_maps.read_token_map(token_map, config.vocab_size)
    # --strip_plan: refittable constants where TensorRT can build them, else weights as engine inputs
    method = ("refit" if strip_plan_supported()[0] else "inputs") if options.strip_plan else None
    draft_files = sorted(Path(draft_dir).glob("*.safetensors")) if mode and draft_dir else []
    est = build_memory.estimate(config, weights, sum(p.stat().st_size for p in draft_files), options, method)
    limit = int(options.max_host_memory_gb * build_memory.GIB) if options.max_host_memory_gb else \
        build_memory.available_bytes()
    log(f"estimated peak host memory {est.peak_bytes / build_memory.GIB:.1f} GiB (limit "
        f"{limit / build_memory.GIB:.1f} GiB; weights {est.weight_bytes / build_memory.GIB:.2f} GiB); serving it "
        f"holds {est.state_bytes / build_memory.GIB:.2f} GiB of KV and Mamba state at --max_batch_size "
        f"{options.max_batch_size} x --max_seq_len {options.max_seq_len}")
    build_memory.check(est, limit, options, config.num_layers)

    contracts, report_engines, refit = {}, {}, {}
    with atomic_dir(output_dir, replaceable=is_engine_dir,
                    inputs={"--checkpoint_dir": checkpoint_dir, "--draft_dir": draft_dir,
                            "--speculative_token_map": token_map}) as tmp:
        log(f"writing weights into {output_dir}/weights")
        (tmp / "weights").mkdir()
        packed = quantized and options.strip_plan
        weights, mapped = write_target_weights(tmp, weights, dtype, packed)
        draft = drafts.load_draft(mode, config, weights, draft_dir, dtype, log, draft_quantization,
                                  token_map) if mode else None
        if draft and (note := drafts.past_trained_block(draft.module, mode, options.max_draft_len)):
            log(note)
        files = [("weights/target.safetensors", mapped)]
        if draft and draft.weights is not None:
            _write_weights(tmp / "weights" / "draft.safetensors", draft.weights)
            files.append(("weights/draft.safetensors", draft.weights))
        provenance = Provenance(files) if options.strip_plan else None
        target = NemotronH(config, weights, dtype, **(draft.target_features if draft else {}))
        components = [target_component(target, options)]
        if draft:
            components += [target_component(target, options, verify=True),
                           *draft_components(draft.module, options, tree=options.tree_engines)]
            if options.tree_engines:
                components.append(tree_verify_component(target, options))
        for n, component in enumerate(components, 1):
            log(f"[{n}/{len(components)}] recording {component.name} network")
            recorder, outputs = record(component, refit=provenance, refit_method=method or "refit")
            contract = component.contract(options, outputs)
            layers = recorder.network.num_layers
            log(f"[{n}/{len(components)}] building {component.name}.engine with {FLAVOUR} {VERSION} "
                f"({layers} layers, {len(contract['profiles'])} optimization profiles"
                f"{', weight-stripped' if provenance else ''})")
            t0 = time.perf_counter()
            engine_bytes = trt_build.build_engine_file(recorder, _profiles(contract, recorder),
                                                       tmp / f"{component.name}.engine", strip_plan=method == "refit")
            contracts[component.name] = contract
            report_engines[component.name] = {
                "layers": layers,
                "engine_bytes": engine_bytes,
                "build_seconds": round(time.perf_counter() - t0, 3),
                "profiles": [{"name": p["name"], "max_tokens": p["max_tokens"]} for p in contract["profiles"]],
                "lowerings": dict(recorder.lowerings),
            }
            if provenance is not None:
                refit[component.name] = {"method": method, "weights": recorder.refit_weights,
                                         "plan_constant_bytes": recorder.plan_bytes}
                report_engines[component.name]["refittable_weights"] = len(recorder.refit_weights)
            del recorder
        if refit:
            write_refit_map(tmp, refit)
        tokenizer = [f for f in TOKENIZER_FILES if (checkpoint_dir / f).is_file()]
        for f in tokenizer:
            shutil.copy2(checkpoint_dir / f, tmp / f)
        meta = {
            "format": "nemospec-engine-dir/1",
            "source": {"checkpoint_dir": str(checkpoint_dir.resolve()), "sha256": checkpoint_hash(checkpoint_dir)},
            "model": config.to_dict(),
            # weights/target.safetensors: the build dtype, or NVFP4 packed as ModelOpt stores it (--strip_plan)
            "weights_format": quantization.FORMAT_NAME if packed else "dense",
            "build": dict(asdict(options), dtype=dtype_name),
            "tensorrt": {"flavour": FLAVOUR, "version": VERSION},
            "tokenizer": "tokenizer.json" if "tokenizer.json" in tokenizer else None,
            "speculative": draft.meta if draft else None,
            "engines": contracts,
            "files": record_files(tmp),   # sizes + sha256, checked by serve/generate (builder.integrity)
        }
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
        report = {
            "engines": report_engines,
            "weight_bytes": {p.stem: _data_bytes(p) for p in sorted((tmp / "weights").glob("*.safetensors"))},
            "memory_estimate": est.as_dict(),
            "strip_plan": bool(options.strip_plan),
            "speculative_decoding_mode": mode,
            "tensorrt": {"flavour": FLAVOUR, "version": VERSION},
            "dtype": dtype_name,
            "total_seconds": round(time.perf_counter() - started, 3),
        }
        (tmp / "build_report.json").write_text(json.dumps(report, indent=2))
    return report


def write_target_weights(directory: Path, weights: dict, dtype: torch.dtype, packed: bool) -> tuple[dict, dict]:
    """Writes ``weights/target.safetensors`` and returns (the weights to build from, the file's tensors).

    Dense weights are built from the written file's mapping (experts back to back, every constant a view
    of it; the checkpoint's mapping is released). NVFP4 weights (:class:`builder.nvfp4_format.NVFP4Weight`)
    are written ``packed`` as ModelOpt stores them (``--strip_plan``: the engines read the FP4 bytes from
    the file) and rebound to the mapping; otherwise dequantized (the TorchRunner's) while the engines keep
    FP4 constants of the checkpoint's bytes."""
    from builder import quantization
    from builder.safetensors_io import mmap_tensors
    target_file = Path(directory) / "weights" / "target.safetensors"
    quantized = any(getattr(w, "is_nvfp4", False) for w in weights.values())
    if quantized and not packed:  # (nothing here is stripped: no file tensors to resolve)
        _write_weights(target_file, quantization.dequantize_weights(weights))
        return weights, {}
    _write_weights(target_file, quantization.nvfp4_file_tensors(weights))
    mapped = mmap_tensors(target_file)
    if not quantized:
        return mapped, mapped
    shapes = {n: tuple(w.shape) for n, w in weights.items() if getattr(w, "is_nvfp4", False)}
    return quantization.nvfp4_weights(mapped, shapes=shapes, dtype=dtype), mapped


def _profiles(contract: dict, recorder) -> list[dict]:
    """The contract's optimization profiles plus the static shape of every weight input (--strip_plan)."""
    from builder.refit import network_shape
    fixed = {n: [network_shape(e)] * 3 for n, e in recorder.refit_weights.items() if e.get("input")}
    return [dict(p["shapes"], **fixed) for p in contract["profiles"]]


def _data_bytes(path: Path) -> int:
    """Bytes of a safetensors file's tensors (the file less its header)."""
    from builder.safetensors_io import read_header
    _, start = read_header(path)
    return path.stat().st_size - start
