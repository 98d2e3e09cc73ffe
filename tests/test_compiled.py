"""The compiled CPU path (runtime.compiled): greedy ids identical to the eager path, target-only and
speculative (eagle3 on the embedded model), ragged batches with a 1-token prompt, K=1 and K=4; and
no graph compiled beyond the shapes the runtime uses (a new capacity reuses them).

Compiling is the cost here (a cold inductor cache: tens of seconds per graph), so one module-scoped
pair of loaded models serves every test and the prompts keep to few shapes: prefill chunks are
eager; decode compiles for batch 2+, verify and rollback for K+1 = 5 (batch 2+, and batch 1 when a
ragged batch's last sequence runs alone; K=3 pads its verify to 5) and K+1 = 2 (batch 1), the draft
for 1 and 5 rows, its chain for catch-up chunks of 1, 2, 3 and 5 rows; trees build their fused draft tree and greedy tree verify per tree shape; a bf16 copy of the target compiles its batch-1 decode.
"""
import gc
import io
import json
import functools
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
from tokenizers import Tokenizer

from builder import embedded
from nemospec import cli
from runtime.generation import generate
from runtime.loading import AUTO_COMPILE_MIN_TOKENS, open_checkpoint, resolve_backend
from runtime.speculative import speculative_generate
from runtime.tree_draft import TreeShape
from tests.tolerances import assert_within, matmul_bound

RAGGED = [[5, 9, 17, 33, 8, 100, 7], [42], [3, 4, 5, 6]]
NEW = 16


def _graphs():
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread here: inductor builds its kernels for the thread count it compiles under, and
    two OpenMP threads on a CI machine shared with other work can run a step 10-100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(one_thread):
    target, draft = embedded.target_dir(), embedded.draft_dir("eagle3")
    eager = open_checkpoint(target, mode="eagle3", draft_dir=draft, backend="torch")
    compiled = open_checkpoint(target, mode="eagle3", draft_dir=draft, backend="compiled")
    assert compiled.backend == "compiled" and type(compiled.runner).__name__ == "CompiledRunner"
    return eager, compiled


def _compiled_keys(loaded):
    proposer = loaded.proposer()
    steps = [loaded.runner._forward, loaded.runner._rollback, loaded.runner._verify_greedy,
             loaded.runner._verify_tree_greedy, proposer.draft._steps, proposer.draft._chains, proposer.draft._trees]
    return sum(len(s.ready) for s in steps), [s for s in steps if s.broken]


def test_target_only_greedy_ids_equal_eager(models):
    eager, compiled = models
    want = generate(eager.runner, RAGGED, NEW).output_ids
    assert generate(compiled.runner, RAGGED, NEW).output_ids == want      # compiled from the 2nd step on
    assert generate(compiled.runner, RAGGED, NEW).output_ids == want
    assert compiled.runner._forward.ready  # decode steps did run compiled


@pytest.mark.parametrize("k", [4, 3, 1])
def test_eagle3_greedy_ids_equal_eager(models, k):
    """K=3: its verify chunk of 4 tokens is padded to 5 and runs K=4's graphs (two copies of one prompt:
    they finish together, so the batch never shrinks to 1, which would build batch-1 graphs)."""
    eager, compiled = models
    prompts = {4: RAGGED, 3: RAGGED[:1] * 2, 1: RAGGED[:1]}[k]
    want = generate(eager.runner, prompts, NEW).output_ids
    assert speculative_generate(eager.runner, eager.proposer(), prompts, NEW, k).output_ids == want
    got = speculative_generate(compiled.runner, compiled.proposer(), prompts, NEW, k)
    assert got.output_ids == want
    assert got.extra["acceptance"]["mean_accepted_tokens"] > 1.0     # the draft proposes through its graphs
    assert compiled.runner._verify_greedy.ready                       # verify + accept + rollback: one graph


def _proposals(loaded, prompts, k, fused, monkeypatch):
    """Every step's proposed ids (the speculation trace), with the one-call chain on or off."""
    from runtime import proposers
    if not fused:
        monkeypatch.setattr(proposers.FeatureDraftProposer, "_fused", lambda *a: False)
    steps = []
    result = speculative_generate(loaded.runner, loaded.proposer(), prompts, NEW, k, trace=steps.append)
    monkeypatch.undo()
    return result.output_ids, [(s["step"], s["sequence"], tuple(s["proposed"])) for s in steps]


def test_draft_chain_proposes_what_step_by_step_proposes(models, monkeypatch):
    """The greedy proposal as one draft call (catch-up chunk + K-1 rows, argmax in between) proposes
    the ids K separate draft calls propose, on a ragged batch; compiled, it is one graph."""
    eager, compiled = models
    out, steps = _proposals(eager, RAGGED, 4, False, monkeypatch)
    fused_out, fused_steps = _proposals(eager, RAGGED, 4, True, monkeypatch)
    assert fused_out == out and fused_steps == steps and any(len(p) == 4 for _, _, p in steps)
    got, _ = _proposals(compiled, RAGGED, 4, True, monkeypatch)
    assert got == out and compiled.proposer().draft._chains.ready


