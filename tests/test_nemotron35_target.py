"""The Nemotron 3.5 target side: ``layers_block_type`` spelled mamba / attention / moe, and stopping on
every id of generation_config.json's eos set."""
from __future__ import annotations

import json

import pytest

from builder.checkpoint import load_checkpoint
from builder.config import load_config
from builder.errors import CheckpointError
from builder.random_checkpoint import write_random_checkpoint
from nemospec import cli
from runtime.generation import generate
from runtime.loading import open_checkpoint


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random NemotronH whose config.json lists its layers as Nemotron 3.5 does."""
    path = write_random_checkpoint(tmp_path_factory.mktemp("n35") / "ckpt", "ME*EM*", seed=5)
    config = json.loads((path / "config.json").read_text())
    for key in ("hybrid_override_pattern", "layer_types"):
        config.pop(key, None)
    config["layers_block_type"] = ["mamba", "moe", "attention", "moe", "mamba", "attention"]
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").unlink(missing_ok=True)
    return path


def test_layers_block_type_names_mamba_attention_moe(target):
    config, weights = load_checkpoint(target)
    assert config.layer_types == ("mamba", "moe", "attention", "moe", "mamba", "attention")
    assert config.hybrid_override_pattern == "ME*EM*"
    assert not any("rotary" in n or "rope" in n for n in weights)  # attention without positional encoding


def _greedy(path, n=12):
    return generate(open_checkpoint(path).runner, [[5, 9, 17, 33]], n).output_ids[0]


def test_generation_config_eos_set_stops_on_every_id(target, capsys):
    out = _greedy(target)
    own = load_config(target).eos_token_id  # config.json's scalar
    fresh = [j for j in range(2, len(out)) if out[j] not in out[:j] and out[j] != own]
    first, second = out[fresh[0]], out[fresh[1]]
    gen = target / "generation_config.json"
    try:
        gen.write_text(json.dumps({"eos_token_id": [second, first]}))
        assert set(load_config(target).eos_token_id) == {first, second, own}
        for stop in (first, second):  # each id of the set alone stops generation
            gen.write_text(json.dumps({"eos_token_id": [stop, 100000 + stop]}))
            code = cli.main(["generate", "--checkpoint_dir", str(target), "--input_ids", "5,9,17,33",
                             "--max_new_tokens", "12", "--json", "--backend", "torch"])
            record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
            stops = {stop, 100000 + stop, own}
            expected = next(j + 1 for j, t in enumerate(out) if t in stops)
            assert code == 0 and record["output_ids"] == out[:expected], stop
    finally:
        gen.unlink()


def test_bad_generation_config_names_the_file_and_field(target):
    gen = target / "generation_config.json"
    try:
        gen.write_text(json.dumps({"eos_token_id": "eos"}))
        with pytest.raises(CheckpointError, match="generation_config.json: field 'eos_token_id' must be a token id"):
            load_config(target)
    finally:
        gen.unlink()
