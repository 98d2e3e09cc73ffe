"""`nemospec generate` end to end, and bad input -> exit code 2 with one line naming the field."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from builder.random_checkpoint import write_random_checkpoint
from nemospec import cli
from runtime.sampling import probabilities


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tok") / "ckpt", "M*-E", seed=3, tokenizer=True,
                                   vocab_size=320)


def _run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _last_json(out):
    return json.loads(out.strip().splitlines()[-1])


def test_generate_json_matches_transformers_greedy(checkpoints, capsys):
    from transformers import NemotronHForCausalLM
    ckpt = checkpoints["dense"]
    code, out, _ = _run(capsys, "generate", "--checkpoint_dir", ckpt, "--input_ids", "5,9,17,33",
                        "--max_new_tokens", 12, "--ignore_eos", "--json")
    assert code == 0
    record = _last_json(out)
    theirs = NemotronHForCausalLM.from_pretrained(str(ckpt)).eval()
    theirs.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = theirs.generate(torch.tensor([[5, 9, 17, 33]]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        theirs_logits = theirs(ref[:, :-1]).logits[:, 3:].float()
    from runtime.loading import open_checkpoint
    from speculative_fixtures import assert_greedy_margin
    # two implementations: no near-tie may decide a token (transformers' logits count in the spread)
    assert_greedy_margin(open_checkpoint(ckpt).runner, [[5, 9, 17, 33]], [ref[0, 4:].tolist()], others=[theirs_logits])
    assert record["output_ids"] == ref[0, 4:].tolist()
    assert record["num_tokens"] == 12 and record["tokens_per_second"] > 0
    assert record["backend"] == "torch"


def test_generate_stops_at_end_id_unless_ignored(checkpoints, capsys):
    ckpt = checkpoints["dense"]
    _, out, _ = _run(capsys, "generate", "--checkpoint_dir", ckpt, "--input_ids", "5,9", "--max_new_tokens", 16,
                     "--ignore_eos", "--json")
    free = _last_json(out)["output_ids"]
    stop = free[3]
    _, out, _ = _run(capsys, "generate", "--checkpoint_dir", ckpt, "--input_ids", "5,9", "--max_new_tokens", 16,
                     "--end_id", stop, "--json")
    assert _last_json(out)["output_ids"] == free[:free.index(stop) + 1]


def test_prompt_text_roundtrip(with_tokenizer, capsys):
    from tokenizers import Tokenizer
    code, out, _ = _run(capsys, "generate", "--checkpoint_dir", with_tokenizer, "--prompt", "def main():",
                        "--max_new_tokens", 8, "--ignore_eos", "--json")
    assert code == 0
    record = _last_json(out)
    tok = Tokenizer.from_file(str(with_tokenizer / "tokenizer.json"))
    assert record["text"] == tok.decode(record["output_ids"])
    code, out2, _ = _run(capsys, "generate", "--checkpoint_dir", with_tokenizer, "--input_ids",
                         ",".join(map(str, tok.encode("def main():").ids)), "--max_new_tokens", 8,
                         "--ignore_eos", "--json")
    assert _last_json(out2)["output_ids"] == record["output_ids"]
    # an end id ends the ids, not the text (as the server answers)
    stop = record["output_ids"][3]
    code, out3, _ = _run(capsys, "generate", "--checkpoint_dir", with_tokenizer, "--prompt", "def main():",
                         "--max_new_tokens", 8, "--end_id", stop, "--json")
    ended = _last_json(out3)
    cut = record["output_ids"].index(stop)
    assert ended["output_ids"] == record["output_ids"][:cut + 1] and ended["text"] == tok.decode(record["output_ids"][:cut])


def test_sampling_is_seeded(checkpoints, capsys):
    args = ["generate", "--checkpoint_dir", checkpoints["dense"], "--input_ids", "7", "--max_new_tokens", 24,
            "--temperature", 1.5, "--ignore_eos", "--json"]
    runs = [_last_json(_run(capsys, *args, "--seed", s)[1])["output_ids"] for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = probabilities(logits, 1.0, 0.6)
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.allclose(probabilities(logits, 1.0, 1.0), torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


@pytest.mark.parametrize("argv, needle", [
    (["--input_ids", "1,x"], "--input_ids"),
    (["--input_ids", "1,2", "--max_new_tokens", "0"], "max_new_tokens"),
    (["--input_ids", "1,2", "--temperature", "-1"], "--temperature"),
    (["--input_ids", "1,2", "--top_p", "1.5"], "--top_p"),
    (["--input_ids", "1,100000"], "input_ids"),
    (["--prompt", "hello"], "tokenizer"),
])
def test_bad_generate_input_exits_2_with_one_line(argv, needle, checkpoints, capsys):
    if "--max_new_tokens" not in argv:
        argv = argv + ["--max_new_tokens", "4"]
    code, out, err = _run(capsys, "generate", "--checkpoint_dir", checkpoints["dense"], *argv)
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and needle in lines[0], err


def test_bad_checkpoint_exits_2(tmp_path, checkpoints, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoints["dense"], broken)
    config = json.loads((broken / "config.json").read_text())
    config["model_type"] = "llama"
    (broken / "config.json").write_text(json.dumps(config))
    code, _, err = _run(capsys, "generate", "--checkpoint_dir", broken, "--input_ids", "1", "--max_new_tokens", 2)
    assert code == 2 and "model_type" in err and "config.json" in err


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "nemospec"
    result = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "build" in result.stdout and "generate" in result.stdout


def test_trtllm_builds_name_for_a_draft_model_is_taken():
    """trtllm-build calls a separate draft model draft_tokens_external; a TensorRT-LLM user types it."""
    for command in (["build", "--output_dir", "x"], ["generate", "--input_ids", "1", "--max_new_tokens", "1"]):
        args = cli._parser().parse_args(command + ["--speculative_decoding_mode", "draft_tokens_external"])
        assert args.speculative_decoding_mode == "draft_target"


def test_help_names_each_default_once():
    """Every subcommand's --help names an option's default where its own text does not (trtllm-build's
    and vLLM's habit), never a default of None or a switch's False or True (``--no_verify`` stores False:
    its "(default: True)" read as the check skipped by default), and never twice; on/off flags show
    their two values."""
    import argparse
    import re
    top = cli._parser()
    subs = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices
    build = " ".join(subs["build"].format_help().split())
    assert "sequences per step (default: 8)" in build and "(default: 1024)" in build
    assert "the embedded trained model --output_dir" in build          # its text says the default: no suffix
    assert "--draft_len_adaptive {on,off}" in build
    for name, parser in subs.items():
        text = " ".join(parser.format_help().split())
        assert "(default: None)" not in text and "(default: False)" not in text, name
        assert "(default: True)" not in text, name
        for action in parser._actions:
            shown = action.help and parser._get_formatter()._expand_help(action)
            if shown:
                assert len(re.findall(r"\bdefault\b", shown)) <= 1 or "(default:" not in shown, (name, shown)
