"""Refit maps: which safetensors bytes fill each refittable weight of a weight-stripped engine.

With ``nemospec build --strip_plan`` every constant of a network that views a tensor of the engine
directory's own ``weights/*.safetensors`` (memory-mapped, :mod:`builder.safetensors_io`) is named and
marked refittable, and TensorRT leaves its bytes out of the plan (``BuilderFlag.STRIP_PLAN`` with
``REFIT_INDIVIDUAL``). The refit map, ``refit_map.json`` in the engine directory, lists for each
engine every refittable weight name -> the file, the tensors whose bytes (back to back, in that order)
make it, and its shape and dtype. Experts of a MoE layer are one constant made of E consecutive
tensors. An NVFP4 weight is three: its packed FP4 bytes, FP8 block scales and FP32 global scale (of an
expert stack: E of each, back to back), each entry saying the TensorRT type and shape of its bytes. A constant that is derived from the checkpoint (``A = -exp(A_log)``, a few hundred bytes) is
not refittable and stays in the plan; the map records how many bytes stayed.

At load (:func:`refit_tensors`) the same bytes are read back, again without a copy, and handed to the
TensorRT ``Refitter``: the target, verify and draft engines all refit from the one copy of the weights.

tensorrt_rtx 1.7 cannot build refittable or stripped engines without a GPU (any REFIT/STRIP_PLAN flag
fails its compiler's CUDA check). There ``--strip_plan`` records each such weight as a network input
of static shape instead (method "inputs"): the plan holds no weight, and the runner binds the same
safetensors bytes (:func:`input_weights`, one device copy shared by the engines) at every execution.
It takes FP4 and FP8 inputs, so NVFP4 bytes are bound as the file holds them and dequantized in the
network (the lowering: ``builder.backends.trt_recorder.Recorder.nvfp4_weight``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Mapping

import torch

from builder.safetensors_io import DTYPE_CODES, mmap_tensors

REFIT_MAP_FILE = "refit_map.json"
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


class Provenance:
    """Finds, for a contiguous tensor, the run of back-to-back tensors of one mapped file it views.

    ``files``: (file name relative to the engine directory, ``name -> tensor`` dict) pairs; a file may
    come more than once (the tensors written into it, and its memory mapping).
    """

    def __init__(self, files: Iterable[tuple[str, Mapping[str, torch.Tensor]]]):
        self._at: dict[tuple[int, int], tuple[str, str, torch.Tensor]] = {}
        for file, tensors in files:
            for name, t in tensors.items():
                if isinstance(t, torch.Tensor) and t.numel():
                    self._at[(t.untyped_storage().data_ptr(), t.storage_offset() * t.element_size())] = (file, name, t)

    def resolve(self, t: torch.Tensor) -> tuple[str, list[str]] | None:
        """(file, [tensor names]) whose bytes, concatenated, are exactly ``t``'s; None if none are."""
        if type(t) is not torch.Tensor or not t.is_contiguous() or not t.numel():
            return None
        ptr = t.untyped_storage().data_ptr()
        offset, end = t.storage_offset() * t.element_size(), (t.storage_offset() + t.numel()) * t.element_size()
        names, file = [], None
        while offset < end:
            hit = self._at.get((ptr, offset))
            if hit is None or (file is not None and hit[0] != file):
                return None
            file = hit[0]
            names.append(hit[1])
            offset += hit[2].numel() * hit[2].element_size()
        return (file, names) if offset == end else None


def weights_name(names: list[str], taken: Mapping) -> str:
    """A unique refit name: the tensor name, or ``first..last`` for a run of tensors."""
    base = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}#{n}"
    return name


def entry(file: str, names: list[str], t: torch.Tensor, layer: str, network: dict | None = None) -> dict:
    """``shape``/``dtype``: the bytes as the file holds them; ``network`` (NVFP4 weights only): the
    TensorRT type and shape the same bytes have in the network (``{"dtype": "FP4", "shape": [out, in]}``
    for packed uint8 ``[out, in/2]``; ``"FP8"`` for float8_e4m3fn block scales)."""
    e = {"file": file, "tensors": names, "shape": list(t.shape), "dtype": DTYPE_CODES[t.dtype], "layer": layer}
    return dict(e, network=network) if network else e


def network_shape(e: dict) -> list[int]:
    """The shape a map entry's weight has in the network (FP4: twice the packed bytes' last dim)."""
    return e.get("network", e)["shape"]


def _trt_weights_type(e: dict, dtype: torch.dtype):
    from builder.backends.trt_dtypes import trt_dtype
    from builder.backends.trt_import import trt
    return getattr(trt.DataType, e["network"]["dtype"]) if "network" in e else trt_dtype(dtype)


