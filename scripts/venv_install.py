"""``pip install`` into a venv, done by uv where it can be: ``make setup`` took 28 s with uv (its
cache empty) against 53 s with pip on a new 2-core machine, the same packages at the same versions,
bytecode compiled as pip does.

uv reads none of pip's configuration, so this hands it pip's own, as pip itself parses it (its
files in its order, the ``PIP_*`` variables): the index, the extra indexes (every index as good as
another, as in pip), find-links, constraints, the certificate bundle and the timeout; uv's own
configuration (``uv.toml``, ``UV_*`` variables that change what it resolves) is left out. A setting
it does not translate, a uv that cannot be had, or a uv install that fails leaves the install to
pip, so the result is never worse than pip's own. Standard library only: it runs before the venv
holds anything but pip.

    python3 scripts/venv_install.py VENV [pip install arguments ...]
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

UV = "uv==0.13.8"
# pip's options (as pip names them once parsed) that uv is given as flags, one per value
_FLAGS = {"index_url": "--index-url", "extra_index_urls": "--extra-index-url", "find_links": "--find-links",
          "constraints": "--constraint"}
# options that change nothing uv would install
_HARMLESS = {"disable_pip_version_check", "quiet", "verbose", "no_input", "progress_bar", "no_color",
             "root_user_action", "require_venv", "cache_dir", "log", "cert", "timeout"}
# uv's own settings that may stay: where it caches and how hard it works, not what it resolves
_UV_KEPT = {"UV_CACHE_DIR", "UV_LINK_MODE", "UV_CONCURRENT_DOWNLOADS", "UV_CONCURRENT_BUILDS",
            "UV_CONCURRENT_INSTALLS", "UV_NO_PROGRESS"}

# pip's own parse of its configuration (files in pip's order, the PIP_* variables, multi-line and
# empty values as pip treats them), printed as the options that differ from pip's defaults
_PIP_OPTIONS = """
import json, optparse
from pip._internal.commands import create_command
command = create_command("install")
options, _ = command.parse_args([])
defaults = vars(optparse.OptionParser.get_default_values(command.parser))
print(json.dumps({k: v for k, v in vars(options).items() if v != defaults.get(k)}, default=str))
"""


def pip_settings(venv: Path) -> dict | None:
    """The ``pip install`` options pip's configuration sets in ``venv`` (pip's names and parsed values),
    or None when pip cannot say."""
    run = subprocess.run([str(venv / "bin" / "python"), "-c", _PIP_OPTIONS], capture_output=True, text=True)
    if run.returncode:
        return None
    try:
        return json.loads(run.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def uv_command(uv: Path, venv: Path, args: list[str], settings: dict) -> tuple[list[str], dict] | None:
    """uv's install command and environment for pip's ``settings``; None where one has no uv form."""
    if set(settings) - set(_FLAGS) - _HARMLESS:
        return None
    command = [str(uv), "pip", "install", "--no-config", "--python", str(venv / "bin" / "python"),
               "--compile-bytecode", "--index-strategy", "unsafe-best-match"]
    for key, flag in _FLAGS.items():
        values = settings.get(key) or []
        for value in [values] if isinstance(values, str) else values:
            command += [flag, value]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_") or k in _UV_KEPT}
    if settings.get("cert"):
        env["SSL_CERT_FILE"] = settings["cert"]
    if settings.get("timeout"):
        env["UV_HTTP_TIMEOUT"] = str(int(float(settings["timeout"])))
    return command + args, env


def install(venv: Path, args: list[str]) -> None:
    """``pip install ARGS`` into ``venv``, by uv where it can be (see the module's docstring)."""
    pip = venv / "bin" / "pip"
    settings = pip_settings(venv)
    planned = None if settings is None else uv_command(venv / "bin" / "uv", venv, args, settings)
    if planned is None:
        print("venv_install: pip's configuration has settings uv is not given; installing with pip", file=sys.stderr)
    elif subprocess.run([str(pip), "install", "--quiet", UV]).returncode == 0:
        command, env = planned
        if subprocess.run(command, env=env).returncode == 0:
            return
        print(f"venv_install: uv failed ({shlex.join(command[:3])} ...); installing with pip", file=sys.stderr)
    subprocess.run([str(pip), "install", *args], check=True)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__.rsplit("\n\n", 1)[1].strip())
    try:
        install(Path(sys.argv[1]), sys.argv[2:])
    except subprocess.CalledProcessError as e:
        sys.exit(f"venv_install: {shlex.join(e.cmd)} failed (exit {e.returncode})")