def test_confidence_stop_trims_the_one_call_chain_to_a_compiled_verify(models, monkeypatch):
    """A confidence threshold on greedy rows: the draft proposes K in its one chain call and the step
    verifies the confident prefix, as the step-by-step draft that stops at the first unconfident token
    proposes (same trace, eager); compiled, a prefix of 3 is cut to 2 (verify lengths 2, 3 and 5 are
    graphs, 4 is not; later steps start elsewhere), no step runs the unfused verify, and the ids equal
    target-only greedy."""
    from runtime import compiled as compiled_module
    from runtime import proposers
    from runtime.draft_policy import DraftPolicy
    eager, compiled = models
    policy = DraftPolicy(4, confidence_threshold=0.6)
    prompts = [Tokenizer.from_file(str(embedded.target_dir() / "tokenizer.json")).encode("def fibonacci(n):").ids]
    want = generate(eager.runner, prompts, 2 * NEW).output_ids

    def run(loaded, fused):
        if not fused:
            monkeypatch.setattr(proposers.FeatureDraftProposer, "_fused", lambda *a: False)
        chains, steps = [], []
        chain = type(loaded.proposer().draft).chain
        monkeypatch.setattr(type(loaded.proposer().draft), "chain", lambda *a: chains.append(1) or chain(*a))
        got = speculative_generate(loaded.runner, loaded.proposer(), prompts, 2 * NEW, 4, policy=policy,
                                   trace=steps.append)
        monkeypatch.undo()
        assert got.output_ids == want
        return [len(s["proposed"]) for s in steps], len(chains)

    step_by_step, no_chain = run(eager, False)
    fused, chains = run(eager, True)
    assert fused == step_by_step and no_chain == 0 and chains == len(fused)   # every step one chain call
    assert 3 in fused and 4 in fused, fused          # a prompt where the trim cuts and where it does not
    monkeypatch.setattr(compiled_module.CompiledRunner, "rollback", lambda *a: pytest.fail("unfused verify"))
    lengths, _ = run(compiled, True)
    cut = fused.index(3) + 1                      # the steps agree until the cut (then positions differ)
    assert lengths[:cut] == [2 if n == 3 else n for n in fused[:cut]] and set(lengths) <= {1, 2, 4}, lengths


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


@pytest.mark.parametrize("nodes, topk, depth", [(1, 1, 1), (6, 2, 3)])
def test_compiled_fused_trees_equal_the_eager_step_by_step_trees_on_a_ragged_batch(models, monkeypatch, nodes, topk,
                                                                                    depth):
    """Batch 2+ (and batch 1 once the ragged batch's other sequences finished): the compiled fused
    draft tree and fused verify grow the trees and keep the paths the eager step-by-step path does."""
    eager, compiled = models
    shape = TreeShape(nodes, topk, depth)
    want, want_steps = _unfused_tree_steps(eager, RAGGED, shape, monkeypatch)
    got, steps = _tree_steps(compiled, RAGGED, shape)
    assert got.output_ids == want.output_ids == generate(eager.runner, RAGGED, NEW).output_ids
    assert steps == want_steps
    assert [k for k in compiled.runner._verify_tree_greedy.ready if not k[0]]           # a batch 2+ graph
    assert [k for k in compiled.proposer().draft._trees.ready if not k[0]]


def test_eagle3_tree_greedy_ids_equal_eager(models, monkeypatch):
    """Tree speculation on the compiled path: the draft's whole tree (catch-up, tree steps, top-k
    selection) is one graph and the tree verify + greedy accept + tree rollback another; the trees
    grown and paths kept equal the eager step-by-step path's, and so do the ids; a second run with
    another max_new_tokens builds no graph."""
    eager, compiled = models
    shape = TreeShape(6, 2, 3)
    prompts = RAGGED[:1]
    want = generate(eager.runner, prompts, NEW).output_ids
    _, want_steps = _unfused_tree_steps(eager, prompts, shape, monkeypatch)
    got, steps = _tree_steps(compiled, prompts, shape)
    assert got.output_ids == want and got.extra["acceptance"]["tree"]["steps_by_size"] == {
        "7": got.extra["acceptance"]["num_verify_forwards"]}
    assert steps == want_steps
    assert compiled.runner._verify_tree_greedy.ready and compiled.proposer().draft._trees.ready
    before = _graphs()
    again = speculative_generate(compiled.runner, compiled.proposer(), prompts, NEW + 7, 3, tree=shape)
    assert again.output_ids == generate(eager.runner, prompts, NEW + 7).output_ids and _graphs() == before


def test_warm_up_compiles_every_catch_up_bucket_and_nothing_compiles_after(models):
    """A chain pads its catch-up chunk (1..K+1 accepted rows) to 1, 2, 3 or K+1 rows, one graph each:
    warm_up compiles all four whatever its own steps accepted, so a later run compiles nothing mid-run,
    and its greedy ids still equal eager target-only."""
    from runtime.compiled import warm_up
    eager, compiled = models
    prompts = RAGGED[:1]
    warm_up(compiled, prompts, 4)
    draft = compiled.proposer().draft
    assert draft.catch_up_rows == [1, 2, 3, 5]
    assert {(True, 4, rows) for rows in draft.catch_up_rows} <= set(draft._chains.ready), draft._chains.ready
    before = _compiled_keys(compiled)[0]
    got = speculative_generate(compiled.runner, compiled.proposer(), prompts, 2 * NEW, 4)
    assert got.output_ids == generate(eager.runner, prompts, 2 * NEW).output_ids
    assert _compiled_keys(compiled)[0] == before, "compiled mid-run"


