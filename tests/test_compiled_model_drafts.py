"""The compiled CPU path for a draft model (draft_target: a NemotronH of its own, whose warm-up compiles
every step it meets), for two same-shape models (each keeps its own graphs) and for bf16 models (their
products as bf16 dot products). Split from tests/test_compiled_drafts.py so that pytest-xdist, which
gives each file to one worker, spreads the compiles over the cores."""
import gc

import pytest
import torch

from builder import embedded
from runtime.generation import generate
from runtime.loading import open_checkpoint
from runtime.speculative import speculative_generate
from runtime.tree.draft import TreeShape
from compiled_helpers import NEW, RAGGED
from tests.tolerances import assert_within

pytestmark = pytest.mark.usefixtures("one_thread")


def test_draft_target_warm_up_compiles_every_draft_step(one_thread):
    """A draft_target draft (a NemotronH of its own) queues a 2-token chunk only after a fully
    accepted step, which a short warm-up may not repeat: warm_up compiles it anyway, so a timed run
    never compiles (the bench's draft_target line once paid a 10 s compile inside its first run).
    Greedy ids equal the eager path's."""
    from runtime.compiled.runner import warm_up
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


def test_same_shape_models_keep_their_own_graphs(tmp_path, one_thread):
    """Compiled calls skip dynamo's guard evaluation; each model's steps still run its own graphs
    (one code object per compiled step, so no cache holds another model's). Two same-shape targets
    with different weights, stepped alternately in one process: each gives its own eager greedy ids,
    and those differ (so a swapped graph would be caught). A one-token prompt: decode steps only."""
    from runtime.compiled.steps import _skip_guards
    from tiny_models import DENSE, make_checkpoint
    assert _skip_guards()
    dirs = [make_checkpoint(tmp_path / f"m{seed}", DENSE, seed) for seed in (3, 4)]
    eager = [generate(open_checkpoint(d, backend="torch").runner, [RAGGED[1]], NEW).output_ids for d in dirs]
    assert eager[0] != eager[1]
    runners = [open_checkpoint(d, backend="compiled").runner for d in dirs]
    for _ in range(2):
        got = [generate(r, [RAGGED[1]], NEW).output_ids for r in runners]
        assert got == eager
    assert all(r._forward.ready for r in runners)


def test_bf16_model_products_run_as_bf16_dot_products():
    """A bf16 model on the compiled path: its few-row products run in the small-row kernel with bf16 x
    and w (bf16 dot products, in AVX512-BF16 or fp32 FMAs; each weight packed as bf16 pairs at its
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
