"""``pip install`` into a venv, done by uv where it can be: pip took 49 s to install the project's
dependencies on a fresh 2-core machine and uv 14 s (bytecode compiled as pip does), the same
packages at the same versions.

uv reads none of pip's configuration, so this hands it pip's own (``pip config list``: the files
and the ``PIP_*`` variables), as pip would read it: the index, the extra indexes (every index as
good as another, as in pip), find-links, constraints and the certificate bundle. A setting it does
not translate, a uv that cannot be had, or a uv install that fails leaves the install to pip, so
the result is never worse than pip's own. Standard library only: it runs before the venv holds
anything.

    python3 scripts/venv_install.py VENV [pip install arguments ...]
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

UV = "uv==0.13.8"
# pip's settings (``section.key``) uv is given, as uv's flag; a section is ``global`` or ``install``
_FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
          "constraint": "--constraint"}
_HARMLESS = {"cert", "default-timeout", "disable-pip-version-check", "timeout", "no-cache-dir", "progress-bar",
             "quiet", "verbose", "no-input", "root-user-action", "require-virtualenv"}
_SECTIONS = ("global", "install", ":env:")   # pip's order for ``install``: a later one overrides


def pip_settings(pip: Path) -> dict | None:
    """pip's effective settings for ``pip install`` (key -> value), or None when ``pip config list``
    fails. Its lines are ``section.key='value'`` in the order pip loads its files; pip applies the
    ``global`` section, then ``install``, then the ``PIP_*`` variables (``:env:``)."""
    run = subprocess.run([str(pip), "config", "list"], capture_output=True, text=True)
    if run.returncode:
        return None
    found = []   # (section rank, key, value), in pip's order within a section
    for line in run.stdout.splitlines():
        name, _, value = line.partition("=")
        section, _, key = name.partition(".")
        if section in _SECTIONS:
            found.append((_SECTIONS.index(section), key, value.strip().strip("'\"")))
    return {key: value for _, key, value in sorted(found, key=lambda f: f[0])}


def uv_command(uv: Path, venv: Path, args: list[str], settings: dict) -> tuple[list[str], dict] | None:
    """uv's install command and environment for pip's ``settings``; None where one has no uv form."""
    unknown = set(settings) - set(_FLAGS) - _HARMLESS
    if unknown:
        return None
    command = [str(uv), "pip", "install", "--python", str(venv / "bin" / "python"), "--compile-bytecode",
               "--index-strategy", "unsafe-best-match"]
    for key, flag in _FLAGS.items():
        for value in settings.get(key, "").split():
            command += [flag, value]
    env = dict(os.environ)
    if settings.get("cert"):
        env["SSL_CERT_FILE"] = settings["cert"]
    return command + args, env


def install(venv: Path, args: list[str]) -> None:
    """``pip install ARGS`` into ``venv``, by uv where it can be (see the module's docstring)."""
    pip = venv / "bin" / "pip"
    settings = pip_settings(pip)
    if settings is not None and subprocess.run([str(pip), "install", "--quiet", UV]).returncode == 0:
        planned = uv_command(venv / "bin" / "uv", venv, args, settings)
        if planned is None:
            print("venv_install: pip's configuration has settings uv is not given; installing with pip",
                  file=sys.stderr)
        else:
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