def test_warm_up_compiles_the_plain_draft_steps_a_prompt_chunk_meets(one_thread):
    """A prompt's draft context runs in K+1-row chunks whose last may hold one row (a 7-token prompt:
    5 + 1), a step the warm-up's own prompt (6 tokens: one 5-row chunk) never meets: warm_up compiles
    the plain step's 1-row and K+1-row buckets anyway, so nothing compiles or loads mid-run (a bench's
    eagle and mtp rows once paid 6-12 s of compile inside their timings)."""
    from runtime.compiled import COMPILE_LOG, warm_up
    target, draft_dir = embedded.target_dir(), embedded.draft_dir("eagle3")
    fresh = open_checkpoint(target, mode="eagle3", draft_dir=draft_dir, backend="compiled")
    warm_up(fresh, [[5, 9, 17, 33, 8, 100]], 4)
    draft = fresh.proposer().draft
    rows = {dict(key[1])["input_ids"][0] for key in draft._steps.ready if key[0]}
    assert {1, 5} <= rows, rows
    before = len(COMPILE_LOG)
    got = speculative_generate(fresh.runner, fresh.proposer(), RAGGED[:1], NEW, 4)
    assert COMPILE_LOG[before:] == [], "compiled mid-run"
    eager = open_checkpoint(target, backend="torch")
    assert got.output_ids == generate(eager.runner, RAGGED[:1], NEW).output_ids


def test_the_runtime_steps_run_as_direct_calls(models):
    """The steps a speculative and a target-only run repeat (decode, greedy verify, the draft chain)
    are explained by their recordings and called directly (runtime.direct_call); the greedy ids of
    the tests above went through those calls. New capacities (other max_new_tokens) keep them."""
    eager, compiled = models
    for new in (NEW, 2 * NEW + 3):
        assert (speculative_generate(compiled.runner, compiled.proposer(), RAGGED[:1], new, 4).output_ids
                == generate(eager.runner, RAGGED[:1], new).output_ids)
        assert generate(compiled.runner, RAGGED[:1], new).output_ids == generate(eager.runner, RAGGED[:1], new).output_ids
    draft = compiled.proposer().draft
    for steps in (compiled.runner._forward, compiled.runner._verify_greedy, draft._chains):
        recorded = {k for k, plans in steps.plans.items() if len(plans) == 2}
        assert recorded and recorded == set(steps.direct), (steps.what, steps.plans.keys(), steps.direct.keys())
    assert (True, 1, 1, False) in compiled.runner._forward.direct, "the batch-1 decode"
    assert (True, 5) in compiled.runner._verify_greedy.direct, "the batch-1 greedy verify at K = 4"


def test_no_graph_beyond_the_step_shapes(models):
    """Every graph dynamo built is one the runner meant to compile (no silent recompiles on strides,
    tensor kinds or capacity), and a new capacity (another max_new_tokens) builds none."""
    eager, compiled = models
    speculative_generate(compiled.runner, compiled.proposer(), RAGGED[:1], NEW, 1)
    generate(compiled.runner, RAGGED[:2], NEW)       # the batch-2 decode graph, when this test runs alone
    before, (keys, broken) = _graphs(), _compiled_keys(compiled)
    assert not broken
    for new in (NEW + 9, 2 * NEW):
        assert (generate(compiled.runner, RAGGED[:2], new).output_ids
                == generate(eager.runner, RAGGED[:2], new).output_ids)
        assert (speculative_generate(compiled.runner, compiled.proposer(), RAGGED[:1], new, 1).output_ids
                == generate(eager.runner, RAGGED[:1], new).output_ids)
    assert _graphs() == before and _compiled_keys(compiled)[0] == keys


def test_short_prompts_prefill_as_compiled_chunks(models):
    """One sequence's prompt chunk of up to PROMPT_COMPILED_MAX tokens runs as compiled PROMPT_ROWS-row
    chunks (eagerly an 11-token prompt cost 6.0 ms, compiled 2.2 ms): every row's features come back
    and greedy ids equal eager's, target-only and speculative; a longer chunk, and a batch's prefill,
    stay eager."""
    from runtime.compiled import PROMPT_COMPILED_MAX, PROMPT_ROWS
    from runtime.prefill import prefill
    eager, compiled = models
    torch.manual_seed(0)
    prompts = [torch.randint(3, 2000, (n,)).tolist() for n in (40, 11, 3)]
    _, _, forwards, feats = prefill(compiled.runner, prompts[:1], compiled.runner.new_state(1, 128), 512,
                                    ("aux_hidden",))
    assert forwards == 1 and feats["aux_hidden"][0].shape[0] == 40
    assert (True, PROMPT_ROWS, 1, False) in compiled.runner._forward.ready     # 3 chunks: compiled at the 2nd
    for prompt in prompts:
        want = generate(eager.runner, [prompt], NEW).output_ids
        assert generate(compiled.runner, [prompt], NEW).output_ids == want
        assert speculative_generate(compiled.runner, compiled.proposer(), [prompt], NEW, 4).output_ids == want
    steps = compiled.runner._forward

    def chunks():   # the keys of chunks of more than one token (decode steps of a new batch size aside)
        return {k for k in steps.ready if k[1] > 1}, {k: n for k, n in steps.calls.items() if k[1] > 1}
    before = chunks()
    long = [torch.randint(3, 2000, (PROMPT_COMPILED_MAX + 6,)).tolist()]
    assert generate(compiled.runner, long, 4).output_ids == generate(eager.runner, long, 4).output_ids
    assert generate(compiled.runner, prompts, 4).output_ids == generate(eager.runner, prompts, 4).output_ids
    assert chunks() == before, "a long prompt or a batch's prefill went through a step"


