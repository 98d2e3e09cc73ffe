"""Speculative engine directories: target + verify + draft engines, checked on the CPU interpreter,
and the CLI for every mode (draft_target, mtp here; eagle and eagle3 in test_eagle_drafts)."""
import json
import shutil

import pytest
import torch

from builder.engine import BuildOptions, build
from nemospec import cli
from runtime.generation import generate
from runtime.loading import open_engine_dir
from runtime.speculative import speculative_generate
from runtime.state import chunk_inputs
from runtime.tree.draft import TreeShape
from speculative_fixtures import assert_greedy_margin, layer_subset_draft, target_with_mtp

OPTIONS = dict(max_batch_size=4, max_input_len=32, max_seq_len=96, max_draft_len=3)


@pytest.fixture(scope="module")
def dirs(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_engines")
    target = target_with_mtp(checkpoints["dense"], root / "target")
    draft = layer_subset_draft(target, root / "draft")
    engines = {}
    for mode in ("draft_target", "mtp"):
        engines[mode] = root / f"engine_{mode}"
        build(target, engines[mode], BuildOptions(**OPTIONS, speculative_decoding_mode=mode, tree_engines=True),
              log=lambda m: None, draft_dir=draft if mode == "draft_target" else None)
    return target, draft, engines


@pytest.mark.parametrize("mode", ["draft_target", "mtp"])
def test_speculative_engine_directory(mode, dirs):
    engine_dir = dirs[2][mode]
    meta = json.loads((engine_dir / "config.json").read_text())
    assert meta["speculative"]["mode"] == mode
    assert set(meta["engines"]) == {"target", "verify", "draft", "tree_verify", "draft_tree"}
    verify = meta["engines"]["verify"]
    assert [p["max_tokens"] for p in verify["profiles"]] == [4]
    kept = {n.rpartition(".")[2] for n in verify["outputs"]}
    assert {"conv_inputs", "ssm_x", "ssm_B", "ssm_dt"} <= kept, "verify keeps what rollback needs"
    assert not kept & {"ssm_state", "ssm_states", "conv_states"}, "no per-position (or final) SSM states"
    report = json.loads((engine_dir / "build_report.json").read_text())
    assert set(report["engines"]) == set(meta["engines"])
    for name in meta["engines"]:
        assert (engine_dir / f"{name}.engine").stat().st_size == report["engines"][name]["engine_bytes"]
    if mode == "mtp":
        assert "features.hidden" in meta["engines"]["target"]["outputs"]
        assert "hidden_out" in meta["engines"]["draft"]["outputs"]
        assert not (engine_dir / "weights" / "draft.safetensors").exists()
    else:
        assert (engine_dir / "weights" / "draft.safetensors").is_file()


@pytest.mark.parametrize("mode", ["draft_target", "mtp"])
def test_interpreted_engines_speculate_exactly(mode, dirs):
    """target, verify and draft networks all run through the interpreter: output == target greedy."""
    engine_dir = dirs[2][mode]
    eager = open_engine_dir(engine_dir, backend="torch")
    interp = open_engine_dir(engine_dir, backend="interpreter")
    prompts = [[5, 9, 17, 33, 4], [7]]
    want = generate(eager.runner, prompts, 12).output_ids
    assert_greedy_margin(eager.runner, prompts, want, 3)  # interpreted verify chunks vs eager decode steps
    got = speculative_generate(interp.runner, interp.proposer(), prompts, 12, 3)
    assert got.output_ids == want
    eager_spec = speculative_generate(eager.runner, eager.proposer(), prompts, 12, 3)
    assert eager_spec.extra["acceptance"] == got.extra["acceptance"]


def test_draft_and_verify_engine_networks_equal_eager(dirs):
    """Each network alone: verify (and the rollback from what it kept) and the MTP draft, interpreter
    vs eager."""
    engine_dir = dirs[2]["mtp"]
    eager = open_engine_dir(engine_dir, backend="torch")
    interp = open_engine_dir(engine_dir, backend="interpreter")
    ids, positions, lengths = chunk_inputs([[5, 6, 7, 8], [9, 10]], [3, 6])
    rows = torch.arange(4, dtype=torch.int32).repeat(2, 1)
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in eager.runner.new_state(2, 16).items()}
    a = interp.runner.forward(ids, positions, lengths, rows, {k: v.clone() for k, v in state.items()}, verify=True)
    b = eager.runner.forward(ids, positions, lengths, rows, {k: v.clone() for k, v in state.items()}, verify=True)
    torch.testing.assert_close(a[0], b[0], rtol=1e-4, atol=1e-4)
    assert set(a[1]) == set(b[1])
    for name in b[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=1e-4, atol=1e-4, msg=name)
    accepted = torch.tensor([2, 0])
    rolled = interp.runner.rollback(state, a[1], accepted), eager.runner.rollback(state, b[1], accepted)
    assert set(rolled[0]) == set(state)
    for name in rolled[1]:
        torch.testing.assert_close(rolled[0][name], rolled[1][name], rtol=1e-4, atol=1e-4, msg=name)
    torch.testing.assert_close(a[2]["hidden"], b[2]["hidden"], rtol=1e-4, atol=1e-4)
    d_eager, d_interp = eager.proposer().draft, interp.proposer().draft
    hidden = torch.randn(2, 4, eager.config.hidden_size, generator=g)
    dstate = {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in d_eager.new_state(2, 16).items()}
    x = d_interp.step(ids, hidden, None, positions, lengths, (lengths - 1)[:, None], {k: v.clone() for k, v in dstate.items()})
    y = d_eager.step(ids, hidden, None, positions, lengths, (lengths - 1)[:, None], {k: v.clone() for k, v in dstate.items()})
    for u, v in zip(x[:2], y[:2]):
        torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-4)


