"""One function compiled per recurring shape key (``_Steps``): how the compiled path captures a step
(``aot_compile`` where this torch has it, dynamo with guards elsewhere), where inductor keeps what it
builds, which compile options a device and a torch get, and the log of what compiled when."""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import types
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

from builder.backends import gpu, torch_backend
from runtime.compiled import cpp_keys, direct_call, store
from runtime.compiled.small_linear import install as install_small_linear

def device_options(device) -> dict:
    """Compile options for where the steps run.

    On a CUDA device inductor replays each step as a CUDA graph (what ``mode="reduce-overhead"``
    sets), so a step costs its kernels rather than their launches (the embedded model's compiled
    decode on an H200 without graphs: 1.03 ms of host launch time for microseconds of GPU work).
    ``NEMOSPEC_CUDA_GRAPHS=0`` turns them off.

    On the CPU the C++ wrapper (allocations and calls) is built at -O1 apart from the kernels (-O3):
    built as one file at -O3, g++ took 5-12 s a step on the embedded model's verify and draft chains,
    apart 2-3.5 s, with the steps' times unchanged within noise (benchmarks/compiled_step.py)."""
    if torch.device(device).type == "cuda":
        return {"triton.cudagraphs": True} if os.environ.get("NEMOSPEC_CUDA_GRAPHS", "1") not in ("", "0") else {}
    return {"cpp_wrapper_build_separate": True}


def _known_options(options: dict) -> dict:
    """The inductor options this torch has: a CPU heuristic's knob of one release can be gone in
    another (``realize_cpu_opcount_threshold`` is not in torch 2.11), and an unknown one fails the compile."""
    import torch._inductor.config as inductor_config

    def known(name):
        where = inductor_config
        for part in name.split("."):   # "triton.cudagraphs": a field of a sub-config
            if not hasattr(where, part):
                return False
            where = getattr(where, part)
        return True
    return {k: v for k, v in options.items() if known(k)}


def cache_dir() -> Path:
    """Where inductor keeps compiled graphs: $NEMOSPEC_COMPILE_CACHE or ~/.cache/nemospec/inductor."""
    return Path(os.environ.get("NEMOSPEC_COMPILE_CACHE") or Path.home() / ".cache" / "nemospec" / "inductor")


def _configure():
    """Points inductor at our cache and lets one code object hold the graphs of every step shape."""
    path = cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path.resolve())
    import torch._dynamo.config as dynamo
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(getattr(dynamo, name), 64))
    if hasattr(dynamo, "accumulated_recompile_limit"):
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 1024)
    install_small_linear(path.parent)
    cpp_keys.install()


def _own_code(fn):
    """``fn`` (a function, bound method or partial) running a code object of its own. Dynamo keeps
    one cache of graphs per code object; with a copy per ``_Steps`` (or per A/B side in
    benchmarks/small_linear.py), every cache holds the graphs of one model instance only."""
    if isinstance(fn, functools.partial):
        return functools.partial(_own_code(fn.func), *fn.args, **fn.keywords)
    if isinstance(fn, types.MethodType):
        return types.MethodType(_own_code(fn.__func__), fn.__self__)
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__, copy.__dict__ = fn.__kwdefaults__, fn.__qualname__, dict(fn.__dict__)
    return copy


def _skip_guards() -> bool:
    """Steps captured whole with ``aot_compile`` and called without guards, unless
    NEMOSPEC_CHECK_GUARDS is set or this torch has no ``aot_compile`` (2.11 has none: dynamo's own
    frame evaluation then checks every guard, as the variable would have it)."""
    return os.environ.get("NEMOSPEC_CHECK_GUARDS", "") in ("", "0") and _has_aot_compile()


@functools.cache
def _has_aot_compile() -> bool:
    # the eager backend: asking must not import inductor (in a Triton stub, whose locale is ASCII,
    # importing inductor's templates before _configure has run fails)
    return hasattr(torch.compile(lambda: None, backend="eager"), "aot_compile")


def _unbind(fn):
    """(plain function, leading positional args, keyword args) of a function, bound method or
    partial: what ``aot_compile`` traces and what each call passes before the step's own args."""
    if isinstance(fn, functools.partial):
        func, lead, keywords = _unbind(fn.func)
        return func, lead + tuple(fn.args), {**keywords, **fn.keywords}
    if isinstance(fn, types.MethodType):
        func, lead, keywords = _unbind(fn.__func__)
        return func, (fn.__self__,) + lead, keywords
    return fn, (), {}


