"""Loading the draft of each speculative mode and checking that it fits its target.

``load_draft`` (build time) returns the draft module, the weights an engine directory keeps for
it, what the target must additionally output for it, and the JSON the engine directory records;
``draft_from_engine_dir`` rebuilds the module from that record (run time, TorchRunner).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from builder.checkpoint import (check_finite_weights, checkpoint_hash, convert_weights, expected_tensors, load_checkpoint,
                               validate_mtp)
from builder.config import NemotronHConfig
from builder.errors import BuildError, DraftError
from builder.formats.tensors import draft_tensors
from builder.safetensors_io import own_storage as _copy_if_view
from builder.draft_checkpoint import draft_config_from_dict, draft_hash, load_draft_checkpoint, validate_against_target
from builder.draft_checkpoint_block import (block_draft_config_from_dict, load_block_draft_checkpoint,
                                            validate_block_draft)
from builder.models.dflash import DFlashDraft
from builder.models.dspark import DSparkDraft
from builder.models.eagle import EagleDraft
from builder.models.eagle3 import Eagle3Draft
from builder.models.peagle import PEagleDraft
from builder.models.mtp import MTPDraft
from builder.models.nemotron_h import NemotronH
from builder import token_map as token_maps


@dataclass
class LoadedDraft:
    module: object
    weights: dict | None          # saved as weights/draft.safetensors (None: lives in the target's)
    target_features: dict         # NemotronH(...) keyword arguments: capture_layers / final_hidden
    meta: dict                    # recorded in the engine directory's config.json


def need_draft_dir(mode, draft_dir):
    if draft_dir is None:
        raise BuildError(f"--draft_dir: speculative mode {mode} needs a draft checkpoint directory")
    return Path(draft_dir)


BLOCK_MODES = {"dflash": DFlashDraft, "dspark": DSparkDraft, "peagle": PEagleDraft}
DRAFT_KINDS = ("eagle", "eagle3", *BLOCK_MODES)   # the kinds a draft directory's config names
QUANTIZATIONS = ("nvfp4_w4a16",)
# draft tensors that stay in high precision when the draft is quantized (ModelOpt keeps these too)
_KEEP_PRECISION = ("embed", "lm_head", "norm", "markov_w1", "d2t", "t2d", "mask_hidden")


def past_trained_block(module, mode: str, max_draft_len: int) -> str | None:
    """A block draft proposes the tokens of its trained block well and later ones rarely (DFlash on the
    embedded model keeps 0.84 of its 4th proposals, 0.43 of its 5th, 0.12 of its 6th): a K past them
    is worth a line at build. None where K is within them, or for a chain draft (any K)."""
    trained = getattr(module, "num_speculative_tokens", None) if mode in BLOCK_MODES else None
    if trained and max_draft_len > trained:
        return (f"warning: the {mode} draft was trained to propose {trained} tokens a block; --max_draft_len "
                f"{max_draft_len} drafts past them, where its proposals are rarely accepted "
                "(--draft_len_adaptive on lets each sequence draft fewer)")
    return None


def quantizable(weights: dict) -> list[str]:
    """The draft's linear weights NVFP4 quantizes: 2-D ``.weight``s with an input dim of whole blocks."""
    return [n for n, w in weights.items() if n.endswith(".weight") and w.dim() == 2 and w.shape[-1] % 16 == 0
            and w.is_floating_point() and not any(k in n for k in _KEEP_PRECISION)]


def _bind_quantized(stored: dict, dtype):
    """Packed ModelOpt tensors -> NVFP4Weight objects (the module binds them like weights)."""
    from builder.quantization import nvfp4_weights
    return nvfp4_weights(stored, None, None, dtype)


def _own_storages(mode, target_weights: dict, draft_weights: dict | None, own: bool) -> dict | None:
    """With ``own`` (the compiled path: a draft step bakes the draft's weights in and saves them with
    its guards), the draft's weights and the target tensors it reads (its embedding and LM head; mtp:
    its ``mtp.*`` layers), each with a storage of its own (``own_storage``). The target's are
    replaced in ``target_weights`` itself, so the target module built next shares the copy instead of
    holding a second one. Without, nothing is copied (a build streams a mapped checkpoint)."""
    if not own or mode == "draft_target":    # a draft NemotronH runs as a target does: weights are inputs
        return draft_weights
    shared = [n for n in target_weights if n in ("backbone.embeddings.weight", "lm_head.weight")
              or (mode == "mtp" and n.startswith("mtp."))]
    for name in shared:
        target_weights[name] = _copy_if_view(target_weights[name])
    return None if draft_weights is None else {k: _copy_if_view(v) for k, v in draft_weights.items()}


def _check_kind(directory: Path, mode: str) -> None:
    """A speculators config names its kind: a draft of another mode is refused in the same words
    whichever loader the mode would use (each layout's loader only knows its own kinds)."""
    try:
        kind = json.loads((directory / "config.json").read_text()).get("speculators_model_type")
    except (OSError, ValueError, AttributeError):
        return   # the loader names what is wrong with the file
    if isinstance(kind, str) and kind != mode and kind in DRAFT_KINDS:
        raise _wrong_kind(directory, kind, mode)


