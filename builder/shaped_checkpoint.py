"""Random NemotronH checkpoints at the shapes NVIDIA ships, written tensor by tensor.

For tests and benchmarks only: ``python -m builder.random_checkpoint --config CONFIG.json --output_dir D``
reads a public ``config.json`` (Nemotron-H-8B, Nano-9B-v2, 3-Nano-30B-A3B, 3.5 Lightning, 3-Super) and
writes a sharded safetensors checkpoint with the real tensor names and shapes (``backbone.*``,
``lm_head.weight``, ``mtp.*`` where the config has MTP layers) plus ``model.safetensors.index.json``
and the config (``num_hidden_layers``, the pattern and ``vocab_size`` adjusted). No transformers model
is instantiated: the names and shapes come from :mod:`builder.checkpoint`'s expected-tensor spec, and
each tensor is drawn, written and dropped before the next (never more than one tensor in memory).

``--num_layers N`` keeps the first N entries of the layer pattern (MTP layers are kept whole).
``--quantize nvfp4_w4a16`` packs the linear weights as ModelOpt does (:mod:`builder.quantization`:
uint8 ``X.weight`` [out, in/2], float8 ``X.weight_scale`` [out, in/16], float32 ``X.weight_scale_2``)
and writes ``hf_quant_config.json`` and ``quantization_config``. ``--fill zeros`` writes a checkpoint
that is all structure (weights 0, norms and block scales 1): its files are sparse, so a 5 GB MoE layer
costs no disk and no time; loaders validate it like any other.

``--routable_experts N`` keeps a MoE layer at full width but lets its router choose among the first N
experts only (their correction bias raised by 2, beyond any sigmoid score): the other experts are
all-zero holes of a sparse file, so a 512-expert layer costs N/512 of its disk and memory while the
router, the expert choice and the routed products still run at the shipped shapes.

The experts of a MoE layer are written back to back (all ``up_proj`` in expert order, then all
``down_proj``), so a memory-mapped reader can stack them without a copy (:func:`builder.safetensors_io.stack`).
"""
from __future__ import annotations

import functools
import json
import math
import re
import zlib
from pathlib import Path
from typing import Iterator

import torch

from builder.atomic_dir import atomic_dir
from builder.checkpoint import INDEX_FILE, expected_tensors, mtp_tensors, storage_order
from builder.config import PATTERN_LETTERS, NemotronHConfig, parse_hf_config
from builder.errors import CheckpointError
from builder.safetensors_io import tensor_bytes, write_safetensors

FILLS = ("random", "zeros")
_KIND_LETTER = {v: k for k, v in PATTERN_LETTERS.items()}


def read_source_config(path) -> dict:
    """A public config.json as a dict, without the ``_``-prefixed annotation keys of ``shared/configs``."""
    from builder.quantization import _read_json
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: config file not found")
    raw = _read_json(path)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object at the top level")
    return {k: v for k, v in raw.items() if not k.startswith("_")}


def sliced_config(raw: dict, num_layers: int | None = None, vocab_size: int | None = None,
                  dtype: str = "bfloat16", where: str = "config.json", pattern: str | None = None,
                  mtp: bool = True) -> tuple[dict, NemotronHConfig]:
    """(the config.json to write, its parsed config) for the first ``num_layers`` pattern entries.

    For tests of one block at full width: ``pattern`` replaces the layer pattern (e.g. ``*`` for one
    attention block), ``mtp=False`` drops the MTP layers."""
    raw = dict(raw)
    if pattern is not None:
        for key in ("layers_block_type", "layer_types"):
            raw.pop(key, None)
        raw["hybrid_override_pattern"], raw["num_hidden_layers"] = pattern, len(pattern)
    if not mtp:
        raw["num_nextn_predict_layers"] = 0
        for key in ("mtp_hybrid_override_pattern", "mtp_layers_block_type", "mtp_layer_types"):
            raw.pop(key, None)
    config = parse_hf_config(raw, where)
    if num_layers is not None:
        if not 1 <= num_layers <= config.num_layers:
            raise CheckpointError(f"{where}: --num_layers {num_layers}: expected 1..{config.num_layers} "
                                  f"(the pattern has {config.num_layers} layers)")
        kinds = config.layer_types[:num_layers]
        for key in ("layers_block_type", "layer_types"):
            if raw.get(key) is not None:
                raw[key] = list(raw[key][:num_layers])
        raw["hybrid_override_pattern"] = "".join(_KIND_LETTER[k] for k in kinds)
        raw["num_hidden_layers"] = num_layers
    if vocab_size is not None:
        if vocab_size < 8:
            raise CheckpointError(f"{where}: --vocab_size {vocab_size}: expected at least 8")
        raw["vocab_size"] = vocab_size
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            ids = raw.get(key)
            if isinstance(ids, int) and ids >= vocab_size:
                raw[key] = min(ids, vocab_size - 1)
            elif isinstance(ids, list):
                raw[key] = [min(i, vocab_size - 1) for i in ids]
    raw["torch_dtype"] = dtype
    raw["dtype"] = dtype
    raw.pop("quantization_config", None)
    return raw, parse_hf_config(raw, where)