def _unaliased(tree):
    """``tree`` with each tensor that appears a second time (the same tensor object) replaced by a
    copy. Dynamo captures one graph input for a tensor passed twice (a warm-up that passed its
    positions as the logit rows too); with guards off, later calls that pass two different tensors
    would then read the first for both. Graphs are captured, and direct calls recorded, from
    distinct inputs; a later call that passes one tensor twice feeds it to both inputs."""
    seen = set()

    def one(x):
        if isinstance(x, torch.Tensor):
            if id(x) in seen:   # the copy keeps the dims marked dynamic (a batch of 2+, a capacity)
                copy = x.clone()
                for d in getattr(x, "_dynamo_weak_dynamic_indices", ()):
                    torch._dynamo.maybe_mark_dynamic(copy, d)
                for d in getattr(x, "_dynamo_dynamic_indices", ()):
                    torch._dynamo.mark_dynamic(copy, d)
                return copy
            seen.add(id(x))
        return x
    return pytree.tree_map(one, tree)


def _no_guards(entries):
    return [False] * len(entries)


class _Steps:
    """One function, compiled for the shape keys that recur; every other call runs it eagerly.

    Each key's graph is captured with ``aot_compile`` (dynamo's whole-graph capture, inductor with
    its C++ wrapper) and called directly: no dynamo frame evaluation, cache lookup or guard check
    per call. Those cost 0.14 ms of a 0.50 ms decode call on the embedded target (the graph itself
    0.36). It is safe because the key names the graph (shapes, batch bucket, chunk kind), weights
    never change after the module is built, and inputs pass ``_prepare`` (dense strides). Set
    ``NEMOSPEC_CHECK_GUARDS=1`` to run the steps through dynamo's frame evaluation instead, every
    guard checked on every call (a mismatch recompiles)."""

    def __init__(self, fn, what: str, options: dict | None = None, product_form: str = "float32",
                 label_prefix: str = ""):
        _configure()
        self.fn, self.what, self.product_form = fn, what, product_form
        self.label_prefix = label_prefix   # "draft " for a draft_target draft's steps: its logs name it
        func, self.lead, self.keywords = _unbind(fn)
        self.check_guards = not _skip_guards()
        options = _known_options({"cpp_wrapper": True, **(options or {})})
        if not self.check_guards:  # none is checked, so none is built (nor pickled: aot_compile saves its guards)
            options["guard_filter_fn"] = _no_guards
        self.compiler = torch.compile(_own_code(func), dynamic=False, fullgraph=True, options=options)
        # what names a saved step beside its key and inputs (runtime.compiled.store)
        self.identity = dict(options, function=f"{func.__module__}.{func.__qualname__}", product_form=product_form,
                             keywords=store.fingerprint([self.keywords]))
        self.identity.pop("guard_filter_fn", None)
        self._lead_digest = None
        # a closure's cells count as the module they hold (a component's call closes over its module,
        # whose weights dynamo then bakes into the graph as constants)
        self._captured = tuple(c.cell_contents for c in (func.__closure__ or ()))
        self.graphs: dict = {}
        self.direct: dict = {}     # key -> DirectCall
        self.plans: dict = {}      # key -> the recorded plans of its first calls
        self.calls: Counter = Counter()
        self.broken = False
        self.compile_seconds: dict = {}

    @property
    def ready(self):
        """The keys that run compiled."""
        return self.graphs.keys()

    def first_compiled(self, buckets, key_of):
        """The first of ``buckets`` (ascending) whose key ``key_of(bucket)`` runs a graph, or would be
        compiled; else the first. After a server's warm-up a shape it did not warm then takes the
        next larger one it did (more padding rows, the same output) rather than running eagerly for
        the life of the process. None when ``buckets`` is empty."""
        buckets = list(buckets)
        compiles = _COMPILING["on"] and not self.broken
        return next((b for b in buckets if compiles or key_of(b) in self.graphs), buckets[0] if buckets else None)

    def _saved_path(self, key, args, kwargs):
        """Where this step is saved (``runtime.compiled.store``); None when it cannot be named (then it
        compiles in memory only)."""
        try:
            if self._lead_digest is None:
                self._lead_digest = store.fingerprint(self.lead + self._captured)
            return store.step_path(cache_dir(), self.what, key, self.identity, self._lead_digest, args, kwargs)
        except Exception as e:
            warnings.warn(f"{self.what}: compiled step not saved ({type(e).__name__}: {str(e)[:120]})", stacklevel=3)
            return None

    def __call__(self, key, label: str, min_calls: int, *args, **kwargs):
        label = self.label_prefix + label
        graph = self.graphs.get(key)
        if graph is not None:
            direct = self.direct.get(key)
            if direct is not None:
                try:
                    return direct(args, {**self.keywords, **kwargs})
                except LookupError:    # laid out otherwise than recorded: the ordinary call
                    return graph(*args, **self.keywords, **kwargs)
            plans = self.plans.get(key)
            if plans is None or len(plans) >= 2:
                return graph(*args, **self.keywords, **kwargs)
            args, kwargs = _unaliased((args, kwargs))   # a recording maps inputs by identity
            out, plan = direct_call.record(graph, args, {**self.keywords, **kwargs})
            plans.append(plan)
            if len(plans) == 2 and direct_call.same_plan(*plans):
                self.direct[key] = direct_call.DirectCall(*plan)
            return out
        self.calls[key] += 1
        if self.broken or self.calls[key] < min_calls or not _COMPILING["on"]:
            if not _COMPILING["on"] and not self.broken:
                _ran_eagerly(label)
            with torch_backend.product_form(self.product_form):   # eager, in the graphs' precision
                return self.fn(*args, **kwargs)
        start = time.perf_counter()
        args, kwargs = _unaliased((args, kwargs))
        path = None if self.check_guards else self._saved_path(key, args, kwargs)
        with store.claim(path) if path is not None else contextlib.nullcontext():   # one process compiles it
            return self._load_or_compile(key, label, start, path, args, kwargs)

    def _load_or_compile(self, key, label: str, start: float, path, args, kwargs):
        if gpu.IN_GRAPHS:
            gpu.load()   # the kernels' custom ops, before a saved step names them or a trace meets them
        saved = store.load(path) if path is not None else None
        if saved is not None:   # compiled by an earlier process
            graph = functools.partial(saved, *self.lead)
            try:
                out = graph(*args, **self.keywords, **kwargs)
            except Exception as e:  # saved with what this process lacks (a test's monkeypatched kernel): compile
                warnings.warn(f"{path}: saved step did not run ({type(e).__name__}: {str(e)[:120]}); compiling it",
                              stacklevel=2)
                return self._compile(key, label, start, path, args, kwargs)
            seconds = time.perf_counter() - start
            print(f"loaded {label} ({seconds:.1f} s)", file=sys.stderr, flush=True)
            COMPILE_LOG.append(f"loaded {label} ({seconds:.1f} s)")
            self.compile_seconds[label] = seconds   # what this process paid for the step
            self._add(key, graph)
            return out
        return self._compile(key, label, start, path, args, kwargs)

    def _compile(self, key, label: str, start: float, path, args, kwargs):
        print(f"compiling {label} ...", end="", file=sys.stderr, flush=True)
        try:
            with torch_backend.product_form(self.product_form):  # read while the graph is traced
                if self.check_guards:   # dynamo's own frame evaluation: every guard on every call
                    graph = functools.partial(self.compiler, *self.lead)
                else:
                    captured = self.compiler.aot_compile(((*self.lead, *args), {**self.keywords, **kwargs}))
                    captured.disable_guard_check()
                    graph = functools.partial(captured, *self.lead)
                out = graph(*args, **self.keywords, **kwargs)
            if path is not None:
                store.save(captured, path)
        except Exception as e:  # a graph break or a lowering inductor lacks: eager from now on
            print(" failed", file=sys.stderr, flush=True)
            warnings.warn(f"{self.what}: torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                          "running it eagerly", stacklevel=3)
            self.broken = True
            with torch_backend.product_form(self.product_form):
                return self.fn(*args, **kwargs)
        seconds = time.perf_counter() - start
        print(f" {seconds:.1f} s", file=sys.stderr, flush=True)
        COMPILE_LOG.append(f"compiled {label} ({seconds:.1f} s)")
        self.compile_seconds[label] = seconds
        self._add(key, graph)
        return out

    def _add(self, key, graph):
        """A graph for ``key``; its next two calls are recorded for a direct call
        (``runtime.compiled.direct_call``) unless guards are checked or direct calls are off."""
        self.graphs[key] = graph
        if not self.check_guards and direct_call.enabled():
            self.plans[key] = []


_COMPILING = {"on": True}
COMPILE_LOG: list[str] = []   # every step this process compiled or loaded, in order (a timed run checks none was)
EAGER_AFTER_WARM_UP: Counter = Counter()   # label -> calls run eagerly after stop_compiling (no graph for them)


def _ran_eagerly(label: str) -> None:
    """A step the warm-up did not compile, met after it: exact but several times slower, for the life
    of the process. Counted (a server exports the total as nemospec_eager_steps_total) and said once
    per label, so that an operator learns which requests the warm-up missed."""
    if not EAGER_AFTER_WARM_UP[label]:
        print(f"nemospec: {label} runs eagerly: the warm-up did not compile it", file=sys.stderr, flush=True)
    EAGER_AFTER_WARM_UP[label] += 1


def stop_compiling() -> None:
    """From now on this process compiles nothing: steps without a graph run eagerly. A server calls
    it after its warm-up, so that no request ever waits behind a compile (tens of seconds on a cold
    cache) for a shape it had not seen."""
    _COMPILING["on"] = False


def product_form(weight_dtype: str = "auto", matmul_precision: str = "highest") -> str:
    """How a model's compiled few-row fp32 products multiply (``torch_backend.product_form``):
    ``--matmul_precision medium`` rounds x and w to bf16 (dot products, fp32 sums), a draft's
    ``--draft_weight_dtype bfloat16`` rounds w only; by default neither."""
    if matmul_precision == "medium":
        return "bf16"
    return "bf16_weights" if weight_dtype == "bfloat16" else "float32"
