import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# pytest-xdist's workers share the machine's cores (make test runs one per core): a thread each
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))


def port_range(worker: str | None) -> str:
    """The ports a worker's servers pick from, below the kernel's ephemeral range (from 32768): two
    workers' servers, or an outgoing connection, took a port a server was about to bind."""
    k = int((worker or "gw0").removeprefix("gw") or 0) % 6
    return f"{20000 + 2000 * k}-{20000 + 2000 * k + 1999}"


# assigned, not defaulted: xdist's workers inherit the controller's environment, which had set gw0's
# range for both (a supervisor test's restarted server then met the other worker's on its ports)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["NEMOSPEC_PORT_RANGE"] = port_range(os.environ["PYTEST_XDIST_WORKER"])
else:
    os.environ.setdefault("NEMOSPEC_PORT_RANGE", port_range(None))


@pytest.fixture(autouse=True)
def _environment_unchanged(request):
    """A test leaves the settings the code reads from the environment as it found them (monkeypatch
    restores its own): a section of scripts/gpu_models.py that repointed the compiled-step store for
    the rest of its worker made every later compiled test file there compile again, every run."""
    from environment_guard import changed, watched_environment
    before = watched_environment()
    yield
    what = changed(before, watched_environment())
    if what:
        pytest.fail(f"{request.node.nodeid} changed the environment: {what}", pytrace=False)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """kind -> directory of a tiny transformers-written NemotronH checkpoint (made once)."""
    from tiny_models import tiny_checkpoint

    class _Lazy(dict):
        def __missing__(self, kind):
            self[kind] = tiny_checkpoint(kind, tmp_path_factory)
            return self[kind]

    return _Lazy()


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of compiled-path tests: inductor builds its kernels for the thread
    count it compiles under, and two OpenMP threads on a CI machine shared with other work can run a
    step 10-100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the order files start in: longest first ----------------------------------------------------------
# xdist hands each worker whole files (--dist loadfile), and one more file whenever it has two tests
# left. Its own order (most tests first) starts the heavy files of 1-5 tests (compiled steps, a server,
# the aiperf venv) last, so one worker ran on ~40 s after the other stopped (a run's 1489 test-seconds
# replayed through xdist's rule: 765 s for the later worker, against 744 longest first). `make test`
# passes --no-loadscope-reorder so that this order stands; file_seconds.json holds a cold run's
# seconds per file (NEMOSPEC_WRITE_FILE_SECONDS=FILE writes a run's), a file it lacks starts last.
FILE_SECONDS = Path(__file__).parent / "file_seconds.json"


def pytest_collection_modifyitems(session, config, items):
    import json
    try:
        seconds = json.loads(FILE_SECONDS.read_text())
    except (OSError, ValueError):   # an order only: without its table the suite runs as collected
        return
    items.sort(key=lambda item: -seconds.get(item.location[0], 0.0))   # stable: a file's own order kept


# --- where the suite's time goes, by test file (make test prints it beside --durations) -------------
_compile_seconds: dict = {}   # test file -> [seconds compiling or loading steps, steps compiled, loaded]
_file_seconds: dict = {}      # test file -> [seconds in setup/call/teardown, workers that ran it]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    steps = sys.modules.get("runtime.compiled.steps")
    before = len(steps.COMPILE_LOG) if steps else 0
    yield
    steps = sys.modules.get("runtime.compiled.steps")
    if steps is None:
        return
    row = _compile_seconds.setdefault(item.location[0], [0.0, 0, 0])
    if steps.COMPILE_LOG[before:] and os.environ.get("NEMOSPEC_TEST_COMPILE_LOG"):   # which test compiled what
        with open(os.environ["NEMOSPEC_TEST_COMPILE_LOG"], "a") as f:
            f.writelines(f"{item.nodeid}\t{entry}\n" for entry in steps.COMPILE_LOG[before:])
    for entry in steps.COMPILE_LOG[before:]:   # "compiled LABEL (S s)" / "loaded LABEL (S s)"
        row[0] += float(entry.rsplit("(", 1)[1].split()[0])
        row[1 if entry.startswith("compiled") else 2] += 1


def pytest_runtest_logreport(report):
    """Runs where the report arrives: in the controller for every worker's tests under xdist."""
    row = _file_seconds.setdefault(report.location[0], [0.0, set()])
    row[0] += report.duration
    node = getattr(report, "node", None)
    row[1].add(getattr(getattr(node, "gateway", None), "id", "main"))


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):   # an xdist worker: hand its compile table to the controller
        import json
        session.config.workeroutput["nemospec_compile_seconds"] = json.dumps(_compile_seconds)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    import json
    for path, (seconds, compiled, loaded) in json.loads(
            getattr(node, "workeroutput", {}).get("nemospec_compile_seconds", "{}")).items():
        row = _compile_seconds.setdefault(path, [0.0, 0, 0])
        row[0] += seconds
        row[1] += compiled
        row[2] += loaded


def pytest_terminal_summary(terminalreporter):
    rows = sorted(_file_seconds.items(), key=lambda kv: -kv[1][0])
    if not rows:
        return
    terminalreporter.section("slowest test files (seconds in their tests; of that, compiling or loading steps)")
    for path, (seconds, workers) in rows[:int(os.environ.get("NEMOSPEC_SLOW_FILES", "12"))]:
        compiled = _compile_seconds.get(path, [0.0, 0, 0])
        terminalreporter.write_line(f"{seconds:8.1f}s  {path} ({', '.join(sorted(workers))}): compiling "
                                    f"{compiled[0]:.1f}s, {compiled[1]} steps compiled, {compiled[2]} loaded")
    terminalreporter.write_line(f"{sum(r[0] for _, r in rows):8.1f}s  all {len(rows)} files; compiling "
                                f"{sum(r[0] for r in _compile_seconds.values()):.1f}s")
    if os.environ.get("NEMOSPEC_WRITE_FILE_SECONDS"):
        import json
        Path(os.environ["NEMOSPEC_WRITE_FILE_SECONDS"]).write_text(
            json.dumps({path: round(seconds, 1) for path, (seconds, _) in rows}, indent=0) + "\n")