def _wrong_kind(directory: Path, kind: str, mode: str) -> DraftError:
    article = "an" if kind[0] in "aeiou" else "a"
    return DraftError(f"{directory / 'config.json'}: this is {article} {kind} draft, not {mode}; "
                      f"pass --speculative_decoding_mode {kind}")


def load_draft(mode, target_cfg: NemotronHConfig, target_weights: dict, draft_dir, dtype, log=print,
               quantization=None, token_map=None, own_storage: bool = False) -> LoadedDraft:
    """``token_map``: a file of target token ids the draft's LM head is cut to (``builder.token_map``);
    ``own_storage``: the compiled path's copies (``_own_storages``)."""
    ids = None
    if token_map is not None:
        token_maps.check_mode(mode)
        ids = token_maps.read_token_map(token_map, target_cfg.vocab_size)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise DraftError(f"--quantization: expected one of {', '.join(QUANTIZATIONS)}, got {quantization}")
    if quantization is not None and mode in ("mtp", "draft_target"):
        raise DraftError(f"--quantization: {mode} drafts are not quantized here; quantize the checkpoint with "
                         "`nemospec quantize` instead")
    if quantization is not None and mode in ("eagle", "eagle3"):   # was ignored: the draft stayed in float
        raise DraftError(f"--quantization: {mode} drafts are not quantized here; the block drafts (dflash, "
                         "dspark, peagle) are")
    if mode == "mtp":
        if draft_dir is not None:
            raise BuildError("--draft_dir: mtp mode uses the target checkpoint's own MTP layers; drop --draft_dir")
        validate_mtp(target_cfg, target_weights, "target checkpoint")
        _own_storages(mode, target_weights, None, own_storage)
        return LoadedDraft(MTPDraft(target_cfg, target_weights, dtype), None, {"final_hidden": True},
                           {"mode": mode})
    directory = need_draft_dir(mode, draft_dir)
    log(f"reading {mode} draft {directory}")
    _check_kind(directory, mode)
    if mode == "draft_target":
        cfg, weights = load_checkpoint(directory)
        check_finite_weights(directory, weights)
        for field in ("vocab_size",):
            if getattr(cfg, field) != getattr(target_cfg, field):
                raise DraftError(f"{directory / 'config.json'}: field '{field}' is {getattr(cfg, field)}, the target's "
                                 f"is {getattr(target_cfg, field)}; a draft_target draft must share the vocabulary")
        weights = convert_weights(weights, dtype)
        return LoadedDraft(NemotronH(cfg, weights, dtype), weights, {},
                           {"mode": mode, "draft": cfg.to_dict(), "draft_sha256": checkpoint_hash(directory)})
    if mode in ("eagle", "eagle3"):
        cfg, weights = load_draft_checkpoint(directory)
        if cfg.kind != mode:
            raise _wrong_kind(directory, cfg.kind, mode)
        cfg = validate_against_target(cfg, target_cfg)
        weights = _own_storages(mode, target_weights, convert_weights(weights, dtype), own_storage)
        if ids is not None:
            cfg, weights = token_maps.prune_draft_head(mode, cfg, weights, target_weights, ids, str(token_map))
            log(f"draft vocabulary cut to {cfg.draft_vocab_size} tokens by {token_map}")
        module = _feature_draft(cfg, weights, target_weights, dtype)
        features = {"capture_layers": module.aux_layer_ids} if mode == "eagle3" else {"final_hidden": True}
        return LoadedDraft(module, weights, features,
                           {"mode": mode, "draft": cfg.to_dict(), "draft_sha256": draft_hash(directory),
                            **_map_record(ids, token_map)})
    if mode in BLOCK_MODES:
        cfg, weights = load_block_draft_checkpoint(directory, keep_quantized=True)
        if cfg.kind != mode:
            raise _wrong_kind(directory, cfg.kind, mode)
        cfg = validate_block_draft(cfg, target_cfg)
        stored = _to_storable(weights, dtype)
        if quantization == "nvfp4_w4a16":
            from builder.quantization import quantize_tensors
            stored = quantize_tensors(stored, quantizable(stored))
        if ids is not None:   # after quantizing: the cut draft is the quantized draft's rows, scales included
            cfg, stored = token_maps.prune_draft_head(mode, cfg, stored, target_weights, ids, str(token_map))
            log(f"draft vocabulary cut to {cfg.draft_vocab_size} tokens by {token_map}")
        stored, kept = _rtx_workaround(stored, mode, dtype, log)
        stored = _own_storages(mode, target_weights, stored, own_storage)
        module = _block_draft(cfg, _bind_quantized(stored, dtype), target_weights, dtype)
        meta = {"mode": mode, "draft": cfg.to_dict(), "draft_sha256": checkpoint_hash(directory),
                "quantization": quantization or ("nvfp4_w4a16" if any(n.endswith("weight_scale_2") for n in stored)
                                                 else None), "kept_high_precision": kept, **_map_record(ids, token_map)}
        return LoadedDraft(module, stored, {"capture_layers": module.target_layer_ids}, meta)
    raise DraftError(f"--speculative_decoding_mode: unknown mode {mode}")