def logical_tensors(config: NemotronHConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the real checkpoint (MTP included), name -> shape, in writing order."""
    spec = dict(expected_tensors(config))
    if config.num_nextn_predict_layers > 0:
        spec.update(mtp_tensors(config))
    return {n: spec[n] for n in storage_order(spec)}


def quantized_names(shapes: dict[str, tuple[int, ...]]) -> tuple[list[str], list[str]]:
    """(weights packed to NVFP4, modules kept in high precision), as ``nemospec quantize`` decides."""
    from builder.quantization import choose_quantized
    return choose_quantized(shapes)


POOL_SIZE = 1_048_573  # a prime: a tiled tensor's rows are shifted, never repeated, copies of the pool


@functools.lru_cache(maxsize=16)
def _pool(dtype: torch.dtype, std: float) -> torch.Tensor:
    return (torch.randn(POOL_SIZE, generator=torch.Generator().manual_seed(20261201)) * std).to(dtype)


def _normal(shape, g: torch.Generator, dtype: torch.dtype, std: float = 1.0) -> torch.Tensor:
    """Standard normal values: drawn for tensors up to POOL_SIZE elements; above, a fixed pool of
    POOL_SIZE Gaussian values tiled from a random offset (drawing 2.8 B values for one Super MoE layer
    takes minutes on these CPUs; tiling runs at copy speed). Element i is pool[(offset + i) % POOL_SIZE]."""
    n = math.prod(shape)
    if n <= POOL_SIZE:
        return torch.randn(shape, generator=g, dtype=dtype).mul_(std)
    pool, out = _pool(dtype, std), torch.empty(n, dtype=dtype)
    pos, src = 0, int(torch.randint(POOL_SIZE, (1,), generator=g))
    while pos < n:
        k = min(n - pos, POOL_SIZE - src)
        out[pos:pos + k] = pool[src:src + k]
        pos, src = pos + k, 0
    return out.reshape(shape)


def init_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A deterministic random value for one tensor (the spread of :mod:`builder.random_checkpoint`:
    linear std 2/sqrt(fan_in), embeddings 0.5, router 1, norms 1 +- 0.1, A_log = log(1..H),
    softplus(dt_bias) log-uniform in [0.01, 0.1]); the same name and seed always give the same value.
    Large tensors tile a Gaussian pool (:func:`_normal`)."""
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) + 7919 * seed) % (2 ** 63))
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        value = torch.log(torch.arange(1, shape[0] + 1, dtype=torch.float32))
    elif leaf == "dt_bias":
        dt = torch.exp(torch.rand(shape, generator=g) * (math.log(0.1) - math.log(0.01)) + math.log(0.01))
        value = dt + torch.log(-torch.expm1(-dt))
    elif leaf == "D":
        value = torch.rand(shape, generator=g) + 0.5
    elif leaf == "e_score_correction_bias" or leaf == "bias":
        value = 0.1 * torch.randn(shape, generator=g)
    elif name.endswith("gate.weight"):
        value = torch.randn(shape, generator=g)
    elif name.endswith(("norm.weight", "norm_f.weight", "enorm.weight", "hnorm.weight", "final_layernorm.weight")):
        value = 1.0 + 0.1 * torch.randn(shape, generator=g)
    elif name.endswith("embeddings.weight"):
        value = _normal(shape, g, dtype, 0.5)
    elif name.endswith("conv1d.weight"):
        value = 0.3 * torch.randn(shape, generator=g)
    elif len(shape) >= 2:
        value = _normal(shape, g, dtype, 2.0 / math.sqrt(shape[-1]))
    else:
        raise CheckpointError(f"random checkpoint: no init rule for tensor {name} {list(shape)}")
    return value.to(dtype)


def _zeros_value(name: str, shape, dtype) -> torch.Tensor | None:
    """The structure-only fill: norms 1, A_log 0, everything else 0 (None: a hole in the file)."""
    if name.endswith("norm.weight") or name.endswith(("norm_f.weight", "enorm.weight", "hnorm.weight")):
        return torch.ones(shape, dtype=dtype)
    return None


_EXPERT = re.compile(r"\.mixer\.experts\.(\d+)\.")


def _unroutable(name: str, routable_experts: int | None) -> bool:
    """Whether ``name`` is a weight of an expert the router can never choose (left a hole)."""
    m = _EXPERT.search(name) if routable_experts is not None else None
    return m is not None and int(m.group(1)) >= routable_experts


