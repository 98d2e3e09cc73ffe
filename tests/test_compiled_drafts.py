"""The compiled CPU path for the one-forward drafts (DFlash, DSpark, P-EAGLE, an NVFP4 block draft):
greedy ids identical to the eager path's, one graph per step shape. (tests/test_compiled.py holds the
eagle3 model's tests, tests/test_compiled_model_drafts.py a draft model's, same-shape models' and bf16
models', tests/test_compiled_steps.py the step compiler's mechanics; split so that pytest-xdist, which
gives each file to one worker, spreads the compiles over the cores.)"""

import pytest
import torch

from builder import embedded
from runtime.generation import generate
from runtime.loading import open_checkpoint
from runtime.speculative import speculative_generate
from runtime.tree.draft import TreeShape
from compiled_helpers import NEW, RAGGED

pytestmark = pytest.mark.usefixtures("one_thread")


def test_dflash_block_draft_compiles_one_graph_per_step(one_thread):
    """A block draft's steady step (context rows padded to K+1) runs as one graph; greedy ids equal
    the eager path's, as chains and as trees (the tree's depth is K, so its block has the same shape)."""
    target, draft = embedded.target_dir(), embedded.draft_dir("dflash")
    eager = open_checkpoint(target, mode="dflash", draft_dir=draft, backend="torch")
    compiled = open_checkpoint(target, mode="dflash", draft_dir=draft, backend="compiled")
    prompts = RAGGED[:1]
    want = generate(eager.runner, prompts, NEW).output_ids
    assert speculative_generate(compiled.runner, compiled.proposer(), prompts, NEW, 4).output_ids == want
    chains = compiled.proposer().draft._chains                                   # greedy chains: block + rows
    assert [k for k in chains.ready if dict(k[1])["aux"][0] == 5], chains.ready  # the padded context width K+1
    tree = speculative_generate(compiled.runner, compiled.proposer(), prompts, NEW, 4, tree=TreeShape(8, 2, 4))
    assert tree.output_ids == want
    trees = compiled.proposer().draft._trees                                     # greedy trees: block + growth
    assert [k for k in trees.ready if dict(k[1])["aux"][0] == 5], trees.ready


def test_peagle_parallel_draft_compiles_one_graph_per_k(one_thread, monkeypatch):
    """P-EAGLE's steady step (1..K+1 verified rows and K-1 placeholders, right-padded to 2K rows)
    runs as one graph (it ran eagerly: 2.8 ms a step, 0.39x target-only in the bench); greedy ids
    equal the eager path's on a ragged batch and on one prompt, chains and trees. A step of a
    shorter K (a tree's depth, a request's own K after a server's warm-up) runs K's graph and uses
    its first rows: it had a graph of its own, and after the warm-up ran eagerly."""
    from collections import Counter
    from runtime.compiled import steps as steps_module
    target, draft = embedded.target_dir(), embedded.draft_dir("peagle")
    eager = open_checkpoint(target, mode="peagle", draft_dir=draft, backend="torch")
    compiled = open_checkpoint(target, mode="peagle", draft_dir=draft, backend="compiled")
    for prompts in (RAGGED[:2], RAGGED[:1]):
        want = generate(eager.runner, prompts, NEW).output_ids
        assert speculative_generate(compiled.runner, compiled.proposer(), prompts, NEW, 4).output_ids == want
    steps = compiled.proposer().draft._steps
    widths = {dict(k[1])["input_ids"][0] for k in steps.ready}
    assert widths == {8} and any(batch_one for batch_one, _ in steps.ready), steps.ready   # 2K, batch 1 too
    # 6 nodes, depth 3: its 7-row verify is the eagle3 tree's graph (same captured layers; test_compiled_trees.py)
    tree = speculative_generate(compiled.runner, compiled.proposer(), RAGGED[:1], NEW, 4, tree=TreeShape(6, 2, 3))
    assert tree.output_ids == want
    monkeypatch.setitem(steps_module._COMPILING, "on", False)
    monkeypatch.setattr(steps_module, "EAGER_AFTER_WARM_UP", Counter())
    assert speculative_generate(compiled.runner, compiled.proposer(), RAGGED[:1], NEW, 2).output_ids == want
    assert steps_module.EAGER_AFTER_WARM_UP == {}
    assert {dict(key[1])["logit_index"][0] for key in steps.ready} == {4}, steps.ready


