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
from runtime.proposers import FeatureDraftProposer, ModelDraftProposer
from runtime.runner import TorchRunner


def target_with_mtp(source, directory):
    """A copy of a transformers-written tiny target with NemotronH MTP layers appended."""
    shutil.copytree(source, directory)
    return add_mtp_layers(directory, "*E", seed=7)


FIXTURES = Path(__file__).parent / "fixtures" / "speculators"
# speculators-made drafts for the tiny "moe" target (hidden 32, vocabulary 96, 6 layers)
FEATURE_DRAFTS = {"eagle3": FIXTURES / "eagle3_llama3", "eagle": FIXTURES / "eagle_speculators"}


def runners(target_dir, draft_dir=None):
    """(target runner with every feature, proposer factory by mode)."""
    config, weights = load_checkpoint(target_dir)
    feature_drafts = {mode: load_draft(mode, config, weights, path, torch.float32, log=lambda m: None)
                      for mode, path in FEATURE_DRAFTS.items() if config.hidden_size == 32}
    capture = feature_drafts["eagle3"].target_features["capture_layers"] if feature_drafts else ()
    target = TorchRunner(NemotronH(config, weights, torch.float32, final_hidden=True, capture_layers=capture))

    def proposer(mode):
        if mode in feature_drafts:
            return FeatureDraftProposer(EagerDraft(feature_drafts[mode].module, config.vocab_size))
        if mode == "draft_target":
            dcfg, dweights = load_checkpoint(draft_dir)
            return ModelDraftProposer(TorchRunner(NemotronH(dcfg, dweights, torch.float32)))
        if mode == "mtp":
            return FeatureDraftProposer(EagerDraft(MTPDraft(config, weights, torch.float32), config.vocab_size))
        raise ValueError(mode)

    return target, proposer


def layer_subset_draft(target_dir, directory, noise=0.05):
    """Every layer of the target with small noise: agrees often, not always (exercises rollback)."""
    config, _ = load_checkpoint(target_dir)
    return write_layer_subset_draft(target_dir, directory, list(range(config.num_layers)), noise=noise, seed=3)
