"""What the compiled-path test files share: the ragged batch they generate for, and the eager and
compiled eagle3 models of the embedded checkpoint (each file loads its own pair, module-scoped:
compiled steps another process saved load from disk in about a second)."""
from builder import embedded
from runtime.loading import open_checkpoint

RAGGED = [[5, 9, 17, 33, 8, 100, 7], [42], [3, 4, 5, 6]]
NEW = 16


def graphs() -> int:
    """Graphs dynamo has built in this process."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def eager_and_compiled():
    target, draft = embedded.target_dir(), embedded.draft_dir("eagle3")
    eager = open_checkpoint(target, mode="eagle3", draft_dir=draft, backend="torch")
    compiled = open_checkpoint(target, mode="eagle3", draft_dir=draft, backend="compiled")
    assert compiled.backend == "compiled" and type(compiled.runner).__name__ == "CompiledRunner"
    return eager, compiled
