"""The compiled CPU path (runtime.compiled): greedy ids identical to the eager path, target-only and
speculative (eagle3 on the embedded model), ragged batches with a 1-token prompt, K=1 and K=4; and
no graph compiled beyond the shapes the runtime uses (a new capacity reuses them). Trees:
test_compiled_trees.py.

Compiling is the cost here (a cold inductor cache: tens of seconds per graph), so one module-scoped
pair of loaded models serves every test and the prompts keep to few shapes: prefill chunks are
eager; decode compiles for batch 2+, the fused greedy verify for K+1 = 5 (batch 2+, and batch 1 when a
ragged batch's last sequence runs alone; K=3 pads its verify to 5) and K+1 = 2 (batch 1), the draft
for 1 and 5 rows, its chain for catch-up chunks of 1, 2, 3 and 5 rows; a bf16 copy of the target
compiles its batch-1 decode.
"""
import io
import json
from contextlib import redirect_stderr, redirect_stdout

import pytest
import torch
from tokenizers import Tokenizer

from builder import embedded
from nemospec import cli
from runtime.generation import generate
from runtime.loading import AUTO_COMPILE_MIN_TOKENS, open_checkpoint, resolve_backend
from runtime.speculative import speculative_generate
from compiled_helpers import NEW, RAGGED, eager_and_compiled, graphs as _graphs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(one_thread):
    return eager_and_compiled()


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
def test_eagle3_greedy_ids_equal_eager(models, k, monkeypatch):
    """K=3: its verify chunk of 4 tokens is padded to 5 and runs K=4's fused greedy verify, the accept
    capped at the 3 real drafts, never the unfused verify (two copies of one prompt: they finish
    together, so the batch never shrinks to 1, which would build batch-1 graphs)."""
    from runtime.compiled.runner import CompiledRunner
    eager, compiled = models
    if k == 3:
        monkeypatch.setattr(CompiledRunner, "rollback", lambda *a: pytest.fail("unfused verify"))
    prompts = {4: RAGGED, 3: RAGGED[:1] * 2, 1: RAGGED[:1]}[k]
    want = generate(eager.runner, prompts, NEW).output_ids
    assert speculative_generate(eager.runner, eager.proposer(), prompts, NEW, k).output_ids == want
    got = speculative_generate(compiled.runner, compiled.proposer(), prompts, NEW, k)
    assert got.output_ids == want
    assert got.extra["acceptance"]["mean_accepted_tokens"] > 1.0     # the draft proposes through its graphs
    assert compiled.runner._verify_greedy.ready                       # verify + accept + rollback: one graph


def test_served_rows_of_their_own_k_verify_in_the_compiled_greedy_graph(models, monkeypatch):
    """Served greedy requests with their own num_draft_tokens (4, 1, 2) in one batch: every step
    verifies in the batch-2+ greedy graph the K=4 test compiled, each row's rows past its own drafts
    padding (no separate verify graph, which a server's warm-up does not compile); ids equal eager."""
    import dataclasses
    from runtime.compiled.runner import CompiledRunner
    from runtime.scheduler import Request, Scheduler
    from test_scheduler import Collector, _drain
    eager, compiled = models
    loaded = dataclasses.replace(compiled, max_seq_len=128, max_input_len=16)
    monkeypatch.setattr(CompiledRunner, "rollback", lambda *a: pytest.fail("unfused verify"))
    scheduler, collectors = Scheduler(loaded), [Collector() for _ in RAGGED]
    for prompt, k, collector in zip(RAGGED, (4, 1, 2), collectors):
        scheduler.submit(Request(prompt, NEW, max_draft=k), collector)
    _drain(scheduler)
    assert [c.tokens for c in collectors] == generate(eager.runner, RAGGED, NEW).output_ids
    assert (False, 5) in compiled.runner._verify_greedy.ready