def test_nvfp4_block_draft_compiles_with_its_weights_dequantized_once(one_thread):
    """The NVFP4 DSpark draft on the compiled path: its FP4 weights are dequantized once at load
    (the per-call FP4 subclass broke the graph: the step ran eagerly, 5x its bf16 twin's cost), the
    step compiles, and greedy ids equal the eager path's, whose module keeps the FP4 weights."""
    from builder.nvfp4_format import NVFP4Weight
    from builder.quantization import dequantized_module
    target, draft = embedded.target_dir(), embedded.target_dir().parent / "dspark_nvfp4"
    eager = open_checkpoint(target, mode="dspark", draft_dir=draft, backend="torch")
    compiled = open_checkpoint(target, mode="dspark", draft_dir=draft, backend="compiled")
    module = eager.proposer().draft.module
    fp4 = [(i, n, w) for i, layer in enumerate(module.layers) for n, w in vars(layer).items()
           if isinstance(w, NVFP4Weight)]
    assert fp4, "the embedded NVFP4 draft binds FP4 weights"
    plain = dequantized_module(module)
    for i, name, w in fp4:
        assert isinstance(vars(module.layers[i])[name], NVFP4Weight)       # the original is untouched
        assert torch.equal(vars(plain.layers[i])[name], w.dequantize())
    assert not any(isinstance(w, NVFP4Weight) for layer in compiled.proposer().draft.module.layers
                   for w in vars(layer).values())
    prompts = RAGGED[:1]
    want = generate(eager.runner, prompts, NEW).output_ids
    assert speculative_generate(compiled.runner, compiled.proposer(), prompts, NEW, 4).output_ids == want
    chains = compiled.proposer().draft._chains        # the greedy block + Markov rows: one graph
    assert chains.ready and not chains.broken


@pytest.mark.parametrize("mode", ["dflash", "dspark"])
def test_block_chain_proposes_what_row_by_row_proposes(mode, one_thread, monkeypatch):
    """A block draft's greedy proposal as one call (the block, then each row's argmax after DSpark's
    Markov bias for the previous token) proposes the ids the row-by-row path draws, eagerly on a
    ragged batch and compiled (one graph) on one prompt."""
    from runtime.drafts import EagerDraft
    target, draft = embedded.target_dir(), embedded.draft_dir(mode)
    eager = open_checkpoint(target, mode=mode, draft_dir=draft, backend="torch")
    compiled = open_checkpoint(target, mode=mode, draft_dir=draft, backend="compiled")

    def proposals(loaded, prompts, fused):
        if not fused:
            monkeypatch.delattr(EagerDraft, "block_chain")
        steps = []
        out = speculative_generate(loaded.runner, loaded.proposer(), prompts, NEW, 4, trace=steps.append)
        monkeypatch.undo()
        return out.output_ids, [(s["step"], s["sequence"], tuple(s["proposed"])) for s in steps]

    want = proposals(eager, RAGGED, False)
    assert proposals(eager, RAGGED, True) == want and any(len(p) == 4 for *_, p in want[1])
    got, _ = proposals(compiled, RAGGED[:1], True)
    assert got == generate(eager.runner, RAGGED[:1], NEW).output_ids and compiled.proposer().draft._chains.ready


@pytest.mark.parametrize("mode", ["dflash", "dspark"])
def test_a_sampled_block_of_a_shorter_k_runs_at_the_graphs_width(mode, monkeypatch):
    """Sampled requests at a K below the compiled draft's (an adaptive K, a schedule, a request's
    own): the block ran unpadded, a shape no graph has, so every step drafted eagerly (36 of 36 in a
    run at K 2 and 1 after a warm-up at K 4); now it runs at the one width (each step's context
    padded to pad_to) and draws its first K rows (their q is that block's: rejection sampling stays
    exact). Compiling is off here: the steps run eagerly through the graph's key."""
    from runtime.compiled import steps as steps_module
    from runtime.compiled.draft import CompiledDraft
    monkeypatch.setitem(steps_module._COMPILING, "on", False)
    loaded = open_checkpoint(embedded.target_dir(), mode=mode, draft_dir=embedded.draft_dir(mode), backend="compiled")
    widths = []
    run_block = CompiledDraft._run_block

    def recording(self, feeds):
        widths.append(feeds["aux"].shape[1] == self.pad_to)
        return run_block(self, feeds)
    monkeypatch.setattr(CompiledDraft, "_run_block", recording)
    out = speculative_generate(loaded.runner, loaded.proposer(), [[5, 9, 17, 33]], 12, 2, temperature=0.8, seed=1)
    assert len(out.output_ids[0]) == 12
    assert len(widths) > 1 and all(widths), widths
