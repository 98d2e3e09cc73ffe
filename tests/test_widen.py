"""The widened embedded model (builder.embedded.widen): the trained function at K times the width.

Oracles: transformers' NemotronHForCausalLM loads the wide target unchanged and its logits equal the
small target's; every draft kind speculates on the wide target exactly (the small target's greedy
output) with the acceptance it has on the small one. K = 2 keeps it fast; the maps are the same for
any K (the divide by K is exact for powers of two, so K = 2 and 4 round alike).
"""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from builder import embedded
from builder.embedded import sources, widen
from runtime.generation import generate
from runtime.loading import open_checkpoint
from runtime.speculative import speculative_generate

K = 2
MODES = ("draft_target", "eagle", "eagle3", "mtp", "dflash", "dspark", "peagle")
PROMPTS = ["class Error(Exception):\n    def __init__(self", "    def __repr__(self):\n        return "]
HELD_OUT = ["Once upon a time there was a little robot who liked to", "for i in range(10):\n    print("]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return widen.widen(tmp_path_factory.mktemp("wide") / "embedded", K, log=lambda line: None)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(embedded.target_dir() / "tokenizer.json"))


@pytest.fixture(scope="module")
def reference(tokenizer):
    runner = open_checkpoint(embedded.target_dir()).runner
    return generate(runner, [tokenizer.encode(p).ids for p in PROMPTS], 32).output_ids


def test_the_wide_directory_mirrors_the_embedded_one(wide):
    data = json.loads((wide / "MANIFEST.json").read_text())
    assert set(data["checkpoints"]) == set(widen.KINDS)
    assert data["widened"]["factor"] == K
    small, big = (json.loads((d / "target" / "config.json").read_text()) for d in (embedded.ROOT, wide))
    for key in ("hidden_size", "intermediate_size", "mamba_num_heads", "num_attention_heads", "num_key_value_heads"):
        assert big[key] == K * small[key], key
    for key in ("vocab_size", "head_dim", "mamba_head_dim", "n_groups", "ssm_state_size", "num_hidden_layers"):
        assert big.get(key) == small.get(key), key
    assert (wide / "target" / "tokenizer.json").read_bytes() == (embedded.ROOT / "target" / "tokenizer.json").read_bytes()
    # a feature draft keeps its own width and reads K times the target's features
    e3s, e3w = (json.loads((d / "eagle3" / "config.json").read_text()) for d in (embedded.ROOT, wide))
    assert e3w["target_hidden_size"] == K * e3s["target_hidden_size"]
    assert e3w.get("transformer_layer_config") == e3s.get("transformer_layer_config")
    # the separate draft model is the shipped one
    assert ((wide / "draft_target" / "model.safetensors").read_bytes()
            == (embedded.ROOT / "draft_target" / "model.safetensors").read_bytes())


def test_transformers_computes_the_small_targets_logits_on_the_wide_one(wide, tokenizer):
    from transformers import NemotronHForCausalLM
    small = NemotronHForCausalLM.from_pretrained(str(embedded.target_dir()), dtype=torch.float32).eval()
    big = NemotronHForCausalLM.from_pretrained(str(wide / "target"), dtype=torch.float32).eval()
    cfg = big.config
    for prompt in HELD_OUT:
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        with torch.no_grad():
            a, b = small(ids).logits[0], big(ids).logits[0]
        # The two differ only by summation order: each layer's sums (at most the widest product's
        # inputs, blocked or pairwise) round within ~log2(n) * eps relative to the summed magnitude,
        # and the layers' errors add up to the logits; 4x margin for the norms' rescaling.
        n = max(cfg.hidden_size, cfg.intermediate_size, cfg.mamba_num_heads * cfg.mamba_head_dim)
        bound = 4 * (cfg.num_hidden_layers + 1) * math.log2(n) * torch.finfo(torch.float32).eps * a.abs().max().item()
        assert (a - b).abs().max().item() <= bound
        top2 = a.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * bound   # positions no rounding can flip
        assert clear.sum() >= len(ids[0]) // 2
        assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])
        with torch.no_grad():
            ga = small.generate(ids, max_new_tokens=24, do_sample=False)
            gb = big.generate(ids, max_new_tokens=24, do_sample=False)
        assert torch.equal(ga, gb)