def test_backend_choice(monkeypatch):
    from runtime import loading
    monkeypatch.setattr(loading, "tensorrt_available", lambda: True)   # a GPU: engines run on TensorRT
    assert resolve_backend("auto") == "tensorrt" and resolve_backend("auto", engine_dir=False) == "compiled"
    assert resolve_backend("auto", engine_dir=False, tokens=64) == "torch"
    monkeypatch.setattr(loading, "tensorrt_available", lambda: False)  # a CPU-only machine
    assert resolve_backend("auto") == "compiled"
    assert resolve_backend("auto", tokens=AUTO_COMPILE_MIN_TOKENS) == "compiled"
    assert resolve_backend("auto", tokens=64) == "torch"   # loading the graphs would cost more than they save
    assert resolve_backend("torch") == "torch" and resolve_backend("compiled") == "compiled"


def test_a_gpu_without_tensorrt_runs_engine_directories_on_the_torch_paths(monkeypatch):
    """CUDA present but no TensorRT to import (the lent H200's image): engines cannot run, so ``auto``
    takes the compiled path for an engine directory too, instead of failing to import TensorRT."""
    import sys
    from runtime import loading
    monkeypatch.setattr(loading.torch.cuda, "is_available", lambda: True)
    for name in ("tensorrt", "tensorrt_rtx", "builder.backends.trt_import"):
        monkeypatch.setitem(sys.modules, name, None)
    assert not loading.tensorrt_available()
    assert resolve_backend("auto") == "compiled" and resolve_backend("auto", tokens=64) == "torch"


def test_cli_backend_compiled(models):
    eager, _ = models
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        # eagle3's target (it captures the draft's layers) and batch 2: graphs already built here
        code = cli.main(["generate", "--backend", "compiled", "--speculative_decoding_mode", "eagle3",
                         "--no_speculation", "--input_ids", "5,9,17,33,8,100,7", "--input_ids", "42",
                         "--max_new_tokens", str(NEW), "--ignore_eos", "--json"])
    assert code == 0, err.getvalue()
    record = json.loads(out.getvalue().strip().splitlines()[-1])
    assert record["backend"] == "compiled"
    assert record["output_ids"] == generate(eager.runner, RAGGED[:2], NEW).output_ids


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


def test_peagle_parallel_draft_compiles_one_graph_per_k(one_thread):
    """P-EAGLE's steady step (1..K+1 verified rows and K-1 placeholders, right-padded to 2K rows)
    runs as one graph (it ran eagerly: 2.8 ms a step, 0.39x target-only in the bench); greedy ids
    equal the eager path's on a ragged batch and on one prompt, chains and trees."""
    target, draft = embedded.target_dir(), embedded.draft_dir("peagle")
    eager = open_checkpoint(target, mode="peagle", draft_dir=draft, backend="torch")
    compiled = open_checkpoint(target, mode="peagle", draft_dir=draft, backend="compiled")
    for prompts in (RAGGED[:2], RAGGED[:1]):
        want = generate(eager.runner, prompts, NEW).output_ids
        assert speculative_generate(compiled.runner, compiled.proposer(), prompts, NEW, 4).output_ids == want
    steps = compiled.proposer().draft._steps
    widths = {dict(k[1])["input_ids"][0] for k in steps.ready}
    assert widths == {8} and any(batch_one for batch_one, _ in steps.ready), steps.ready   # 2K, batch 1 too
    tree = speculative_generate(compiled.runner, compiled.proposer(), RAGGED[:1], NEW, 4, tree=TreeShape(8, 2, 4))
    assert tree.output_ids == want


