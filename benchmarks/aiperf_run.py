"""NVIDIA aiperf against the OpenAI-compatible frontend, from its own venv (aiperf pulls numpy >= 2,
which the project's venv cannot hold beside Triton's Python stub).

``ensure_venv`` makes the venv once (``python3 -m venv`` + ``pip install aiperf==0.13.0`` from the
configured package index; nothing is fetched at run time after that); ``profile`` runs one
``aiperf profile`` and returns the numbers of its ``profile_export_aiperf.json``, the speculation
figures included (``speculation``, ``None`` when aiperf found no per-request spec-decode payload).

aiperf reads speculation from vLLM's per-request payload (``metrics.speculative_decoding`` on the
last streamed chunk; the frontend sends it, see ``serving.openai.protocol.speculative_metrics``) and
exports, per request averaged over requests, ``spec_decode_acceptance_length`` (``1 + accepted /
steps`` of each request) and ``spec_decode_draft_acceptance_rate`` (percent), and over the whole run
``spec_decode_token_weighted_acceptance_length`` (``1 + sum(accepted) / sum(steps)``: what the
server's ``nemospec_mean_accepted_tokens`` measures), ``spec_decode_overall_draft_acceptance_rate``
(percent), ``total_spec_decode_steps``, ``total_accepted_draft_tokens``, ``total_draft_tokens`` and
``pooled_spec_decode_acceptance_histogram`` ({accepted drafts j: steps}).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from own_venv import make_once  # noqa: E402

AIPERF = "aiperf==0.13.0"


def ensure_venv(venv: Path) -> Path:
    """aiperf's binary in ``venv``, made there first if missing (its presence means done)."""
    venv = Path(venv)
    binary = venv / "bin" / "aiperf"
    if not binary.is_file():
        make_once(venv, binary, [[AIPERF]], f"the aiperf venv ({AIPERF})")
        # torchvision / torchaudio, if pulled in, break beside the CPU torch wheel
        subprocess.run([str(venv / "bin" / "pip"), "uninstall", "--quiet", "-y", "torchvision", "torchaudio"],
                       check=False, capture_output=True)
    return binary


def _metric(data: dict, name: str, stat: str = "avg"):
    value = data.get(name)
    if isinstance(value, dict):
        return value.get(stat)
    return value


def speculation(data: dict) -> dict | None:
    """The spec-decode figures of an aiperf export (None when it has none)."""
    records = data.get("records", data)
    if _metric(records, "spec_decode_token_weighted_acceptance_length") is None:
        return None
    histogram = data.get("pooled_spec_decode_acceptance_histogram") or {}

    def fraction(name):   # aiperf exports rates in percent
        value = _metric(records, name)
        return None if value is None else value / 100

    return {"mean_acceptance_length": _metric(records, "spec_decode_token_weighted_acceptance_length"),
            "mean_acceptance_length_per_request": _metric(records, "spec_decode_acceptance_length"),
            "draft_acceptance_rate": fraction("spec_decode_overall_draft_acceptance_rate"),
            "draft_acceptance_rate_per_request": fraction("spec_decode_draft_acceptance_rate"),
            "steps": _metric(records, "total_spec_decode_steps"),
            "accepted_draft_tokens": _metric(records, "total_accepted_draft_tokens"),
            "draft_tokens": _metric(records, "total_draft_tokens"),
            "histogram": {int(j): int(n) for j, n in sorted(histogram.items(), key=lambda kv: int(kv[0]))}}


def profile(binary: Path, url: str, model: str, tokenizer: Path, concurrency: int, requests: int,
            input_tokens: int, output_tokens: int, artifact_dir: Path, endpoint: str = "chat",
            extra_args=(), timeout: float = 1800) -> dict:
    """One ``aiperf profile`` run (streaming). ``tokenizer``: a directory, made absolute (aiperf takes
    a relative path for a hub repo id); ``extra_args``: more aiperf flags."""
    artifact_dir.mkdir(parents=True, exist_ok=True)
    cmd = [str(binary), "profile", "-m", model, "--url", url, "--endpoint-type", endpoint, "--streaming",
           "--tokenizer", str(Path(tokenizer).resolve()), "--concurrency", str(concurrency), "--request-count", str(requests),
           "--synthetic-input-tokens-mean", str(input_tokens), "--output-tokens-mean", str(output_tokens),
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"max_tokens:{output_tokens}",
           "--artifact-dir", str(artifact_dir), *extra_args]
    # (no HF_HUB_OFFLINE: aiperf 0.13 then looks a local tokenizer directory up in the hub cache)
    # its dataset's memory-mapped files among the artifacts: by default a directory per run in the
    # temporary directory, left behind (empty) by every run
    env = {**os.environ, "AIPERF_DATASET_MMAP_BASE_PATH": str((artifact_dir / "dataset_mmap").resolve())}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    found = sorted(artifact_dir.rglob("profile_export_aiperf.json"))
    if done.returncode or not found:
        raise RuntimeError(f"aiperf failed ({done.returncode}): {done.stderr[-2000:] or done.stdout[-2000:]}")
    data = json.loads(found[-1].read_text())
    records = data.get("records", data)
    errors = data.get("error_summary") or []
    return {"concurrency": concurrency, "requests": requests,
            "output_tokens_per_s": _metric(records, "output_token_throughput"),
            "requests_per_s": _metric(records, "request_throughput"),
            "ttft_ms_p50": _metric(records, "time_to_first_token", "p50"),
            "itl_ms_p50": _metric(records, "inter_token_latency", "p50"),
            "errors": sum(int(e.get("count", 1)) for e in errors) if isinstance(errors, list) else errors,
            "speculation": speculation(data), "export": str(found[-1])}