def _accepted(target, mode, draft, prompts):
    loaded = open_checkpoint(target, mode=mode, draft_dir=draft)
    got = speculative_generate(loaded.runner, loaded.proposer(), prompts, 32, 4)
    return got.output_ids, got.extra["acceptance"]["mean_accepted_tokens"]


@pytest.mark.parametrize("mode", MODES)
def test_every_draft_speculates_exactly_on_the_wide_target_with_its_small_acceptance(mode, wide, tokenizer,
                                                                                     reference):
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    _, small_target_draft = sources.resolve_sources(None, mode)
    out_small, small = _accepted(embedded.target_dir(), mode, small_target_draft, prompts)
    draft = None if mode == "mtp" else wide / mode
    out_wide, big = _accepted(wide / "target", mode, draft, prompts)
    assert out_small == out_wide == reference
    assert abs(big - small) <= 0.15, f"{mode}: mean accepted {big:.2f} wide vs {small:.2f} small"


def test_the_nvfp4_block_draft_widens_with_its_packed_scales(wide, tokenizer, reference):
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    out_small, small = _accepted(embedded.target_dir(), "dspark", embedded.draft_dir("dspark", "nvfp4_w4a16"),
                                 prompts)
    assert (wide / "dspark_nvfp4" / "hf_quant_config.json").is_file()
    out_wide, big = _accepted(wide / "target", "dspark", wide / "dspark_nvfp4", prompts)
    assert out_small == out_wide == reference
    assert abs(big - small) <= 0.15


def test_widening_is_deterministic(wide, tmp_path):
    again = widen.widen(tmp_path / "again", K, log=lambda line: None)
    first, second = (json.loads((d / "MANIFEST.json").read_text()) for d in (wide, again))
    assert first == second


@pytest.mark.parametrize("factor", ["0", "-3", "1.5", "four"])
def test_a_bad_factor_exits_2_naming_it(factor, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        widen.main(["--factor", factor, "--output_dir", str(tmp_path / "out")])
    assert e.value.code == 2
    assert "--factor" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_source_that_is_not_the_shipped_model_is_refused_and_nothing_is_written(tmp_path, capsys):
    source = tmp_path / "source"
    shutil.copytree(embedded.ROOT, source, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    cfg = source / "eagle3" / "config.json"
    cfg.write_text(cfg.read_text() + " ")
    assert widen.main(["--factor", "2", "--output_dir", str(tmp_path / "out"), "--source", str(source)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "eagle3/config.json" in err[0] and "SHA-256" in err[0]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out*"))


def test_an_output_dir_that_is_not_an_earlier_widening_is_never_replaced(wide, tmp_path, capsys):
    """--output_dir another directory (or the source itself) exited 0 and deleted it; a file or a path
    under a file was a traceback. Each is now one line and exit 2, with nothing changed or left; an
    earlier widening (the fixture's) is accepted as replaceable."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    (tmp_path / "afile").write_text("x")
    for out, named in ((other, "holds other files"), (tmp_path / "afile", "is a file"),
                       (tmp_path / "afile" / "sub", "is a file")):
        assert widen.main(["--factor", "1", "--output_dir", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and named in err[0], err
    assert (other / "keep.txt").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["afile", "other"]
    assert widen._earlier_output(wide) and not widen._earlier_output(embedded.ROOT)


def test_a_failed_write_leaves_no_parent_directory_it_made(tmp_path):
    from builder.atomic_dir import atomic_dir
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "new" / "deeper" / "out"):
            raise RuntimeError("the write failed")
    assert list(tmp_path.iterdir()) == []


def test_commands_resolve_the_wide_embedded_model_from_a_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("NEMOSPEC_EMBEDDED_CACHE", str(tmp_path))
    target, draft = sources.resolve_sources(None, "eagle3", embedded="wide", embedded_factor=K)
    assert target.parent.parent == tmp_path and draft == target.parent / "eagle3"
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    again, mtp = sources.resolve_sources(None, "mtp", embedded="wide", embedded_factor=K)
    assert again == target and mtp is None and (target / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(sources.CheckpointError, match="--embedded_factor"):
        sources.resolve_sources(None, "eagle3", embedded="small", embedded_factor=3)
