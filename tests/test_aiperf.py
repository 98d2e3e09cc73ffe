"""NVIDIA aiperf 0.13.0, the real one from its own venv, against the OpenAI frontend of a real
tritonserver serving the embedded trained model (eagle3 draft, torch backend): aiperf's export has
the speculation section, read from the vLLM-shaped per-request payload the frontend sends, and its
acceptance figures are the server's own.

What is compared. aiperf keeps one acceptance record per request and exports two mean acceptance
lengths: ``spec_decode_acceptance_length`` averages each request's ``1 + accepted / steps`` (every
request weighs the same) and ``spec_decode_token_weighted_acceptance_length`` is ``1 + sum(accepted) /
sum(steps)`` over the run (every verify step weighs the same). The server's own
``nemospec_mean_accepted_tokens`` is tokens gained (accepted drafts + the bonus token) per verify row
since it started: verify steps weigh the same, so it is the token-weighted figure, and with aiperf's
requests the only traffic the server has seen the two agree within the rounding of the metrics text.
The per-request mean has no server-side counterpart (the server keeps no per-request means): it is
only checked to lie between 1 and K + 1. Under both, the totals must agree exactly: verify steps, accepted and proposed draft tokens, and aiperf's pooled
histogram against the server's per-position acceptance counters.

The venv is made on first use by ``benchmarks/aiperf_run.py``'s ``ensure_venv`` (``pip install
aiperf==0.13.0`` from the configured package index) under ``~/.cache/nemospec/aiperf-venv-0.13.0`` (beside the compile cache, so a fresh clone reuses it; the
``NEMOSPEC_AIPERF_VENV`` environment variable overrides) and kept for later runs; the test fails
when it cannot be made.
"""
import importlib.util
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from builder import embedded
from builder.engine import BuildOptions, build
from serving import launch
from serving.openai.server import OpenAIFrontend
from serving_helpers import NEEDS_TRITON, free_ports, metric

pytestmark = NEEDS_TRITON

ROOT = Path(__file__).resolve().parents[1]
K = 3
OPTIONS = dict(max_batch_size=4, max_input_len=96, max_seq_len=192, max_draft_len=K)
CONCURRENCY, REQUESTS, INPUT_TOKENS, OUTPUT_TOKENS = 2, 6, 24, 24


