"""``nemospec quantize``: write a ModelOpt-layout W4A16 NVFP4 copy of a NemotronH checkpoint."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Sequence

from builder.checkpoint import check_finite_weights, load_checkpoint
from builder.errors import CheckpointError
from builder.nvfp4_format import BLOCK_SIZE
from builder.quantization import (CONFIG_FILE, HF_QUANT_CONFIG, PRODUCER, QUANT_ALGO, QuantConfig, _module, _read_json,
                                  choose_quantized, quantize_tensors, read_quant_config)

__all__ = ["quantize_checkpoint"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def _earlier_output(directory: Path) -> bool:
    """A directory `nemospec quantize` wrote before (its hf_quant_config.json names nemospec as the
    producer): the only kind it replaces, so a mistyped --output_dir never deletes a checkpoint."""
    try:
        producer = json.loads((directory / HF_QUANT_CONFIG).read_text()).get("producer") or {}
        return producer.get("name") == PRODUCER["name"]
    except (OSError, ValueError, AttributeError):
        return False


def quantize_checkpoint(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                        exclude_modules: Sequence[str] = (), log=print) -> dict:
    """Write a ModelOpt-layout W4A16 NVFP4 checkpoint of a bf16/fp16/fp32 NemotronH checkpoint.

    Quantizes the linear layers (experts included) except ModelOpt's default exclusions and
    ``exclude_modules`` (module names or fnmatch wildcards); a linear whose input dim is not a multiple
    of 16 is kept too (and listed). Writes ``model.safetensors``, ``config.json`` (with
    ``quantization_config``), ``hf_quant_config.json`` and the tokenizer files under a temporary name,
    renamed into place at the end. Returns a summary dict. Raises :class:`CheckpointError`.
    """
    from builder.safetensors_io import write_safetensors

    src, dst = Path(checkpoint_dir), Path(output_dir)
    if read_quant_config(src) is not None:
        raise CheckpointError(f"{src}: already a quantized checkpoint (it has a quantization config)")
    if src.resolve() == dst.resolve():
        raise CheckpointError(f"--output_dir {dst}: must differ from --checkpoint_dir")
    from builder.atomic_dir import atomic_dir, check_output_dir
    check_output_dir(dst, replaceable=_earlier_output, inputs={"--checkpoint_dir": src})   # before minutes of work
    _config, weights = load_checkpoint(src)
    check_finite_weights(src, weights)
    chosen, excluded = choose_quantized({n: tuple(w.shape) for n, w in weights.items()}, exclude_modules, log)
    if not chosen:
        raise CheckpointError(f"{src}: no linear layer left to quantize (check --exclude_modules)")
    qc = QuantConfig(QUANT_ALGO, BLOCK_SIZE, tuple(sorted(set(excluded))))  # module names, as ModelOpt lists them
    log(f"quantizing {len(chosen)} linear weights to NVFP4 (W4A16, blocks of {BLOCK_SIZE}); "
        f"{len(set(excluded))} modules kept in high precision")
    tensors = quantize_tensors(weights, chosen)
    tensors = {n: t.contiguous() for n, t in tensors.items()}

    raw_config = _read_json(src / CONFIG_FILE)
    raw_config["quantization_config"] = qc.quantization_config()
    with atomic_dir(dst, replaceable=_earlier_output, inputs={"--checkpoint_dir": src}) as tmp:
        # our writer, not safetensors' save_file: that one writes mode 0600 (a server running as
        # another user could not read the checkpoint) and copies every tensor into one buffer first
        write_safetensors(tmp / "model.safetensors", {n: (t.dtype, t.shape) for n, t in tensors.items()},
                          tensors.__getitem__)
        (tmp / CONFIG_FILE).write_text(json.dumps(raw_config, indent=2) + "\n")
        (tmp / HF_QUANT_CONFIG).write_text(json.dumps(qc.hf_quant_config(), indent=4) + "\n")
        copied = [f for f in _TOKENIZER_FILES if (src / f).is_file()]
        for f in copied:
            shutil.copy2(src / f, tmp / f)
    before = sum(w.numel() * w.element_size() for w in weights.values())
    after = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"quantized": [_module(n) for n in chosen], "excluded": qc.exclude_modules, "bytes_before": before,
            "bytes_after": after, "copied": copied, "output_dir": str(dst)}


