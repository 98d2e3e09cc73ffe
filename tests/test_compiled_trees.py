"""Tree speculation on the compiled CPU path (runtime.compiled): the fused draft tree and the greedy
tree verify (with its accept and rollback) compiled per tree shape grow the trees, keep the paths and
emit the ids the eager step-by-step path does, on a ragged batch (batch 2+ graphs, then batch 1 once
the other sequences finished) and alone; a second run builds no graph. Its own file so that a
parallel run can put these compiles (the costliest of the suite) beside test_compiled.py's.
"""
import pytest

from compiled_helpers import NEW, RAGGED, eager_and_compiled, graphs as _graphs
from runtime.compiled.runner import warm_up
from runtime.generation import generate
from runtime.speculative import speculative_generate
from runtime.tree.draft import TreeShape

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(one_thread):
    return eager_and_compiled()


def _tree_steps(loaded, prompts, shape):
    """Output ids and every tree step's (step, sequence, tree tokens, parents, accepted path)."""
    records = []
    out = speculative_generate(loaded.runner, loaded.proposer(), prompts, NEW, shape.depth, tree=shape,
                               trace=records.append)
    return out, [(r["step"], r["sequence"], tuple(r["tree_tokens"]), tuple(r["tree_parents"]),
                  tuple(r["accepted_path"])) for r in records if "tree_parents" in r]


def _unfused_tree_steps(loaded, prompts, shape, monkeypatch):
    """``_tree_steps`` on the step-by-step path (the fused calls removed)."""
    from runtime.drafts import EagerDraft
    from runtime.runner import TorchRunner
    for name, owner in (("tree_chain", EagerDraft), ("verify_tree_greedy", TorchRunner)):
        monkeypatch.delattr(owner, name)
    out = _tree_steps(loaded, prompts, shape)
    monkeypatch.undo()
    return out


def test_compiled_fused_trees_equal_the_eager_step_by_step_trees_on_a_ragged_batch(models, monkeypatch):
    """Batch 2+ (and batch 1 once the ragged batch's other sequences finished): the compiled fused
    draft tree and fused verify grow the trees and keep the paths the eager step-by-step path does.
    (The one-node tree, a chain of one, is checked fused and eager in test_tree_fused.py; compiled it
    cost 46 s of graphs that differ from these only in their row count.)"""
    eager, compiled = models
    shape = TreeShape(6, 2, 3)
    want, want_steps = _unfused_tree_steps(eager, RAGGED, shape, monkeypatch)
    got, steps = _tree_steps(compiled, RAGGED, shape)
    assert got.output_ids == want.output_ids == generate(eager.runner, RAGGED, NEW).output_ids
    assert steps == want_steps
    assert [k for k in compiled.runner._verify_tree_greedy.ready if not k[0]]           # a batch 2+ graph
    assert [k for k in compiled.proposer().draft._trees.ready if not k[0]]


def test_eagle3_tree_greedy_ids_equal_eager(models, monkeypatch):
    """Tree speculation on the compiled path: the draft's whole tree (catch-up, tree steps, top-k
    selection) is one graph and the tree verify + greedy accept + tree rollback another; the trees
    grown and paths kept equal the eager step-by-step path's, and so do the ids; after the CLI's
    warm-up no run builds a graph, another max_new_tokens included (on a cold store the draft's
    prompt chunks, which a run meets once, had compiled inside the run after the warm-up's)."""
    eager, compiled = models
    shape = TreeShape(6, 2, 3)
    prompts = RAGGED[:1]
    want = generate(eager.runner, prompts, NEW).output_ids
    _, want_steps = _unfused_tree_steps(eager, prompts, shape, monkeypatch)
    warm_up(compiled, prompts, shape.depth, shape)
    before = _graphs()
    got, steps = _tree_steps(compiled, prompts, shape)
    assert got.output_ids == want and got.extra["acceptance"]["tree"]["steps_by_size"] == {
        "7": got.extra["acceptance"]["num_verify_forwards"]}
    assert steps == want_steps
    assert compiled.runner._verify_tree_greedy.ready and compiled.proposer().draft._trees.ready
    again = speculative_generate(compiled.runner, compiled.proposer(), prompts, NEW + 7, 3, tree=shape)
    assert again.output_ids == generate(eager.runner, prompts, NEW + 7).output_ids and _graphs() == before




def test_a_tree_deeper_than_k_runs_its_catch_up_as_its_graph(models):
    """After a tree step the draft catches up the accepted path, up to depth + 1 rows: a tree deeper
    than K pads its catch-up to that (not K+1), so a long accepted path runs the tree's graph instead
    of an eager chunk (the wide model's depth-6 trees at K = 4 paid 0.68 ms a depth, twice a chain
    proposal's cost); a chunk past the slots beyond capacity still runs eagerly, as it is."""
    from runtime.compiled.shapes import HEADROOM
    _, compiled = models
    draft = compiled.proposer().draft
    assert draft.catch_up_width(3, tree_depth=3) == draft.pad_to == 5       # K = 4: K+1 rows
    assert draft.catch_up_width(2, tree_depth=6) == draft.catch_up_width(7, tree_depth=6) == 7
    assert draft.catch_up_width(7) == 7 and draft.catch_up_width(3) == 5      # chains: buckets 2 and K+1
    assert draft.catch_up_width(HEADROOM + 2, tree_depth=HEADROOM + 4) == HEADROOM + 2
