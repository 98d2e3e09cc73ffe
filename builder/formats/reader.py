"""Reading a draft checkpoint directory through one layout: config, tensor headers, validation, tensors.

A :class:`Layout` says how one checkpoint family spells things: the config file, how stored tensor
names map onto the canonical names of :mod:`builder.formats.tensors`, how its config keys become a
config of :mod:`builder.models.draft_configs` (``parse``), and optional fix-ups (fused projections
split, weights rearranged). :func:`load` does the rest the same way for every layout: the headers
are checked against the config's required and optional tensors before any tensor data is read.
Every error is a one-line :class:`~builder.errors.DraftError` naming the file and the tensor.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open

from builder.checkpoint import checkpoint_files
from builder.errors import CheckpointError, DraftError
from builder.formats.fields import Fields
from builder.formats.tensors import draft_tensors, fmt
from builder.safetensors_io import check_finite

CONFIG_FILE = "config.json"
FLOAT_DTYPES = ("F32", "F16", "BF16")
INT_DTYPES = ("I64", "I32")
#: tensors a checkpoint may carry that inference does not use
IGNORED = ("t2d", "verifier_norm.weight", "verifier_lm_head.weight")
#: entry: (file, stored name, shape, safetensors dtype, (row start, rows) of a fused tensor or None)
Entry = tuple


@dataclass(frozen=True)
class Layout:
    """How one checkpoint family stores a draft."""

    name: str
    #: (Fields of the config, canonical tensor names, canonical name -> shape) -> draft config
    parse: Callable[[Fields, set, dict], Any]
    #: stored tensor name -> canonical name
    canonical: Callable[[str], str] = staticmethod(lambda stored: stored)
    #: (entries, config data) -> entries with fused tensors split into virtual per-part entries
    unpack: Callable[[dict, dict], dict] | None = None
    #: (cfg, canonical name -> tensor) -> weights as the module expects them
    convert: Callable[[Any, dict], dict] | None = None
    config_file: str = CONFIG_FILE
    #: files holding the tensors (default: model.safetensors or the shards of its index)
    files: Callable[[Path], list] | None = None
    #: canonical name -> stored name, for messages about a tensor that is missing
    stored: Callable[[str], str] = staticmethod(lambda name: name)
    #: canonical names a checkpoint may carry that this layout does not use
    ignored: tuple = ()
    #: typed reads of the config (a layout with other key names maps them, and its errors name its keys)
    fields: Callable[[dict, str], Fields] = Fields


def strip_model_prefix(stored: str) -> str:
    """Hugging Face layouts may store everything under ``model.`` (the LM head stays as it is)."""
    return stored[len("model."):] if stored.startswith("model.") and not stored.startswith("model.lm_head") else stored


def read_json(path: Path, what: str) -> tuple[dict, str]:
    directory = path.parent
    if not directory.is_dir():
        raise DraftError(f"{directory}: draft checkpoint directory not found")
    if not path.is_file():
        raise DraftError(f"{path}: missing; a draft checkpoint needs a {what}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DraftError(f"{path}: invalid JSON ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise DraftError(f"{path}: expected a JSON object")
    return data, str(path)


def read_config(directory: Path) -> tuple[dict, str]:
    return read_json(directory / CONFIG_FILE, CONFIG_FILE)


@contextmanager
def _opened(path: Path):
    """``safe_open`` with safetensors' own errors (a cut-off file, a damaged header) as one line
    naming the file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise DraftError(f"{path}: not a readable safetensors file ({' '.join(str(e).split())})") from None


def headers(files) -> dict[str, Entry]:
    """stored name -> entry over all files."""
    entries: dict[str, Entry] = {}
    for path in files:
        with _opened(path) as f:
            for name in f.keys():
                sl = f.get_slice(name)
                if name in entries:
                    raise DraftError(f"{path}: tensor {name!r} is stored twice (also in {entries[name][0].name})")
                entries[name] = (path, name, tuple(sl.get_shape()), sl.get_dtype(), None)
    return entries


def _quant_config(directory: Path):
    from builder.quantization import read_quant_config
    try:
        return read_quant_config(directory)
    except CheckpointError as e:
        raise DraftError(str(e)) from None


def _article(kind: str) -> str:
    return "an" if kind[:1] in "aeiou" else "a"


