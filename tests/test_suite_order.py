"""The order test files start in under `make test` (tests/conftest.py): longest first by
file_seconds.json, so that xdist does not start the heavy few-test files last."""
import json
from pathlib import Path
from types import SimpleNamespace

import conftest

ROOT = Path(__file__).resolve().parents[1]


def test_the_table_names_test_files_that_exist():
    seconds = json.loads(conftest.FILE_SECONDS.read_text())
    missing = [path for path in seconds if not (ROOT / path).is_file()]
    assert not missing, f"file_seconds.json names files that are gone: {missing}"
    assert all(isinstance(s, (int, float)) and s >= 0 for s in seconds.values())


def test_files_start_longest_first_each_in_its_own_order(monkeypatch, tmp_path):
    table = tmp_path / "file_seconds.json"
    table.write_text(json.dumps({"tests/test_b.py": 9.0, "tests/test_c.py": 30.0}))
    monkeypatch.setattr(conftest, "FILE_SECONDS", table)
    items = [SimpleNamespace(location=(f"tests/test_{f}.py", 0, name))
             for f, name in (("a", "a1"), ("b", "b1"), ("c", "c1"), ("b", "b2"), ("c", "c2"), ("a", "a2"))]
    conftest.pytest_collection_modifyitems(None, None, items)
    assert [i.location[2] for i in items] == ["c1", "c2", "b1", "b2", "a1", "a2"]   # a, not in the table: last


def test_make_test_keeps_this_order():
    """xdist's own reordering (by test count) would undo it."""
    assert "--no-loadscope-reorder" in (ROOT / "Makefile").read_text()