def test_a_request_of_a_shorter_k_alone_runs_the_warmed_graphs_after_the_warm_up(models, monkeypatch):
    """A served request whose own num_draft_tokens (2) is below the K the server warmed (4), alone in
    its batch: its chain of 2 and its verify of 3 have no graph, and after the warm-up they ran
    eagerly for the life of the server. It now drafts through the chain of 4 (the first 2 tokens are
    the chain of 2) and verifies in the graph of 5 (its rows past 3 padding): nothing runs eagerly,
    ids equal eager. The graphs of K = 2 that other tests here compile are set aside."""
    import dataclasses
    from collections import Counter
    from runtime.compiled import steps as steps_module
    from runtime.compiled.runner import warm_up
    from runtime.scheduler import Request, Scheduler
    from test_scheduler import Collector, _drain
    eager, compiled = models
    warm_up(compiled, RAGGED[:1], 4)
    chains, verifies = compiled.proposer().draft._chains, compiled.runner._verify_greedy
    assert (True, 4, 2) in chains.ready and (True, 5) in verifies.ready
    monkeypatch.setattr(chains, "graphs", {key: g for key, g in chains.graphs.items() if key[1] in (4,)})
    monkeypatch.setattr(verifies, "graphs", {key: g for key, g in verifies.graphs.items() if key[1] != 3})
    monkeypatch.setitem(steps_module._COMPILING, "on", False)
    monkeypatch.setattr(steps_module, "EAGER_AFTER_WARM_UP", Counter())
    scheduler, collector = Scheduler(dataclasses.replace(compiled, max_seq_len=128, max_input_len=16)), Collector()
    scheduler.submit(Request(RAGGED[0], NEW, max_draft=2), collector)
    _drain(scheduler)
    assert collector.tokens == generate(eager.runner, RAGGED[:1], NEW).output_ids[0]
    spec = collector.info["speculation"]        # 2 drafts a step at most, some accepted
    assert spec["accepted_draft_tokens"] > 0 and len(spec["histogram"]) == 3, spec
    assert steps_module.EAGER_AFTER_WARM_UP == {}


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
    from runtime import proposers
    from runtime.compiled.runner import CompiledRunner
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
    monkeypatch.setattr(CompiledRunner, "rollback", lambda *a: pytest.fail("unfused verify"))
    lengths, _ = run(compiled, True)
    cut = fused.index(3) + 1                      # the steps agree until the cut (then positions differ)
    assert lengths[:cut] == [2 if n == 3 else n for n in fused[:cut]] and set(lengths) <= {1, 2, 4}, lengths


def test_warm_up_compiles_every_catch_up_bucket_and_nothing_compiles_after(models):
    """A chain pads its catch-up chunk (1..K+1 accepted rows) to 2 or K+1 rows, one graph each:
    warm_up compiles both whatever its own steps accepted, so a later run compiles nothing mid-run,
    and its greedy ids still equal eager target-only."""
    from runtime.compiled.runner import warm_up
    eager, compiled = models
    prompts = RAGGED[:1]
    warm_up(compiled, prompts, 4)
    draft = compiled.proposer().draft
    assert draft.catch_up_rows == [2, 5]
    assert {(True, 4, rows) for rows in draft.catch_up_rows} <= set(draft._chains.ready), draft._chains.ready
    before = _compiled_keys(compiled)[0]
    got = speculative_generate(compiled.runner, compiled.proposer(), prompts, 2 * NEW, 4)
    assert got.output_ids == generate(eager.runner, prompts, 2 * NEW).output_ids
    assert _compiled_keys(compiled)[0] == before, "compiled mid-run"


def test_warm_up_with_a_confidence_stop_compiles_every_verify_length_up_to_k_plus_1(models):
    """A confidence stop trims steps to shorter verifies: warm_up, given the run's policy, compiles
    each verify bucket up to the whole K + 1 (its own run drafts the whole K, whatever the policy's
    schedule: the graphs of the K it was asked to warm)."""
    from runtime.compiled.runner import warm_up
    from runtime.draft_policy import DraftPolicy
    _, compiled = models
    warm_up(compiled, RAGGED[:1], 4, policy=DraftPolicy(4, confidence_threshold=0.999))
    ready = {key for key in compiled.runner._verify_greedy.ready if key[0]}
    assert {(True, t) for t in compiled.runner.verify_buckets if t <= 5} <= ready, ready