def test_verify_engine_of_an_older_build_is_refused(dirs, tmp_path):
    """An engine directory whose verify returns per-position states (older nemospec) exits 2 naming
    the field and the fix, instead of failing inside the rollback."""
    old = tmp_path / "old"
    shutil.copytree(dirs[2]["mtp"], old)
    meta = json.loads((old / "config.json").read_text())
    outputs = meta["engines"]["verify"]["outputs"]
    meta["engines"]["verify"]["outputs"] = {n.replace(".ssm_x", ".ssm_states"): v for n, v in outputs.items()}
    (old / "config.json").write_text(json.dumps(meta))
    from builder.errors import NemospecError
    with pytest.raises(NemospecError, match=r"engines.verify has no '\*.ssm_x' outputs.*rebuild"):
        open_engine_dir(old, backend="torch")
    open_engine_dir(dirs[2]["mtp"], backend="torch")  # the current layout loads


def _gen(capsys, *argv):
    code = cli.main(["generate", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, (json.loads(out.strip().splitlines()[-1]) if code == 0 else None), err


@pytest.mark.parametrize("mode", ["draft_target", "mtp"])
def test_cli_generate_reports_acceptance_and_no_speculation_matches(mode, dirs, capsys):
    engine_dir = dirs[2][mode]
    args = ["--engine_dir", engine_dir, "--input_ids", "5,9,17", "--max_new_tokens", 24, "--ignore_eos", "--json"]
    code, spec, err = _gen(capsys, *args)
    assert code == 0 and "mean accepted tokens" in err
    a = spec["acceptance"]
    assert set(a) >= {"mean_accepted_tokens", "histogram", "num_target_forwards"}
    assert sum(int(n) * c for n, c in a["histogram"].items()) >= 23
    _, plain, _ = _gen(capsys, *args, "--no_speculation")
    assert spec["output_ids"] == plain["output_ids"] and "acceptance" not in plain
    assert_greedy_margin(open_engine_dir(engine_dir, backend="torch").runner, [[5, 9, 17]], [plain["output_ids"]], 3)
    _, smaller, _ = _gen(capsys, *args, "--num_draft_tokens", 1)
    assert smaller["output_ids"] == plain["output_ids"]
    assert list(smaller["acceptance"]["histogram"]) == ["1", "2"]
    code, _, err = _gen(capsys, *args, "--num_draft_tokens", 9)
    assert code == 2 and "--num_draft_tokens" in err


def test_build_errors_name_the_field(dirs, checkpoints, tmp_path, capsys):
    target, draft, _ = dirs

    def build_cli(*extra):
        code = cli.main(["build", "--checkpoint_dir", str(target), "--output_dir", str(tmp_path / "e"),
                         "--max_draft_len", "2", *map(str, extra)])
        return code, capsys.readouterr().err

    code, err = build_cli("--speculative_decoding_mode", "draft_target")
    assert code == 2 and "--draft_dir" in err
    code, err = build_cli("--speculative_decoding_mode", "mtp", "--draft_dir", draft)
    assert code == 2 and "--draft_dir" in err
    other_vocab = checkpoints["two_attention"]  # vocab 112 vs the target's 128
    code, err = build_cli("--speculative_decoding_mode", "draft_target", "--draft_dir", other_vocab)
    assert code == 2 and "vocab_size" in err
    code = cli.main(["build", "--checkpoint_dir", str(checkpoints["dense"]), "--output_dir", str(tmp_path / "e"),
                     "--max_draft_len", "2", "--speculative_decoding_mode", "mtp"])
    assert code == 2 and "num_nextn_predict_layers" in capsys.readouterr().err
    code2 = cli.main(["build", "--checkpoint_dir", str(target), "--output_dir", str(tmp_path / "e"),
                      "--speculative_decoding_mode", "mtp", "--max_draft_len", "0"])
    assert code2 == 2 and "--max_draft_len" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
    broken = tmp_path / "broken"
    shutil.copytree(target, broken)
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["mtp.layers.0.eh_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    code = cli.main(["build", "--checkpoint_dir", str(broken), "--output_dir", str(tmp_path / "e"),
                     "--max_draft_len", "2", "--speculative_decoding_mode", "mtp"])
    assert code == 2 and "mtp.layers.0.eh_proj.weight" in capsys.readouterr().err


@pytest.fixture(scope="module")
def eagle_dirs(checkpoints, tmp_path_factory):
    from speculative_fixtures import FEATURE_DRAFTS
    root = tmp_path_factory.mktemp("eagle_engines")
    engines = {}
    for mode, draft in FEATURE_DRAFTS.items():
        engines[mode] = root / mode
        build(checkpoints["moe"], engines[mode], BuildOptions(**OPTIONS, speculative_decoding_mode=mode, tree_engines=True),
              log=lambda m: None, draft_dir=draft, draft_quantization="nvfp4_w4a16" if mode == "dspark" else None)
    return engines


@pytest.mark.parametrize("mode", ["eagle", "eagle3", "dflash", "dspark", "peagle"])
def test_eagle_engine_directories_speculate_exactly_on_the_interpreter(mode, eagle_dirs):
    engine_dir = eagle_dirs[mode]
    meta = json.loads((engine_dir / "config.json").read_text())
    assert meta["speculative"]["mode"] == mode and meta["speculative"]["draft"]["kind"] == mode
    target_outputs = meta["engines"]["target"]["outputs"]
    assert ("features.hidden" if mode == "eagle" else "features.aux_hidden") in target_outputs
    report = json.loads((engine_dir / "build_report.json").read_text())
    if mode != "eagle":
        assert "hidden_capture" in report["engines"]["target"]["lowerings"]
    if mode == "eagle3":
        assert "from_target" in meta["engines"]["draft"]["inputs"]
    if mode == "dspark":  # NVFP4 draft: FP4 linears; the Markov step in its own engine (rank 8: W2 stays dense)
        assert meta["speculative"]["quantization"] == "nvfp4_w4a16"
        assert "linear_nvfp4" in report["engines"]["draft"]["lowerings"]
        assert "markov" in report["engines"] and "markov" in meta["engines"]
    eager = open_engine_dir(engine_dir, backend="torch")
    interp = open_engine_dir(engine_dir, backend="interpreter")
    prompts = [[5, 9, 17, 33, 4], [7]]
    want = generate(eager.runner, prompts, 10).output_ids
    assert_greedy_margin(eager.runner, prompts, want, 3)
    got = speculative_generate(interp.runner, interp.proposer(), prompts, 10, 3)
    assert got.output_ids == want
    assert got.extra["acceptance"] == speculative_generate(eager.runner, eager.proposer(), prompts, 10, 3).extra["acceptance"]


def test_eagle3_draft_that_does_not_fit_exits_2(dirs, tmp_path, capsys):
    from speculative_fixtures import FEATURE_DRAFTS
    target = dirs[0]  # hidden 64: the fixture drafts are for hidden 32
    code = cli.main(["build", "--checkpoint_dir", str(target), "--output_dir", str(tmp_path / "e"), "--max_draft_len", "2",
                     "--speculative_decoding_mode", "eagle3", "--draft_dir", str(FEATURE_DRAFTS["eagle3"])])
    assert code == 2 and "hidden_size" in capsys.readouterr().err
    code = cli.main(["build", "--checkpoint_dir", str(target), "--output_dir", str(tmp_path / "e"), "--max_draft_len", "2",
                     "--speculative_decoding_mode", "eagle", "--draft_dir", str(FEATURE_DRAFTS["eagle3"])])
    assert code == 2 and "eagle3" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


TREE = TreeShape(max_nodes=6, topk=2, depth=3)


@pytest.mark.parametrize("mode", ["draft_target", "mtp", "eagle", "eagle3", "dflash", "dspark", "peagle"])
def test_tree_engines_speculate_exactly_on_the_interpreter(mode, dirs, eagle_dirs):
    """--tree_engines: the target's tree verify network (and a chain draft's tree step network) run on
    the CPU interpreter inside tree speculation: greedy output equal to target-only, and the same
    accepted paths as the eager tree run (both draft and verify networks compute what eager does)."""
    engine_dir = dirs[2][mode] if mode in ("draft_target", "mtp") else eagle_dirs[mode]
    meta = json.loads((engine_dir / "config.json").read_text())
    engines = meta["engines"]
    assert [p["max_tokens"] for p in engines["tree_verify"]["profiles"]] == [17]   # max_tree_nodes 16 + the root
    assert {"parents", "ancestors"} <= set(engines["tree_verify"]["inputs"])
    kept = {n.rpartition(".")[2] for n in engines["tree_verify"]["outputs"]}
    assert {"conv_inputs", "ssm_x", "ssm_B", "ssm_dt"} <= kept and not kept & {"ssm_state", "ssm_states"}
    chain_draft = mode in ("draft_target", "mtp", "eagle", "eagle3")
    assert ("draft_tree" in engines) == chain_draft
    if chain_draft and mode != "draft_target":
        assert {"slots", "visible", "hidden"} <= set(engines["draft_tree"]["inputs"])
        assert [p["max_tokens"] for p in engines["draft_tree"]["profiles"]] == [16]
    eager = open_engine_dir(engine_dir, backend="torch")
    interp = open_engine_dir(engine_dir, backend="interpreter")
    prompts = [[5, 9, 17, 33, 4], [7]]
    want = generate(eager.runner, prompts, 10).output_ids
    assert_greedy_margin(eager.runner, prompts, want, TREE.max_nodes + 1)
    proposer, calls = interp.proposer(), {}
    draft_tree = proposer.runner.tree if mode == "draft_target" else proposer.draft.executors.get("draft_tree")
    for name, executor in (("tree_verify", interp.runner.tree), ("draft_tree", draft_tree)):
        if executor is not None:   # count the interpreted networks' calls
            executor.run = (lambda run, name: lambda feeds: calls.update({name: calls.get(name, 0) + 1}) or run(feeds))(
                executor.run, name)
    got = speculative_generate(interp.runner, proposer, prompts, 10, TREE.depth, tree=TREE)
    assert got.output_ids == want
    stats = got.extra["acceptance"]
    steps = sum(stats["tree"]["steps_by_size"].values())
    assert steps and calls["tree_verify"] == steps, "every tree step verifies on the interpreted network"
    if chain_draft:   # a chain draft's tree step runs its interpreted tree network once per depth below the last
        assert calls["draft_tree"] >= steps * (TREE.depth - 1 if mode != "draft_target" else TREE.depth)
    assert stats == speculative_generate(eager.runner, eager.proposer(), prompts, 10, TREE.depth,
                                         tree=TREE).extra["acceptance"]


def test_tree_on_an_engine_backend_needs_tree_engines(eagle_dirs, tmp_path, capsys):
    """A directory built without --tree_engines refuses --tree on an engine backend, naming the flag."""
    plain = tmp_path / "plain"
    shutil.copytree(eagle_dirs["eagle3"], plain)
    meta = json.loads((plain / "config.json").read_text())
    for name in ("tree_verify", "draft_tree"):
        del meta["engines"][name]
        (plain / f"{name}.engine").unlink()
        del meta["files"][f"{name}.engine"]
    (plain / "config.json").write_text(json.dumps(meta))
    code = cli.main(["generate", "--engine_dir", str(plain), "--backend", "interpreter", "--tree",
                     "--input_ids", "5,9,17", "--max_new_tokens", "4"])
    assert code == 2 and "--tree_engines" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["eagle3", "draft_target", "dspark"])
def test_sampled_tree_steps_run_the_tree_engines(mode, dirs, eagle_dirs):
    """Sampled trees take the step-by-step path (tree steps, tree verify, rejection walk, tree
    rollback apart): through the interpreted networks they draw what the eager run draws with the
    same seed (logits equal to ~1e-6; a draw flips only if a uniform lands that close to a boundary)."""
    engine_dir = dirs[2][mode] if mode == "draft_target" else eagle_dirs[mode]
    eager = open_engine_dir(engine_dir, backend="torch")
    interp = open_engine_dir(engine_dir, backend="interpreter")
    runs = [speculative_generate(o.runner, o.proposer(), [[5, 9, 17, 33, 4]], 8, TREE.depth, temperature=0.8, seed=3,
                                 tree=TREE) for o in (interp, eager)]
    assert runs[0].output_ids == runs[1].output_ids
    assert runs[0].extra["acceptance"]["tree"]["steps_by_size"]
