"""scripts/venv_install.py: uv is given pip's configuration as pip reads it, and pip installs
whatever uv cannot (a venv of stand-in pip and uv scripts that log their arguments)."""
import importlib.util
import shlex
import stat
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "venv_install", Path(__file__).resolve().parents[1] / "scripts" / "venv_install.py")
venv_install = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(venv_install)


def _fake_venv(tmp_path, config: str, uv_exit: int) -> Path:
    """A venv whose pip prints ``config`` for ``config list``, installs a uv that exits ``uv_exit``,
    and logs every call; the uv logs its own."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "log"
    uv = f"#!/bin/sh\necho \"uv $*\" >> {log}\nexit {uv_exit}\n"
    pip = (f"#!/bin/sh\necho \"pip $*\" >> {log}\n"
           f"if [ \"$1\" = config ]; then printf '%s\\n' {shlex.quote(config)}; exit 0; fi\n"
           f"if [ \"$3\" = {venv_install.UV} ]; then printf '%s' {shlex.quote(uv)} > {venv}/bin/uv; "
           f"chmod +x {venv}/bin/uv; fi\n")
    (venv / "bin" / "pip").write_text(pip)
    (venv / "bin" / "pip").chmod(stat.S_IRWXU)
    return venv


def _log(tmp_path) -> list[str]:
    return (tmp_path / "log").read_text().splitlines()


def test_pip_settings_override_as_pip_applies_them(tmp_path):
    config = ("global.find-links='/opt/a'\ninstall.find-links='/opt/b'\n:env:.default-timeout='180'\n"
              "global.extra-index-url='file:///x/simple file:///y/simple'\n:env:.find-links='/opt/c'\n"
              "global.index-url='https://mirror/simple'")
    venv = _fake_venv(tmp_path, config, 0)
    settings = venv_install.pip_settings(venv / "bin" / "pip")
    assert settings == {"find-links": "/opt/c", "default-timeout": "180", "index-url": "https://mirror/simple",
                        "extra-index-url": "file:///x/simple file:///y/simple"}


def test_uv_gets_every_index_constraint_and_the_certificate(tmp_path):
    venv = tmp_path / "venv"
    settings = {"index-url": "https://mirror/simple", "extra-index-url": "file:///x/simple file:///y/simple",
                "find-links": "/opt/wheels", "constraint": "/etc/c.txt", "cert": "/etc/ca.pem",
                "disable-pip-version-check": "1"}
    command, env = venv_install.uv_command(Path("uv"), venv, ["-e", ".[dev]"], settings)
    assert command[:4] == ["uv", "pip", "install", "--python"] and command[-2:] == ["-e", ".[dev]"]
    assert {"--compile-bytecode", "unsafe-best-match"} <= set(command)
    pairs = list(zip(command, command[1:]))
    for pair in [("--index-url", "https://mirror/simple"), ("--extra-index-url", "file:///x/simple"),
                 ("--extra-index-url", "file:///y/simple"), ("--find-links", "/opt/wheels"),
                 ("--constraint", "/etc/c.txt")]:
        assert pair in pairs
    assert env["SSL_CERT_FILE"] == "/etc/ca.pem"


def test_a_setting_uv_is_not_given_leaves_the_install_to_pip(tmp_path, capsys):
    venv = _fake_venv(tmp_path, "global.trusted-host='mirror'", 0)
    venv_install.install(venv, ["--quiet", "pkg==1"])
    assert not any(line.startswith("uv ") for line in _log(tmp_path))
    assert _log(tmp_path)[-1] == "pip install --quiet pkg==1"
    assert "installing with pip" in capsys.readouterr().err


@pytest.mark.parametrize("uv_exit", [0, 1])
def test_uv_installs_and_pip_takes_over_when_it_fails(tmp_path, uv_exit):
    venv = _fake_venv(tmp_path, "global.find-links='/opt/wheels'", uv_exit)
    venv_install.install(venv, ["--quiet", "pkg==1"])
    log = _log(tmp_path)
    uv = [line for line in log if line.startswith("uv ")]
    assert len(uv) == 1 and uv[0].endswith("--find-links /opt/wheels --quiet pkg==1"), log
    assert (log[-1] == "pip install --quiet pkg==1") == bool(uv_exit), log