def test_draft_target_warm_up_compiles_every_draft_step(one_thread):
    """A draft_target draft (a NemotronH of its own) queues a 2-token chunk only after a fully
    accepted step, which a short warm-up may not repeat: warm_up compiles it anyway, so a timed run
    never compiles (the bench's draft_target line once paid a 10 s compile inside its first run).
    Greedy ids equal the eager path's."""
    from runtime.compiled import warm_up
    target, draft = embedded.target_dir(), embedded.draft_dir("draft_target")
    eager = open_checkpoint(target, mode="draft_target", draft_dir=draft, backend="torch")
    compiled = open_checkpoint(target, mode="draft_target", draft_dir=draft, backend="compiled")
    prompts = RAGGED[:1]
    warm_up(compiled, prompts, 4)
    runner = compiled.proposer().runner
    assert (True, 2, 1, False) in runner._forward.ready, runner._forward.ready    # batch 1, 2 tokens, 1 logit row
    assert (True, 1, 1, False) in runner._forward.ready
    want = generate(eager.runner, prompts, NEW).output_ids
    assert speculative_generate(compiled.runner, compiled.proposer(), prompts, NEW, 4).output_ids == want
    # trees: the draft queues 1..depth+1 rows after a tree step (other short chunks compile on their
    # 16th call, mid-run); warm_up with the tree compiles them and the tree shapes, and nothing after
    shape = TreeShape(4, 2, 2)
    warm_up(compiled, prompts, 4, shape)
    assert {(True, n, 1, False) for n in (2, 3)} <= set(runner._forward.ready), runner._forward.ready
    before = {id(s): set(s.ready) for s in (runner._forward, compiled.runner._forward, compiled.runner._verify_tree_greedy)}
    tree = speculative_generate(compiled.runner, compiled.proposer(), prompts, NEW, 4, tree=shape)
    assert tree.output_ids == want and tree.extra["acceptance"]["tree"]["steps_by_size"]
    assert {id(s): set(s.ready) for s in (runner._forward, compiled.runner._forward,
                                          compiled.runner._verify_tree_greedy)} == before, "compiled mid-run"


def test_nvfp4_block_draft_compiles_with_its_weights_dequantized_once(one_thread):
    """The NVFP4 DSpark draft on the compiled path: its FP4 weights are dequantized once at load
    (the per-call FP4 subclass broke the graph: the step ran eagerly, 5x its bf16 twin's cost), the
    step compiles, and greedy ids equal the eager path's, whose module keeps the FP4 weights."""
    from builder.quantization import NVFP4Weight, dequantized_module
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


def test_same_shape_models_keep_their_own_graphs(tmp_path, one_thread):
    """Compiled calls skip dynamo's guard evaluation; each model's steps still run its own graphs
    (one code object per compiled step, so no cache holds another model's). Two same-shape targets
    with different weights, stepped alternately in one process: each gives its own eager greedy ids,
    and those differ (so a swapped graph would be caught)."""
    from runtime import compiled as compiled_lib
    from tiny_models import DENSE, make_checkpoint
    assert compiled_lib._skip_guards()
    dirs = [make_checkpoint(tmp_path / f"m{seed}", DENSE, seed) for seed in (3, 4)]
    eager = [generate(open_checkpoint(d, backend="torch").runner, [RAGGED[0]], NEW).output_ids for d in dirs]
    assert eager[0] != eager[1]
    runners = [open_checkpoint(d, backend="compiled").runner for d in dirs]
    for _ in range(2):
        got = [generate(r, [RAGGED[0]], NEW).output_ids for r in runners]
        assert got == eager
    assert all(r._forward.ready for r in runners)


