"""EAGLE-1/2 and EAGLE-3 draft checkpoints: which layout a directory holds, and checks against the target.

``load_draft_checkpoint(dir)`` returns ``(cfg, weights)``: a frozen :class:`Eagle3Config` or
:class:`EagleConfig` and canonical name -> tensor (dtype as stored; ``d2t`` int64). Every error is a
one-line :class:`~builder.errors.DraftError` naming the file and the field or tensor at fault.

The layouts live in ``builder/formats`` (one file per family): speculators ``eagle3`` / ``eagle``
(:mod:`builder.formats.speculators`), the original EAGLE / EAGLE-3 of SafeAILab and SpecForge
(:mod:`builder.formats.specforge`), EagleMistralForCausalLM in its Hugging Face and Mistral native
layouts (:mod:`builder.formats.mistral`; the native one is a directory with ``params.json`` and
``consolidated.safetensors`` instead of ``config.json``). Which one follows from the checkpoint.

``validate_against_target(draft_cfg, target_cfg)`` checks a draft against its NemotronH target and
returns the draft config with its aux layer ids resolved: vLLM's default ``(2, L // 2, L - 3)`` when
the checkpoint pins none, and sorted ascending (vLLM captures them walking the layers, so ``fc``'s
input columns are in layer order).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from builder.checkpoint import checkpoint_hash, files_hash
from builder.errors import DraftError
from builder.formats import mistral, reader, specforge, speculators
from builder.formats.fields import ROPE_TYPES, Fields
from builder.formats.tensors import draft_tensors
from builder.models.draft_configs import FEATURE_CLASSES, Eagle3Config, EagleConfig, draft_config_from_dict as _from_dict

__all__ = [
    "Eagle3Config",
    "EagleConfig",
    "load_draft_checkpoint",
    "load_draft_config",
    "draft_config_from_dict",
    "draft_tensors",
    "validate_against_target",
    "default_aux_layer_ids",
    "draft_hash",
    "ROPE_TYPES",
]

EAGLE3_ARCHITECTURES = specforge.EAGLE3_ARCHITECTURES
EAGLE_ARCHITECTURES = specforge.EAGLE_ARCHITECTURES


def draft_config_from_dict(data) -> Eagle3Config | EagleConfig:
    """Inverse of ``cfg.to_dict()`` (for an engine directory's config.json)."""
    return _from_dict(data, FEATURE_CLASSES)


def _layout(f: Fields, names: set[str]) -> reader.Layout:
    """The layout of a config.json; ``names``: stored tensor names (some layouts are told by them)."""
    data = f.data
    if "speculators_model_type" in data:
        kind = data["speculators_model_type"]
        if kind in speculators.FEATURE_TYPES:
            return speculators.LAYOUTS[kind]
        raise f.fail("speculators_model_type", f"is {kind!r}: unsupported draft type "
                                              f"(supported: {', '.join(speculators.FEATURE_TYPES)})")
    archs = data.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise f.fail("architectures", f"must name the draft architecture, got {archs!r} "
                                      f"(and no speculators_model_type is set)")
    arch = archs[0]
    if arch == mistral.ARCHITECTURE:
        return mistral.HF_LAYOUT
    if arch in EAGLE3_ARCHITECTURES:
        return specforge.eagle3_layout(arch)
    plain = {reader.strip_model_prefix(n) for n in names}
    if arch in EAGLE_ARCHITECTURES or (arch == "LlamaForCausalLM" and "fc.weight" in plain):
        return specforge.eagle_layout(arch)
    supported = ", ".join(EAGLE3_ARCHITECTURES + EAGLE_ARCHITECTURES + (mistral.ARCHITECTURE,))
    raise f.fail("architectures", f"is {arch!r}: unknown draft architecture (supported: {supported}, "
                                  f"or a speculators config with speculators_model_type eagle/eagle3)")


def _parse(data: dict, where: str, names: set[str], shapes=None) -> Eagle3Config | EagleConfig:
    """The config of a config.json object (``names``: canonical tensor names present)."""
    f = Fields(data, where)
    return _layout(f, names).parse(f, names, shapes or {})


def load_draft_config(checkpoint_dir: str | os.PathLike) -> Eagle3Config | EagleConfig:
    """The draft's config (reads tensor headers to tell optional tensors apart; no tensor data)."""
    return _load(checkpoint_dir, read=False)[0]


def load_draft_checkpoint(checkpoint_dir: str | os.PathLike) -> tuple[Eagle3Config | EagleConfig, dict[str, torch.Tensor]]:
    """Read and validate an EAGLE / EAGLE-3 draft checkpoint: (cfg, canonical name -> tensor)."""
    return _load(checkpoint_dir, read=True)


def draft_hash(checkpoint_dir: str | os.PathLike) -> str:
    """sha256 of the files the draft is read from (a Mistral native draft has no config.json)."""
    directory = Path(checkpoint_dir)
    if mistral.is_native(directory):
        return files_hash([directory / mistral.PARAMS_FILE, directory / mistral.CONSOLIDATED])
    return checkpoint_hash(directory)


def _load(checkpoint_dir, read: bool):
    directory = Path(checkpoint_dir)
    if mistral.is_native(directory):
        data, where = mistral.read_params(directory)
        return reader.load(directory, mistral.NATIVE_LAYOUT, data, where, read, quantized=False)
    data, where = reader.read_config(directory)
    quant = directory / "hf_quant_config.json"
    if quant.is_file() or isinstance(data.get("quantization_config"), dict):   # a shape error named a packed tensor
        raise DraftError(f"{quant if quant.is_file() else where}: a quantized EAGLE draft; nemospec reads EAGLE and "
                         "EAGLE-3 drafts in bf16/fp16/fp32 (NVFP4 applies to the block drafts dflash, dspark, peagle)")
    stored = set(reader.headers(reader.checkpoint_files(directory)))
    layout = _layout(Fields(data, where), stored)
    return reader.load(directory, layout, data, where, read, quantized=False)


# --- against the target --------------------------------------------------------------------------
def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 capture layers for a target of ``num_layers`` layers."""
    return (2, num_layers // 2, num_layers - 3)


def validate_against_target(draft_cfg: Eagle3Config | EagleConfig, target_cfg) -> Eagle3Config | EagleConfig:
    """Check a draft against its target (a NemotronHConfig, or any config with ``hidden_size``,
    ``vocab_size`` and ``num_layers`` / ``num_hidden_layers``). Returns the draft config with
    ``aux_layer_ids`` resolved (EAGLE-3). Raises :class:`DraftError` naming the field."""
    c = draft_cfg
    target_hidden = int(target_cfg.hidden_size)
    target_vocab = int(target_cfg.vocab_size)
    layers = getattr(target_cfg, "num_layers", None)
    if layers is None:
        layers = getattr(target_cfg, "num_hidden_layers")
    layers = int(layers)
    if isinstance(c, Eagle3Config):
        if c.target_hidden_size != target_hidden:
            field = "target_hidden_size" if c.target_hidden_size != c.hidden_size else "hidden_size"
            raise DraftError(f"eagle3 draft: {field} {c.target_hidden_size} does not match the target's "
                             f"hidden_size {target_hidden}")
        if not c.has_embedding and c.hidden_size != target_hidden:
            raise DraftError(f"eagle3 draft: hidden_size {c.hidden_size} differs from the target's hidden_size "
                             f"{target_hidden} and the draft ships no embed_tokens.weight to use instead")
        if c.target_vocab_size != target_vocab:
            raise DraftError(f"eagle3 draft: vocab_size (target vocabulary) {c.target_vocab_size} does not match "
                             f"the target's vocab_size {target_vocab}")
        if c.draft_vocab_size != target_vocab and not c.has_d2t:
            raise DraftError(f"eagle3 draft: draft_vocab_size {c.draft_vocab_size} != target vocab_size "
                             f"{target_vocab} but the checkpoint has no d2t tensor")
        if c.draft_vocab_size > target_vocab:
            raise DraftError(f"eagle3 draft: draft_vocab_size {c.draft_vocab_size} exceeds the target's "
                             f"vocab_size {target_vocab}")
        ids = c.aux_layer_ids if c.aux_layer_ids is not None else default_aux_layer_ids(layers)
        if len(ids) != c.num_aux:
            raise DraftError(f"eagle3 draft: eagle_aux_hidden_state_layer_ids has {len(ids)} ids but fc.weight "
                             f"expects {c.num_aux}")
        bad = [i for i in ids if not 0 <= i <= layers]
        if bad:
            origin = "" if c.aux_layer_ids is not None else " (vLLM's default for this target)"
            raise DraftError(f"eagle3 draft: eagle_aux_hidden_state_layer_ids {list(ids)}{origin} has id {bad[0]} "
                             f"outside [0, {layers}] for a target of {layers} layers")
        if len(set(ids)) != len(ids):
            raise DraftError(f"eagle3 draft: eagle_aux_hidden_state_layer_ids {list(ids)} repeats a layer id")
        # vLLM (and speculators' datagen through it) appends captured states while walking the layers,
        # so fc's input columns are in ascending layer order whatever order the config lists
        return dataclasses.replace(c, aux_layer_ids=tuple(sorted(ids)))
    # a Mistral native draft names its keys in params.json
    hidden_key, where = ("dim", f" ({mistral.PARAMS_FILE})") if c.source == "mistral_native" else ("hidden_size", "")
    if c.hidden_size != target_hidden:
        raise DraftError(f"eagle draft{where}: {hidden_key} {c.hidden_size} does not match the target's hidden_size "
                         f"{target_hidden}")
    if c.vocab_size != target_vocab:
        raise DraftError(f"eagle draft{where}: vocab_size {c.vocab_size} does not match the target's vocab_size "
                         f"{target_vocab}")
    return c
