"""`nemospec build`: engine directories, their contract and report, and that the serialized network
computes what the eager model computes (CPU interpreter; engines cannot execute without a GPU)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from builder.checkpoint import checkpoint_hash, load_checkpoint
from builder.config import NemotronHConfig
from builder.engine import BuildOptions, build
from nemospec import cli
from runtime.generation import generate
from runtime.loading import open_checkpoint, open_engine_dir
from runtime.state import chunk_inputs
from speculative_fixtures import assert_greedy_margin

OPTIONS = BuildOptions(max_batch_size=4, max_input_len=32, max_seq_len=64, max_draft_len=3)


@pytest.fixture(scope="module")
def engines(checkpoints, tmp_path_factory):
    """kind -> engine directory built from the tiny checkpoint of that kind (once)."""
    root = tmp_path_factory.mktemp("engines")

    class _Lazy(dict):
        def __missing__(self, kind):
            self[kind] = root / kind
            build(checkpoints[kind], self[kind], OPTIONS, log=lambda m: None)
            return self[kind]

    return _Lazy()


def test_engine_directory_is_self_contained(engines, checkpoints):
    engine_dir = engines["moe"]
    names = {p.name for p in engine_dir.iterdir()}
    assert {"build_report.json", "config.json", "target.engine", "weights"} <= names
    assert names - {"build_report.json", "config.json", "target.engine", "weights"} <= {"generation_config.json"}
    meta = json.loads((engine_dir / "config.json").read_text())
    config, _ = load_checkpoint(checkpoints["moe"])
    assert meta["source"]["sha256"] == checkpoint_hash(checkpoints["moe"])
    assert NemotronHConfig.from_dict(meta["model"]) == config
    assert meta["build"] == {"max_batch_size": 4, "max_input_len": 32, "max_seq_len": 64, "max_draft_len": 3,
                             "dtype": "float32", "speculative_decoding_mode": None, "draft_len_schedule": "",
                             "draft_confidence_threshold": 0.0, "acceptance_rate_threshold": 0.0,
                             "acceptance_rate_window_size": 8, "draft_len_adaptive": False, "max_tree_nodes": 16, "tree_topk": 0,
                             "tree_depth": 0, "tree_engines": False,
                             "strip_plan": False, "max_host_memory_gb": 0.0, "num_layers": 0,
                             "draft_weight_dtype": "auto", "matmul_precision": "highest"}
    assert meta["tensorrt"]["flavour"] in ("tensorrt", "tensorrt_rtx") and meta["tensorrt"]["version"]
    target = meta["engines"]["target"]
    assert set(target["inputs"]) >= {"input_ids", "positions", "lengths", "logit_index"}
    mamba = config.layer_indices("mamba")[0]
    assert target["inputs"][f"past.layers.{mamba}.ssm_state"]["dtype"] == "float32"
    assert f"present.layers.{mamba}.conv_state" in target["outputs"]
    assert [(p["name"], p["max_tokens"]) for p in target["profiles"]] == [("decode", 4), ("prefill", 32)]
    prefill = target["profiles"][1]["shapes"]["input_ids"]
    assert prefill[0] == [1, 1] and prefill[2] == [4, 32]
    report = json.loads((engine_dir / "build_report.json").read_text())
    t = report["engines"]["target"]
    assert t["engine_bytes"] == (engine_dir / "target.engine").stat().st_size > 0
    assert t["layers"] > 100 and t["build_seconds"] > 0
    assert report["weight_bytes"]["target"] == (engine_dir / "weights" / "target.safetensors").stat().st_size - _header(engine_dir)
    assert {"ssm_scan", "attention", "moe", "causal_conv1d"} <= set(t["lowerings"])
    assert report["tensorrt"] == meta["tensorrt"]


def _header(engine_dir):
    raw = (engine_dir / "weights" / "target.safetensors").read_bytes()
    return 8 + int.from_bytes(raw[:8], "little")


@pytest.mark.parametrize("kind", ["dense", "moe", "two_attention"])
def test_interpreted_engine_network_generates_like_eager(kind, engines):
    eager = open_engine_dir(engines[kind], backend="torch").runner
    interp = open_engine_dir(engines[kind], backend="interpreter").runner
    prompts = [[5, 9, 17, 33, 4, 8, 11], [7], [12, 13, 14]]
    # prefill logits of a ragged batch, every row
    ids, positions, lengths = chunk_inputs(prompts, [0, 0, 0])
    index = torch.arange(7, dtype=torch.int32).repeat(3, 1)
    a, state_a, _ = interp.forward(ids, positions, lengths, index, interp.new_state(3, 24))
    b, state_b, _ = eager.forward(ids, positions, lengths, index, eager.new_state(3, 24))
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for name in state_b:
        if "conv" in name or "ssm" in name:
            torch.testing.assert_close(state_a[name], state_b[name], rtol=1e-4, atol=1e-4, msg=name)
    # greedy decode through the interpreted network equals eager decode (where no near-tie decides it)
    want = generate(eager, prompts, 10).output_ids
    assert_greedy_margin(eager, prompts, want)
    assert generate(interp, prompts, 10).output_ids == want


def test_engine_weights_reproduce_the_checkpoint(engines, checkpoints):
    prompts = [[3, 4, 5, 6]]
    from_engine = generate(open_engine_dir(engines["dense"], backend="torch").runner, prompts, 16).output_ids
    from_ckpt = generate(open_checkpoint(checkpoints["dense"]).runner, prompts, 16).output_ids
    assert from_engine == from_ckpt


def test_bfloat16_build(checkpoints, tmp_path):
    out = tmp_path / "bf16"
    report = build(checkpoints["dense"], out, BuildOptions(max_batch_size=2, max_input_len=16, max_seq_len=32,
                                                           dtype="bfloat16"), log=lambda m: None)
    assert report["dtype"] == "bfloat16"
    with safe_open(str(out / "weights" / "target.safetensors"), "pt") as f:
        assert f.get_tensor("backbone.layers.0.mixer.in_proj.weight").dtype == torch.bfloat16
        assert f.get_tensor("backbone.layers.0.mixer.A_log").dtype == torch.float32
    interp = open_engine_dir(out, backend="interpreter").runner
    eager = open_engine_dir(out, backend="torch").runner
    assert eager.dtype == torch.bfloat16
    ids, positions, lengths = chunk_inputs([[5, 6, 7, 8]], [0])
    a, _, _ = interp.forward(ids, positions, lengths, (lengths - 1)[:, None], interp.new_state(1, 8))
    b, _, _ = eager.forward(ids, positions, lengths, (lengths - 1)[:, None], eager.new_state(1, 8))
    assert ((a - b).abs().max() / b.abs().max()).item() < 5e-2


def _leftovers(parent: Path):
    return sorted(p.name for p in parent.iterdir())


def test_bad_checkpoint_leaves_no_output(checkpoints, tmp_path, capsys):
    import shutil
    from safetensors.torch import load_file, save_file
    broken = tmp_path / "ckpt"
    shutil.copytree(checkpoints["dense"], broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["backbone.layers.3.mixer.q_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    code = cli.main(["build", "--checkpoint_dir", str(broken), "--output_dir", str(out_parent / "engine")])
    err = capsys.readouterr().err
    assert code == 2
    assert "backbone.layers.3.mixer.q_proj.weight" in err
    assert _leftovers(out_parent) == []


def test_failure_during_build_leaves_nothing_and_keeps_an_old_engine(checkpoints, tmp_path, monkeypatch):
    from builder.backends import trt_build
    out = tmp_path / "engine"
    build(checkpoints["dense"], out, BuildOptions(max_batch_size=1, max_input_len=8, max_seq_len=16), log=lambda m: None)
    before = (out / "target.engine").read_bytes()

    def explode(*args, **kwargs):
        raise RuntimeError("builder crashed")

    monkeypatch.setattr(trt_build, "build_serialized", explode)
    with pytest.raises(RuntimeError):
        build(checkpoints["moe"], out, OPTIONS, log=lambda m: None)
    assert _leftovers(tmp_path) == ["engine"]
    assert (out / "target.engine").read_bytes() == before


@pytest.mark.parametrize("flag, value, needle", [("--max_input_len", "2000", "--max_input_len"),
                                                  ("--max_batch_size", "0", "--max_batch_size")])
def test_bad_build_options_exit_2(flag, value, needle, checkpoints, tmp_path, capsys):
    code = cli.main(["build", "--checkpoint_dir", str(checkpoints["dense"]), "--output_dir", str(tmp_path / "e"),
                     flag, value])
    assert code == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_nemospec_build_console_script_and_engine_generate(checkpoints, tmp_path):
    exe = Path(sys.executable).parent
    out = tmp_path / "engine"
    built = subprocess.run([str(exe / "nemospec-build"), "--checkpoint_dir", str(checkpoints["two_attention"]),
                            "--output_dir", str(out), "--max_batch_size", "2", "--max_input_len", "16",
                            "--max_seq_len", "48"], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    assert "[1/1] building target.engine" in built.stderr and "lowering" not in built.stdout
    gen = subprocess.run([str(exe / "nemospec"), "generate", "--engine_dir", str(out), "--input_ids", "4,5,6",
                          "--max_new_tokens", "8", "--ignore_eos", "--json"], capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr
    record = json.loads(gen.stdout.strip().splitlines()[-1])
    runner = open_checkpoint(checkpoints["two_attention"]).runner
    ref = generate(runner, [[4, 5, 6]], 8).output_ids[0]
    assert_greedy_margin(runner, [[4, 5, 6]], [ref])
    assert record["output_ids"] == ref


def test_draft_weight_dtype_is_checked():
    """--draft_weight_dtype takes auto, float32 or bfloat16; anything else is one clear error."""
    from builder.errors import BuildError
    with pytest.raises(BuildError, match="--draft_weight_dtype: expected auto, float32 or bfloat16, got int8"):
        BuildOptions(draft_weight_dtype="int8").validate()
    BuildOptions(draft_weight_dtype="bfloat16").validate()
