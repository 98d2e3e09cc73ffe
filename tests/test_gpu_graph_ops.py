"""The Triton kernels inside compiled steps (builder/backends/gpu/graph_ops.py, NEMOSPEC_KERNELS_IN_GRAPHS=1),
on CPU tensors under TRITON_INTERPRET inside gpu.forced().

* torch's own custom-op checker (``torch.library.opcheck``: schema and mutation, the fake against the
  real op, AOT dispatch with dynamic shapes) on every registered kernel's op;
* what a traced step holds: the kernel's op where its check takes the static shapes, the torch op
  where it declines (rows past the kernel's, a float64 input) or an argument's type is not the
  schema's (a Python float for a tensor);
* a real compiled step: the tiny MoE NemotronH's decode compiled by the compiled runner with the
  kernels in its graph gives the eager path's greedy ids, and every decode op ran as its kernel."""
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"   # before any kernel is jitted

import pytest  # noqa: E402
import torch  # noqa: E402

from builder.backends import gpu  # noqa: E402
from builder.backends import torch_backend as tb  # noqa: E402
from builder.backends.gpu import graph_ops  # noqa: E402
from builder.nvfp4_format import quantize_nvfp4  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gpu_kernels  # noqa: E402

FP8_INPUTS = ("linear_nvfp4", "fp4_markov_head")   # opcheck's schema test compares inputs with allclose,
                                                   # which has no float8 kernel on the CPU


@pytest.fixture
def in_graphs(monkeypatch):
    monkeypatch.setattr(gpu, "IN_GRAPHS", True)
    gpu.load()
    with gpu.forced():
        yield


def _other_rows():
    """Arguments for the ops gpu_check's rows do not cover (tiny, fp32)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 3, 4, 16, generator=g), torch.randn(1, 24, 2, 16, generator=g), torch.randn(1, 24, 2, 16, generator=g)
    visible = torch.rand(1, 3, 24, generator=g) < 0.6
    visible[..., 0] = True
    residual, delta, buffer = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 24, generator=g)
    w1 = torch.randn(70, 32, generator=g)
    packed, scale, scale_2 = quantize_nvfp4(torch.randn(80, 32, generator=g))
    logits, prev = torch.randn(2, 3, 80, generator=g), torch.randint(0, 70, (2, 3), generator=g)
    return [("masked_attention", (q, k, v, visible, 0.25)),
            ("hidden_capture", (residual, delta, buffer, 1)),
            ("hidden_capture", (residual, None, buffer, 2)),     # no delta: x_new is the residual, copied
            ("fp4_markov_head", (logits, prev, w1, packed, scale, scale_2))]


def _cases():
    rows = [(op, build) for op, build in gpu_kernels._rows(gpu_kernels.shapes("cpu"), "cpu", torch.float32)]
    return [pytest.param(op, build, id=f"{op}-{i}") for i, (op, build) in enumerate(rows)] + \
        [pytest.param(op, lambda args=args: (args,), id=f"{op}-x{i}") for i, (op, args) in enumerate(_other_rows())]


@pytest.mark.parametrize("op,build", _cases())
def test_every_kernel_op_passes_torchs_custom_op_checks(op, build, in_graphs):
    kernel = gpu._KERNELS[op]
    args = build()[0]
    assert graph_ops.fits(kernel.kinds, args) and kernel.check(*args) is None
    coerced = graph_ops.coerce(kernel.kinds, args)
    tests = ("test_faketensor", "test_aot_dispatch_dynamic") if op in FP8_INPUTS else None
    kwargs = {"test_utils": tests} if tests else {}
    results = torch.library.opcheck(kernel.custom_op, coerced, **kwargs)
    assert set(results.values()) == {"SUCCESS"}, results


def _traced_targets(fn, *args):
    """The call targets of the graph dynamo captures for fn(*args) (whole-graph), and its result."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes
                       if n.op == "call_function" and "getitem" not in str(n.target))
        return gm.forward
    out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    torch._dynamo.reset()
    return targets, out


def _ssm(seq, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, seq, 4, 8, generator=g).to(dtype)
    dt = (0.05 + 0.4 * torch.rand(1, seq, 4, generator=g)).to(dtype)
    A, D = -(0.5 + torch.rand(4, generator=g)), torch.randn(4, generator=g)
    B, C = torch.randn(1, seq, 2, 16, generator=g).to(dtype), torch.randn(1, seq, 2, 16, generator=g).to(dtype)
    return x, dt, A, B, C, D, torch.randn(1, 4, 8, 16, generator=g), 8