def test_warm_up_with_an_adaptive_k_compiles_each_k_and_nothing_compiles_after(models):
    """An adaptive K drafts any of 1, 2 and 4 (the compiled verify lengths) step by step: warm_up,
    given that policy, readies each one's verify and chain, so an adaptive run compiles nothing and its
    greedy ids equal eager target-only."""
    from runtime.compiled.runner import warm_up
    from runtime.compiled.steps import COMPILE_LOG
    from runtime.draft_policy import DraftPolicy
    eager, compiled = models
    policy = DraftPolicy(4, adaptive=True)
    warm_up(compiled, RAGGED[:1], 4, policy=policy)
    before = len(COMPILE_LOG)
    got = speculative_generate(compiled.runner, compiled.proposer(), RAGGED[:1], 2 * NEW, 4, policy=policy)
    assert COMPILE_LOG[before:] == [], "compiled mid-run"
    assert got.output_ids == generate(eager.runner, RAGGED[:1], 2 * NEW).output_ids
    assert len(got.extra["acceptance"]["steps_by_draft_len"]) > 1, got.extra["acceptance"]


def test_warm_up_compiles_the_plain_draft_steps_a_prompt_chunk_meets(one_thread):
    """A prompt's draft context runs in K+1-row chunks whose last may hold one row (a 7-token prompt:
    5 + 1), a step the warm-up's own prompt (6 tokens: one 5-row chunk) never meets: warm_up compiles
    the plain step's 1-row and K+1-row buckets anyway, so nothing compiles or loads mid-run (a bench's
    eagle and mtp rows once paid 6-12 s of compile inside their timings)."""
    from runtime.compiled.runner import warm_up
    from runtime.compiled.steps import COMPILE_LOG
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


def test_a_target_only_warm_up_leaves_nothing_to_load_in_the_run(one_thread):
    """A prompt chunk compiles or loads on its second call, and a target-only warm-up prefilled once:
    `generate --no_speculation` loaded its prompt's chunk inside the timed run (15 ms of a 36 ms run;
    a whole compile on a cold store)."""
    from runtime.compiled.runner import warm_up
    from runtime.compiled.steps import COMPILE_LOG
    # a fresh eagle3 pair's target: the graphs this file's target-only test saves (a target loaded
    # without a draft captures nothing, so its graphs would be two more compiles)
    fresh = open_checkpoint(embedded.target_dir(), mode="eagle3", draft_dir=embedded.draft_dir("eagle3"),
                            backend="compiled")
    warm_up(fresh, RAGGED[:1], 0)
    before = len(COMPILE_LOG)
    generate(fresh.runner, RAGGED[:1], NEW)
    assert COMPILE_LOG[before:] == [], "compiled or loaded mid-run"


def test_warm_up_at_k_1_readies_the_draft_steps_its_catch_ups_meet(one_thread):
    """At K = 1 a feature draft proposes from its catch-up step's own logits and never runs a chain,
    so the warm-up learns the target features' width from that step: it then readies the step's
    1-row bucket (the catch-up after a rejected draft) and K+1-row one, whatever its own short run
    accepted (a K = 1 run's first rejection compiled mid-run)."""
    from runtime.compiled.runner import warm_up
    fresh = open_checkpoint(embedded.target_dir(), mode="eagle3", draft_dir=embedded.draft_dir("eagle3"),
                            backend="compiled")
    warm_up(fresh, RAGGED[:1], 1)
    draft = fresh.proposer().draft
    assert not draft._chains.ready                       # K = 1: no chain ran
    rows = {dict(key[1])["input_ids"][0] for key in draft._steps.ready if key[0]}
    assert {1, draft.pad_to} <= rows, rows


