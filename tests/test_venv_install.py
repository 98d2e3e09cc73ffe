"""scripts/venv_install.py: uv is given pip's configuration as pip itself parses it (the project's own
pip is the oracle), uv's own configuration is left out, and pip installs whatever uv cannot (a venv
of stand-in python, pip and uv scripts that log their arguments)."""
import importlib.util
import json
import os
import shlex
import stat
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "venv_install", Path(__file__).resolve().parents[1] / "scripts" / "venv_install.py")
venv_install = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(venv_install)


def test_pip_settings_are_pips_own_parse_of_its_files_and_variables(tmp_path, monkeypatch):
    """A config file with a multi-line value, an empty variable (pip ignores it) and variables that
    override the file, read through this venv's real pip."""
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nfind-links =\n    /opt/a\n    /opt/b\nindex-url = https://file.example/simple\n"
                      "[install]\nconstraint = /etc/c.txt\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "https://env.example/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///x/simple file:///y/simple")
    monkeypatch.setenv("PIP_TRUSTED_HOST", "")
    settings = venv_install.pip_settings(Path(sys.prefix))
    assert settings["find_links"] == ["/opt/a", "/opt/b"]
    assert settings["index_url"] == "https://env.example/simple"
    assert settings["extra_index_urls"] == ["file:///x/simple", "file:///y/simple"]
    assert "/etc/c.txt" in settings["constraints"] and "trusted_hosts" not in settings


def test_uv_gets_every_index_constraint_and_the_certificate_and_none_of_its_own_settings(monkeypatch):
    monkeypatch.setenv("UV_INDEX_URL", "https://elsewhere/simple")
    monkeypatch.setenv("UV_CACHE_DIR", "/tmp/uv-cache")
    settings = {"index_url": "https://mirror/simple", "extra_index_urls": ["file:///x/simple", "file:///y/simple"],
                "find_links": ["/opt/wheels"], "constraints": ["/etc/c.txt"], "cert": "/etc/ca.pem", "timeout": 180.0,
                "disable_pip_version_check": 1}
    command, env = venv_install.uv_command(Path("uv"), Path("venv"), ["-e", ".[dev]"], settings)
    assert command[:4] == ["uv", "pip", "install", "--no-config"] and command[-2:] == ["-e", ".[dev]"]
    assert {"--compile-bytecode", "unsafe-best-match"} <= set(command)
    pairs = list(zip(command, command[1:]))
    for pair in [("--index-url", "https://mirror/simple"), ("--extra-index-url", "file:///x/simple"),
                 ("--extra-index-url", "file:///y/simple"), ("--find-links", "/opt/wheels"),
                 ("--constraint", "/etc/c.txt")]:
        assert pair in pairs
    assert env["SSL_CERT_FILE"] == "/etc/ca.pem" and env["UV_HTTP_TIMEOUT"] == "180"
    assert "UV_INDEX_URL" not in env and env["UV_CACHE_DIR"] == "/tmp/uv-cache"


def _fake_venv(tmp_path, settings: dict, uv_exit: int) -> Path:
    """A venv whose python prints ``settings`` as pip's parse, whose pip installs a uv that exits
    ``uv_exit``, each logging its calls."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "log"
    uv = f"#!/bin/sh\necho \"uv $*\" >> {log}\nexit {uv_exit}\n"
    scripts = {
        "python": f"#!/bin/sh\necho {shlex.quote(json.dumps(settings))}\n",
        "pip": (f"#!/bin/sh\necho \"pip $*\" >> {log}\n"
                f"if [ \"$3\" = {venv_install.UV} ]; then printf '%s' {shlex.quote(uv)} > {venv}/bin/uv; "
                f"chmod +x {venv}/bin/uv; fi\n")}
    for name, text in scripts.items():
        (venv / "bin" / name).write_text(text)
        os.chmod(venv / "bin" / name, stat.S_IRWXU)
    return venv


def _log(tmp_path) -> list[str]:
    return (tmp_path / "log").read_text().splitlines()


def test_a_setting_uv_is_not_given_leaves_the_install_to_pip(tmp_path, capsys):
    venv = _fake_venv(tmp_path, {"trusted_hosts": ["mirror"]}, 0)
    venv_install.install(venv, ["--quiet", "pkg==1"])
    assert _log(tmp_path) == ["pip install --quiet pkg==1"]    # uv not even installed
    assert "installing with pip" in capsys.readouterr().err


@pytest.mark.parametrize("uv_exit", [0, 1])
def test_uv_installs_and_pip_takes_over_when_it_fails(tmp_path, uv_exit):
    venv = _fake_venv(tmp_path, {"find_links": ["/opt/wheels"]}, uv_exit)
    venv_install.install(venv, ["--quiet", "pkg==1"])
    log = _log(tmp_path)
    uv = [line for line in log if line.startswith("uv ")]
    assert len(uv) == 1 and uv[0].endswith("--find-links /opt/wheels --quiet pkg==1"), log
    assert (log[-1] == "pip install --quiet pkg==1") == bool(uv_exit), log
