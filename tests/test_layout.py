"""ARCHITECTURE.md's import rules, checked on the source: imports run nemospec -> serving -> runtime
-> builder -> plugins (training may use any), nothing imports model_repo, and no two modules import
each other (lazy imports inside functions count too)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"plugins": 0, "builder": 1, "runtime": 2, "serving": 3, "nemospec": 4}
PACKAGES = (*LAYERS, "training")


def _imports():
    graph = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    found.add(node.module)
                    found.update(f"{node.module}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Import):
                    found.update(a.name for a in node.names)
            graph[name] = found
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}, graph


def test_imports_only_go_down_the_layers():
    graph, raw = _imports()
    upward = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
              if m.split(".")[0] in LAYERS and LAYERS[d.split(".")[0]] > LAYERS[m.split(".")[0]]]
    assert not upward, upward
    assert not [m for m, deps in raw.items() if any(d.split(".")[0] == "model_repo" for d in deps)]


def test_no_two_modules_import_each_other():
    graph, _ = _imports()
    pairs = sorted({tuple(sorted((m, d))) for m, deps in graph.items() for d in deps if m in graph.get(d, ())})
    assert not pairs, pairs


def test_no_source_file_far_past_500_lines():
    """A file past ~500 lines is split along its seam before it grows (the style rule)."""
    long = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if (n := len(path.read_text().splitlines())) > 560:
                long[str(path.relative_to(ROOT))] = n
    assert not long, f"split along the seam: {long}"