def load(directory: Path, layout: Layout, data: dict, where: str, read: bool, keep_quantized: bool = True,
         quantized: bool = True):
    """(cfg, canonical name -> tensor) of the draft in ``directory`` stored in ``layout`` (config
    ``data`` read from ``where``). ``quantized``: a ModelOpt NVFP4 quantization config is honoured
    (packed weights become :class:`builder.nvfp4_format.NVFP4Weight`, or plain tensors with
    ``keep_quantized=False``); with ``read=False`` only headers are read."""
    from builder.quantization import _SCALE_SUFFIXES
    qc = _quant_config(directory) if quantized else None
    files = layout.files(directory) if layout.files is not None else checkpoint_files(directory)
    stored_entries = headers(files)
    entries: dict[str, Entry] = {}
    for stored, entry in stored_entries.items():
        name = layout.canonical(stored)
        if name in entries:
            raise DraftError(f"{entry[0]}: tensor {stored!r} duplicates {entries[name][1]!r} (both are {name!r})")
        entries[name] = entry
    if layout.unpack is not None:
        entries = layout.unpack(entries, data)
    shapes = {n: e[2] for n, e in entries.items()}
    cfg = layout.parse(layout.fields(data, where), set(entries), shapes)
    required, optional = draft_tensors(cfg)
    missing = [n for n in required if n not in entries]
    if missing:
        names = sorted({e[0].name for e in stored_entries.values()}) or ["(no tensors)"]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        hint = ""
        if missing[0] == "d2t":
            hint = (f"; draft_vocab_size {cfg.draft_vocab_size} != target vocab_size {cfg.target_vocab_size} "
                    f"needs the d2t draft->target id map")
        raise DraftError(f"{directory / names[0]}: missing tensor {layout.stored(missing[0])!r}, expected shape "
                         f"{fmt(required[missing[0]])}{hint}{more}")
    entries = {n: e for n, e in entries.items() if n not in IGNORED and n not in layout.ignored}
    for name, (path, stored, shape, dtype, _) in entries.items():
        if qc is not None and name.endswith(_SCALE_SUFFIXES):
            base = name[:name.rfind(".")] + ".weight"
            if base not in entries:
                raise DraftError(f"{path}: tensor {stored!r} has no packed FP4 weight {base!r}")
            continue  # validated with its weight (builder.quantization) when read
        want = required.get(name, optional.get(name))
        if want is None:
            raise DraftError(f"{path}: unexpected tensor {stored!r} for {_article(cfg.kind)} {cfg.kind} draft "
                             f"({cfg.architecture}, {cfg.num_hidden_layers} layer(s))")
        if qc is not None and dtype == "U8" and name.endswith(".weight"):
            packed = tuple(want[:-1]) + (want[-1] // 2,)
            if shape != packed or want[-1] % 2:
                raise DraftError(f"{path}: packed FP4 tensor {stored!r} has shape {fmt(shape)}, expected "
                                 f"{fmt(packed)} for logical shape {fmt(want)} (odd or wrong packed length)")
            if name + "_scale" not in entries:
                raise DraftError(f"{path}: packed FP4 tensor {stored!r} has no {name + '_scale'!r} block scales")
            continue
        if shape != want:
            raise DraftError(f"{path}: tensor {stored!r} has shape {fmt(shape)}, expected {fmt(want)}")
        allowed = INT_DTYPES if name == "d2t" else FLOAT_DTYPES
        if dtype not in allowed:
            raise DraftError(f"{path}: tensor {stored!r} has dtype {dtype}, expected one of {', '.join(allowed)}"
                             + ("" if qc is not None or not quantized else
                                " (no quantization config: not an NVFP4 checkpoint)"))
    if not read:
        return cfg, {}
    weights = _read(entries)
    if qc is not None:
        from builder.quantization import dequantize_weights, nvfp4_weights
        try:
            weights = nvfp4_weights(weights, qc, {**optional, **required}, where=str(directory))
        except CheckpointError as e:
            raise DraftError(str(e)) from None
        if not keep_quantized:
            weights = dequantize_weights(weights)
    if "d2t" in weights:
        d2t = weights["d2t"] = weights["d2t"].long()
        target_ids = torch.arange(d2t.shape[0]) + d2t
        vocab = cfg.target_vocab_size
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab:
            raise DraftError(f"{entries['d2t'][0]}: tensor 'd2t' maps draft ids outside the target vocabulary "
                             f"[0, {vocab})")
    if layout.convert is not None:
        weights = layout.convert(cfg, weights)
    return cfg, weights


def _read(entries: dict[str, Entry]) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name, entry in entries.items():
        by_file.setdefault(entry[0], []).append(name)
    for path, names in by_file.items():
        with _opened(path) as f:
            cache: dict[str, torch.Tensor] = {}
            for name in names:
                _, stored, _, _, part = entries[name]
                t = cache.get(stored)
                if t is None:
                    t = cache[stored] = f.get_tensor(stored)
                    check_finite(t, path, stored, scale=stored.endswith(("weight_scale", "weight_scale_2")))
                weights[name] = t if part is None else t[part[0]:part[0] + part[1]].contiguous()
    return weights
