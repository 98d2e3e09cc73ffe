"""Target + draft pairs for the speculative tests, made by our own generators (no downloads)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from builder.drafts import load_draft
from builder.checkpoint import load_checkpoint
from builder.models.mtp import MTPDraft
from builder.models.nemotron_h import NemotronH
from builder.random_checkpoint import add_mtp_layers, write_layer_subset_draft
from runtime.drafts import EagerDraft
from runtime.proposers import BlockDraftProposer, FeatureDraftProposer, ModelDraftProposer, ParallelDraftProposer
from runtime.runner import TorchRunner


def target_with_mtp(source, directory):
    """A copy of a transformers-written tiny target with NemotronH MTP layers appended."""
    shutil.copytree(source, directory)
    return add_mtp_layers(directory, "*E", seed=7)


FIXTURES = Path(__file__).parent / "fixtures" / "speculators"
# speculators-made drafts for the tiny "moe" target (hidden 32, vocabulary 96, 6 layers)
FEATURE_DRAFTS = {"eagle3": FIXTURES / "eagle3_llama3", "eagle": FIXTURES / "eagle_speculators",
                  "dflash": FIXTURES / "dflash_speculators", "dspark": FIXTURES / "dspark_speculators",
                  "peagle": FIXTURES / "peagle_speculators"}
PROPOSERS = {"dflash": BlockDraftProposer, "dspark": BlockDraftProposer, "peagle": ParallelDraftProposer}


def runners(target_dir, draft_dir=None):
    """(target runner with every feature, proposer factory by mode)."""
    config, weights = load_checkpoint(target_dir)
    drafts = {}
    if config.hidden_size == 32:
        for mode, path in FEATURE_DRAFTS.items():
            for quantization in ((None, "nvfp4_w4a16") if mode in PROPOSERS else (None,)):
                drafts[mode if quantization is None else f"{mode}_nvfp4"] = load_draft(
                    mode, config, weights, path, torch.float32, log=lambda m: None, quantization=quantization)
    # one target serves every draft: it captures the union of the layers they read
    capture = sorted({i for d in drafts.values() for i in d.target_features.get("capture_layers", ())})
    target = TorchRunner(NemotronH(config, weights, torch.float32, final_hidden=True, capture_layers=capture))

    def features_for(draft, feats):
        ids = draft.target_features.get("capture_layers")
        if not ids or list(ids) == capture:
            return feats
        width = config.hidden_size
        cols = [c for i in ids for c in range(capture.index(i) * width, (capture.index(i) + 1) * width)]
        return {**feats, "aux_hidden": [f[..., cols] for f in feats["aux_hidden"]] if isinstance(feats["aux_hidden"], list)
                else feats["aux_hidden"][..., cols]}

    def proposer(mode):
        if mode in drafts:
            d = drafts[mode]
            kind = mode.split("_")[0]
            inner = PROPOSERS.get(kind, FeatureDraftProposer)(EagerDraft(d.module, config.vocab_size))
            return _Narrowed(inner, lambda feats: features_for(d, feats))
        if mode == "draft_target":
            dcfg, dweights = load_checkpoint(draft_dir)
            return ModelDraftProposer(TorchRunner(NemotronH(dcfg, dweights, torch.float32)))
        if mode == "mtp":
            return FeatureDraftProposer(EagerDraft(MTPDraft(config, weights, torch.float32), config.vocab_size))
        raise ValueError(mode)

    return target, proposer


class _Narrowed:
    """A proposer whose draft reads a subset of the target's captured layers (tests share one target)."""

    def __init__(self, inner, narrow):
        self.inner, self.narrow, self.features = inner, narrow, inner.features

    def start(self, prompts, first_tokens, features, capacity):
        return self.inner.start(prompts, first_tokens, self.narrow(features), capacity)

    def accept(self, accepted, next_tokens, drafts, verify_features):
        return self.inner.accept(accepted, next_tokens, drafts, self.narrow(verify_features))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def layer_subset_draft(target_dir, directory, noise=0.05):
    """Every layer of the target with small noise: agrees often, not always (exercises rollback)."""
    config, _ = load_checkpoint(target_dir)
    return write_layer_subset_draft(target_dir, directory, list(range(config.num_layers)), noise=noise, seed=3)
