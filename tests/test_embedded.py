"""The embedded default model: shipped checkpoints load, their hashes match, every draft speculates
exactly on the trained target, and the trained drafts are really accepted."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from builder import embedded
from builder.checkpoint import load_checkpoint
from builder.errors import CheckpointError
from runtime.generation import generate
from runtime.loading import open_checkpoint
from runtime.speculative import speculative_generate

MODES = ("draft_target", "eagle", "eagle3", "mtp", "dflash", "dspark", "peagle")
PROMPTS = ["import os\nimport sys\n\n\ndef main(argv=None):\n    ", "class Error(Exception):\n    def __init__(self",
           "    def __repr__(self):\n        return ", "x"]
# measured on the shipped drafts (greedy, K=4, these prompts x 48 tokens): eagle3 2.70, draft_target
# 2.46, mtp 2.31, eagle 2.24, dspark 2.08, dflash 2.05, peagle 1.97; an untrained draft gets ~1.05.
# The floors keep a margin for other CPUs' rounding while a broken draft or loop still fails.
MIN_MEAN_ACCEPTED = {"eagle3": 2.2, "draft_target": 2.0, "mtp": 1.9, "eagle": 1.8, "dspark": 1.7, "dflash": 1.7,
                     "peagle": 1.6}


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(embedded.target_dir() / "tokenizer.json"))


@pytest.fixture(scope="module")
def reference(tokenizer):
    """The trained target's greedy output for PROMPTS (48 tokens), computed once, with no near-tie a
    verify chunk could decide otherwise than a decode step (min top-2 gap 1.3e-2, ~8x its bound)."""
    from speculative_fixtures import assert_greedy_margin
    runner = open_checkpoint(embedded.target_dir()).runner
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    out = generate(runner, prompts, 48).output_ids
    assert_greedy_margin(runner, prompts, out)
    return out


def test_manifest_hashes_match_and_fit_the_budget():
    data = embedded.manifest()
    names = set(data["checkpoints"])
    assert {"target", "draft_target", "eagle", "eagle3", "dflash", "dspark", "dspark_nvfp4", "peagle"} <= names
    for name in names:
        assert embedded.verify(name) == embedded.ROOT / name
    total = sum((embedded.ROOT / n / f).stat().st_size for n in names for f in data["checkpoints"][n]["files"])
    assert total == data["total_bytes"] <= 40 * 2**20


def test_a_changed_file_is_refused(tmp_path, monkeypatch):
    copy = tmp_path / "embedded"
    shutil.copytree(embedded.ROOT / "eagle3", copy / "eagle3")
    shutil.copy2(embedded.MANIFEST, copy / "MANIFEST.json")
    cfg = copy / "eagle3" / "config.json"
    cfg.write_text(cfg.read_text().replace('"dtype"', '"dtype" ', 1))
    monkeypatch.setattr(embedded, "ROOT", copy)
    monkeypatch.setattr(embedded, "MANIFEST", copy / "MANIFEST.json")
    with pytest.raises(CheckpointError, match="config.json: SHA-256"):
        embedded.verify("eagle3")


def test_target_is_a_trained_nemotron_h_with_every_block_kind():
    config, weights = load_checkpoint(embedded.target_dir())
    assert set(config.layer_types) == {"mamba", "attention", "mlp", "moe"}
    assert config.num_nextn_predict_layers == 1 and any(n.startswith("mtp.") for n in weights)
    training = json.loads((embedded.ROOT / "TRAINING.json").read_text())
    curve = training["target"]["curve"]
    assert curve[-1]["valid_loss"] < curve[0]["valid_loss"] - 1.0
    assert set(training["drafts"]) >= set(MODES) - {"mtp"} | {"mtp"}


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_speculates_exactly_and_is_accepted(mode, tokenizer, reference):
    loaded = open_checkpoint(embedded.target_dir(), mode=mode, draft_dir=embedded.draft_dir(mode))
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    got = speculative_generate(loaded.runner, loaded.proposer(), prompts, 48, 4)
    assert got.output_ids == reference
    mean = got.extra["acceptance"]["mean_accepted_tokens"]
    assert mean >= MIN_MEAN_ACCEPTED[mode], f"{mode}: mean accepted {mean:.2f}"


def test_nvfp4_dspark_copy_speculates_exactly(tokenizer, reference):
    directory = embedded.draft_dir("dspark", "nvfp4_w4a16")
    assert (directory / "hf_quant_config.json").is_file()
    loaded = open_checkpoint(embedded.target_dir(), mode="dspark", draft_dir=directory)
    prompts = [tokenizer.encode(p).ids for p in PROMPTS[:2]]
    got = speculative_generate(loaded.runner, loaded.proposer(), prompts, 32, 4)
    assert got.output_ids == [r[:32] for r in reference[:2]]  # greedy: a prefix of the 48-token answer
    assert got.extra["acceptance"]["mean_accepted_tokens"] > 1.3


def test_build_defaults_to_the_embedded_model(tmp_path):
    from nemospec import cli
    out = tmp_path / "engine"
    assert cli.main(["build", "--output_dir", str(out), "--speculative_decoding_mode", "eagle3",
                     "--max_seq_len", "256", "--max_input_len", "64"]) == 0
    meta = json.loads((out / "config.json").read_text())
    assert meta["speculative"]["mode"] == "eagle3"
    assert meta["speculative"]["draft_sha256"] and meta["build"]["max_draft_len"] == 4
    assert (out / "tokenizer.json").is_file()
