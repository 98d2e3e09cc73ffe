"""Bad input to the commands, as a probe of every command found it: exit 2 with one line naming the
file, field or flag, no traceback, and nothing of the user's overwritten or left half-written."""
import json
import shutil

import pytest
import torch

from nemospec import cli


def _run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str) -> str:
    """The error: one line (progress lines of a build may precede it), and no traceback."""
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err and lines[0] == err.rstrip("\n").splitlines()[-1], err
    return lines[0]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("bad") / "eng"
    assert cli.main(["build", "--output_dir", str(out)]) == 0     # the embedded small model, target only
    return out


DAMAGES = {
    "not an object": lambda c: [],
    "no build": lambda c: {k: v for k, v in c.items() if k != "build"},
    "no max_seq_len": lambda c: {**c, "build": {k: v for k, v in c["build"].items() if k != "max_seq_len"}},
    "max_seq_len a string": lambda c: {**c, "build": {**c["build"], "max_seq_len": "abc"}},
    "no model": lambda c: {k: v for k, v in c.items() if k != "model"},
    "speculative without its draft": lambda c: {**c, "speculative": {"mode": "eagle3"}},
    # each of these was a traceback (TypeError, IndexError from torch's embedding)
    "a build option of a newer nemospec": lambda c: {**c, "build": {**c["build"], "foo": 1}},
    "vocab_size past the embedding": lambda c: {**c, "model": {**c["model"], "vocab_size": 2 * c["model"]["vocab_size"]}},
}


@pytest.fixture(scope="module")
def eagle3_engine(tmp_path_factory):
    out = tmp_path_factory.mktemp("bad") / "eng"
    assert cli.main(["build", "--output_dir", str(out), "--speculative_decoding_mode", "eagle3"]) == 0
    return out


ENGINE_DRAFT_DAMAGES = {   # each was a traceback from deep inside the loaders
    "a schedule that is a number": lambda c, d: {**c, "build": {**c["build"], "draft_len_schedule": 5}},
    "a threshold that is text": lambda c, d: {**c, "build": {**c["build"], "draft_confidence_threshold": "x"}},
    "a draft config its weights do not fit": lambda c, d: {
        **c, "speculative": {**c["speculative"], "draft": {**c["speculative"]["draft"], "hidden_size": 7}}},
    "its weights file gone": lambda c, d: (d / "weights" / "draft.safetensors").unlink() or c,
}


@pytest.mark.parametrize("damage", ENGINE_DRAFT_DAMAGES, ids=list(ENGINE_DRAFT_DAMAGES))
def test_a_damaged_speculative_engine_directory_is_one_line_naming_it(eagle3_engine, tmp_path, capsys, damage):
    broken = tmp_path / "eng"
    shutil.copytree(eagle3_engine, broken)
    meta = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(ENGINE_DRAFT_DAMAGES[damage](meta, broken)))
    code, _, err = _run(capsys, "generate", "--engine_dir", broken, "--input_ids", "1,2,3", "--max_new_tokens", 2,
                        "--backend", "torch")
    line = _one_error_line(err)
    assert code == 2 and ("config.json" in line or "draft.safetensors" in line), err


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_engine_config_is_one_line_naming_it(engine, tmp_path, capsys, damage):
    broken = tmp_path / "eng"
    shutil.copytree(engine, broken)
    meta = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(DAMAGES[damage](meta)))
    code, _, err = _run(capsys, "generate", "--engine_dir", broken, "--input_ids", "1,2,3", "--max_new_tokens", 2)
    assert code == 2 and "config.json" in _one_error_line(err), err


