"""The step compiler's mechanics (runtime.compiled.steps): a recurring key runs compiled, guards off
or on; a tensor passed twice; stop_compiling; graphs saved and loaded by a later process, keyed by
what they close over, compiled again where a saved one cannot run; compile options by device and
torch; asking for aot_compile imports no inductor. Toy functions: no model to load."""
import functools

import pytest
import torch

from tests.tolerances import assert_within, matmul_bound

pytestmark = pytest.mark.usefixtures("one_thread")

def _toy(x, w, scale):
    return torch.tanh(x @ w) * scale


@pytest.mark.parametrize("check_guards", ["0", "1"])
def test_steps_run_a_recurring_key_compiled(monkeypatch, check_guards):
    """A key compiles on its min_calls-th call and runs compiled after (its output the function's);
    by default the graph is called directly (no dynamo frame, no guards: the key must name the
    shapes), with NEMOSPEC_CHECK_GUARDS=1 through dynamo, where a shape the key does not name still
    computes the right thing (dynamo recompiles)."""
    from runtime.compiled.steps import _Steps
    monkeypatch.setenv("NEMOSPEC_CHECK_GUARDS", check_guards)
    steps = _Steps(functools.partial(_toy, scale=2.0), "toy")
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
    from runtime.compiled.steps import _Steps
    monkeypatch.setenv("NEMOSPEC_COMPILE_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))   # _configure points it there: restored after
    a, b = torch.arange(4.0), torch.full((4,), 10.0)
    steps = _Steps(_weighted, "weighted")
    for _ in range(4):   # eager, compiled (recorded), recorded, direct
        assert torch.equal(steps(("n", 4), "weighted", 2, a, a), _weighted(a, a))
    if saved:            # a later process: the step loads from the cache, first called with two tensors
        steps = _Steps(_weighted, "weighted")
        for _ in range(2):
            assert torch.equal(steps(("n", 4), "weighted", 2, a, a), _weighted(a, a))
    assert list(steps.ready) == [("n", 4)]
    for _ in range(3):
        assert torch.equal(steps(("n", 4), "weighted", 2, a, b), _weighted(a, b))


def test_a_batch_step_first_called_with_one_tensor_twice_keeps_its_batch_dynamic():
    """The copy that separates a tensor passed twice keeps the dims marked dynamic (as ``_prepare``
    marks a batch of 2+): the graph captured at batch 2 serves batch 3 with two tensors."""
    from runtime.compiled.steps import _Steps

    def batch(n, fill):
        t = torch.arange(4.0).repeat(n, 1) + fill
        torch._dynamo.maybe_mark_dynamic(t, 0)
        return t
    steps = _Steps(_weighted, "weighted batch")
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
    from runtime.compiled.steps import _COMPILING, _Steps, stop_compiling
    monkeypatch.setitem(_COMPILING, "on", True)
    steps = _Steps(functools.partial(_toy, scale=2.0), "toy")
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 8, generator=g), torch.randn(8, 5, generator=g)
    for _ in range(2):
        steps(("rows", 3), "toy", 2, x, w)
    stop_compiling()
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


@pytest.mark.parametrize("warm_up, want", [
    ("all", [(1, False, 4), (1, True, 4), (2, False, 4), (2, True, 4), (2, False, 0)]),
    ("greedy", [(1, False, 4), (2, False, 4), (2, False, 0)]),
    ("single", [(1, False, 4), (1, False, 0)])])
def test_a_servers_warm_up_runs_what_its_warm_up_option_names(monkeypatch, warm_up, want):
    """``nemospec serve --warm_up``: all warms greedy and sampled requests, one sequence and a batch,
    then target-only ones batched; greedy leaves out the sampled; single one greedy sequence (and
    one target-only); then compiling stops."""
    from types import SimpleNamespace
    from runtime.compiled import runner
    calls, stopped = [], []
    monkeypatch.setattr(runner, "_warm_batch", lambda loaded, batch, k, tree, policy, **kw: calls.append(
        (len(batch), "temperature" in kw, k)) or 0.0)
    monkeypatch.setattr(runner, "stop_compiling", lambda: stopped.append(True))
    loaded = SimpleNamespace(runner=object.__new__(runner.CompiledRunner), max_seq_len=64)
    runner.warm_up_for_serving(loaded, 4, **runner.SERVING_WARM_UPS[warm_up])
    assert calls == want and stopped == [True]
    from serving.repository import WARM_UPS
    assert WARM_UPS == tuple(runner.SERVING_WARM_UPS)