def _aiperf_run():
    spec = importlib.util.spec_from_file_location("aiperf_run", ROOT / "benchmarks" / "aiperf_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def aiperf():
    """(the aiperf_run module, aiperf's binary in its own venv)."""
    module = _aiperf_run()
    venv = Path(os.environ.get("NEMOSPEC_AIPERF_VENV") or Path.home() / ".cache" / "nemospec" / "aiperf-venv-0.13.0")
    try:
        return module, module.ensure_venv(venv)
    except (subprocess.CalledProcessError, OSError) as e:
        # the package index make setup installs from serves aiperf too: a venv that cannot be made is a
        # broken environment to fix, not a machine that cannot run the test
        pytest.fail(f"aiperf's venv could not be made at {venv}: {e}")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("aiperf")
    build(embedded.target_dir(), root / "engine", BuildOptions(**OPTIONS, speculative_decoding_mode="eagle3"),
          log=lambda m: None, draft_dir=embedded.draft_dir("eagle3"))
    return root / "engine"


@pytest.fixture(scope="module")
def stack(engine):
    for attempt in range(3):  # a port picked free may be taken by another process before the server binds it
        try:
            handle = launch.start_server(engine, **free_ports(), backend="torch", max_queue=16, ready_timeout=300)
            break
        except Exception as e:
            if "already in use" not in str(e) or attempt == 2:
                raise
    try:
        frontend = OpenAIFrontend(engine, handle.grpc_url, port=0, metrics_url=handle.metrics_url).start()
    except BaseException:
        handle.stop()
        raise
    try:
        yield handle, frontend
    finally:
        frontend.stop()
        handle.stop()


COUNTERS = {"rows": "nemospec_verify_rows_total", "gained": "nemospec_accepted_tokens_total",
            "steps": "nemospec_spec_decode_num_drafts_total",
            "accepted": "nemospec_spec_decode_num_accepted_tokens_total",
            "drafts": "nemospec_spec_decode_num_draft_tokens_total"}


def _server_figures(server, requests: int = REQUESTS) -> dict:
    """The server's own figures once ``requests`` are counted as completed (the model publishes its
    metrics every 0.1 s)."""
    deadline = time.monotonic() + 15
    while True:
        done = metric(server, "nemospec_requests_total", outcome="completed")
        figures = {key: metric(server, name) for key, name in COUNTERS.items()}
        if done >= requests and figures == {key: metric(server, name) for key, name in COUNTERS.items()}:
            break
        assert time.monotonic() < deadline, f"{done} of {requests} requests counted as completed"
        time.sleep(0.3)
    figures["completed"] = done
    figures["received"] = metric(server, "nemospec_requests_received_total")
    figures["mean_accepted_tokens"] = metric(server, "nemospec_mean_accepted_tokens")
    figures["per_position"] = [metric(server, "nemospec_spec_decode_num_accepted_tokens_per_pos_total",
                                      position=str(j)) for j in range(K)]
    return figures


def test_aiperf_reports_the_servers_acceptance(aiperf, stack, engine, tmp_path):
    module, binary = aiperf
    server, frontend = stack
    assert metric(server, "nemospec_verify_rows_total") == 0, "aiperf's requests are the server's first"
    result = module.profile(binary, frontend.url.removesuffix("/v1"), frontend.info.name, engine, CONCURRENCY,
                            REQUESTS, INPUT_TOKENS, OUTPUT_TOKENS, tmp_path / "artifacts",
                            extra_args=["--ui-type", "none", "--random-seed", "0", "--workers-max", "1"],
                            timeout=240)
    assert result["errors"] == 0, result
    # its dataset's files among the artifacts (each run left a directory in the temporary directory)
    assert list((tmp_path / "artifacts" / "dataset_mmap").glob("aiperf_mmap_*")), "aiperf's dataset files elsewhere"
    spec = result["speculation"]
    assert spec is not None, f"no speculation section in aiperf's export {result['export']}"
    served = _server_figures(server)
    assert served["received"] == served["completed"] == REQUESTS, served

    # the same verify steps and draft tokens on both sides of the wire, exactly
    assert served["rows"] == served["steps"] == spec["steps"] > 0, (served, spec)
    assert served["accepted"] == spec["accepted_draft_tokens"] and served["drafts"] == spec["draft_tokens"], (served, spec)
    assert served["gained"] == served["rows"] + served["accepted"]
    histogram = spec["histogram"]
    assert set(histogram) <= set(range(K + 1)) and sum(histogram.values()) == spec["steps"], histogram
    # the server counts, per draft position j, the verify rows that accepted it: j + 1 drafts or more
    assert served["per_position"] == [sum(n for i, n in histogram.items() if i > j) for j in range(K)], (served, histogram)

    # the mean acceptance length: aiperf's token-weighted figure is the server's own metric
    assert spec["accepted_draft_tokens"] > 0, "the trained draft is accepted sometimes"
    assert spec["mean_acceptance_length"] == pytest.approx(served["mean_accepted_tokens"], abs=1e-4), (spec, served)
    assert spec["mean_acceptance_length"] == pytest.approx(served["gained"] / served["rows"], rel=1e-9)
    assert spec["draft_acceptance_rate"] == pytest.approx(served["accepted"] / served["drafts"], rel=1e-9)
    assert 1 <= spec["mean_acceptance_length_per_request"] <= K + 1, spec
    print(f"\naiperf: {spec}\nserver: {served}")


def _vllm_metrics(frontend) -> dict:
    """The frontend's /metrics as vLLM's clients read it: {(sample name, position): value}."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(frontend.url.removesuffix("/v1") + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                assert sample.labels.get("model_name") == frontend.info.name, sample
                out[sample.name, sample.labels.get("position")] = sample.value
    return out


def test_aiperf_reads_vllms_metrics_on_the_openai_port(aiperf, stack, engine, tmp_path):
    """aiperf scrapes <its --url>/metrics, as vLLM serves it: its export holds vLLM's speculative
    families there, with the server's own counts (a 404 before)."""
    module, binary = aiperf
    server, frontend = stack
    before = _server_figures(server, requests=0)
    module.profile(binary, frontend.url.removesuffix("/v1"), frontend.info.name, engine, CONCURRENCY, 2,
                   INPUT_TOKENS, OUTPUT_TOKENS, tmp_path / "artifacts",
                   extra_args=["--ui-type", "none", "--random-seed", "1", "--workers-max", "1"], timeout=240)
    served = _server_figures(server, requests=before["completed"] + 2)
    scraped = _vllm_metrics(frontend)
    assert scraped["vllm:spec_decode_num_drafts_total", None] == served["steps"] > before["steps"], (scraped, served)
    assert scraped["vllm:spec_decode_num_accepted_tokens_total", None] == served["accepted"]
    assert scraped["vllm:spec_decode_num_draft_tokens_total", None] == served["drafts"]
    assert [scraped["vllm:spec_decode_num_accepted_tokens_per_pos_total", str(j)] for j in range(K)] == served["per_position"]
    assert scraped["vllm:num_requests_running", None] == 0 and scraped["vllm:e2e_request_latency_seconds_count", None] == served["completed"]
    # aiperf's own export: each counter's growth over its run (its last scrape waits 2 s for the server's
    # metrics to settle; ours publish every 0.1 s), from which it reads vLLM's acceptance
    export = json.loads(next((tmp_path / "artifacts").rglob("server_metrics_export.json")).read_text())["metrics"]
    grown = {name: sum(s["stats"]["total"] for s in export[name]["series"])
             for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                          "vllm:spec_decode_num_draft_tokens")}
    assert grown == {"vllm:spec_decode_num_drafts": served["steps"] - before["steps"],
                     "vllm:spec_decode_num_accepted_tokens": served["accepted"] - before["accepted"],
                     "vllm:spec_decode_num_draft_tokens": served["drafts"] - before["drafts"]}, (grown, served, before)
