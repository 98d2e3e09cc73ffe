"""DFlash, DSpark and P-EAGLE draft checkpoints: which layout a directory holds, and checks against the target.

Companion of :mod:`builder.draft_checkpoint` (EAGLE / EAGLE-3) for the drafts that propose several
tokens in one forward. ``load_block_draft_checkpoint(dir)`` returns ``(cfg, weights)``: a frozen
:class:`DFlashConfig`, :class:`DSparkConfig` or :class:`PEagleConfig` and canonical name -> tensor
(dtype as stored; ``d2t`` int64). Every error is a one-line :class:`~builder.errors.DraftError`
naming the file and the field or tensor at fault. ``is_block_draft(dir)`` tells whether a
directory holds one of these (so a caller can dispatch between the two loaders).

The layouts live in ``builder/formats``: speculators ``dflash`` / ``dspark`` / ``peagle``
(:mod:`builder.formats.speculators`), z-lab / DeepSpec (:mod:`builder.formats.zlab`) and NVIDIA's
Nemotron 3.5 Lightning drafts (:mod:`builder.formats.nemotron35`). Which one follows from the checkpoint.

``validate_block_draft(cfg, target_cfg)`` checks a draft against its NemotronH target (hidden size,
vocabulary, d2t, layer ids in [0, L], mask token) and returns the config with its layer ids sorted
ascending (the capture order of vLLM and of our fused hidden capture).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from builder.draft_checkpoint import validate_against_target
from builder.errors import DraftError
from builder.formats import nemotron35, reader, speculators, zlab
from builder.formats.fields import MARKOV_HEAD_TYPES, Fields
from builder.formats.tensors import draft_tensors as block_draft_tensors
from builder.models.draft_configs import BLOCK_CLASSES, DFlashConfig, DSparkConfig, PEagleConfig
from builder.models.draft_configs import draft_config_from_dict as _from_dict

__all__ = [
    "DFlashConfig",
    "DSparkConfig",
    "PEagleConfig",
    "BLOCK_SPECULATORS_TYPES",
    "BLOCK_ARCHITECTURES",
    "MARKOV_HEAD_TYPES",
    "is_block_draft",
    "load_block_draft_checkpoint",
    "load_block_draft_config",
    "block_draft_config_from_dict",
    "block_draft_tensors",
    "validate_block_draft",
]

BLOCK_SPECULATORS_TYPES = speculators.BLOCK_TYPES
BLOCK_ARCHITECTURES = zlab.ARCHITECTURES


def block_draft_config_from_dict(data) -> DFlashConfig | DSparkConfig | PEagleConfig:
    """Inverse of ``cfg.to_dict()`` (for an engine directory's config.json)."""
    return _from_dict(data, BLOCK_CLASSES)


def _layout(f: Fields) -> reader.Layout:
    data = f.data
    kind = data.get("speculators_model_type")
    if kind is not None:
        if kind in BLOCK_SPECULATORS_TYPES:
            return speculators.LAYOUTS[kind]
        raise f.fail("speculators_model_type", f"is {kind!r}: not a block draft "
                                              f"(supported: {', '.join(BLOCK_SPECULATORS_TYPES)})")
    archs = data.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if nemotron35.is_nemotron35(data):
        return nemotron35.LAYOUT
    if arch in BLOCK_ARCHITECTURES:
        return zlab.layout(arch)
    raise f.fail("architectures", f"is {arch!r}: unknown block draft architecture (supported: "
                                  f"{', '.join(BLOCK_ARCHITECTURES)}, or speculators_model_type "
                                  f"{'/'.join(BLOCK_SPECULATORS_TYPES)})")


def _parse(data: dict, where: str, names: set[str], shapes: dict):
    """The config of a config.json object (``names``: canonical tensor names present, ``shapes`` theirs)."""
    f = Fields(data, where)
    return _layout(f).parse(f, names, shapes)


def is_block_draft(checkpoint_dir: str | os.PathLike) -> bool:
    """Whether ``config.json`` declares a dflash / dspark / peagle draft (reads the config only)."""
    try:
        data, _ = reader.read_config(Path(checkpoint_dir))
    except DraftError:
        return False
    if data.get("speculators_model_type") in BLOCK_SPECULATORS_TYPES:
        return True
    archs = data.get("architectures")
    return isinstance(archs, list) and bool(archs) and archs[0] in BLOCK_ARCHITECTURES


def load_block_draft_config(checkpoint_dir: str | os.PathLike):
    """The draft's config (reads tensor headers to tell optional tensors apart; no tensor data)."""
    return _load(checkpoint_dir, read=False)[0]


def load_block_draft_checkpoint(checkpoint_dir: str | os.PathLike, keep_quantized: bool = True):
    """Read and validate a DFlash / DSpark / P-EAGLE draft checkpoint: (cfg, canonical name -> tensor).

    A ModelOpt NVFP4 checkpoint (``hf_quant_config.json`` or ``quantization_config``; packed uint8
    ``X.weight`` + ``X.weight_scale`` + ``X.weight_scale_2``) gives
    :class:`builder.nvfp4_format.NVFP4Weight` objects for its packed weights (the draft modules bind
    them like tensors; ``F.linear`` dequantizes on the fly eagerly and lowers to FP4 constants in
    TensorRT; DSpark's W2 goes to the fused Markov-head op), or plain dequantized tensors with
    ``keep_quantized=False``. The logical shape of each packed weight comes from the config."""
    return _load(checkpoint_dir, read=True, keep_quantized=keep_quantized)


def _load(checkpoint_dir, read: bool, keep_quantized: bool = True):
    directory = Path(checkpoint_dir)
    data, where = reader.read_config(directory)
    return reader.load(directory, _layout(Fields(data, where)), data, where, read, keep_quantized)


# --- against the target --------------------------------------------------------------------------
def validate_block_draft(draft_cfg, target_cfg):
    """Check a block draft against its target (a NemotronHConfig, or any config with
    ``hidden_size``, ``vocab_size`` and ``num_layers`` / ``num_hidden_layers``). Returns the draft
    config with its layer ids sorted ascending. Raises :class:`DraftError` naming the field."""
    c = draft_cfg
    target_hidden = int(target_cfg.hidden_size)
    target_vocab = int(target_cfg.vocab_size)
    layers = getattr(target_cfg, "num_layers", None)
    if layers is None:
        layers = getattr(target_cfg, "num_hidden_layers")
    layers = int(layers)
    if isinstance(c, PEagleConfig):
        try:
            c = validate_against_target(c, target_cfg)
        except DraftError as e:
            raise DraftError(str(e).replace("eagle3 draft:", "peagle draft:", 1)) from None
        rows = c.target_vocab_size
        if not 0 <= c.mask_token_id < rows:
            raise DraftError(f"peagle draft: mask_token_id {c.mask_token_id} is outside the embedding's "
                             f"{rows} rows")
        return c
    kind = c.kind
    if c.target_hidden_size != target_hidden:
        field = "target_hidden_size" if c.target_hidden_size != c.hidden_size else "hidden_size"
        raise DraftError(f"{kind} draft: {field} {c.target_hidden_size} does not match the target's "
                         f"hidden_size {target_hidden}")
    if c.hidden_size != target_hidden:
        if not c.embedding_rows:
            raise DraftError(f"{kind} draft: hidden_size {c.hidden_size} differs from the target's hidden_size "
                             f"{target_hidden} and the draft ships no embed_tokens.weight to use instead")
        if not c.has_lm_head:
            raise DraftError(f"{kind} draft: hidden_size {c.hidden_size} differs from the target's hidden_size "
                             f"{target_hidden} and the draft ships no lm_head.weight to use instead")
    if c.target_vocab_size != target_vocab:
        field = "transformer_layer_config.vocab_size" if c.source == "speculators" else "vocab_size"
        raise DraftError(f"{kind} draft: {field} (target vocabulary) {c.target_vocab_size} does not match the "
                         f"target's vocab_size {target_vocab}")
    if c.draft_vocab_size > target_vocab:
        raise DraftError(f"{kind} draft: draft_vocab_size {c.draft_vocab_size} exceeds the target's vocab_size "
                         f"{target_vocab}")
    if c.draft_vocab_size != target_vocab and not c.has_d2t:
        raise DraftError(f"{kind} draft: draft_vocab_size {c.draft_vocab_size} != target vocab_size "
                         f"{target_vocab} but the checkpoint has no d2t tensor")
    ids = c.target_layer_ids
    field = c.layer_ids_field
    shown = [i - c.layer_ids_offset for i in ids]
    bad = [i for i in ids if not 0 <= i <= layers]
    if bad:
        conv = f" (HF hidden_states ids {list(ids)})" if c.layer_ids_offset else ""
        raise DraftError(f"{kind} draft: {field} {shown}{conv} has id {shown[ids.index(bad[0])]} outside the "
                         f"target's layers ([0, {layers}] hidden_states ids for {layers} layers)")
    if len(set(ids)) != len(ids):
        raise DraftError(f"{kind} draft: {field} {shown} repeats a layer id")
    rows = c.embedding_rows or target_vocab
    if not 0 <= c.mask_token_id < rows:
        raise DraftError(f"{kind} draft: mask_token_id {c.mask_token_id} is outside the embedding's {rows} rows")
    return dataclasses.replace(c, target_layer_ids=tuple(sorted(ids)))