def test_a_servers_warm_up_readies_every_k_an_adaptive_policy_may_pick(monkeypatch):
    """``--draft_len_adaptive on``: a request's K may be any compiled verify length up to the engine's,
    so the server warms each of them (greedy, one sequence here), longest first, once each."""
    from types import SimpleNamespace
    from runtime.compiled import runner
    from runtime.draft_policy import DraftPolicy
    calls = []
    monkeypatch.setattr(runner, "_warm_batch", lambda loaded, batch, k, tree, policy, **kw: calls.append(
        (k, bool(policy and policy.adaptive))) or 0.0)
    monkeypatch.setattr(runner, "stop_compiling", lambda: None)
    compiled = object.__new__(runner.CompiledRunner)
    compiled.verify_buckets = [2, 3, 5, 9]
    loaded = SimpleNamespace(runner=compiled, max_seq_len=64, draft_policy=DraftPolicy(8, adaptive=True))
    runner.warm_up_for_serving(loaded, 8, **runner.SERVING_WARM_UPS["single"])
    assert calls == [(8, False), (4, False), (2, False), (1, False), (0, False)]


def test_compiled_steps_are_saved_and_a_later_process_loads_them(tmp_path, monkeypatch, capsys):
    """A compiled step is written to the cache directory whole; a new ``_Steps`` over an equal module
    (a later process) loads it instead of compiling and computes the same; a module with other weights
    or a damaged file compiles afresh (with a warning for the file)."""
    from runtime.compiled.steps import _Steps
    monkeypatch.setenv("NEMOSPEC_COMPILE_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))   # _configure points it there: restored after
    monkeypatch.setenv("NEMOSPEC_CHECK_GUARDS", "0")
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(8, 5, generator=g), torch.randn(3, 8, generator=g)
    bound = 2.0 * (matmul_bound(x, w) + 4 * torch.finfo(torch.float32).eps)

    def run(module):
        steps = _Steps(module.forward, "scaled")
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


_CLAIMING = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
from runtime.compiled import store
path, source, hold = sys.argv[2], sys.argv[3], float(sys.argv[4])
with store.claim(path):
    print("claimed", flush=True)
    time.sleep(hold)            # compiling, as far as the other process can tell
    if source:
        os.replace(source, path)
print("saved", flush=True)
"""


def test_a_step_another_process_is_compiling_is_waited_for_and_loaded(tmp_path, monkeypatch, capsys):
    """Two processes on one store need the same step: while one holds its claim (compiling; here it
    puts the step's file in place after 1.5 s), the other waits and then loads the file instead of
    compiling it too; a claim held past CLAIM_WAIT_S is not waited for any longer (the waiter compiles)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from runtime.compiled import store
    from runtime.compiled.steps import _Steps
    for name, value in (("NEMOSPEC_COMPILE_CACHE", tmp_path), ("TORCHINDUCTOR_CACHE_DIR", tmp_path),
                        ("NEMOSPEC_CHECK_GUARDS", "0")):
        monkeypatch.setenv(name, str(value))
    root = str(Path(__file__).resolve().parents[1])
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(8, 5, generator=g), torch.randn(3, 8, generator=g)
    first = _Steps(_Scaled(w).forward, "scaled")
    first(("rows", 3), "scaled step", 1, x)                      # the step's file, to be put back later
    path = first._saved_path(("rows", 3), (x,), {})
    assert path.is_file() and "compiling scaled step" in capsys.readouterr().err
    aside = tmp_path / "compiled-elsewhere.bin"
    path.rename(aside)

    def other(hold_s, source):
        p = subprocess.Popen([sys.executable, "-c", _CLAIMING, root, str(path), source, str(hold_s)],
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "claimed"
        return p

    p = other(1.5, str(aside))
    start = time.monotonic()
    out = _Steps(_Scaled(w.clone()).forward, "scaled")(("rows", 3), "scaled step", 1, x)
    waited = time.monotonic() - start
    log = capsys.readouterr().err
    assert p.wait(timeout=60) == 0 and p.stdout.read().strip() == "saved"
    assert "loaded scaled step" in log and "compiling" not in log and waited >= 1.0, (log, waited)
    assert torch.equal(out, first(("rows", 3), "scaled step", 1, x))
    monkeypatch.setattr(store, "CLAIM_WAIT_S", 0.3)
    path.unlink()
    p = other(30.0, "")
    start = time.monotonic()
    _Steps(_Scaled(w).forward, "scaled")(("rows", 3), "scaled step", 1, x)
    assert time.monotonic() - start < 25.0 and "compiling scaled step" in capsys.readouterr().err
    p.kill()
    p.wait()


def test_a_saved_step_of_a_closure_is_keyed_by_what_it_closes_over(tmp_path, monkeypatch, capsys):
    """A step function that closes over its module (a component's call): dynamo bakes the weights
    into the graph, so the cell's module names the file; other weights never load that graph."""
    from runtime.compiled.steps import _Steps
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
        steps = _Steps(closing_over(_Scaled(weights)), "closure")
        out = [steps(("rows", 3), "closure step", 2, x) for _ in range(3)][-1]
        assert f"{want} closure step" in capsys.readouterr().err
        bound = 2.0 * (matmul_bound(x, weights) + 4 * torch.finfo(torch.float32).eps)
        assert_within(out, _Scaled(weights).forward(x), bound, "closure step")


def test_a_saved_closure_step_holds_its_weights_not_the_storage_they_view(tmp_path, monkeypatch, capsys):
    """A closure's weights are saved with the step: a weight viewing a larger storage (every tensor
    of a mapped checkpoint views the whole file) writes all of that storage; ``own_storage``, which
    the compiled path applies to a draft's weights (builder.drafts), writes the weight alone."""
    from builder.safetensors_io import own_storage
    from runtime.compiled.steps import _Steps
    monkeypatch.setenv("NEMOSPEC_COMPILE_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("NEMOSPEC_CHECK_GUARDS", "0")
    g = torch.Generator().manual_seed(4)
    mapped = torch.randn(2_000_000, generator=g)          # 8 MB, as a file's one storage
    x = torch.randn(3, 8, generator=g)

    def saved_bytes(weight, tag):
        module = _Scaled(weight)

        def call(x):
            return module.forward(x)
        steps = _Steps(call, tag)
        for _ in range(3):
            steps(("rows", 3), f"{tag} step", 2, x)
        assert f"compiling {tag} step" in capsys.readouterr().err
        files = sorted((tmp_path / "steps").glob("*.bin"), key=lambda p: p.stat().st_mtime)
        return files[-1].stat().st_size

    view = mapped[1000:1040].view(8, 5)
    owned = own_storage(mapped[2000:2040].view(8, 5))
    assert own_storage(owned) is owned and owned.untyped_storage().nbytes() == 40 * 4
    assert saved_bytes(view, "view") > mapped.numel() * 4, "the control: the whole storage is saved"
    assert saved_bytes(owned, "owned") < mapped.numel() * 4 / 4


def test_draft_weights_own_their_storage_on_the_compiled_path():
    """builder.drafts copies a draft's mapped weights (and the target tensors it reads) only for the
    compiled path; a build keeps the views (it streams the mapped checkpoint)."""
    from builder import embedded
    from builder.checkpoint import load_checkpoint
    from builder.drafts import load_draft

    def views(weights):
        return [n for n, t in weights.items() if isinstance(t, torch.Tensor)
                and t.untyped_storage().nbytes() > t.numel() * t.element_size()]
    for own in (False, True):
        config, target = load_checkpoint(embedded.target_dir())
        draft = load_draft("eagle3", config, target, embedded.draft_dir("eagle3"), torch.float32,
                           log=lambda m: None, own_storage=own)
        shared = {n: target[n] for n in ("backbone.embeddings.weight", "lm_head.weight")}
        if own:
            assert not views(draft.weights) and not views(shared)
        else:   # the fp32 target's tensors view its mapped file (the bf16 draft's are converted copies)
            assert len(views(shared)) == 2


def test_a_saved_step_that_cannot_run_here_is_compiled_again(tmp_path, monkeypatch, capsys):
    """A step that loads but fails on its first call (saved by a process that had something this
    one lacks, e.g. a test's patched kernel) is compiled afresh, with a warning naming the file."""
    from runtime.compiled import store
    from runtime.compiled.steps import _Steps
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

    monkeypatch.setattr(store, "load", lambda path: Unrunnable())
    steps = _Steps(_Scaled(w).forward, "unrunnable")
    with pytest.warns(UserWarning, match="saved step did not run .AttributeError"):
        outs = [steps(("rows", 3), "unrunnable step", 2, x) for _ in range(3)]
    assert "compiling unrunnable step" in capsys.readouterr().err and list(steps.ready) == [("rows", 3)]
    bound = 2.0 * (matmul_bound(x, w) + 4 * torch.finfo(torch.float32).eps)
    for out in outs:
        assert_within(out, _Scaled(w).forward(x), bound, "compiled after the saved step failed")


def test_compile_options_by_device_and_torch(monkeypatch):
    """CUDA graphs are asked of inductor on a CUDA device unless NEMOSPEC_CUDA_GRAPHS=0, never on the
    CPU, whose wrapper builds apart from its kernels; options the installed torch lacks are dropped (torch 2.11 has no
    realize_cpu_opcount_threshold), a sub-config's dotted name is kept."""
    from runtime.compiled.steps import _known_options, device_options
    monkeypatch.delenv("NEMOSPEC_CUDA_GRAPHS", raising=False)
    cpu = {"cpp_wrapper_build_separate": True}
    assert device_options("cpu") == cpu and device_options("cuda") == {"triton.cudagraphs": True}
    monkeypatch.setenv("NEMOSPEC_CUDA_GRAPHS", "0")
    assert device_options("cpu") == cpu and device_options("cuda") == {}
    monkeypatch.setenv("NEMOSPEC_CUDA_GRAPHS", "1")
    assert device_options("cpu") == cpu and device_options("cuda") == {"triton.cudagraphs": True}
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
    code = ("import sys; from runtime.compiled.steps import _has_aot_compile; _has_aot_compile(); "
            "assert 'torch._inductor.lowering' not in sys.modules, 'inductor imported'")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG", "PYTHONUTF8"))}
    run = subprocess.run([sys.executable, "-X", "utf8=0", "-c", code], env=dict(env, LC_ALL="C"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-1500:]
    from pathlib import Path
    assert server_env(Tritonserver(binary=Path("tritonserver")))["PYTHONUTF8"] == "1"


def test_the_step_store_keeps_the_most_recently_used_within_its_bound(tmp_path, monkeypatch):
    """Saved steps beyond $NEMOSPEC_COMPILE_CACHE_GB go least recently used first (a load counts as
    a use), the step just saved always stays, and a reserve of free disk is kept the same way."""
    import os
    import shutil
    from collections import namedtuple
    from runtime.compiled import store
    steps = tmp_path / "steps"
    steps.mkdir()
    names = [steps / f"{i}.bin" for i in range(5)]
    for i, p in enumerate(names):
        p.write_bytes(b"x" * 1024)
        os.utime(p, (1000 + i, 1000 + i))
    os.utime(names[0], (2000, 2000))                         # the oldest, but used last
    monkeypatch.setenv("NEMOSPEC_COMPILE_CACHE_GB", str(3.5 * 1024 / 2**30))   # room for three and a half
    monkeypatch.setenv("NEMOSPEC_COMPILE_CACHE_RESERVE_GB", "0")
    removed = store.prune(tmp_path, keep=names[1])
    assert sorted(removed) == [names[2], names[3]]           # 1 kept though old, 4 and 0 the newest
    assert sorted(p.name for p in steps.iterdir()) == ["0.bin", "1.bin", "4.bin"]
    # a nearly full disk: steps go until the reserve is free, even under the size bound
    monkeypatch.setenv("NEMOSPEC_COMPILE_CACHE_GB", "16")
    monkeypatch.setenv("NEMOSPEC_COMPILE_CACHE_RESERVE_GB", str(1.5 * 1024 / 2**30))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(store.shutil, "disk_usage", lambda d: usage(1 << 30, 1 << 30, 0))
    assert store.prune(tmp_path, keep=names[0]) == [names[1], names[4]]
    monkeypatch.setattr(store.shutil, "disk_usage", shutil.disk_usage)
    monkeypatch.setenv("NEMOSPEC_COMPILE_CACHE_GB", "lots")
    with pytest.raises(ValueError, match=r"NEMOSPEC_COMPILE_CACHE_GB: expected a number of gigabytes, got 'lots'"):
        store.prune(tmp_path)


def test_a_step_that_cannot_be_saved_leaves_no_partial_file(tmp_path, monkeypatch):
    """A full disk while saving: a warning naming the file, and no half-written file left behind."""
    from runtime.compiled import store

    class FillsTheDisk:
        def save_compiled_function(self, name):
            with open(name, "wb") as f:
                f.write(b"partial")
            raise OSError(28, "No space left on device")

    monkeypatch.setenv("NEMOSPEC_COMPILE_CACHE_RESERVE_GB", "0")
    path = tmp_path / "steps" / "abc.bin"
    with pytest.warns(UserWarning, match=r"abc.bin: compiled step not saved \(OSError"):
        store.save(FillsTheDisk(), path)
    assert list((tmp_path / "steps").iterdir()) == []



def _relu_step():
    """A toy step run three times (compiled on its second call), and its output."""
    from runtime.compiled.steps import _Steps
    w, x = torch.ones(8, 5), torch.ones(3, 8)
    steps = _Steps(lambda x: torch.relu(x @ w) * 3.0, "relu step")
    for _ in range(3):
        out = steps(("rows", 3), "relu step", 2, x)
    assert torch.equal(out, torch.full((3, 5), 24.0))


_LOADING = """
import sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/tests")
import torch
from runtime.compiled import steps
steps.install_small_linear = lambda cache: False   # not built beside this store (~14 s): the step has no linear
from test_compiled_steps import _relu_step
_relu_step()
print(torch.__file__)
"""


def test_a_step_saved_by_one_venv_loads_in_another_without_building_again(tmp_path, monkeypatch, capsys):
    """Inductor keys its C++ builds by a command line that names the torch installation's paths; a
    step saved by one venv and loaded by another (a CI checkout's) ran gcc again for every library
    (runtime.compiled.cpp_keys). The other venv here is this one reached through a symlink."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    store = tmp_path / "store"
    for name, value in (("NEMOSPEC_COMPILE_CACHE", store), ("TORCHINDUCTOR_CACHE_DIR", store),
                        ("NEMOSPEC_CHECK_GUARDS", "0")):
        monkeypatch.setenv(name, str(value))
    _relu_step()
    assert "compiling relu step" in capsys.readouterr().err
    built = sorted(store.rglob("*.main.so"))
    assert built
    other = tmp_path / "venv"
    other.symlink_to(sys.prefix)
    done = subprocess.run([str(other / "bin" / "python"), "-c", _LOADING, str(Path(__file__).resolve().parents[1])],
                          env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()),
                               "TORCHINDUCTOR_VEC_ISA_OK": "1"},   # the ISA probes' libraries are not a step's
                          capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() != torch.__file__, "the other process imported torch from the same path"
    assert "loaded relu step" in done.stderr and "compiling" not in done.stderr, done.stderr
    assert sorted(store.rglob("*.main.so")) == built, "a library was built again"


@pytest.fixture
def after_warm_up(monkeypatch):
    """This process as a server after its warm-up (compiling stopped), with a fresh count of the steps
    run eagerly since; both restored after the test (stop_compiling is process-wide)."""
    from collections import Counter
    from runtime.compiled import steps as steps_module
    monkeypatch.setitem(steps_module._COMPILING, "on", False)
    monkeypatch.setattr(steps_module, "EAGER_AFTER_WARM_UP", Counter())
    return steps_module


def test_a_step_met_after_the_warm_up_runs_eagerly_counted_and_said_once(after_warm_up, capsys):
    """After stop_compiling (a server's warm-up is done) a key without a graph runs the function
    eagerly: its output exact, nothing compiled, every call counted by label (the server's
    nemospec_eager_steps_total) and the label said once on stderr."""
    steps_module = after_warm_up
    steps = steps_module._Steps(functools.partial(_toy, scale=2.0), "toy")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 8, generator=g), torch.randn(8, 5, generator=g)
    outs = [steps(("rows", 3), "toy step (3 rows)", 1, x, w) for _ in range(3)]
    assert all(torch.equal(out, _toy(x, w, 2.0)) for out in outs) and not steps.ready
    assert steps_module.EAGER_AFTER_WARM_UP == {"toy step (3 rows)": 3}
    assert capsys.readouterr().err.count("toy step (3 rows) runs eagerly: the warm-up did not compile it") == 1


def test_a_greedy_verify_past_every_bucket_caps_each_row_at_its_length(tmp_path):
    """K >= 16: a verify of K+1 tokens fits no compiled bucket and runs verify, accept and rollback
    apart, where the accept took no limit: a row verifying fewer drafts than the step (its rows past
    its length padding) accepted padding rows and took its next token from one. Drafts here are the
    target's own greedy continuation (all agree); a row of length 1 accepts none, as the eager path."""
    from runtime.generation import generate
    from runtime.loading import open_checkpoint
    from runtime.runner import TorchRunner
    from tiny_models import DENSE, make_checkpoint
    loaded = open_checkpoint(make_checkpoint(tmp_path / "dense", DENSE, 0), backend="compiled", max_draft_len=16)
    runner, tokens = loaded.runner, 17
    assert tokens > max(runner.verify_buckets)
    eager = TorchRunner(runner.module)
    prompts = [[5], [9]]
    out = generate(eager, prompts, tokens).output_ids
    ids = torch.tensor([p + o[:tokens - 1] for p, o in zip(prompts, out)], dtype=torch.int32)
    pos = torch.arange(tokens, dtype=torch.int32).expand(2, -1).contiguous()
    lengths = torch.tensor([tokens, 1], dtype=torch.int32)
    want = eager.verify_greedy(ids, pos, lengths, pos.clone(), eager.new_state(2, 64))[:2]
    got = runner.verify_greedy(ids, pos, lengths, pos.clone(), runner.new_state(2, 64))[:2]
    assert [t.tolist() for t in got] == [t.tolist() for t in want] and want[0].tolist() == [16, 0]


def test_a_draft_models_steps_are_named_as_the_drafts(after_warm_up):
    """A draft_target draft is a NemotronH with a compiled runner of its own: its steps' labels (the
    compile log, the eager-after-warm-up line and count) say "draft", so that a step the warm-up
    missed is not mistaken for the target's of the same shape."""
    from builder import embedded
    from runtime.loading import open_checkpoint
    steps_module = after_warm_up
    loaded = open_checkpoint(embedded.target_dir(), mode="draft_target", draft_dir=embedded.draft_dir("draft_target"),
                             backend="compiled")
    for runner in (loaded.runner, loaded.proposer().runner):
        ids = torch.tensor([[5]], dtype=torch.int32)
        runner.forward(ids, ids * 0, torch.ones(1, dtype=torch.int32), ids * 0, runner.new_state(1, 8))
    assert steps_module.EAGER_AFTER_WARM_UP == {"decode step (batch 1)": 1, "draft decode step (batch 1)": 1}
