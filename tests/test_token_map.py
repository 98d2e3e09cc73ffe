"""--speculative_token_map (FR-Spec): a draft's LM head cut to chosen target tokens. The cut draft's
logits are the full draft's at the kept tokens, speculation with it stays equal to target-only
greedy, an engine directory keeps the cut head, and bad maps are refused with the file named."""
import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from builder import embedded
from builder.checkpoint import load_checkpoint
from builder.drafts import load_draft
from builder.engine import BuildOptions, build
from builder.errors import DraftError, NemospecError
from builder.models.nemotron_h import NemotronH
from builder.token_map import rank_tokens, read_token_map
from nemospec import cli
from runtime.drafts import EagerDraft
from runtime.generation import generate
from runtime.loading import open_engine_dir
from runtime.proposers import FeatureDraftProposer
from runtime.runner import TorchRunner
from runtime.speculative import speculative_generate
from speculative_fixtures import FEATURE_DRAFTS, PROPOSERS, assert_greedy_margin

MAPPED = ["eagle3", "dflash", "dspark", "peagle"]
PROMPTS = [[5, 9, 17, 33, 4, 8, 11], [7], [40, 41, 42, 43, 44, 45, 46, 47]]
# every third id of the tiny target's 96 and a few more: the drafts' favourite tokens fall on both sides
MAP = sorted(set(range(0, 96, 3)) | {1, 2, 5, 7, 11, 13})


def _map_file(tmp_path, ids=MAP, name="map.json"):
    path = tmp_path / name
    path.write_text(json.dumps(ids))
    return path


def _target_ids(module):
    """The target id of each draft-vocabulary row (target id = draft id + d2t[draft id])."""
    rows = torch.arange(module.lm_head.shape[0])
    return rows if module.d2t is None else rows + module.d2t


