"""Engine directory integrity: sizes and sha256 recorded at build; `serve` and `generate` refuse a
missing, truncated or altered engine/weights file with exit 2 naming it, before anything starts."""
import json
import shutil
import time

import pytest

from builder import integrity
from builder.engine import BuildOptions, build
from builder.random_checkpoint import write_random_checkpoint
from nemospec import cli


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    checkpoint = write_random_checkpoint(root / "checkpoint", "M*-", seed=0, tokenizer=True)
    build(checkpoint, root / "engine", BuildOptions(max_batch_size=2, max_input_len=16, max_seq_len=48),
          log=lambda m: None)
    return root / "engine"


@pytest.fixture
def copy(engine_dir, tmp_path):
    shutil.copytree(engine_dir, tmp_path / "engine")
    return tmp_path / "engine"


def _run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, "".join(err.split())    # rich wraps long lines, paths included


def _generate(engine, *extra):
    return ["generate", "--engine_dir", engine, "--input_ids", "1,2,3", "--max_new_tokens", "2", "--backend", "torch",
            *extra]


def test_build_records_every_engine_and_weights_file(engine_dir):
    files = json.loads((engine_dir / "config.json").read_text())["files"]
    assert set(files) == {"target.engine", "weights/target.safetensors"}
    for name, entry in files.items():
        assert entry["bytes"] == (engine_dir / name).stat().st_size
        assert entry["sha256"] == integrity.sha256_file(engine_dir / name)
    assert integrity.verify_engine_dir(engine_dir) is None


@pytest.mark.parametrize("name", ["target.engine", "weights/target.safetensors"])
def test_truncated_file_is_refused_by_serve_and_generate(copy, capsys, name):
    path = copy / name
    path.write_bytes(path.read_bytes()[:-100])
    start = time.monotonic()
    code, err = _run(capsys, "serve", "--engine_dir", copy)
    assert code == 2 and f"{path}:truncated" in err, err
    assert time.monotonic() - start < 10, "refused before starting tritonserver"
    code, err = _run(capsys, *_generate(copy))
    assert code == 2 and f"{path}:truncated" in err, err


def test_altered_file_is_refused_with_hashes(copy, capsys):
    path = copy / "target.engine"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    code, err = _run(capsys, "serve", "--engine_dir", copy)        # --verify is on by default for serve
    assert code == 2 and f"{path}:altered:sha256" in err, err
    code, err = _run(capsys, *_generate(copy, "--verify"))
    assert code == 2 and f"{path}:altered" in err, err
    with pytest.raises(integrity.IntegrityError, match="altered"):
        integrity.verify_engine_dir(copy, hashes=True)
    assert integrity.verify_engine_dir(copy, hashes=False) is None, "sizes alone cannot see it"


def test_missing_and_unrecorded_files(copy, capsys):
    (copy / "weights" / "target.safetensors").unlink()
    code, err = _run(capsys, *_generate(copy))
    assert code == 2 and f"{copy / 'weights' / 'target.safetensors'}:missing" in err, err
    shutil.copy2(copy / "target.engine", copy / "weights" / "target.safetensors")
    (copy / "extra.engine").write_bytes(b"x")
    with pytest.raises(integrity.IntegrityError, match="extra.engine: not recorded"):
        integrity.verify_engine_dir(copy, hashes=False)


def test_old_engine_dir_without_hashes_gets_a_clear_message(copy, capsys):
    meta = json.loads((copy / "config.json").read_text())
    del meta["files"]
    (copy / "config.json").write_text(json.dumps(meta))
    notice = integrity.verify_engine_dir(copy)
    assert "records no file sizes or sha256 hashes" in notice and "rebuild" in notice
    code, err = _run(capsys, *_generate(copy, "--verify"))
    assert code == 0 and "recordsnofilesizesorsha256hashes" in err, err


@pytest.mark.parametrize("field, value, named", [
    ("files", 5, "field'files':expectedanobject"),
    ("files", {"target.engine": 7}, "field'files.target.engine':expected"),
    ("files", {"target.engine": {"bytes": "12", "sha256": "00"}}, "field'files.target.engine':expected"),
    ("tokenizer", 5, "field'tokenizer':expectedthetokenizerfile'sname"),
])
def test_a_malformed_config_field_is_one_line_naming_it(copy, capsys, field, value, named):
    meta = json.loads((copy / "config.json").read_text())
    meta[field] = value
    (copy / "config.json").write_text(json.dumps(meta))
    for command in (["serve", "--engine_dir", copy], _generate(copy)):
        code, err = _run(capsys, *command)
        assert code == 2 and named in err and "Traceback" not in err, err
