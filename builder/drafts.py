"""Loading the draft of each speculative mode and checking that it fits its target.

``load_draft`` (build time) returns the draft module, the weights an engine directory keeps for
it, what the target must additionally output for it, and the JSON the engine directory records;
``draft_from_engine_dir`` rebuilds the module from that record (run time, TorchRunner).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from builder.checkpoint import checkpoint_hash, load_checkpoint, validate_mtp
from builder.config import NemotronHConfig
from builder.errors import BuildError, DraftError
from builder.draft_checkpoint import draft_config_from_dict, load_draft_checkpoint, validate_against_target
from builder.models.eagle import EagleDraft
from builder.models.eagle3 import Eagle3Draft
from builder.models.mtp import MTPDraft
from builder.models.nemotron_h import NemotronH


@dataclass
class LoadedDraft:
    module: object
    weights: dict | None          # saved as weights/draft.safetensors (None: lives in the target's)
    target_features: dict         # NemotronH(...) keyword arguments: capture_layers / final_hidden
    meta: dict                    # recorded in the engine directory's config.json


def _need_draft_dir(mode, draft_dir):
    if draft_dir is None:
        raise BuildError(f"--draft_dir: speculative mode {mode} needs a draft checkpoint directory")
    return Path(draft_dir)


def load_draft(mode, target_cfg: NemotronHConfig, target_weights: dict, draft_dir, dtype, log=print) -> LoadedDraft:
    from builder.engine import convert_weights
    if mode == "mtp":
        if draft_dir is not None:
            raise BuildError("--draft_dir: mtp mode uses the target checkpoint's own MTP layers; drop --draft_dir")
        validate_mtp(target_cfg, target_weights, "target checkpoint")
        return LoadedDraft(MTPDraft(target_cfg, target_weights, dtype), None, {"final_hidden": True},
                           {"mode": mode})
    directory = _need_draft_dir(mode, draft_dir)
    log(f"reading {mode} draft {directory}")
    if mode == "draft_target":
        cfg, weights = load_checkpoint(directory)
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
            raise DraftError(f"{directory / 'config.json'}: this is an {cfg.kind} draft, not {mode}; "
                             f"pass --speculative_decoding_mode {cfg.kind}")
        cfg = validate_against_target(cfg, target_cfg)
        weights = convert_weights(weights, dtype)
        module = _feature_draft(cfg, weights, target_weights, dtype)
        features = {"capture_layers": module.aux_layer_ids} if mode == "eagle3" else {"final_hidden": True}
        return LoadedDraft(module, weights, features,
                           {"mode": mode, "draft": cfg.to_dict(), "draft_sha256": checkpoint_hash(directory)})
    raise DraftError(f"--speculative_decoding_mode: unknown mode {mode}")


def _feature_draft(cfg, weights, target_weights, dtype):
    """EAGLE drafts use the target's embedding (and LM head, for EAGLE-1) unless they ship their own."""
    embedding = target_weights["backbone.embeddings.weight"]
    if cfg.kind == "eagle3":
        return Eagle3Draft(cfg, weights, embedding, dtype)
    head = target_weights.get("lm_head.weight", embedding)
    return EagleDraft(cfg, weights, embedding, head, dtype)


def draft_from_engine_dir(meta: dict, target_cfg: NemotronHConfig, target_weights: dict, draft_weights, dtype):
    mode = meta["mode"]
    if mode == "mtp":
        return MTPDraft(target_cfg, target_weights, dtype)
    if mode == "draft_target":
        return NemotronH(NemotronHConfig.from_dict(meta["draft"]), draft_weights, dtype)
    if mode in ("eagle", "eagle3"):
        return _feature_draft(draft_config_from_dict(meta["draft"]), draft_weights, target_weights, dtype)
    raise DraftError(f"engine directory: unknown speculative mode {mode}")
