"""The Triton Python models (model_repo/*/1/model.py) run only inside a tritonserver, and an error path
there runs only when something fails: every ``self.NAME`` a model reads is one it assigns or defines.
(The preprocessing model read ``self._fault`` in its except clause without ever assigning it: a
request that met an unexpected error would have raised again inside the handler.)"""
import ast
from pathlib import Path

import pytest

MODELS = sorted((Path(__file__).resolve().parents[1] / "model_repo").glob("*/1/model.py"))


def _attributes(tree: ast.AST) -> tuple[set, set]:
    read, given = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            (given if isinstance(node.ctx, ast.Store) else read).add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    given.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                        for name in ast.walk(target):
                            if isinstance(name, ast.Name):
                                given.add(name.id)
    return read, given


@pytest.mark.parametrize("path", MODELS, ids=[p.parts[-3] for p in MODELS])
def test_every_attribute_a_model_reads_is_one_it_sets(path):
    read, given = _attributes(ast.parse(path.read_text()))
    assert not read - given, f"{path.parts[-3]} reads self.{sorted(read - given)} but never sets it"