def test_a_traced_step_holds_the_kernel_where_its_check_takes_the_shapes(in_graphs):
    args = _ssm(5)
    targets, (y, h) = _traced_targets(tb.ssm_scan, *args)
    assert targets == ["nemospec.ssm_scan"], targets
    with gpu.forced():
        want_y, want_h = gpu._KERNELS["ssm_scan"].run(*args)
    assert torch.equal(y, want_y) and torch.equal(h, want_h)


@pytest.mark.parametrize("why,args", [
    ("40 rows: past the kernel's 32 (a prefill chunk)", _ssm(40)),
    ("float64", tuple(a.double() if isinstance(a, torch.Tensor) else a for a in _ssm(5))),
])
def test_a_traced_step_keeps_the_torch_op_where_the_kernel_declines(why, args, in_graphs):
    targets, (y, h) = _traced_targets(tb.ssm_scan, *args)
    assert not any(t.startswith("nemospec.") for t in targets) and targets, (why, targets)
    want_y, want_h = tb.ssm_scan(*args)      # eagerly the kernel declines too: the torch op's result
    assert torch.equal(y, want_y) and torch.equal(h, want_h)


def test_a_graph_traced_at_one_batch_serves_another_and_past_the_kernels_rows(in_graphs, monkeypatch, caplog):
    """The compiled steps mark the batch dim dynamic and do not check guards per call: a graph traced
    at batch 2 runs batch 3 (the fake kept the size symbolic: one graph) and batch 8, whose 40 rows
    are past the MoE kernel's 32 (its custom op checks again and runs the torch op, said once), each
    equal to the torch op's result within the kernel's bound."""
    import logging

    from builder.backends.gpu import moe as gmoe
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    s = gpu_kernels.shapes("cpu")["moe"]
    base = gpu_kernels._moe(s, "cpu", torch.float32, 8 * 5)[0]
    step = torch.compile(lambda r, x, *rest: tb.moe(r, x, *rest), backend=backend, fullgraph=True, dynamic=False,
                         options={"guard_filter_fn": lambda entries: [False] * len(entries)})   # as the steps
    monkeypatch.setattr(gpu, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="nemospec.gpu"):
        for batch in (2, 3, 8):
            x = base[1][:batch * 5].reshape(batch, 5, -1)
            torch._dynamo.maybe_mark_dynamic(x, 0)
            graph_ops.CALLS.clear()
            got = step(x, x, *base[2:])
            with gpu.reference():
                want = tb.moe(x, x, *base[2:])
            assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-5), batch
            assert graph_ops.CALLS["moe"] == (1 if batch * 5 <= gmoe.MAX_ROWS else 0), (batch, graph_ops.CALLS)
    torch._dynamo.reset()
    assert len(graphs) == 1, "the batch dim was fixed to the traced size"
    said = [r.getMessage() for r in caplog.records if r.name == "nemospec.gpu"]
    assert said == ["moe: Triton kernel not used (40 rows (kernel covers 1..32), in a compiled step); running the torch op"], said


def test_an_argument_outside_the_schema_keeps_the_torch_op(in_graphs):
    """moe's norm_topk_prob given as the int 1 (the schema has a bool, which an int is not): the torch
    op is traced, and with True the kernel's op."""
    args = gpu_kernels._moe(gpu_kernels.shapes("cpu")["moe"], "cpu", torch.float32, 3)[0]
    assert args[9] is True
    targets, _ = _traced_targets(tb.moe, *args[:9], 1, *args[10:])
    # the Triton kernel's op stays out (the CPU path's own nemospec.moe_routed may trace in its place,
    # where an earlier test in this process installed the small-row kernel)
    assert "nemospec.moe" not in targets, targets
    targets, _ = _traced_targets(tb.moe, *args)
    assert targets == ["nemospec.moe"], targets


def test_a_compiled_decode_step_runs_its_ops_as_kernels_and_keeps_the_eager_ids(tmp_path, monkeypatch, one_thread):
    from runtime.generation import generate
    from runtime.loading import open_checkpoint
    from tiny_models import MOE, make_checkpoint

    target = make_checkpoint(tmp_path / "moe", MOE, 3)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4]]
    want = generate(open_checkpoint(target, backend="torch").runner, prompts, 6).output_ids
    monkeypatch.setattr(gpu, "IN_GRAPHS", True)
    graph_ops.CALLS.clear()
    with gpu.forced():
        loaded = open_checkpoint(target, backend="compiled")
        got = generate(loaded.runner, prompts, 6).output_ids
    steps = loaded.runner._forward
    assert steps.ready and not steps.broken
    assert got == want
    assert {"rms_norm", "causal_conv1d", "mamba_dt", "ssm_scan", "gated_rms_norm", "attention", "moe"} <= set(graph_ops.CALLS)