def mark_refittable(recorder, t: torch.Tensor, weights, layer_name: str, network: dict | None = None) -> None:
    """A constant that views bytes of the engine directory's safetensors (``recorder.refit``, a
    :class:`Provenance`) is named after them and marked refittable; other constants stay in the plan.
    ``network``: an FP4/FP8 constant's TensorRT type and logical shape (see :func:`entry`)."""
    hit = recorder.refit.resolve(t)
    if hit is None:
        recorder.plan_bytes += t.numel() * t.element_size()
        return
    name = weights_name(hit[1], recorder.refit_weights)
    recorder.network.set_weights_name(weights, name)
    recorder.network.mark_weights_refittable(name)
    recorder.refit_weights[name] = entry(hit[0], hit[1], t, layer_name, network)


def weight_input(recorder, t: torch.Tensor, network: dict | None = None):
    """Method "inputs": a weight that views the engine directory's safetensors becomes a network input of
    static shape (bound at load to those bytes, FP4 and FP8 ones as they are); None for any other
    constant. ``network``: an FP4/FP8 weight's TensorRT type and logical shape (see :func:`entry`)."""
    hit = recorder.refit.resolve(t)
    if hit is None:
        return None
    name = weights_name(hit[1], recorder.refit_weights)
    e = dict(entry(hit[0], hit[1], t, name, network), input=True)
    tensor = recorder.network.add_input(name, _trt_weights_type(e, t.dtype), tuple(network_shape(e)))
    recorder.refit_weights[name] = e
    return tensor


def write_refit_map(directory, engines: Mapping[str, dict]) -> Path:
    path = Path(directory) / REFIT_MAP_FILE
    path.write_text(json.dumps({"format": "nemospec-refit-map/1", "engines": dict(engines)}, indent=1))
    return path


def read_refit_map(directory) -> dict:
    return json.loads((Path(directory) / REFIT_MAP_FILE).read_text())["engines"]


def refit_tensors(directory, weights: Mapping[str, dict]) -> dict[str, torch.Tensor]:
    """Refit name -> tensor (a view of the engine directory's safetensors) for one engine's map."""
    directory = Path(directory)
    files = {f: mmap_tensors(directory / f) for f in {e["file"] for e in weights.values()}}
    out = {}
    for name, e in weights.items():
        parts = [files[e["file"]][n] for n in e["tensors"]]
        first = parts[0]
        flat = torch.as_strided(first, (sum(p.numel() for p in parts),), (1,), first.storage_offset()) \
            if len(parts) > 1 else first.reshape(-1)
        out[name] = flat.view(_CODE_DTYPES[e["dtype"]]).reshape(e["shape"]) if first.dtype != _CODE_DTYPES[e["dtype"]] \
            else flat.reshape(e["shape"])
    return out


def refit_engine(engine, directory, name: str, logger=None) -> int:
    """Refit a deserialized weight-stripped engine (``name``: target, verify, draft, ...) from the engine
    directory's safetensors by its refit map; returns the number of weights set (0: nothing to refit).
    Raises RuntimeError naming a weight TensorRT refused or still misses."""
    from builder.backends.trt_import import trt
    directory = Path(directory)
    if not (directory / REFIT_MAP_FILE).is_file():
        return 0
    entries = read_refit_map(directory).get(name)
    if not entries or not entries["weights"] or entries.get("method") == "inputs":
        return 0
    refitter = trt.Refitter(engine, logger or trt.Logger(trt.Logger.WARNING))
    tensors = refit_tensors(directory, entries["weights"])
    for wname, t in tensors.items():
        e = entries["weights"][wname]  # FP4/FP8 bytes as they are, counted in the network's elements
        weights = trt.Weights(_trt_weights_type(e, t.dtype), t.data_ptr(), math.prod(network_shape(e)))
        if not refitter.set_named_weights(wname, weights):
            raise RuntimeError(f"{directory / REFIT_MAP_FILE}: engine {name}: TensorRT refused weight {wname!r} "
                               f"{list(t.shape)}")
    missing = refitter.get_missing_weights()
    if missing:
        raise RuntimeError(f"{directory / REFIT_MAP_FILE}: engine {name}: no refit entry for weight {missing[0]!r} "
                           f"(and {len(missing) - 1} more)")
    if not refitter.refit_cuda_engine():
        raise RuntimeError(f"{directory}: engine {name}: TensorRT could not refit the engine")
    return len(tensors)


def input_weights(directory, name: str, device: str = "cuda", cache: dict | None = None) -> dict[str, torch.Tensor]:
    """``--strip_plan`` engines whose weights are inputs (method "inputs"): input name -> the tensor to
    bind, read from the engine directory's safetensors and moved to ``device`` once; ``cache`` (keyed by
    file and tensors) lets the target and verify engines share one device copy of the same bytes."""
    directory = Path(directory)
    if not (directory / REFIT_MAP_FILE).is_file():
        return {}
    entries = read_refit_map(directory).get(name) or {}
    if entries.get("method") != "inputs":
        return {}
    weights = entries["weights"]
    host = refit_tensors(directory, weights)
    cache = {} if cache is None else cache
    out = {}
    for n, e in weights.items():
        key = (str(directory), e["file"], tuple(e["tensors"]), device)
        if key not in cache:
            cache[key] = host[n].to(device).contiguous()
        out[n] = cache[key]
    return out