@pytest.mark.parametrize("kind, tensor", [("target", "backbone.norm_f.weight"), ("eagle3", "fc.weight")])
def test_nan_or_inf_weights_are_named_at_build_and_at_generate(tmp_path, capsys, kind, tensor):
    """One NaN in a target or draft tensor built, and generated token 0 after token 0, with exit 0."""
    from safetensors.torch import load_file, save_file

    from builder import embedded
    target = tmp_path / "target"
    shutil.copytree(embedded.target_dir(), target)
    draft = None
    if kind != "target":
        draft = tmp_path / kind
        shutil.copytree(embedded.draft_dir(kind), draft)
    damaged = next((draft or target).glob("*.safetensors"))
    tensors = load_file(str(damaged))
    tensors[tensor] = tensors[tensor].clone()
    tensors[tensor].view(-1)[3] = float("nan") if kind == "target" else float("inf")
    save_file(tensors, str(damaged), metadata={"format": "pt"})
    sources = ["--checkpoint_dir", target] + (["--speculative_decoding_mode", kind, "--draft_dir", draft] if draft else [])
    code, _, err = _run(capsys, "build", *sources, "--output_dir", tmp_path / "out")
    line = _one_error_line(err)
    assert code == 2 and f"tensor '{tensor}' holds NaN or inf" in line and (draft or target).name in line
    assert not (tmp_path / "out").exists()
    code, _, err = _run(capsys, "generate", *sources, "--input_ids", "1,2", "--max_new_tokens", 2, "--backend", "torch")
    assert code == 2 and f"tensor '{tensor}' holds NaN or inf" in _one_error_line(err)


def test_a_weight_beyond_float16s_range_is_named_when_built_or_run_as_float16(tmp_path, capsys):
    """An fp32 value of 1e6 checked finite, then became inf in the float16 cast: exit 0, token 0 only."""
    from safetensors.torch import load_file, save_file

    from builder import embedded
    target = tmp_path / "target"
    shutil.copytree(embedded.target_dir(), target)
    damaged = next(target.glob("*.safetensors"))
    tensors = load_file(str(damaged))
    name = next(n for n in tensors if n.endswith("mixer.in_proj.weight"))
    tensors[name] = tensors[name].float().clone()
    tensors[name].view(-1)[0] = 1e6
    save_file(tensors, str(damaged), metadata={"format": "pt"})
    code, _, err = _run(capsys, "build", "--checkpoint_dir", target, "--dtype", "float16", "--output_dir", tmp_path / "out")
    line = _one_error_line(err)
    assert code == 2 and f"tensor '{name}' holds 1e+06, beyond float16's range" in line and "--dtype bfloat16" in line
    assert not (tmp_path / "out").exists()
    code, _, err = _run(capsys, "generate", "--checkpoint_dir", target, "--dtype", "float16", "--input_ids", "1,2",
                        "--max_new_tokens", 2, "--backend", "torch")
    assert code == 2 and "beyond float16's range" in _one_error_line(err)


def test_an_mtp_layer_the_config_does_not_describe_is_named(tmp_path, capsys):
    """A checkpoint's mtp.layers.N past num_nextn_predict_layers was silently left out of the draft."""
    from safetensors.torch import load_file, save_file

    from builder import embedded
    target = tmp_path / "target"
    shutil.copytree(embedded.target_dir(), target)
    damaged = next(target.glob("*.safetensors"))
    tensors = load_file(str(damaged))
    tensors["mtp.layers.7.enorm.weight"] = tensors["mtp.layers.0.enorm.weight"].clone()
    save_file(tensors, str(damaged), metadata={"format": "pt"})
    code, _, err = _run(capsys, "build", "--checkpoint_dir", target, "--speculative_decoding_mode", "mtp",
                        "--output_dir", tmp_path / "out")
    line = _one_error_line(err)
    assert code == 2 and "mtp.layers.7.enorm.weight" in line and "num_nextn_predict_layers" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mode, given", [("eagle3", "dflash"), ("dflash", "eagle3"), ("eagle", "eagle3"),
                                         ("peagle", "dflash"), ("draft_target", "eagle3")])
def test_a_draft_of_another_kind_is_named_in_one_wording(tmp_path, capsys, mode, given):
    """Each layout's loader worded it its own way ("unsupported draft type" for a supported dflash draft,
    a missing model_type for draft_target)."""
    from builder import embedded
    code, _, err = _run(capsys, "build", "--speculative_decoding_mode", mode, "--draft_dir",
                        embedded.draft_dir(given), "--output_dir", tmp_path / "out")
    line = _one_error_line(err)
    assert code == 2 and f"draft, not {mode}; pass --speculative_decoding_mode {given}" in line, line


