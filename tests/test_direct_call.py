"""Direct calls of compiled steps (runtime.compiled.direct_call): after two agreeing recordings a step's graph
is called at its innermost function, with the same results as the ordinary call (bitwise: the same
graph runs), in-place state writes included; a new capacity reads its size from the inputs; what a
recording cannot explain (a result that is a new view of an input), another layout of the
arguments, and NEMOSPEC_DIRECT_CALLS=0 keep the ordinary call."""

import pytest
import torch

from runtime.compiled import direct_call
from runtime.compiled.steps import _Steps
from tests.tolerances import assert_within, matmul_bound


class _Cached:
    """A module of one weight whose step writes one cache row per sequence in place (as the KV write
    does) and returns a new tensor beside the cache."""

    def __init__(self, w):
        self.w = w

    def forward(self, x, pos, state):
        y = torch.tanh(x @ self.w)
        cache = state["cache"]
        cache.index_put_((torch.arange(x.shape[0]), pos.long()), y)
        return y.sum(-1), {"cache": cache, "total": state["total"] + y.sum(-1)}

    def view(self, x, state):
        y = torch.tanh(x @ self.w)
        return y, state["cache"][:, :2]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _inputs(g, batch=2, capacity=6, width=5):
    x = torch.randn(batch, 8, generator=g)
    state = {"cache": torch.zeros(batch, capacity, width), "total": torch.zeros(batch)}
    torch._dynamo.maybe_mark_dynamic(state["cache"], 1)   # as _prepare marks a state's capacity dim
    return x, state


def _call(steps, x, pos, state):
    return steps(("rows", x.shape[0]), "cached", 2, x, pos, state)


def _recorded(seed, capacity=6):
    """A cached step called four times (eager, compiled, recorded twice): (steps, module, generator)."""
    g = torch.Generator().manual_seed(seed)
    module = _Cached(torch.randn(8, 5, generator=g))
    steps = _Steps(module.forward, "cached")
    x, state = _inputs(g, capacity=capacity)
    for p in range(4):
        _call(steps, x, torch.tensor([p, p]), state)
    return steps, module, g


def test_a_step_runs_directly_with_the_ordinary_results_and_in_place_writes(one_thread, monkeypatch):
    monkeypatch.setenv("NEMOSPEC_CHECK_GUARDS", "0")
    steps, module, g = _recorded(0)
    key = ("rows", 2)
    assert key in steps.direct, f"not explained: {steps.plans}"

    # no dynamo bytecode or AOT wrapper runs on a direct call
    from torch._dynamo import aot_compile
    monkeypatch.setattr(aot_compile.AOTCompiledFunction, "__call__", lambda *a, **k: pytest.fail("ordinary call"))
    x2, direct_state = _inputs(g)
    ordinary_state = {k: v.clone() for k, v in direct_state.items()}
    pos = torch.tensor([1, 4])
    out, new_state = _call(steps, x2, pos, direct_state)
    monkeypatch.undo()
    want, want_state = steps.graphs[key](x2, pos, ordinary_state)
    assert torch.equal(out, want) and torch.equal(new_state["total"], want_state["total"])
    assert new_state["cache"] is direct_state["cache"], "the cache is written in place and returned as itself"
    assert torch.equal(direct_state["cache"], ordinary_state["cache"])
    y = torch.tanh(x2 @ module.w)
    assert_within(direct_state["cache"][[0, 1], [1, 4]], y, matmul_bound(x2, module.w) + 4 * torch.finfo(torch.float32).eps,
                  "cache rows")


def test_a_new_capacity_reads_its_size_from_the_inputs(one_thread, monkeypatch):
    monkeypatch.setenv("NEMOSPEC_CHECK_GUARDS", "0")
    steps, module, g = _recorded(1)
    assert ("rows", 2) in steps.direct
    x, big = _inputs(g, capacity=40)
    ordinary = {k: v.clone() for k, v in big.items()}
    pos = torch.tensor([37, 12])
    out, _ = _call(steps, x, pos, big)
    want, _ = steps.graphs[("rows", 2)](x, pos, ordinary)
    assert torch.equal(out, want) and torch.equal(big["cache"], ordinary["cache"])
    assert big["cache"][0, 37].abs().sum() > 0 and big["cache"][1, 12].abs().sum() > 0


def test_another_layout_of_the_arguments_takes_the_ordinary_call(one_thread, monkeypatch):
    monkeypatch.setenv("NEMOSPEC_CHECK_GUARDS", "0")
    steps, module, g = _recorded(2)
    x, state = _inputs(g)
    plan = steps.direct[("rows", 2)]
    with pytest.raises(LookupError):
        plan((x, torch.tensor([0, 0]), {**state, "extra": torch.zeros(1)}), {})
    x, state = _inputs(g)
    state["extra"] = torch.zeros(1)
    out, _ = _call(steps, x, torch.tensor([0, 1]), state)
    eps = torch.finfo(torch.float32).eps
    y = torch.tanh(x @ module.w)   # tanh moves an error no further; the sum of 5 adds its own rounding
    assert_within(out, y.sum(-1), (matmul_bound(x, module.w) + 4 * eps).sum(-1) + 8 * eps * y.abs().sum(-1),
                  "the ordinary call's result")


def test_a_result_the_wrapper_makes_keeps_the_ordinary_call(one_thread, monkeypatch):
    monkeypatch.setenv("NEMOSPEC_CHECK_GUARDS", "0")
    g = torch.Generator().manual_seed(3)
    module = _Cached(torch.randn(8, 5, generator=g))
    steps = _Steps(module.view, "view")
    x, state = _inputs(g)
    outs = [steps(("rows", 2), "view", 2, x, state) for _ in range(4)]
    assert not steps.direct and steps.plans[("rows", 2)] == [None, None]
    for y, head in outs:
        assert head.data_ptr() == state["cache"].data_ptr() and head.shape == (2, 2, 5)


def test_direct_calls_off(one_thread, monkeypatch):
    monkeypatch.setenv("NEMOSPEC_CHECK_GUARDS", "0")
    monkeypatch.setenv("NEMOSPEC_DIRECT_CALLS", "0")
    steps, _, _ = _recorded(4)
    assert ("rows", 2) in steps.graphs and not steps.direct and not direct_call.enabled()
