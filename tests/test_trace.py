"""The speculation trace (``nemospec generate --trace FILE``): one JSON line per verify step per
sequence, consistent with the output and with the acceptance statistics."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from builder import embedded
from nemospec import cli

PROMPTS = ["import os\nimport sys\n\n\ndef main(argv=None):\n    ", "class Error(Exception):\n    def __init__(self"]
FIELDS = {"step", "sequence", "position", "k", "proposed", "accepted", "bonus", "emitted", "draft_ms", "verify_ms"}


def _replay(records, first_tokens):
    """Each sequence's output rebuilt from its trace alone: the prefill's token, then per step the
    accepted proposals and the bonus token (cut where a stop cut them)."""
    out = {i: [t] for i, t in enumerate(first_tokens)}
    for r in records:
        out[r["sequence"]] += (r["proposed"][:r["accepted"]] + [r["bonus"]])[:r["emitted"]]
    return [out[i] for i in sorted(out)]


def _check(records, outputs, histogram, prompt_lengths):
    assert records and all(set(r) == FIELDS for r in records)
    assert all(len(r["proposed"]) == r["k"] and 0 <= r["accepted"] <= r["k"] for r in records)
    assert all(r["draft_ms"] >= 0 and r["verify_ms"] > 0 for r in records)
    # accepted + bonus over all steps, plus each prompt's first token, are the generated tokens
    assert sum(r["emitted"] for r in records) + len(outputs) == sum(len(o) for o in outputs)
    assert _replay(records, [o[0] for o in outputs]) == outputs
    gained = Counter(r["accepted"] + 1 for r in records if r["k"] > 0)
    assert {str(n): gained.get(n, 0) for n in range(1, len(histogram) + 1)} == histogram
    # each sequence's steps start where the previous one ended, numbered in order
    for i, length in enumerate(prompt_lengths):
        own = [r for r in records if r["sequence"] == i]
        assert [r["step"] for r in own] == sorted(r["step"] for r in own)
        position = length
        for r in own:
            assert r["position"] == position
            position += r["accepted"] + 1


def test_trace_of_speculative_generate_matches_output_and_histogram():
    from tokenizers import Tokenizer

    from runtime.loading import open_checkpoint
    from runtime.speculative import speculative_generate
    tok = Tokenizer.from_file(str(embedded.target_dir() / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in PROMPTS]
    loaded = open_checkpoint(embedded.target_dir(), mode="dflash", draft_dir=embedded.draft_dir("dflash"))
    records = []
    got = speculative_generate(loaded.runner, loaded.proposer(), prompts, 30, 4, trace=records.append)
    _check(records, got.output_ids, got.extra["acceptance"]["histogram"], [len(p) for p in prompts])
    assert max(r["accepted"] for r in records) > 0  # a trained draft: some proposals are accepted


def test_generate_writes_the_trace_file(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    code = cli.main(["generate", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max_new_tokens", "20",
                     "--speculative_decoding_mode", "eagle", "--num_draft_tokens", "3", "--ignore_eos", "--json",
                     "--trace", str(path), "--backend", "torch"])
    out, _ = capsys.readouterr()
    assert code == 0
    record = json.loads(out.strip().splitlines()[-1])
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert {r["k"] for r in records} == {3}
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(embedded.target_dir() / "tokenizer.json"))
    _check(records, record["output_ids"], record["acceptance"]["histogram"], [len(tok.encode(p).ids) for p in PROMPTS])


@pytest.mark.parametrize("argv, message", [
    (["--trace", "{tmp}/t.jsonl"], "--trace: traces speculative decoding"),
    (["--speculative_decoding_mode", "eagle", "--trace", "{tmp}/missing/t.jsonl"], "cannot write"),
])
def test_trace_bad_input_exits_2(tmp_path, capsys, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code = cli.main(["generate", "--input_ids", "5,6,7", "--max_new_tokens", "4", "--backend", "torch", *argv])
    _, err = capsys.readouterr()
    assert code == 2 and message in " ".join(err.split())  # one message (the console wraps long paths)


def test_a_trace_that_cannot_be_written_keeps_the_output_and_says_so(tmp_path, capsys, monkeypatch):
    """A write that failed (a full disk) was two chained tracebacks at close, with the output lost.
    The trace file here fails as a full disk does: its writes and its close raise ENOSPC."""
    import errno
    path = tmp_path / "trace.jsonl"

    class FullDisk:
        def __init__(self, *a, **k):
            path.write_text("")           # opened: the file exists, as a real open leaves it
        def write(self, text=None):
            raise OSError(errno.ENOSPC, "No space left on device")
        close = write
    monkeypatch.setattr(cli, "open", FullDisk, raising=False)   # the module's open, not builtins'
    code = cli.main(["generate", "--input_ids", "5,6,7", "--max_new_tokens", "40", "--backend", "torch", "--json",
                     "--speculative_decoding_mode", "eagle", "--trace", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and len(json.loads(out.strip().splitlines()[-1])["output_ids"]) == 40
    assert "could not be written (No space left on device)" in " ".join(err.split()) and "Traceback" not in err
    assert not path.exists()                # the part-written trace is removed