def stored_tensors(config: NemotronHConfig, dtype: torch.dtype, quantize: bool, fill: str = "random",
                   seed: int = 0, routable_experts: int | None = None) -> tuple[dict, callable, list[str]]:
    """(stored name -> (dtype, shape) in file order, produce(name) -> tensor or None, excluded modules)."""
    from builder.nvfp4_format import quantize_nvfp4
    logical = logical_tensors(config)
    packed, excluded = quantized_names(logical) if quantize else ([], [])
    packed_set = set(packed)
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, shape in logical.items():
        if name in packed_set:
            specs[name] = (torch.uint8, (*shape[:-1], shape[-1] // 2))
            specs[name + "_scale"] = (torch.float8_e4m3fn, (*shape[:-1], shape[-1] // 16))
            specs[name + "_scale_2"] = (torch.float32, ())
        else:
            specs[name] = (dtype, shape)
    pending: dict[str, torch.Tensor] = {}  # the scales of the weight just packed (written right after it)

    def produce(name: str):
        if name in pending:
            return pending.pop(name)
        base = name
        if base in packed_set:
            shape = logical[base]
            if fill == "zeros" or _unroutable(base, routable_experts):
                pending[base + "_scale"] = torch.full(specs[base + "_scale"][1], 1.0).to(torch.float8_e4m3fn)
                pending[base + "_scale_2"] = torch.tensor(1.0)
                return None
            q, scale, scale_2 = quantize_nvfp4(init_tensor(base, shape, dtype, seed))
            pending[base + "_scale"], pending[base + "_scale_2"] = scale, scale_2
            return q
        shape = logical[name]
        if fill == "zeros":
            return _zeros_value(name, shape, dtype)
        if _unroutable(name, routable_experts):
            return None
        value = init_tensor(name, shape, dtype, seed)
        if routable_experts is not None and name.endswith("e_score_correction_bias"):
            value[:routable_experts] += 2.0   # a sigmoid score is below 1: these always win
        return value
    return specs, produce, excluded


def plan_shards(specs: dict, max_shard_bytes: int) -> list[list[str]]:
    """Tensors grouped into shards of at most ``max_shard_bytes``, never splitting a unit (a block's
    tensors, or one projection's run of experts, which must stay back to back in one file); a unit
    larger than the limit gets a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for unit in _units(specs):
        unit_bytes = sum(tensor_bytes(*specs[n]) for n in unit)
        if shards[-1] and size + unit_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(unit)
        size += unit_bytes
    return shards


def _units(specs: dict) -> Iterator[list[str]]:
    """Consecutive tensors of one block (``backbone.layers.i`` / ``mtp.layers.i``), one projection's
    experts (with their NVFP4 scales), or one other tensor."""
    unit, key = [], None
    for name in specs:
        parts = name.split(".")
        k = ".".join(parts[:3]) if parts[1] == "layers" else name
        if ".experts." in name:
            k += "." + next(p for p in parts if p.endswith("_proj"))
        if unit and k != key:
            yield unit
            unit = []
        unit.append(name)
        key = k
    if unit:
        yield unit


def write_shaped_checkpoint(config_path, output_dir, num_layers: int | None = None, dtype: str = "bfloat16",
                            quantize: str | None = None, vocab_size: int | None = None, fill: str = "random",
                            seed: int = 0, max_shard_gb: float = 4.0, log=print, pattern: str | None = None,
                            mtp: bool = True, routable_experts: int | None = None) -> dict:
    """Writes the checkpoint (under a temporary name, renamed into place at the end); returns a summary."""
    from builder.quantization import FORMAT_NAME, HF_QUANT_CONFIG, QUANT_ALGO, QuantConfig
    if fill not in FILLS:
        raise CheckpointError(f"--fill: expected one of {', '.join(FILLS)}, got {fill}")
    if quantize not in (None, FORMAT_NAME):
        raise CheckpointError(f"--quantize: expected {FORMAT_NAME}, got {quantize}")
    if dtype not in ("float32", "float16", "bfloat16"):
        raise CheckpointError(f"--dtype: expected float32, float16 or bfloat16, got {dtype}")
    raw, config = sliced_config(read_source_config(config_path), num_layers, vocab_size, dtype, str(config_path),
                                pattern, mtp)
    if routable_experts is not None and not (config.num_experts_per_tok <= routable_experts <= config.n_routed_experts):
        raise CheckpointError(f"--routable_experts: expected {config.num_experts_per_tok}..{config.n_routed_experts} "
                              f"(the config's num_experts_per_tok..n_routed_experts), got {routable_experts}")
    specs, produce, excluded = stored_tensors(config, getattr(torch, dtype), quantize is not None, fill, seed,
                                              routable_experts)
    shards = plan_shards(specs, int(max_shard_gb * 2 ** 30))
    total = sum(tensor_bytes(*s) for s in specs.values())
    qc = QuantConfig(QUANT_ALGO, 16, tuple(sorted(set(excluded)))) if quantize else None
    if qc is not None:
        raw["quantization_config"] = qc.quantization_config()
    weight_map = {}
    with atomic_dir(output_dir) as tmp:
        for i, names in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            log(f"writing {file} ({len(names)} tensors)")
            write_safetensors(tmp / file, {n: specs[n] for n in names}, produce)
            weight_map.update({n: file for n in names})
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        if qc is not None:
            (tmp / HF_QUANT_CONFIG).write_text(json.dumps(qc.hf_quant_config(), indent=4) + "\n")
    return {"output_dir": str(output_dir), "pattern": config.hybrid_override_pattern, "tensors": len(specs),
            "bytes": total, "shards": len(shards), "quantized": quantize, "fill": fill}