def test_an_odd_draft_head_dim_and_a_directory_named_model_safetensors_are_named(tmp_path, capsys):
    from builder import embedded
    draft = tmp_path / "eagle3"
    shutil.copytree(embedded.draft_dir("eagle3"), draft)
    config = json.loads((draft / "config.json").read_text())
    config["transformer_layer_config"]["head_dim"] = 33
    (draft / "config.json").write_text(json.dumps(config))
    code, _, err = _run(capsys, "build", "--speculative_decoding_mode", "eagle3", "--draft_dir", draft,
                        "--output_dir", tmp_path / "out")
    assert code == 2 and "'transformer_layer_config.head_dim' is 33: rotary embeddings need an even" in _one_error_line(err)
    target = tmp_path / "target"
    shutil.copytree(embedded.target_dir(), target)
    (target / "model.safetensors").unlink()
    (target / "model.safetensors").mkdir()
    code, _, err = _run(capsys, "build", "--checkpoint_dir", target, "--output_dir", tmp_path / "out")
    assert code == 2 and "model.safetensors: is not a file" in _one_error_line(err)


@pytest.mark.parametrize("field", ["mlp_hidden_act", "mamba_hidden_act"])
def test_an_activation_nemospec_lacks_is_named_at_load(tmp_path, capsys, field):
    """gelu_new (valid in transformers) failed a build after its weights were written, without naming
    config.json, and generate with a KeyError traceback."""
    from builder import embedded
    from builder.backends.torch_backend import _ACTIVATIONS
    from builder.config import ACTIVATIONS
    assert set(ACTIVATIONS) == set(_ACTIVATIONS)
    target = tmp_path / "target"
    shutil.copytree(embedded.target_dir(), target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, field: "gelu_new"}))
    for argv in (["build", "--output_dir", tmp_path / "out"],
                 ["generate", "--input_ids", "1,2", "--max_new_tokens", 2, "--backend", "torch"]):
        code, _, err = _run(capsys, argv[0], "--checkpoint_dir", target, *argv[1:])
        line = _one_error_line(err)
        assert code == 2 and "config.json" in line and f"field '{field}': 'gelu_new' is not supported" in line, err


LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
DRAFT_DAMAGES = {   # config.json edits of the embedded eagle3 draft -> the field the error names
    "rms_norm_eps": (lambda c: c["transformer_layer_config"].update(rms_norm_eps=-1.0), "rms_norm_eps"),
    "rope_theta": (lambda c: c["transformer_layer_config"]["rope_parameters"].update(rope_theta=0.0), "rope_theta"),
    "low_freq_factor": (lambda c: c["transformer_layer_config"].update(
        rope_parameters={**LLAMA3, "low_freq_factor": 0.0}), "low_freq_factor"),
    "yarn beta_fast": (lambda c: c["transformer_layer_config"].update(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
        "beta_fast": -1.0}), "beta_fast"),
    "architectures": (lambda c: c["speculators_config"]["verifier"].update(architectures=5), "architectures"),
}


@pytest.mark.parametrize("damage", DRAFT_DAMAGES, ids=list(DRAFT_DAMAGES))
def test_a_draft_config_value_that_breaks_its_math_is_named(tmp_path, capsys, damage):
    """Each built a draft that proposed nothing (epsilon < 0), or raised ZeroDivisionError, a math
    domain error or a TypeError traceback."""
    from builder import embedded
    draft = tmp_path / "eagle3"
    shutil.copytree(embedded.draft_dir("eagle3"), draft)
    config = json.loads((draft / "config.json").read_text())
    edit, field = DRAFT_DAMAGES[damage]
    edit(config)
    (draft / "config.json").write_text(json.dumps(config))
    code, _, err = _run(capsys, "generate", "--speculative_decoding_mode", "eagle3", "--draft_dir", draft,
                        "--input_ids", "1,2", "--max_new_tokens", 2, "--backend", "torch")
    line = _one_error_line(err)
    assert code == 2 and "config.json" in line and field in line, err