def test_bf16_draft_weights_keep_the_target_output(models, monkeypatch, tmp_path):
    """``draft_weight_dtype="bfloat16"``: the compiled draft's graphs multiply by its weights rounded
    to bf16 (traced through the bf16-weights kernel; the target's graphs are not) and speculation
    still emits the target's greedy output. Its graphs are saved apart (``tmp_path``): they hold the
    patched kernel that counts the calls."""
    from builder.backends import torch_backend
    from runtime import small_linear
    monkeypatch.setenv("NEMOSPEC_COMPILE_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    eager, _ = models
    target, draft = embedded.target_dir(), embedded.draft_dir("eagle3")
    loaded = open_checkpoint(target, mode="eagle3", draft_dir=draft, backend="compiled", draft_weight_dtype="bfloat16")
    proposer = loaded.proposer()
    assert proposer.draft._chains.product_form == "bf16_weights"
    assert loaded.runner._verify_greedy.product_form == "float32"
    traced = []
    if small_linear.supported():
        kernel = torch_backend._small_linear_bf16w
        monkeypatch.setattr(torch_backend, "_small_linear_bf16w", lambda x, w: (traced.append(w.shape), kernel(x, w))[1])
    prompts = RAGGED[:1]
    want = generate(eager.runner, prompts, NEW).output_ids
    got = speculative_generate(loaded.runner, proposer, prompts, NEW, 4)
    assert got.output_ids == want
    assert got.extra["acceptance"]["mean_accepted_tokens"] > 1.0
    assert proposer.draft._chains.ready, "the draft chain ran compiled"
    if small_linear.supported():
        assert traced, "no draft product went through the bf16-weights kernel"


def test_bf16_model_products_run_as_bf16_dot_products():
    """A bf16 model on the compiled path: its few-row products run in the small-row kernel with bf16 x
    and w (AVX512-BF16 dot products, where the CPU has them; each weight packed as bf16 pairs at its
    first use, so the kernel's packed bytes grow by at least the LM head's), and its decode logits stay within
    the bf16 rounding of the LM head (``lm_head_bound``) of the eager bf16 path's; a broken product
    moves them by whole units."""
    from builder.backends import torch_backend
    from tests.tolerances import lm_head_bound
    target = embedded.target_dir()
    eager = open_checkpoint(target, dtype="bfloat16", backend="torch")
    loaded = open_checkpoint(target, dtype="bfloat16", backend="compiled")
    bf16_kernel = torch_backend.small_linear_kernels()[2]
    if bf16_kernel:   # earlier tests' dead weights lose their copies at the next new weight: now, not mid-test
        gc.collect()
        torch.ops.nemospec.small_linear(torch.zeros(1, 4), torch.zeros(4, 4))
    packed_before = torch.ops.nemospec.small_linear_packed_bytes() if bf16_kernel else 0
    prompt = torch.tensor([[(i * 37) % 2000 + 3 for i in range(70)]], dtype=torch.int32)  # > 64: eager prefill
    one = torch.ones(1, dtype=torch.int32)
    logits = {}
    for name, runner in (("eager", eager.runner), ("compiled", loaded.runner)):
        state = runner.new_state(1, 96)
        _, state, _ = runner.forward(prompt, torch.arange(70, dtype=torch.int32)[None], torch.tensor([70], dtype=torch.int32),
                                     torch.tensor([[69]], dtype=torch.int32), state)
        rows = []
        for i in range(3):   # compiled from the 2nd call on
            out, state, _ = runner.forward(prompt[:, i:i + 1], torch.tensor([[70 + i]], dtype=torch.int32), one,
                                           torch.zeros(1, 1, dtype=torch.int32), state)
            rows.append(out[0, -1])
        logits[name] = torch.stack(rows)
    assert loaded.runner._forward.ready, "the decode step ran compiled"
    module = eager.runner.module
    bound = lm_head_bound(module.norm_f.float(), module.lm_head.float(), torch.bfloat16)
    assert_within(logits["compiled"], logits["eager"], bound, "bf16 compiled decode logits vs eager")
    if bf16_kernel:
        head_bytes = module.lm_head.numel() * 2
        assert torch.ops.nemospec.small_linear_packed_bytes() - packed_before >= head_bytes, \
            "the bf16 products did not run in the small-row kernel"


def test_a_verify_warmed_on_scratch_rows_verifies_real_rows(models, tmp_path, monkeypatch):
    """``warm_verify`` (the warm-up of the lengths a confidence stop trims steps to) compiles the greedy
    verify on a scratch chunk whose logit rows are its positions tensor itself. The graph it leaves
    must verify real rows (positions past the rows): served with --draft_confidence_threshold, it had
    read the positions as row indices, and speculative output differed from target-only greedy."""
    eager, _ = models
    monkeypatch.setenv("NEMOSPEC_COMPILE_CACHE", str(tmp_path))      # compiled here, not loaded
    compiled = open_checkpoint(embedded.target_dir(), mode="eagle3", draft_dir=embedded.draft_dir("eagle3"),
                               backend="compiled")
    compiled.runner.warm_verify(3)
    assert (True, 3) in compiled.runner._verify_greedy.ready
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    prompt = [5, 9, 17, 33, 8, 100, 7, 42, 3]
    out = []
    for runner in (eager.runner, compiled.runner):
        state = runner.new_state(1, 64)
        logits, state, _ = runner.forward(i32([prompt]), i32([list(range(9))]), i32([9]), i32([[8]]), state)
        drafts = [int(logits[0, -1].argmax()), 11, 12]
        out.append(runner.verify_greedy(i32([drafts]), i32([[9, 10, 11]]), i32([3]), i32([[0, 1, 2]]), state))
    (m_e, next_e, logits_e, _, _), (m_c, next_c, logits_c, _, _) = out
    assert torch.equal(m_c, m_e) and torch.equal(next_c, next_e)
    assert torch.equal(logits_c.argmax(-1), logits_e.argmax(-1))   # every row's token, not just the kept ones


def _toy(x, w, scale):
    return torch.tanh(x @ w) * scale


@pytest.mark.parametrize("check_guards", ["0", "1"])
def test_steps_run_a_recurring_key_compiled(monkeypatch, check_guards):
    """A key compiles on its min_calls-th call and runs compiled after (its output the function's);
    by default the graph is called directly (no dynamo frame, no guards: the key must name the
    shapes), with NEMOSPEC_CHECK_GUARDS=1 through dynamo, where a shape the key does not name still
    computes the right thing (dynamo recompiles)."""
    from runtime import compiled
    monkeypatch.setenv("NEMOSPEC_CHECK_GUARDS", check_guards)
    steps = compiled._Steps(functools.partial(_toy, scale=2.0), "toy")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 8, generator=g), torch.randn(8, 5, generator=g)
    want = _toy(x, w, 2.0)
    outs = [steps(("rows", 3), "toy", 2, x, w) for _ in range(3)]
    assert list(steps.ready) == [("rows", 3)] and not steps.broken
    for out in outs:   # eager, then compiled: the same products, maybe summed in another order
        assert_within(out, want, 2.0 * (matmul_bound(x, w) + 4 * torch.finfo(torch.float32).eps), "toy")
    direct = type(steps.graphs[("rows", 3)].func).__name__ == "AOTCompiledFunction"
    assert direct == (check_guards == "0")
    if check_guards == "1":
        x4 = torch.randn(4, 8, generator=g)
        assert steps(("rows", 3), "toy", 2, x4, w).shape == (4, 5)


