"""Safetensors checkpoint reading, name mapping and validation for NemotronH targets.

Tensor names returned by :func:`load_checkpoint` are canonical: exactly the names ``transformers``
5.24 ``save_pretrained`` writes for ``NemotronHForCausalLM`` (``backbone.`` prefix, one pair of
``experts.{e}.up_proj.weight`` / ``down_proj.weight`` per routed expert, ``lm_head.weight``).
Accepted on input and renamed: the ``model.`` prefix (transformers' in-memory name) and experts
stored fused as 3-D ``experts.up_proj`` [E, I, in] / ``experts.down_proj`` [E, in, I].

``mtp.*`` tensors (multi-token-prediction layers, ignored by transformers) are passed through
unchanged; only their dtype is checked.

Two tensor groups are optional because transformers writes them although a config could do without:

* ``lm_head.weight`` when ``tie_word_embeddings`` is true. transformers 5.24 never ties NemotronH
  weights: it writes ``lm_head.weight`` and uses it. Model code: use ``lm_head.weight`` when present,
  else ``backbone.embeddings.weight``.
* ``mixer.shared_experts.*`` of MoE layers when ``n_shared_experts == 0``. transformers always builds
  and runs the shared expert. Model code: run the shared expert when its tensors are present.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from builder import nvfp4_format, quantization
from builder.config import NemotronHConfig, defaulted_sizes, load_config
from builder.errors import CheckpointError
from builder.safetensors_io import check_finite, mmap_tensors

__all__ = [
    "SAFETENSORS_FILE",
    "INDEX_FILE",
    "expected_tensors",
    "optional_tensors",
    "block_tensors",
    "canonical_name",
    "checkpoint_files",
    "load_checkpoint",
    "checkpoint_hash",
    "files_hash",
]

SAFETENSORS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
MTP_PREFIX = "mtp."
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_PER_EXPERT = re.compile(r"^(.*\.mixer\.experts)\.\d+\.(up_proj|down_proj)\.(weight|weight_scale|weight_scale_2)$")
_FUSED_EXPERTS = re.compile(r"^(backbone\.layers\.\d+\.mixer\.experts)\.(up_proj|down_proj)(?:\.weight)?$")

Shape = tuple[int, ...]


# --- the expected-tensor spec --------------------------------------------------------------------
def block_tensors(config: NemotronHConfig, kind: str, prefix: str) -> dict[str, Shape]:
    """Tensors of one block (``{prefix}.norm.weight`` and ``{prefix}.mixer.*``) of a layer kind."""
    c = config
    H = c.hidden_size
    t: dict[str, Shape] = {f"{prefix}.norm.weight": (H,)}
    m = f"{prefix}.mixer"
    if kind == "mamba":
        t[f"{m}.in_proj.weight"] = (c.mamba_in_proj_size, H)
        if c.use_bias:
            t[f"{m}.in_proj.bias"] = (c.mamba_in_proj_size,)
        t[f"{m}.conv1d.weight"] = (c.conv_dim, 1, c.conv_kernel)
        if c.use_conv_bias:
            t[f"{m}.conv1d.bias"] = (c.conv_dim,)
        t[f"{m}.dt_bias"] = (c.mamba_num_heads,)
        t[f"{m}.A_log"] = (c.mamba_num_heads,)
        t[f"{m}.D"] = (c.mamba_num_heads,)
        t[f"{m}.norm.weight"] = (c.mamba_intermediate_size,)
        t[f"{m}.out_proj.weight"] = (H, c.mamba_intermediate_size)
        if c.use_bias:
            t[f"{m}.out_proj.bias"] = (H,)
    elif kind == "attention":
        # transformers 5.24 builds q/k/v/o without biases whatever attention_bias says.
        q = c.num_attention_heads * c.head_dim
        kv = c.num_key_value_heads * c.head_dim
        t[f"{m}.q_proj.weight"] = (q, H)
        t[f"{m}.k_proj.weight"] = (kv, H)
        t[f"{m}.v_proj.weight"] = (kv, H)
        t[f"{m}.o_proj.weight"] = (H, q)
    elif kind == "mlp":
        t.update(_mlp(f"{m}", H, c.intermediate_size, c.mlp_bias))
    elif kind == "moe":
        E, I, D = c.n_routed_experts, c.moe_intermediate_size, c.moe_input_size
        t[f"{m}.gate.weight"] = (E, H)
        t[f"{m}.gate.e_score_correction_bias"] = (E,)
        for e in range(E):
            t[f"{m}.experts.{e}.up_proj.weight"] = (I, D)
            t[f"{m}.experts.{e}.down_proj.weight"] = (D, I)
        if c.n_shared_experts > 0:
            t.update(_mlp(f"{m}.shared_experts", H, c.moe_shared_expert_intermediate_size, c.mlp_bias))
        if c.moe_latent_size is not None:
            L = c.moe_latent_size
            t[f"{m}.fc1_latent_proj.weight"] = (L, H)
            if c.mlp_bias:
                t[f"{m}.fc1_latent_proj.bias"] = (L,)
            t[f"{m}.fc2_latent_proj.weight"] = (H, L)
            if c.mlp_bias:
                t[f"{m}.fc2_latent_proj.bias"] = (H,)
    else:
        raise ValueError(f"unknown layer kind {kind!r}")
    return t


def _mlp(prefix: str, H: int, inter: int, bias: bool) -> dict[str, Shape]:
    t: dict[str, Shape] = {f"{prefix}.up_proj.weight": (inter, H)}
    if bias:
        t[f"{prefix}.up_proj.bias"] = (inter,)
    t[f"{prefix}.down_proj.weight"] = (H, inter)
    if bias:
        t[f"{prefix}.down_proj.bias"] = (H,)
    return t


def expected_tensors(config: NemotronHConfig) -> dict[str, Shape]:
    """Every tensor a target checkpoint must hold, canonical name -> shape, in model order."""
    t: dict[str, Shape] = {"backbone.embeddings.weight": (config.vocab_size, config.hidden_size)}
    for i, kind in enumerate(config.layer_types):
        t.update(block_tensors(config, kind, f"backbone.layers.{i}"))
    t["backbone.norm_f.weight"] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        t["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return t


def optional_tensors(config: NemotronHConfig) -> dict[str, Shape]:
    """Tensors allowed but not required (see the module docstring), canonical name -> shape."""
    t: dict[str, Shape] = {}
    if config.n_shared_experts == 0:
        for i, kind in enumerate(config.layer_types):
            if kind == "moe":
                t.update(_mlp(f"backbone.layers.{i}.mixer.shared_experts", config.hidden_size,
                              config.moe_shared_expert_intermediate_size, config.mlp_bias))
    if config.tie_word_embeddings:
        t["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    return t


def mtp_tensors(config: NemotronHConfig) -> dict[str, Shape]:
    """The ``mtp.*`` tensors of NemotronH's own MTP layers (vLLM's layout), name -> shape."""
    H, last = config.hidden_size, len(config.mtp_layer_types) - 1
    t: dict[str, Shape] = {"mtp.layers.0.enorm.weight": (H,), "mtp.layers.0.hnorm.weight": (H,),
                           "mtp.layers.0.eh_proj.weight": (H, 2 * H)}
    for i, kind in enumerate(config.mtp_layer_types):
        t.update(block_tensors(config, kind, f"mtp.layers.{i}"))
    t[f"mtp.layers.{last}.final_layernorm.weight"] = (H,)
    return t


def validate_mtp(config: NemotronHConfig, tensors: dict, where: str) -> None:
    """The checkpoint really holds MTP layers for ``--speculative_decoding_mode mtp``."""
    if config.num_nextn_predict_layers < 1:
        raise CheckpointError(f"{where}: field 'num_nextn_predict_layers' is {config.num_nextn_predict_layers}; "
                              "mtp mode needs a checkpoint with MTP layers (>= 1)")
    if "mamba" in config.mtp_layer_types:
        raise CheckpointError(f"{where}: field 'mtp_hybrid_override_pattern' "
                              f"{config.mtp_hybrid_override_pattern!r}: MTP layers may be attention, MLP or MoE (*, -, E)")
    expected = mtp_tensors(config)
    extra = sorted(n for n in tensors if n.startswith(MTP_PREFIX) and n not in expected)
    if extra:   # a layer past num_nextn_predict_layers (or of another kind) would be silently left out
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]} is not part of the MTP layers that fields "
                              f"'num_nextn_predict_layers' ({config.num_nextn_predict_layers}) and "
                              f"'mtp_hybrid_override_pattern' ({config.mtp_hybrid_override_pattern!r}) describe")
    for name, shape in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{where}: missing tensor {name} (MTP layer), expected shape {_fmt(shape)}")
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"{where}: tensor {name} has shape {_fmt(tuple(tensors[name].shape))}, "
                                  f"expected {_fmt(shape)}{defaulted_sizes(config)}")


def storage_order(names) -> list[str]:
    """``names`` in the order to store them: as given, except that a MoE layer's experts lie back to back
    (every expert's ``up_proj`` in expert order, then every ``down_proj``; NVFP4 experts: their packed
    weights, then their block scales, then their global scales), so that a memory-mapped reader stacks
    them without a copy (:func:`builder.safetensors_io.stack`)."""
    names = list(names)
    present = set(names)
    out, done = [], set()
    for name in names:
        if name in done:
            continue
        fused = _PER_EXPERT.match(name)
        if fused is None:
            out.append(name)
            done.add(name)
            continue
        prefix = fused.group(1)
        for proj in ("up_proj", "down_proj"):
            for part in ("weight", "weight_scale", "weight_scale_2"):
                e = 0
                while f"{prefix}.{e}.{proj}.{part}" in present:
                    key = f"{prefix}.{e}.{proj}.{part}"
                    if key not in done:
                        out.append(key)
                        done.add(key)
                    e += 1
        if name not in done:  # an expert index past a gap: keep it where it was
            out.append(name)
            done.add(name)
    return out


def canonical_name(name: str) -> str:
    """``model.`` prefix -> ``backbone.``; every other name unchanged."""
    if name.startswith("model."):
        return "backbone." + name[len("model."):]
    return name


# --- locating files ------------------------------------------------------------------------------
class _Layout:
    """Which safetensors files make the checkpoint and which stored names each holds."""

    def __init__(self, directory: Path, files: list[Path], index: Path | None, names: dict[Path, list[str]]):
        self.directory = directory
        self.files = files
        self.index = index
        self.names = names  # file -> stored tensor names (from the file header)

    @property
    def where(self) -> Path:
        return self.index if self.index is not None else self.files[0]


def _locate(checkpoint_dir: str | os.PathLike) -> _Layout:
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory not found")
    single = directory / SAFETENSORS_FILE
    index = directory / INDEX_FILE
    if single.is_file():
        return _Layout(directory, [single], None, {single: _header_names(single)})
    if index.is_file():
        return _locate_sharded(directory, index)
    for path in (single, index):
        if path.exists():
            raise CheckpointError(f"{path}: is not a file; expected the checkpoint's {path.name}")
    pickles = sorted(p.name for p in directory.iterdir() if p.is_file() and (
        p.name.endswith(_PICKLE_SUFFIXES) or p.name.endswith(".bin.index.json")))
    if pickles:
        raise CheckpointError(f"{directory}: found {pickles[0]} but no {SAFETENSORS_FILE} or {INDEX_FILE}; "
                              f"pickle checkpoints are refused: safetensors only")
    others = sorted(p.name for p in directory.glob("*.safetensors"))
    hint = f" (found {', '.join(others[:3])} without an index)" if others else ""
    raise CheckpointError(f"{directory}: no {SAFETENSORS_FILE} or {INDEX_FILE}{hint}")


def _locate_sharded(directory: Path, index: Path) -> _Layout:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index}: invalid JSON ({' '.join(str(e).split())})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: expected a non-empty \"weight_map\" object of tensor name -> shard file")
    by_file: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or "/" in shard or "\\" in shard or shard in (".", ".."):
            raise CheckpointError(f"{index}: weight_map entry {name!r} names an invalid shard file {shard!r}")
        by_file.setdefault(shard, []).append(name)
    files: list[Path] = []
    names: dict[Path, list[str]] = {}
    for shard in sorted(by_file):
        path = directory / shard
        if not path.is_file():
            raise CheckpointError(f"{index}: weight_map names shard {shard} (for tensor {by_file[shard][0]!r}) "
                                  f"but {path} is missing")
        stored = set(_header_names(path))
        for name in by_file[shard]:
            if name not in stored:
                raise CheckpointError(f"{path}: tensor {name!r} is listed in {INDEX_FILE} but absent from the shard")
        files.append(path)
        names[path] = by_file[shard]
    return _Layout(directory, files, index, names)


def _header_names(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error types for malformed headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({' '.join(str(e).split())})") from None


def checkpoint_files(checkpoint_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files the checkpoint is made of (one file, or the shards of its index)."""
    return list(_locate(checkpoint_dir).files)


TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Tensors kept in fp32 whatever the build dtype (as transformers keeps them).
FP32_TENSORS = ("A_log", ".D", "gate.weight", "e_score_correction_bias", "attention_sink_bias")


def convert_weights(weights: dict, dtype: torch.dtype) -> dict:
    """Checkpoint tensors in the build dtype (fp32-only tensors stay fp32), contiguous for saving."""
    out = {}
    for name, w in weights.items():
        if w.is_floating_point():
            w = w.float() if any(name.endswith(s) for s in FP32_TENSORS) else w.to(dtype)
        out[name] = w.contiguous()
    return out


# --- loading -------------------------------------------------------------------------------------
class _Entry:
    __slots__ = ("file", "stored", "shape", "dtype", "expert")

    def __init__(self, file: Path, stored: str, shape: Shape, dtype: str, expert: int | None = None):
        self.file, self.stored, self.shape, self.dtype, self.expert = file, stored, shape, dtype, expert


def _fmt(shape: Shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def load_checkpoint(checkpoint_dir: str | os.PathLike) -> tuple[NemotronHConfig, dict[str, torch.Tensor]]:
    """Read, rename and validate a NemotronH safetensors checkpoint.

    Returns the config and canonical name -> tensor (dtype as stored) for every expected tensor,
    the optional ones present, and every ``mtp.*`` tensor. The tensors view copy-on-write mappings
    of the files (:func:`builder.safetensors_io.mmap_tensors`): loading reads headers only, a tensor's
    bytes are paged in when it is used. Raises :class:`CheckpointError`.
    A ModelOpt NVFP4 checkpoint (``hf_quant_config.json`` / ``quantization_config``) is dequantized
    to the config's dtype (:func:`load_nvfp4_checkpoint` with ``keep_quantized`` keeps it packed).
    """
    config = load_config(checkpoint_dir)
    if quantization.read_quant_config(checkpoint_dir) is not None:  # validated, dequantized on load
        return load_nvfp4_checkpoint(checkpoint_dir)
    layout = _locate(checkpoint_dir)
    expected = expected_tensors(config)
    optional = optional_tensors(config)

    # 1. Headers only: canonical name -> where it is stored, its shape and dtype.
    entries: dict[str, _Entry] = {}
    for path in layout.files:
        with safe_open(str(path), framework="pt") as f:
            for stored in layout.names[path]:
                sl = f.get_slice(stored)
                shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
                name = canonical_name(stored)
                fused = _FUSED_EXPERTS.match(name)
                if fused:
                    base, proj = fused.group(1), fused.group(2)
                    probe = f"{base}.0.{proj}.weight"
                    if probe not in expected:
                        raise CheckpointError(f"{path}: unexpected tensor {stored!r} (no MoE layer at that index)")
                    want = (config.n_routed_experts, *expected[probe])
                    if shape != want:
                        raise CheckpointError(f"{path}: fused expert tensor {stored!r} has shape {_fmt(shape)}, "
                                              f"expected {_fmt(want)} [experts, out, in]{defaulted_sizes(config)}")
                    for e in range(shape[0]):
                        _add(entries, f"{base}.{e}.{proj}.weight", _Entry(path, stored, shape[1:], dtype, e), path)
                else:
                    _add(entries, name, _Entry(path, stored, shape, dtype), path)

    # 2. Missing and unknown names.
    missing = [n for n in expected if n not in entries]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        if layout.index is not None:
            raise CheckpointError(f"{layout.index}: missing tensor {missing[0]!r}, expected shape "
                                  f"{_fmt(expected[missing[0]])}; its weight_map does not list it{more}")
        raise CheckpointError(f"{layout.files[0]}: missing tensor {missing[0]!r}, expected shape "
                              f"{_fmt(expected[missing[0]])}{more}")
    unknown = [n for n in entries if n not in expected and n not in optional and not n.startswith(MTP_PREFIX)]
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        entry = entries[unknown[0]]
        raise CheckpointError(f"{entry.file}: unexpected tensor {entry.stored!r} is not part of a NemotronH model "
                              f"with layers {config.hybrid_override_pattern!r}{more}")

    # 3. dtypes and shapes.
    for name, entry in entries.items():
        if entry.dtype not in _FLOAT_DTYPES:
            got = _DTYPE_NAMES.get(entry.dtype, entry.dtype)
            raise CheckpointError(f"{entry.file}: tensor {entry.stored!r} has dtype {got}, "
                                  f"expected float32, float16 or bfloat16")
        want = expected.get(name, optional.get(name))
        if want is not None and entry.shape != want:
            raise CheckpointError(f"{entry.file}: tensor {entry.stored!r} has shape {_fmt(entry.shape)}, "
                                  f"expected {_fmt(want)}{defaulted_sizes(config)}")

    # 4. Map the tensors, one mapping per file (nothing is read until used); fused experts split into views.
    order = [n for n in expected] + [n for n in optional if n in entries] + \
        sorted(n for n in entries if n.startswith(MTP_PREFIX))
    by_file: dict[Path, list[str]] = {}
    for name in order:
        by_file.setdefault(entries[name].file, []).append(name)
    loaded: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        mapped = mmap_tensors(path, dict.fromkeys(entries[n].stored for n in names))
        for name in names:
            entry = entries[name]
            loaded[name] = mapped[entry.stored] if entry.expert is None else mapped[entry.stored][entry.expert]
    if not getattr(config, "_dtype_given", True):
        # config.json names no dtype: the weights' own, as transformers' torch_dtype="auto" falls back
        # to (a bf16 checkpoint was built and run in float32, twice its bytes)
        object.__setattr__(config, "dtype", _DTYPE_NAMES[entries[order[0]].dtype])
    return config, {name: loaded[name] for name in order}


def check_finite_weights(directory, weights: dict, dtype: torch.dtype | None = None) -> None:
    """No NaN or inf in a loaded checkpoint's tensors (NVFP4 weights: their scales too), named by the
    checkpoint and tensor: one built and generated token 0 after token 0 with exit 0; and none beyond
    the range of ``dtype``, the build dtype it is cast to (``convert_weights``). Reads every byte, so
    the commands that use the weights call it (build, generate, quantize), not the loader, which maps
    headers only."""
    for name, t in weights.items():
        if not getattr(t, "is_nvfp4", False):
            kept_fp32 = any(name.endswith(s) for s in FP32_TENSORS)
            check_finite(t, directory, name, cast=None if kept_fp32 else dtype)
            continue
        check_finite(t.packed, directory, name)
        check_finite(t.scale, directory, f"{name} (weight_scale)", scale=True)
        check_finite(t.scale_2, directory, f"{name} (weight_scale_2)")   # its sign is checked when it binds


def _add(entries: dict[str, _Entry], name: str, entry: _Entry, path: Path) -> None:
    if name in entries:
        first = entries[name]
        raise CheckpointError(f"{path}: tensor {entry.stored!r} duplicates {first.stored!r} in {first.file.name} "
                              f"(both are {name!r})")
    entries[name] = entry


# --- hashing -------------------------------------------------------------------------------------
def checkpoint_hash(checkpoint_dir: str | os.PathLike) -> str:
    """sha256 (hex) over config.json, the index (if sharded) and the safetensors files in use.

    Files are taken in name order; each contributes its name, its size and its bytes (read in
    1 MiB blocks).
    """
    layout = _locate(checkpoint_dir)
    config = layout.directory / CONFIG_FILE
    if not config.is_file():
        raise CheckpointError(f"{config}: missing; a Hugging Face checkpoint needs a config.json")
    return files_hash([config, *layout.files] + ([layout.index] if layout.index is not None else []))


def files_hash(files) -> str:
    """sha256 (hex) over ``files`` in name order: each one's name, size and bytes."""
    h = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        h.update(path.name.encode("utf-8") + b"\0" + str(path.stat().st_size).encode("ascii") + b"\0")
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()


# --- ModelOpt NVFP4 NemotronH checkpoints ----------------------------------------------------------
def load_nvfp4_checkpoint(checkpoint_dir: str | os.PathLike, keep_quantized: bool = False):
    """Read, validate and (unless ``keep_quantized``) dequantize a ModelOpt NVFP4 NemotronH checkpoint.

    Returns ``(config, weights)`` with canonical names like :func:`builder.checkpoint.load_checkpoint`.
    Dequantized weights are in the config's dtype; with ``keep_quantized`` packed weights are
    :class:`nvfp4_format.NVFP4Weight` objects (compute dtype: the config's) for the FP4 TensorRT lowering.
    Raises :class:`CheckpointError` with one line naming the file and tensor.
    """
    config = load_config(checkpoint_dir)
    qc = quantization.read_quant_config(checkpoint_dir)
    if qc is None:
        raise CheckpointError(f"{checkpoint_dir}: no {quantization.HF_QUANT_CONFIG} or quantization_config; not an NVFP4 checkpoint")
    layout = _locate(checkpoint_dir)
    raw: dict[str, torch.Tensor] = {}
    files: dict[str, Path] = {}
    for path in layout.files:
        mapped = mmap_tensors(path, layout.names[path])  # headers only: bytes are paged in when used
        for stored in layout.names[path]:
            name = canonical_name(stored)
            if name in raw:
                raise CheckpointError(f"{path}: tensor {stored!r} duplicates another tensor named {name!r}")
            t = mapped[stored]
            fused = _FUSED_EXPERTS.match(name)
            if fused:
                if t.dtype == torch.uint8:
                    raise CheckpointError(f"{path}: tensor {stored!r}: fused NVFP4 expert tensors are not "
                                          "supported; store experts.{e}.up_proj.weight / down_proj.weight "
                                          "per expert")
                for e in range(t.shape[0]):
                    split = f"{fused.group(1)}.{e}.{fused.group(2)}.weight"
                    raw[split], files[split] = t[e], path
                continue
            raw[name], files[name] = t, path
    expected, optional = expected_tensors(config), optional_tensors(config)
    shapes = dict(optional)
    shapes.update(expected)
    if config.num_nextn_predict_layers > 0 and "mamba" not in config.mtp_layer_types:
        shapes.update(mtp_tensors(config))
    where_of = {n: str(files[n]) for n in raw}
    dtype = getattr(torch, config.dtype)

    weights = quantization.nvfp4_weights(raw, qc, shapes, dtype, where=str(layout.where))
    # the logical checkpoint: same rules as an unquantized one
    missing = [n for n in expected if n not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{layout.where}: missing tensor {missing[0]!r}, expected shape "
                              f"{_fmt(expected[missing[0]])}{more}")
    unknown = [n for n in weights if n not in expected and n not in optional and not n.startswith(MTP_PREFIX)]
    if unknown:
        raise CheckpointError(f"{where_of.get(unknown[0], layout.where)}: unexpected tensor {unknown[0]!r} is not part "
                              f"of a NemotronH model with layers {config.hybrid_override_pattern!r}")
    for name, w in weights.items():
        if isinstance(w, nvfp4_format.NVFP4Weight):
            continue
        if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise CheckpointError(f"{where_of.get(name, layout.where)}: tensor {name!r} has dtype "
                                  f"{nvfp4_format._dtype_name(w.dtype)}, expected float32, float16 or bfloat16 (or uint8 packed "
                                  "FP4 with its scales)")
        want = shapes.get(name)
        if want is not None and tuple(w.shape) != tuple(want):
            raise CheckpointError(f"{where_of.get(name, layout.where)}: tensor {name!r} has shape "
                                  f"{_fmt(tuple(w.shape))}, expected {_fmt(tuple(want))}{defaulted_sizes(config)}")
    order = list(expected) + [n for n in optional if n in weights] + \
        sorted(n for n in weights if n.startswith(MTP_PREFIX))
    weights = {n: weights[n] for n in order}
    if not keep_quantized:
        weights = quantization.dequantize_weights(weights)
    return config, weights