@pytest.mark.parametrize("text, named", [('{"chat_template": ', "not readable JSON"),
                                         ('{"chat_template": "{% for m in messages %}{{ m }"}', "not a valid jinja2"),
                                         ('{"chat_template": 5}', "expected a template string")])
def test_a_broken_chat_template_is_named_at_build(tmp_path, capsys, text, named):
    """tokenizer_config.json was copied unchecked, and the served chat endpoint failed on it later."""
    from builder import embedded
    target = tmp_path / "target"
    shutil.copytree(embedded.target_dir(), target)
    (target / "tokenizer_config.json").write_text(text)
    code, _, err = _run(capsys, "build", "--checkpoint_dir", target, "--output_dir", tmp_path / "out")
    line = _one_error_line(err)
    assert code == 2 and "tokenizer_config.json" in line and named in line and not (tmp_path / "out").exists()


def test_a_broken_tokenizer_is_named_at_build_and_at_generate(engine, tmp_path, capsys):
    from builder import embedded
    source = tmp_path / "ckpt"
    shutil.copytree(embedded.target_dir(), source)
    (source / "tokenizer.json").write_text('{"x":')
    code, _, err = _run(capsys, "build", "--checkpoint_dir", source, "--output_dir", tmp_path / "out")
    assert code == 2 and "tokenizer.json" in _one_error_line(err) and not (tmp_path / "out").exists()
    broken = tmp_path / "eng"
    shutil.copytree(engine, broken)
    (broken / "tokenizer.json").write_text('{"x":')
    code, _, err = _run(capsys, "generate", "--engine_dir", broken, "--prompt", "hi", "--max_new_tokens", 2)
    assert code == 2 and "tokenizer.json" in _one_error_line(err)


def test_engines_of_another_tensorrt_are_named_before_loading(engine, tmp_path, capsys):
    """An engine directory built by tensorrt_rtx on a CPU-only machine reached full TensorRT (the
    Docker image) unchecked: TensorRT's own deserialize error named neither side."""
    from builder.backends.trt_import import FLAVOUR, VERSION
    other = tmp_path / "eng"
    shutil.copytree(engine, other)
    meta = json.loads((other / "config.json").read_text())
    meta["tensorrt"] = {"flavour": "tensorrt" if FLAVOUR != "tensorrt" else "tensorrt_rtx", "version": "0.1"}
    (other / "config.json").write_text(json.dumps(meta))
    code, _, err = _run(capsys, "generate", "--engine_dir", other, "--backend", "tensorrt",
                        "--input_ids", "1,2", "--max_new_tokens", 2)
    line = _one_error_line(err)
    assert code == 2 and f"{meta['tensorrt']['flavour']} 0.1" in line and f"{FLAVOUR} {VERSION}" in line, line
    from serving.launch import free_port   # serve says it before Triton starts, not as a model failing to load
    ports = [a for flag in ("--http_port", "--grpc_port", "--metrics_port", "--health_port", "--openai_port")
             for a in (flag, str(free_port()))]
    code, _, err = _run(capsys, "serve", "--engine_dir", other, "--backend", "tensorrt", "--no_verify", *ports)
    line = _one_error_line(err)
    assert code == 2 and f"{FLAVOUR} {VERSION}" in line, line