def _weighted(a, b):
    return a * 2.0 + b * 3.0


@pytest.mark.parametrize("saved", [False, True])
def test_a_step_first_called_with_one_tensor_twice_computes_two_tensors_later(tmp_path, monkeypatch, saved):
    """A warm-up that passes one tensor for two inputs (``warm_verify`` passed its positions as the
    logit rows) must not leave a graph that reads the first input for both: later calls with two
    tensors (a real verify) got the positions as row indices (an index error, or wrong rows). The
    first calls' own result stays right too, and a process that loads the saved step agrees."""
    from runtime import compiled
    monkeypatch.setenv("NEMOSPEC_COMPILE_CACHE", str(tmp_path))
    a, b = torch.arange(4.0), torch.full((4,), 10.0)
    steps = compiled._Steps(_weighted, "weighted")
    for _ in range(4):   # eager, compiled (recorded), recorded, direct
        assert torch.equal(steps(("n", 4), "weighted", 2, a, a), _weighted(a, a))
    if saved:            # a later process: the step loads from the cache, first called with two tensors
        steps = compiled._Steps(_weighted, "weighted")
        for _ in range(2):
            assert torch.equal(steps(("n", 4), "weighted", 2, a, a), _weighted(a, a))
    assert list(steps.ready) == [("n", 4)]
    for _ in range(3):
        assert torch.equal(steps(("n", 4), "weighted", 2, a, b), _weighted(a, b))


def test_a_batch_step_first_called_with_one_tensor_twice_keeps_its_batch_dynamic():
    """The copy that separates a tensor passed twice keeps the dims marked dynamic (as ``_prepare``
    marks a batch of 2+): the graph captured at batch 2 serves batch 3 with two tensors."""
    from runtime import compiled

    def batch(n, fill):
        t = torch.arange(4.0).repeat(n, 1) + fill
        torch._dynamo.maybe_mark_dynamic(t, 0)
        return t
    steps = compiled._Steps(_weighted, "weighted batch")
    a2 = batch(2, 0.0)
    for _ in range(3):
        assert torch.equal(steps(("batch", 4), "weighted", 2, a2, a2), _weighted(a2, a2))
    a3, b3 = batch(3, 1.0), batch(3, 10.0)
    for _ in range(3):
        assert torch.equal(steps(("batch", 4), "weighted", 2, a3, b3), _weighted(a3, b3))


def test_after_stop_compiling_a_new_key_runs_eagerly_and_compiled_ones_stay(monkeypatch):
    """A server warms up, then stops compiling (``warm_up_for_serving``): a key compiled before keeps
    its graph, a key seen only afterwards runs the function eagerly however often it recurs, so no
    request waits behind a compile."""
    from runtime import compiled
    monkeypatch.setitem(compiled._COMPILING, "on", True)
    steps = compiled._Steps(functools.partial(_toy, scale=2.0), "toy")
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 8, generator=g), torch.randn(8, 5, generator=g)
    for _ in range(2):
        steps(("rows", 3), "toy", 2, x, w)
    compiled.stop_compiling()
    x2 = torch.randn(2, 8, generator=g)
    outs = [steps(("rows", 2), "toy", 2, x2, w) for _ in range(20)]
    assert list(steps.ready) == [("rows", 3)], "nothing compiles once compiling stopped"
    assert all(torch.equal(o, _toy(x2, w, 2.0)) for o in outs), "the eager function itself"
    assert_within(steps(("rows", 3), "toy", 2, x, w), _toy(x, w, 2.0),
                  2.0 * (matmul_bound(x, w) + 4 * torch.finfo(torch.float32).eps), "the graph compiled before")


class _Scaled:
    """A module of one weight, run by a step as ``_Steps`` runs a model's bound method."""

    def __init__(self, w):
        self.w = w

    def forward(self, x):
        return torch.tanh(x @ self.w) * 2.0