def test_warm_up_of_a_batch_readies_its_tail_at_batch_1(one_thread):
    """A batch's sequences finish at different steps, so its last one runs alone: warm_up of several
    prompts readies the batch-1 graphs (verify, decode, the draft's chains) beside the batch's, even
    where its own short run kept the batch whole (two copies of one prompt finish together).
    `nemospec generate` with several prompts paid ~25 s of batch-1 compiles inside its timed run."""
    from runtime.compiled.runner import warm_up
    fresh = open_checkpoint(embedded.target_dir(), mode="eagle3", draft_dir=embedded.draft_dir("eagle3"),
                            backend="compiled")
    warm_up(fresh, RAGGED[:1] * 2, 4)
    draft = fresh.proposer().draft
    for steps in (fresh.runner._verify_greedy, fresh.runner._forward, draft._chains):
        batches = {key[0] for key in steps.ready}
        assert batches == {True, False}, (steps.what, list(steps.ready))


def test_a_batchs_prompts_prefill_as_each_would_alone(models, monkeypatch):
    """The compiled prompt chunks are batch-1 graphs, so a batch of short prompts (a burst of
    requests, or several prompts on the command line) is prefilled one prompt at a time on its own
    rows of the batch's state: each sequence's logits and state equal that prompt's prefill alone,
    bit for bit, and no chunk runs eagerly (a batch's chunk had run eagerly, its sums in another order)."""
    from runtime.compiled.runner import CompiledRunner
    from runtime.prefill import prefill
    _, compiled = models
    runner = compiled.runner
    for _ in range(2):   # a step compiles at its second call (the first runs eagerly)
        alone = [prefill(runner, [p], runner.new_state(1, 64), 512, ("aux_hidden",)) for p in RAGGED]
    monkeypatch.setattr(CompiledRunner, "_eager", lambda *a: pytest.fail("a prompt chunk ran eagerly"))
    logits, state, _, features = prefill(runner, RAGGED, runner.new_state(len(RAGGED), 64), 512, ("aux_hidden",))
    for b, (want_logits, want_state, _, want_features) in enumerate(alone):
        assert torch.equal(logits[b], want_logits[0])
        assert torch.equal(features["aux_hidden"][b], want_features["aux_hidden"][0])
        for name, value in want_state.items():
            assert torch.equal(state[name][b:b + 1], value), name
    # a burst with a prompt past the compiled chunks: the short ones still prefill as they would alone
    monkeypatch.undo()
    long = [(i * 37) % 2000 + 3 for i in range(70)]
    burst = [RAGGED[0], long, RAGGED[2]]
    logits, state, _, _ = prefill(runner, burst, runner.new_state(len(burst), 96), 512)
    for b in (0, 2):
        want_logits, want_state, _, _ = prefill(runner, [burst[b]], runner.new_state(1, 96), 512)
        assert torch.equal(logits[b], want_logits[0])
        for name, value in want_state.items():
            assert torch.equal(state[name][b:b + 1], value), name
    want_logits = prefill(runner, [long], runner.new_state(1, 96), 512)[0]
    assert torch.equal(logits[1], want_logits[0])