def _map_record(ids, token_map) -> dict:
    """What the engine directory's config.json records of a token map (its weights are already cut)."""
    if ids is None:
        return {}
    return {"token_map": {"file": Path(token_map).name, "tokens": ids.numel(), "sha256": token_maps.digest(ids)}}


def _rtx_workaround(stored: dict, mode, dtype, log):
    """tensorrt_rtx 1.7's Myelin fails to build (``CHECK(def_tactic_desc)``) a DFlash/DSpark draft
    whose k_proj and v_proj are both FP4: each projects the same context rows and block rows. There,
    v_proj is dequantized to the build dtype (logged, recorded in the engine directory's config)."""
    try:
        from builder.backends.trt_import import FLAVOUR
    except ImportError:   # no TensorRT here (a GPU image running the torch path): nothing to work around
        return stored, []
    if FLAVOUR != "tensorrt_rtx" or mode not in ("dflash", "dspark"):
        return stored, []
    from builder.quantization import dequantize_tensors
    kept = [n for n in stored if n.endswith("v_proj.weight") and n.replace("v_proj", "k_proj") + "_scale_2" in stored
            and n + "_scale_2" in stored]
    if kept:
        subset = {k: v for k, v in stored.items() if any(k.startswith(n) for n in kept)}
        plain = dequantize_tensors(subset, None, None, dtype)
        stored = {k: v for k, v in stored.items() if not any(k.startswith(n) for n in kept)}
        stored.update(plain)
        log(f"tensorrt_rtx: keeping {len(kept)} v_proj weight(s) of the {mode} draft in {str(dtype)[6:]} "
            "(its builder fails on FP4 k_proj + v_proj sharing an input)")
    return stored, kept


def _to_storable(weights: dict, dtype) -> dict:
    """Draft tensors as a flat safetensors dict: packed NVFP4 weights back to ModelOpt's three tensors."""
    out = {}
    for name, w in weights.items():
        if getattr(w, "is_nvfp4", False):
            base = name[:-len("weight")]
            out.update({name: w.packed, base + "weight_scale": w.scale, base + "weight_scale_2": w.scale_2})
        else:
            out.update(convert_weights({name: w}, dtype))
    return out


def _block_draft(cfg, weights, target_weights, dtype):
    embedding = target_weights["backbone.embeddings.weight"]
    head = target_weights.get("lm_head.weight", embedding)
    if cfg.kind == "peagle":
        return PEagleDraft(cfg, weights, embedding, dtype)
    return BLOCK_MODES[cfg.kind](cfg, weights, embedding, head, dtype)


def _feature_draft(cfg, weights, target_weights, dtype):
    """EAGLE drafts use the target's embedding (and LM head, for EAGLE-1) unless they ship their own."""
    embedding = target_weights["backbone.embeddings.weight"]
    if cfg.kind == "eagle3":
        return Eagle3Draft(cfg, weights, embedding, dtype)
    head = target_weights.get("lm_head.weight", embedding)
    return EagleDraft(cfg, weights, embedding, head, dtype)


def _check_recorded_shapes(expected: dict, weights: dict) -> None:
    """An engine directory's draft weights against the shapes its recorded draft config gives them
    (a damaged config failed at the first step, in torch); packed NVFP4 bytes have shapes of their own."""
    for name, shape in expected.items():
        w = weights.get(name)
        if w is not None and w.dtype != torch.uint8 and tuple(w.shape) != tuple(shape):
            raise DraftError(f"weights/draft.safetensors: tensor {name!r} has shape {list(w.shape)}, the recorded "
                             f"draft config gives {list(shape)}")


def draft_from_engine_dir(meta: dict, target_cfg: NemotronHConfig, target_weights: dict, draft_weights, dtype,
                          own_storage: bool = False):
    mode = meta["mode"]
    draft_weights = _own_storages(mode, target_weights, draft_weights, own_storage)
    if mode == "mtp":
        return MTPDraft(target_cfg, target_weights, dtype)
    if mode == "draft_target":
        cfg = NemotronHConfig.from_dict(meta["draft"])
        _check_recorded_shapes(expected_tensors(cfg), draft_weights)
        return NemotronH(cfg, draft_weights, dtype)
    if mode in ("eagle", "eagle3"):
        cfg = draft_config_from_dict(meta["draft"])
        _check_recorded_shapes(draft_tensors(cfg)[0], draft_weights)
        return _feature_draft(cfg, draft_weights, target_weights, dtype)
    if mode in BLOCK_MODES:
        cfg = block_draft_config_from_dict(meta["draft"])
        _check_recorded_shapes(draft_tensors(cfg)[0], draft_weights)
        return _block_draft(cfg, _bind_quantized(draft_weights, dtype), target_weights, dtype)
    raise DraftError(f"engine directory: unknown speculative mode {mode}")