def test_compiled_steps_are_saved_and_a_later_process_loads_them(tmp_path, monkeypatch, capsys):
    """A compiled step is written to the cache directory whole; a new ``_Steps`` over an equal module
    (a later process) loads it instead of compiling and computes the same; a module with other weights
    or a damaged file compiles afresh (with a warning for the file)."""
    from runtime import compiled
    monkeypatch.setenv("NEMOSPEC_COMPILE_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))   # _configure points it there: restored after
    monkeypatch.setenv("NEMOSPEC_CHECK_GUARDS", "0")
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(8, 5, generator=g), torch.randn(3, 8, generator=g)
    bound = 2.0 * (matmul_bound(x, w) + 4 * torch.finfo(torch.float32).eps)

    def run(module):
        steps = compiled._Steps(module.forward, "scaled")
        outs = [steps(("rows", 3), "scaled step", 2, x) for _ in range(3)]
        return steps, outs, capsys.readouterr().err

    first, outs, log = run(_Scaled(w))
    assert "compiling scaled step" in log and list(first.ready) == [("rows", 3)]
    files = sorted((tmp_path / "steps").glob("*.bin"))
    assert len(files) == 1, "one step, one file"
    second, again, log = run(_Scaled(w.clone()))
    assert "loaded scaled step" in log and "compiling" not in log
    for out in outs + again:
        assert_within(out, _Scaled(w).forward(x), bound, "scaled step")
    _, _, log = run(_Scaled(w + 1.0))
    assert "compiling scaled step" in log, "other weights: another graph"
    assert len(list((tmp_path / "steps").glob("*.bin"))) == 2
    files[0].write_bytes(b"not a compiled step")
    with pytest.warns(UserWarning, match="not loaded"):
        _, outs, log = run(_Scaled(w))
    assert "compiling scaled step" in log
    assert_within(outs[-1], _Scaled(w).forward(x), bound, "recompiled after a damaged file")


def test_a_saved_step_of_a_closure_is_keyed_by_what_it_closes_over(tmp_path, monkeypatch, capsys):
    """A step function that closes over its module (a component's call): dynamo bakes the weights
    into the graph, so the cell's module names the file; other weights never load that graph."""
    from runtime import compiled
    monkeypatch.setenv("NEMOSPEC_COMPILE_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("NEMOSPEC_CHECK_GUARDS", "0")
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(8, 5, generator=g), torch.randn(3, 8, generator=g)

    def closing_over(module):
        def call(x):
            return module.forward(x)
        return call

    for weights, want in ((w, "compiling"), (w + 1.0, "compiling"), (w.clone(), "loaded")):
        steps = compiled._Steps(closing_over(_Scaled(weights)), "closure")
        out = [steps(("rows", 3), "closure step", 2, x) for _ in range(3)][-1]
        assert f"{want} closure step" in capsys.readouterr().err
        bound = 2.0 * (matmul_bound(x, weights) + 4 * torch.finfo(torch.float32).eps)
        assert_within(out, _Scaled(weights).forward(x), bound, "closure step")


def test_a_saved_step_that_cannot_run_here_is_compiled_again(tmp_path, monkeypatch, capsys):
    """A step that loads but fails on its first call (saved by a process that had something this
    one lacks, e.g. a test's patched kernel) is compiled afresh, with a warning naming the file."""
    from runtime import compiled, compiled_store
    monkeypatch.setenv("NEMOSPEC_COMPILE_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("NEMOSPEC_CHECK_GUARDS", "0")
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(8, 5, generator=g), torch.randn(3, 8, generator=g)

    class Unrunnable:
        def disable_guard_check(self):
            pass

        def __call__(self, *args, **kwargs):
            raise AttributeError("'nemospec.kernel' has no attribute __closure__")

    monkeypatch.setattr(compiled_store, "load", lambda path: Unrunnable())
    steps = compiled._Steps(_Scaled(w).forward, "unrunnable")
    with pytest.warns(UserWarning, match="saved step did not run .AttributeError"):
        outs = [steps(("rows", 3), "unrunnable step", 2, x) for _ in range(3)]
    assert "compiling unrunnable step" in capsys.readouterr().err and list(steps.ready) == [("rows", 3)]
    bound = 2.0 * (matmul_bound(x, w) + 4 * torch.finfo(torch.float32).eps)
    for out in outs:
        assert_within(out, _Scaled(w).forward(x), bound, "compiled after the saved step failed")


def test_compile_options_by_device_and_torch(monkeypatch):
    """CUDA graphs are asked of inductor only on a CUDA device and only with NEMOSPEC_CUDA_GRAPHS=1;
    options the installed torch lacks are dropped (torch 2.11 has no realize_cpu_opcount_threshold),
    a sub-config's dotted name is kept."""
    from runtime.compiled_steps import _known_options, device_options
    monkeypatch.delenv("NEMOSPEC_CUDA_GRAPHS", raising=False)
    assert device_options("cpu") == {} and device_options("cuda") == {}
    monkeypatch.setenv("NEMOSPEC_CUDA_GRAPHS", "1")
    assert device_options("cpu") == {} and device_options("cuda") == {"triton.cudagraphs": True}
    kept = _known_options({"triton.cudagraphs": True, "cpp_wrapper": True, "no_such_option": 1, "triton.no_such": 2})
    assert kept == {"triton.cudagraphs": True, "cpp_wrapper": True}


def test_asking_for_aot_compile_imports_no_inductor_and_stubs_read_utf8():
    """A Triton stub's interpreter starts in an ASCII locale, where importing inductor's lowering (its
    UTF-8 templates) fails: probing the torch for ``aot_compile`` must not import it (a bench's served
    run once died of that), and the server's env asks for UTF-8 anyway."""
    import os
    import subprocess
    import sys
    from serving.tritonserver import Tritonserver, server_env
    code = ("import sys; from runtime.compiled_steps import _has_aot_compile; _has_aot_compile(); "
            "assert 'torch._inductor.lowering' not in sys.modules, 'inductor imported'")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG", "PYTHONUTF8"))}
    run = subprocess.run([sys.executable, "-X", "utf8=0", "-c", code], env=dict(env, LC_ALL="C"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-1500:]
    from pathlib import Path
    assert server_env(Tritonserver(binary=Path("tritonserver")))["PYTHONUTF8"] == "1"