def _draft_inputs(module, mode, batch=2, rows=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(batch, rows, module.aux_width, generator=g, dtype=torch.float64)
    positions = torch.arange(rows, dtype=torch.int32).repeat(batch, 1)
    lengths = torch.full((batch,), rows, dtype=torch.int32)
    ids = torch.randint(3, 90, (batch, rows), generator=g, dtype=torch.int32)
    index = torch.arange(rows, dtype=torch.int32).repeat(batch, 1)

    def run(m):
        state = {k: torch.zeros(s, dtype=d if not d.is_floating_point else torch.float64)
                 for k, (s, d) in m.state_spec(batch, 16).items()}
        if mode == "eagle3":
            hidden = torch.zeros(batch, rows, m.hidden_size, dtype=torch.float64)
            return m.forward(ids, aux, hidden, torch.ones_like(ids), positions, lengths, index, state)[0]
        if mode == "peagle":
            return m.forward(ids, aux, torch.zeros_like(ids), positions, lengths, index, state)[0]
        block = m.block_inputs(ids[:, 0], torch.full((batch,), rows, dtype=torch.int32), 3)
        return m.forward(aux, positions, lengths, *block, state)[0]
    return run


@pytest.mark.parametrize("mode, quantization", [(m, None) for m in MAPPED] + [("dspark", "nvfp4_w4a16")])
def test_the_cut_draft_scores_the_kept_tokens_as_the_full_draft(mode, quantization, checkpoints, tmp_path):
    """Also for a DSpark quantized at load (its linears NVFP4; the fixture's rank-8 Markov W2 has no
    whole 16-block, so it stays in precision and only its rows are cut)."""
    config, weights = load_checkpoint(checkpoints["moe"])
    weights64 = {k: v.double() if v.is_floating_point() else v for k, v in weights.items()}
    full = load_draft(mode, config, weights64, FEATURE_DRAFTS[mode], torch.float64, log=lambda m: None,
                      quantization=quantization)
    cut = load_draft(mode, config, weights64, FEATURE_DRAFTS[mode], torch.float64, log=lambda m: None,
                     token_map=_map_file(tmp_path), quantization=quantization)
    full_ids, cut_ids = (_target_ids(d.module) for d in (full, cut))
    kept = [i for i, t in enumerate(full_ids.tolist()) if t in set(MAP)]
    assert cut_ids.tolist() == full_ids[kept].tolist()                        # the map's tokens the draft had
    assert 0 < len(kept) < full.module.vocab_size                             # really cut
    assert cut.meta["token_map"]["tokens"] == len(MAP) and cut.meta["draft"]["draft_vocab_size"] == len(kept)
    run = _draft_inputs(full.module, mode)
    a, b = run(cut.module), run(full.module)[..., kept]
    # float64 inside, fp32 logits out: the same sums to ~1e-16, so equal up to the fp32 rounding step
    assert torch.allclose(a, b, rtol=torch.finfo(torch.float32).eps, atol=0), (a - b).abs().max()


def _speculate(target_dir, mode, token_map, k):
    config, weights = load_checkpoint(target_dir)
    draft = load_draft(mode, config, weights, FEATURE_DRAFTS[mode], torch.float32, log=lambda m: None,
                       token_map=token_map)
    target = TorchRunner(NemotronH(config, weights, torch.float32, **draft.target_features))
    proposer = PROPOSERS.get(mode, FeatureDraftProposer)(EagerDraft(draft.module, config.vocab_size))
    return target, speculative_generate(target, proposer, PROMPTS, 40, k)


@pytest.mark.parametrize("mode", MAPPED)
def test_speculation_with_a_cut_draft_equals_target_greedy(mode, checkpoints, tmp_path):
    target, result = _speculate(checkpoints["moe"], mode, _map_file(tmp_path), 4)
    want = generate(target, PROMPTS, 40).output_ids
    assert_greedy_margin(target, PROMPTS, want)
    assert result.output_ids == want
    hist = result.extra["acceptance"]["histogram"]
    assert sum(int(n) * c for n, c in hist.items()) >= 40 * len(PROMPTS) - len(PROMPTS)


def test_a_map_of_every_token_changes_nothing(checkpoints, tmp_path):
    """Control: the map over the whole vocabulary keeps every row; the run is the unmapped run's."""
    _, plain = _speculate(checkpoints["moe"], "eagle3", None, 4)
    _, everything = _speculate(checkpoints["moe"], "eagle3", _map_file(tmp_path, list(range(96))), 4)
    _, cut = _speculate(checkpoints["moe"], "eagle3", _map_file(tmp_path, MAP, "cut.json"), 4)
    assert everything.output_ids == plain.output_ids == cut.output_ids
    assert everything.extra["acceptance"]["histogram"] == plain.extra["acceptance"]["histogram"]


def test_token_map_formats(tmp_path):
    (tmp_path / "m.txt").write_text("4 7\n9\n")
    torch.save(torch.tensor([4, 7, 9]), tmp_path / "m.pt")
    for name in ("m.txt", "m.pt"):
        assert read_token_map(tmp_path / name, 96).tolist() == [4, 7, 9]
    assert read_token_map(_map_file(tmp_path, [9, 4]), 96).tolist() == [9, 4]


@pytest.mark.parametrize("content, message", [
    ("[1, 2, 200]", "token id 200 outside the target vocabulary [0, 96)"),
    ("[1, 2, 2]", "token ids repeat"),
    ("[]", "expected a non-empty 1-D list"),
    ("[[1, 2]]", "expected a non-empty 1-D list"),
    ("[1.5, 2]", "expected a non-empty 1-D list"),
    ("{\"a\": 1}", "not a list of token ids"),
    ("[true, 2]", "true or false is no token id"),
])
def test_bad_token_maps_are_refused_naming_the_file(content, message, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(DraftError, match="--speculative_token_map: .*bad.json") as e:
        read_token_map(path, 96)
    assert message in str(e.value)
    with pytest.raises(DraftError, match="no such file"):
        read_token_map(tmp_path / "missing.json", 96)


@pytest.mark.parametrize("mode", ["eagle", "mtp", "draft_target"])
def test_drafts_without_a_head_of_their_own_refuse_a_map(mode, checkpoints, tmp_path):
    config, weights = load_checkpoint(checkpoints["moe"])
    with pytest.raises(DraftError, match=f"--speculative_token_map: {mode} drafts"):
        load_draft(mode, config, weights, FEATURE_DRAFTS.get(mode, tmp_path), torch.float32, log=lambda m: None,
                   token_map=_map_file(tmp_path))


def test_rank_tokens_orders_by_count_then_id(tmp_path):
    from tokenizers import Tokenizer
    tokenizer = embedded.target_dir() / "tokenizer.json"
    (tmp_path / "sub").mkdir()
    texts = {"a.py": "def f(x):\n    return x + 1\n" * 7, "sub/b.txt": "import os\nprint(os.getcwd())\n" * 3}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    tok = Tokenizer.from_file(str(tokenizer))
    counts = Counter(t for text in texts.values() for t in tok.encode(text, add_special_tokens=False).ids)
    ranked = rank_tokens(tokenizer, [tmp_path], 1000)
    assert sorted(ranked) == sorted(counts)                                   # every token of both files
    keys = [(-counts[t], t) for t in ranked]
    assert keys == sorted(keys)                                               # by count, ties by id
    assert len(rank_tokens(tokenizer, [tmp_path], 2)) == 2


def test_token_map_command(tmp_path, capsys):
    (tmp_path / "c.py").write_text("for i in range(10):\n    print(i)\n")
    out = tmp_path / "map.json"
    assert cli.main(["token_map", "--corpus", str(tmp_path / "c.py"), "--size", "5", "--output", str(out)]) == 0
    ids = json.loads(out.read_text())
    assert len(ids) == 5 and len(set(ids)) == 5
    assert cli.main(["token_map", "--corpus", str(tmp_path / "nope"), "--size", "5", "--output", str(out)]) == 2
    assert "--corpus" in capsys.readouterr().err
    for suffix in (".txt", ".pt", ".ids"):   # each written as --speculative_token_map reads that suffix
        other = tmp_path / f"map{suffix}"
        assert cli.main(["token_map", "--corpus", str(tmp_path / "c.py"), "--size", "5", "--output", str(other)]) == 0
        assert read_token_map(other, 1 << 20).tolist() == ids, suffix


def test_generate_flag(checkpoints, tmp_path, capsys):
    args = ["generate", "--checkpoint_dir", str(checkpoints["moe"]), "--speculative_decoding_mode", "eagle3",
            "--draft_dir", str(FEATURE_DRAFTS["eagle3"]), "--input_ids", "5,9,17", "--max_new_tokens", "8",
            "--backend", "torch", "--json"]
    assert cli.main(args + ["--speculative_token_map", str(_map_file(tmp_path))]) == 0
    cut = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert cli.main(args) == 0
    full = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert cut["output_ids"] == full["output_ids"]
    assert cli.main(args + ["--speculative_token_map", str(tmp_path / "missing.json")]) == 2
    assert "missing.json: no such file" in capsys.readouterr().err


def test_engine_directory_keeps_the_cut_head(checkpoints, tmp_path):
    engine = tmp_path / "engine"
    options = BuildOptions(max_batch_size=2, max_input_len=16, max_seq_len=64, max_draft_len=3,
                           speculative_decoding_mode="eagle3")
    build(checkpoints["moe"], engine, options, log=lambda m: None, draft_dir=FEATURE_DRAFTS["eagle3"],
          token_map=_map_file(tmp_path))
    meta = json.loads((engine / "config.json").read_text())
    record = meta["speculative"]["token_map"]
    assert record["file"] == "map.json" and record["tokens"] == len(MAP)
    head = load_file(str(engine / "weights" / "draft.safetensors"))["lm_head.weight"]
    assert head.shape[0] == meta["speculative"]["draft"]["draft_vocab_size"] < 64
    loaded = open_engine_dir(engine, "torch")
    assert loaded.proposer().draft.module.vocab_size == head.shape[0]
    want = generate(loaded.runner, PROMPTS, 24).output_ids
    assert speculative_generate(loaded.runner, loaded.proposer(), PROMPTS, 24, 3).output_ids == want
    # the built networks (target, verify, cut draft) evaluated by the CPU interpreter: the same tokens
    interpreted = open_engine_dir(engine, "interpreter")
    assert interpreted.proposer().draft.module.vocab_size == head.shape[0]
    got = speculative_generate(interpreted.runner, interpreted.proposer(), PROMPTS[:1], 12, 3).output_ids
    assert got == [want[0][:12]]
    with pytest.raises(NemospecError, match="needs --speculative_decoding_mode"):
        build(checkpoints["moe"], tmp_path / "plain", BuildOptions(max_batch_size=1, max_input_len=16, max_seq_len=32),
              log=lambda m: None, token_map=_map_file(tmp_path))


def test_token_map_never_replaces_its_inputs_nor_leaves_a_part_written_map(tmp_path, capsys, monkeypatch):
    """--output naming the tokenizer or a corpus file replaced it with the id list (exit 0); a write
    that failed (a full disk) left the earlier map cut short; an empty corpus wrote an empty map."""
    import shutil

    from pathlib import Path

    from builder import embedded
    tokenizer = tmp_path / "tok.json"
    shutil.copy(embedded.target_dir() / "tokenizer.json", tokenizer)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "c.py").write_text("for i in range(10):\n    print(i)\n")
    before = {p: p.read_bytes() for p in (tokenizer, tmp_path / "corpus" / "c.py")}
    base = ["token_map", "--tokenizer", str(tokenizer), "--corpus", str(tmp_path / "corpus"), "--size", "5"]
    for output, flag in ((tokenizer, "--tokenizer"), (tmp_path / "corpus" / "c.py", "--corpus"),
                         (tmp_path / "corpus" / "map.json", "--corpus")):
        assert cli.main([*base, "--output", str(output)]) == 2
        err = capsys.readouterr().err
        assert f"is or is inside the {flag}" in err and len(err.strip().splitlines()) == 1, err
    assert {p: p.read_bytes() for p in before} == before and not (tmp_path / "corpus" / "map.json").exists()

    old = tmp_path / "old.json"
    old.write_text("[1, 2, 3]\n")

    def full_disk(self, *a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Path, "write_text", full_disk)
    assert cli.main([*base, "--output", str(old)]) == 2
    monkeypatch.undo()
    assert "--output" in capsys.readouterr().err and old.read_text() == "[1, 2, 3]\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "old.json", "tok.json"]   # no temporary file left
    (tmp_path / "empty.txt").write_text("")
    assert cli.main(["token_map", "--corpus", str(tmp_path / "empty.txt"), "--size", "5", "--output",
                     str(tmp_path / "m.json")]) == 2
    assert "no text in" in capsys.readouterr().err and not (tmp_path / "m.json").exists()
