"""A peer's own venv, made once: real clients and peers that need numpy >= 2 (aiperf, llama.cpp's
Python binding and the gguf writer) cannot live in the project's venv beside Triton's Python stub."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

_INSTALL = Path(__file__).resolve().parents[1] / "scripts" / "venv_install.py"


def make_once(venv: Path, done: Path, installs: list[list[str]], what: str, env: dict | None = None) -> None:
    """Makes ``venv`` (``python3 -m venv``, then ``pip install`` of each argument list in
    ``installs``, by uv where it can be: scripts/venv_install.py) unless ``done`` exists; under a
    lock, since two test workers or a test and a benchmark may ask at once. ``done`` must be what
    the last install writes (or the caller writes after), so that its presence means a whole venv."""
    if done.is_file():
        return
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.is_file():
            return
        print(f"making {what} at {venv} ...", file=sys.stderr, flush=True)
        subprocess.run(["python3", "-m", "venv", "--clear", str(venv)], check=True)
        for args in installs:
            subprocess.run([sys.executable, str(_INSTALL), str(venv), "--quiet", *args], check=True,
                           env={**os.environ, **(env or {})})