def test_the_runtime_steps_run_as_direct_calls(models):
    """The steps a speculative and a target-only run repeat (decode, greedy verify, the draft chain)
    are explained by their recordings and called directly (runtime.compiled.direct_call); the greedy ids of
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
    from runtime.compiled.shapes import PROMPT_COMPILED_MAX, PROMPT_ROWS
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


def test_a_gpu_with_only_tensorrt_rtx_runs_engine_directories_on_the_torch_paths(monkeypatch):
    """`make setup` installs tensorrt_rtx everywhere, and its runtime supports RTX GPUs, not Hopper:
    ``auto`` picked its engines on an H100/H200 because the import succeeded."""
    from builder.backends import trt_import
    from runtime import loading
    monkeypatch.setattr(loading.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(trt_import, "FLAVOUR", "tensorrt_rtx")
    assert not loading.tensorrt_available() and resolve_backend("auto") == "compiled"
    monkeypatch.setattr(trt_import, "FLAVOUR", "tensorrt")
    assert loading.tensorrt_available() and resolve_backend("auto") == "tensorrt"


def test_the_tensorrt_backends_rollback_reads_its_state_on_the_engines_device():
    """The engines hold the weights; the host module's rollback runs on their CUDA states and read
    each Mamba layer's A from the CPU (a device mismatch at the first verify). ``meta`` stands in for
    the device here."""
    from builder.checkpoint import load_checkpoint
    from builder.models.nemotron_h import NemotronH
    from runtime.loading import place_rollback
    cfg, weights = load_checkpoint(embedded.target_dir())
    target = NemotronH(cfg, weights, torch.float32)
    place_rollback(target, "meta")
    mixers = [m for kind, _, m in target.layers if kind == "mamba"]
    assert mixers and all(m.A.device.type == "meta" for m in mixers)
    assert all(m.out_proj.device.type == "cpu" for m in mixers)   # the weights stay: no second copy


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



def test_bf16_draft_weights_keep_the_target_output(models, monkeypatch, tmp_path):
    """``draft_weight_dtype="bfloat16"``: the compiled draft's graphs multiply by its weights rounded
    to bf16 (traced through the bf16-weights kernel; the target's graphs are not) and speculation
    still emits the target's greedy output. The draft's graphs are compiled apart (``tmp_path``), so
    they are traced here, through the patched kernel that counts the calls; the target verifying is
    the module's compiled one (the same checkpoint and capture), whose graphs earlier tests made."""
    from builder.backends import torch_backend
    from runtime.compiled import small_linear
    monkeypatch.setenv("NEMOSPEC_COMPILE_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    eager, compiled = models
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
    got = speculative_generate(compiled.runner, proposer, prompts, NEW, 4)
    assert got.output_ids == want
    assert got.extra["acceptance"]["mean_accepted_tokens"] > 1.0
    assert proposer.draft._chains.ready, "the draft chain ran compiled"
    if small_linear.supported():
        assert traced, "no draft product went through the bf16-weights kernel"




def test_a_verify_warmed_on_scratch_rows_verifies_real_rows(models, tmp_path, monkeypatch):
    """``warm_verify`` (the warm-up of the lengths a confidence stop trims steps to) compiles the greedy
    verify on a scratch chunk whose logit rows are its positions tensor itself. The graph it leaves
    must verify real rows (positions past the rows): served with --draft_confidence_threshold, it had
    read the positions as row indices, and speculative output differed from target-only greedy."""
    eager, _ = models
    monkeypatch.setenv("NEMOSPEC_COMPILE_CACHE", str(tmp_path))      # compiled here, not loaded
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    compiled = open_checkpoint(embedded.target_dir(), mode="eagle3", draft_dir=embedded.draft_dir("eagle3"),
                               backend="compiled")
    compiled.runner.warm_verify(2)   # the length test_eagle3_greedy_ids_equal_eager[1] verifies
    assert (True, 2) in compiled.runner._verify_greedy.ready
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    prompt = [5, 9, 17, 33, 8, 100, 7, 42, 3]
    out = []
    for runner in (eager.runner, compiled.runner):
        state = runner.new_state(1, 64)
        logits, state, _ = runner.forward(i32([prompt]), i32([list(range(9))]), i32([9]), i32([[8]]), state)
        drafts = [int(logits[0, -1].argmax()), 11]
        out.append(runner.verify_greedy(i32([drafts]), i32([[9, 10]]), i32([2]), i32([[0, 1]]), state))
    (m_e, next_e, logits_e, _, _), (m_c, next_c, logits_c, _, _) = out
    assert torch.equal(m_c, m_e) and torch.equal(next_c, next_e)
    assert torch.equal(logits_c.argmax(-1), logits_e.argmax(-1))   # every row's token, not just the kept ones
