"""NVIDIA aiperf against the OpenAI-compatible frontend, from its own venv (aiperf pulls numpy >= 2,
which the project's venv cannot hold beside Triton's Python stub).

``ensure_venv`` makes the venv once (``python3 -m venv`` + ``pip install aiperf==0.13.0`` from the
configured package index; nothing is fetched at run time after that); ``profile`` runs one
``aiperf profile`` and returns the numbers of its ``profile_export_aiperf.json``.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

AIPERF = "aiperf==0.13.0"


def ensure_venv(venv: Path) -> Path:
    binary = venv / "bin" / "aiperf"
    if binary.is_file():
        return binary
    print(f"making the aiperf venv at {venv} ({AIPERF}) ...", file=sys.stderr)
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", AIPERF], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "uninstall", "--quiet", "-y", "torchvision", "torchaudio"], check=False)
    return binary


def _metric(data: dict, name: str, stat: str = "avg"):
    value = data.get(name)
    if isinstance(value, dict):
        return value.get(stat)
    return value


def profile(binary: Path, url: str, model: str, tokenizer: Path, concurrency: int, requests: int,
            input_tokens: int, output_tokens: int, artifact_dir: Path, endpoint: str = "chat") -> dict:
    artifact_dir.mkdir(parents=True, exist_ok=True)
    cmd = [str(binary), "profile", "-m", model, "--url", url, "--endpoint-type", endpoint, "--streaming",
           "--tokenizer", str(tokenizer), "--concurrency", str(concurrency), "--request-count", str(requests),
           "--synthetic-input-tokens-mean", str(input_tokens), "--output-tokens-mean", str(output_tokens),
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"max_tokens:{output_tokens}",
           "--artifact-dir", str(artifact_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
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
            "errors": sum(int(e.get("count", 1)) for e in errors) if isinstance(errors, list) else errors}