def test_an_output_dir_that_is_not_an_earlier_build_is_never_replaced(engine, tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep")
    code, _, err = _run(capsys, "build", "--output_dir", a_file)
    assert code == 2 and "is a file" in _one_error_line(err) and a_file.read_text() == "keep"
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    code, _, err = _run(capsys, "build", "--output_dir", other)
    assert code == 2 and "holds other files" in _one_error_line(err) and (other / "notes.txt").read_text() == "keep"
    again = tmp_path / "again"
    shutil.copytree(engine, again)
    assert _run(capsys, "build", "--output_dir", again)[0] == 0    # an earlier build is rebuilt in place
    link = tmp_path / "link"    # ... also through a symbolic link, which stays and points at the new build
    link.symlink_to(again)
    assert _run(capsys, "build", "--output_dir", link)[0] == 0
    assert link.resolve() == again.resolve() and (again / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    code, _, err = _run(capsys, "build", "--output_dir", dangling)
    assert code == 2 and "symbolic link to a missing path" in _one_error_line(err)
    # ... but never while it holds what the build reads: the rebuild deleted a checkpoint copied into it
    from builder import embedded
    shutil.copytree(embedded.target_dir(), again / "my_ckpt")
    code, _, err = _run(capsys, "build", "--checkpoint_dir", again / "my_ckpt", "--output_dir", again)
    assert code == 2 and "holds the --checkpoint_dir" in _one_error_line(err) and (again / "my_ckpt").is_dir()
    shutil.copytree(embedded.draft_dir("eagle3"), again / "my_draft")
    code, _, err = _run(capsys, "build", "--speculative_decoding_mode", "eagle3", "--draft_dir", again / "my_draft",
                        "--output_dir", again)
    assert code == 2 and "holds the --draft_dir" in _one_error_line(err) and (again / "my_draft").is_dir()


@pytest.mark.parametrize("argv, named", [
    (["build", "--embedded", "wide", "--embedded_factor", "0"], "--embedded_factor"),
    (["build", "--embedded_factor", "3", "--checkpoint_dir", "CKPT"], "--embedded_factor"),
    (["build", "--max_draft_len", "4"], "--max_draft_len"),
    (["build", "--num_layers", "-1"], "--num_layers"),
    (["build", "--draft_dir", "DRAFT"], "--draft_dir"),
    (["generate", "--draft_dir", "DRAFT", "--input_ids", "1", "--max_new_tokens", "1"], "--draft_dir"),
    (["generate", "--checkpoint_dir", "", "--input_ids", "1", "--max_new_tokens", "1"], "--checkpoint_dir"),
    (["build", "--draft_len_schedule", "1:4"], "--draft_len_schedule"),
    (["build", "--speculative_decoding_mode", "eagle3", "--quantization", "nvfp4_w4a16"], "--quantization: eagle3"),
    (["build", "--speculative_decoding_mode", "eagle", "--draft_dir", "DRAFT", "--quantization", "nvfp4_w4a16"],
     "--quantization: eagle"),
    (["build", "--max_tree_nodes", "8"], "--max_tree_nodes"),
    (["build", "--speculative_decoding_mode", "eagle3", "--tree_topk", "99"], "--tree_topk"),
    (["bench", "--embedded", "wide", "--embedded_factor", "0"], "--embedded_factor"),
    (["build", "--embedded", "wide", "--checkpoint_dir", "CKPT"], "--embedded wide"),
    (["generate", "--embedded", "small", "--checkpoint_dir", "CKPT", "--input_ids", "1", "--max_new_tokens", "1"],
     "--embedded small"),
    (["bench", "--embedded", "wide", "--checkpoint_dir", "CKPT"], "--embedded wide"),
    (["build", "--max_host_memory_gb", "nan"], "--max_host_memory_gb"),
    (["build", "--max_host_memory_gb", "inf"], "--max_host_memory_gb"),
])
def test_flags_that_make_no_sense_are_refused_by_name(tmp_path, capsys, argv, named):
    from builder import embedded
    subs = {"CKPT": str(embedded.target_dir()), "DRAFT": str(embedded.draft_dir("eagle3"))}
    writes = [] if argv[0] == "generate" else ["--output_dir", tmp_path / "o"]
    code, _, err = _run(capsys, *[subs.get(a, a) for a in argv], *writes)
    assert code == 2 and named in _one_error_line(err) and not (tmp_path / "o").exists(), err


@pytest.mark.parametrize("value_flag", [("nan", "--temperature"), ("inf", "--temperature"),
                                        ("99999999999999999999999", "--seed"), ("-1", "--seed"),
                                        ("-5", "--end_id"), ("999999", "--end_id")])
def test_generate_sampling_values_out_of_range_are_refused_by_name(capsys, value_flag):
    """NaN passed the temperature check and failed in sampling with a traceback; a seed past 64 bits
    said only "Overflow when unpacking long long"."""
    value, flag = value_flag
    code, _, err = _run(capsys, "generate", "--backend", "torch", "--input_ids", "1,2", "--max_new_tokens", "2",
                        flag, value)
    assert code == 2 and flag in _one_error_line(err), err


@pytest.mark.parametrize("flags, named", [
    (["--max_draft_len", "0"], "--max_draft_len"), (["--max_draft_len", "100000"], "--max_draft_len"),
    (["--tree", "--tree_topk", "100000"], "--tree_topk"), (["--tree", "--tree_depth", "100000"], "--tree_depth"),
    (["--tree", "--max_tree_nodes", "100000"], "--max_tree_nodes"),
])
def test_generate_draft_sizes_past_what_a_step_can_hold_are_refused_by_name(capsys, flags, named):
    """The torch path bounded none of these: --max_draft_len 100000 drafted for minutes, --tree_topk
    100000 ran out of memory, and --max_draft_len 0 was named 'draft_len'."""
    code, _, err = _run(capsys, "generate", "--backend", "torch", "--input_ids", "1,2", "--max_new_tokens", "2",
                        "--speculative_decoding_mode", "eagle3", *flags)
    assert code == 2 and named in _one_error_line(err), err


def test_argument_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["build", "--output_dir", "o", "--speculative_decoding_mode", "medusa"])
    _, err = capsys.readouterr()
    assert exit_.value.code == 2 and "--speculative_decoding_mode" in _one_error_line(err)
    with pytest.raises(SystemExit) as exit_:   # a trtllm-build flag: named by the command it was given to
        cli.main(["build", "--output_dir", "o", "--max_num_tokens", "8192"])
    _, err = capsys.readouterr()
    line = _one_error_line(err)
    assert exit_.value.code == 2 and line.startswith("nemospec build: error: unrecognized arguments: --max_num_tokens")
    for argv in (["build", "--output_dir", "o", "--max_draft", "4"],                    # no flag by its prefix
                 ["generate", "--input_ids", "1", "--max_new_tokens", "2", "--temp", "0.5"], ["bench", "--thread", "1"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        _, err = capsys.readouterr()
        assert exit_.value.code == 2 and f"unrecognized arguments: {argv[-2]} " in _one_error_line(err) + " ", err


def test_quantize_refuses_its_output_dir_before_quantizing(tmp_path, capsys, monkeypatch):
    from builder import embedded, quantize_checkpoint
    monkeypatch.setattr(quantize_checkpoint, "quantize_tensors", lambda *a: pytest.fail("quantized first"))
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    code, _, err = _run(capsys, "quantize", "--checkpoint_dir", embedded.target_dir(), "--output_dir", other)
    assert code == 2 and "holds other files" in _one_error_line(err) and (other / "notes.txt").read_text() == "keep"


def test_generate_flags_the_engine_cannot_honour(engine, tmp_path, capsys):
    code, _, err = _run(capsys, "generate", "--engine_dir", engine, "--input_ids", "1,2", "--max_new_tokens", 2,
                        "--num_draft_tokens", 2)
    assert code == 2 and "does not speculate" in _one_error_line(err)
    if not torch.cuda.is_available():
        code, _, err = _run(capsys, "generate", "--engine_dir", engine, "--input_ids", "1,2", "--max_new_tokens", 2,
                            "--backend", "tensorrt")
        assert code == 2 and "CUDA GPU" in _one_error_line(err)
    code, _, err = _run(capsys, "token_map", "--corpus", engine / "config.json", "--size", 4, "--output", tmp_path)
    assert code == 2 and "--output" in _one_error_line(err)


def test_a_size_the_config_leaves_out_is_named_beside_the_shape_it_breaks(tmp_path, capsys):
    """transformers' defaults fill a field config.json leaves out (hidden_size 4096), so the first
    error is a tensor's shape: it names the missing field too."""
    from builder import embedded
    source = tmp_path / "ckpt"
    shutil.copytree(embedded.target_dir(), source)
    config = json.loads((source / "config.json").read_text())
    del config["hidden_size"]
    (source / "config.json").write_text(json.dumps(config))
    code, _, err = _run(capsys, "build", "--checkpoint_dir", source, "--output_dir", tmp_path / "out")
    line = _one_error_line(err)
    assert code == 2 and "has shape" in line and "config.json has no hidden_size (default 4096)" in line, err
    assert not (tmp_path / "out").exists()


def test_an_exclude_pattern_that_matches_no_module_is_refused(tmp_path, capsys):
    from builder import embedded
    code, _, err = _run(capsys, "quantize", "--checkpoint_dir", embedded.target_dir(), "--output_dir", tmp_path / "q",
                        "--exclude_modules", "backbone.layers.*.mixer.out_proj,backbone.layer.0.mlp.*")
    line = _one_error_line(err)
    assert code == 2 and "--exclude_modules 'backbone.layer.0.mlp.*'" in line and "matches no linear module" in line
    assert not (tmp_path / "q").exists()


def test_a_request_past_max_seq_len_is_refused_before_any_step_compiles(engine, capsys):
    from runtime.compiled import steps
    before = len(steps.COMPILE_LOG)
    code, _, err = _run(capsys, "generate", "--engine_dir", engine, "--backend", "compiled", "--input_ids", "1,2",
                        "--max_new_tokens", 5000)
    assert code == 2 and "exceeds max_seq_len" in _one_error_line(err) and steps.COMPILE_LOG[before:] == [], err


@pytest.mark.parametrize("flag, value", [("--ready_timeout", 0), ("--shutdown_timeout", 0)])
def test_serve_timeouts_out_of_range_are_refused_before_a_server_starts(engine, capsys, flag, value):
    code, _, err = _run(capsys, "serve", "--engine_dir", engine, "--no_verify", flag, value)
    assert code == 2 and flag in _one_error_line(err), err


def test_a_nan_block_scale_of_an_nvfp4_weight_is_named():
    """NVFP4 weights bind as packed codes + FP8 block scales: a NaN scale built and generated garbage
    (a NaN global scale was already refused)."""
    from builder.checkpoint import check_finite_weights
    from builder.errors import CheckpointError
    from builder.nvfp4_format import NVFP4Weight, quantize_nvfp4
    packed, scale, scale_2 = quantize_nvfp4(torch.randn(8, 32))
    check_finite_weights("ckpt", {"w": NVFP4Weight(packed, scale, scale_2, (8, 32))})
    scale = scale.float()
    scale[1, 0] = float("nan")
    bad = NVFP4Weight(packed, scale.to(torch.float8_e4m3fn), scale_2, (8, 32))
    with pytest.raises(CheckpointError, match=r"ckpt: tensor 'w \(weight_scale\)' holds NaN or inf"):
        check_finite_weights("ckpt", {"w": bad, "n": torch.ones(3)})
    # a negative scale (E4M3 has a sign bit) flipped its block's signs, silently
    scale[1, 0] = -scale[1, 1]
    flipped = NVFP4Weight(packed, scale.to(torch.float8_e4m3fn), scale_2, (8, 32))
    with pytest.raises(CheckpointError, match=r"'w \(weight_scale\)' holds negative scales"):
        check_finite_weights("ckpt", {"w": flipped})


def test_draft_argument_errors_come_before_any_weight_is_written(tmp_path, capsys):
    """A missing --draft_dir or --speculative_token_map was named only after the target's weights were
    written (minutes at full size)."""
    from builder import embedded
    target = tmp_path / "target"     # a checkpoint of the user's own: no embedded draft fills in
    shutil.copytree(embedded.target_dir(), target)
    for extra, named in (([], "--draft_dir"),
                         (["--draft_dir", embedded.draft_dir("eagle3"), "--speculative_token_map", tmp_path / "none.json"],
                          "--speculative_token_map")):
        code, _, err = _run(capsys, "build", "--checkpoint_dir", target, "--speculative_decoding_mode", "eagle3", *extra,
                            "--output_dir", tmp_path / "o")
        assert code == 2 and named in _one_error_line(err) and "writing weights" not in err, err
        assert not (tmp_path / "o").exists()


def test_output_dirs_named_by_dot_or_that_cannot_be_written(engine, tmp_path, capsys, monkeypatch):
    """``--output_dir .`` was a traceback (a path with an empty name); a directory that cannot be made
    is one line naming it."""
    again = tmp_path / "again"
    shutil.copytree(engine, again)
    monkeypatch.chdir(again)
    assert _run(capsys, "build", "--output_dir", ".")[0] == 0 and (again / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]
    code, _, err = _run(capsys, "build", "--output_dir", "/proc/nemospec-cannot-write/eng")
    assert code == 2 and "--output_dir /proc/nemospec-cannot-write/eng" in _one_error_line(err)


def test_a_batch_past_the_engines_max_batch_size_is_refused(engine, capsys):
    ids = [a for _ in range(9) for a in ("--input_ids", "1,2")]
    code, _, err = _run(capsys, "generate", "--engine_dir", engine, *ids, "--max_new_tokens", 2)
    assert code == 2 and "9 prompts exceed the engine directory's max_batch_size 8" in _one_error_line(err)


def test_a_build_cut_by_a_closed_terminal_leaves_nothing(tmp_path):
    """SIGHUP (the terminal closed, an ssh session dropped) killed a build midway and left its
    temporary directory (gigabytes at full size): it now unwinds as SIGTERM and Ctrl-C do."""
    import signal
    import subprocess
    import sys
    import time
    out = tmp_path / "sub" / "out"
    process = subprocess.Popen([sys.executable, "-m", "nemospec.cli", "build", "--output_dir", str(out),
                                "--speculative_decoding_mode", "eagle3"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(out.parent.glob(".out.tmp-*")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, process.stderr.read()      # caught while writing
    process.send_signal(signal.SIGHUP)
    assert process.wait(timeout=60) == 128 + signal.SIGHUP
    assert not out.exists() and not list(out.parent.glob(".out.tmp-*"))


def test_a_max_seq_len_past_the_checkpoints_positions_is_refused_by_name(tmp_path, capsys, monkeypatch):
    """--max_seq_len 1e9 reached TensorRT, whose own log refused a tensor volume, the flag unnamed."""
    code, _, err = _run(capsys, "build", "--output_dir", tmp_path / "out", "--max_seq_len", 1000000000)
    line = _one_error_line(err)
    assert code == 2 and "--max_seq_len 1000000000: beyond the checkpoint's max_position_embeddings 4096" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, value", [("--speculative_token_map", "MAP"), ("--draft_len_schedule", "1:2"),
                                         ("--max_draft_len", "8")])
def test_generate_refuses_draft_flags_on_a_target_only_run(tmp_path, capsys, flag, value):
    """Each ran target-only with exit 0, as if given a draft; build refused them by name."""
    from builder import embedded
    value = str(embedded.ROOT / "token_map.json") if value == "MAP" else value
    code, _, err = _run(capsys, "generate", "--input_ids", "1,2", "--max_new_tokens", 2, "--backend", "torch", flag, value)
    assert code == 2 and f"{flag}: applies to a draft; this run is target-only" in _one_error_line(err)


def test_a_checkpoint_given_as_an_engine_directory_is_named_in_one_line(capsys):
    """It printed a notice about unrecorded file hashes, then the error: two lines for one mistake."""
    from builder import embedded
    code, _, err = _run(capsys, "generate", "--engine_dir", embedded.target_dir(), "--input_ids", "1,2",
                        "--max_new_tokens", 2)
    line = _one_error_line(err)
    assert code == 2 and "holds a checkpoint" in line and "--checkpoint_dir" in line and "warning" not in err


def test_a_quantized_eagle3_draft_is_named_as_such(tmp_path, capsys):
    """Its ModelOpt config was ignored and the error blamed a packed tensor's shape."""
    from builder import embedded
    draft = tmp_path / "eagle3"
    shutil.copytree(embedded.draft_dir("eagle3"), draft)
    (draft / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    code, _, err = _run(capsys, "generate", "--speculative_decoding_mode", "eagle3", "--draft_dir", draft,
                        "--input_ids", "1,2", "--max_new_tokens", 2, "--backend", "torch")
    line = _one_error_line(err)
    assert code == 2 and "hf_quant_config.json: a quantized EAGLE draft" in line
