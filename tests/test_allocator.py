"""runtime.allocator: model processes run on mimalloc, preloaded by one re-exec of the entry point."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from builder.errors import NemospecError
from runtime import allocator

REPO = Path(__file__).resolve().parents[1]
ACTIVE = "from runtime import allocator; allocator.reexec(); print(allocator.active())"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "NEMOSPEC_MALLOC", allocator._MARK)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return {**env, **extra}


def _active(**extra) -> str:
    run = subprocess.run([sys.executable, "-c", ACTIVE], capture_output=True, text=True, timeout=120, env=_env(**extra))
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_the_pinned_wheel_ships_the_library():
    lib = allocator.library()
    assert lib is not None and lib.name == "libmimalloc.so" and lib.is_file()


def test_preload_env_puts_mimalloc_first_and_keeps_other_preloads():
    lib = str(allocator.library())
    env = allocator.preload_env({"LD_PRELOAD": "/opt/x/libfoo.so:/opt/y/libbar.so", "PATH": "/bin"})
    assert env["LD_PRELOAD"].split() == [lib, "/opt/x/libfoo.so", "/opt/y/libbar.so"] and env["PATH"] == "/bin"
    assert allocator.preload_env(env)["LD_PRELOAD"] == env["LD_PRELOAD"]      # not twice
    assert allocator.preload_env({})["LD_PRELOAD"] == lib


def test_system_choice_leaves_the_environment_alone():
    env = {"NEMOSPEC_MALLOC": "system", "LD_PRELOAD": "/opt/x/libfoo.so"}
    assert allocator.preload_env(env) == env


def test_a_bad_choice_is_one_line_naming_the_variable():
    with pytest.raises(NemospecError, match=r"^NEMOSPEC_MALLOC: expected one of mimalloc, system, got 'jemalloc'$"):
        allocator.preload_env({"NEMOSPEC_MALLOC": "jemalloc"})


def test_reexec_runs_the_process_on_mimalloc_once():
    assert _active().startswith("mimalloc ")
    assert _active(NEMOSPEC_MALLOC="system") == "system"
    # the process reexec started never starts another, even when the preload did not take
    assert _active(**{allocator._MARK: "1"}) == "system"


def test_the_console_entry_preloads_and_refuses_a_bad_choice():
    exe = Path(sys.executable).parent / "nemospec"
    for entry in ([str(exe)], [sys.executable, "-m", "nemospec.cli"]):
        bad = subprocess.run([*entry, "generate", "--help"], capture_output=True, text=True, timeout=120,
                             env=_env(NEMOSPEC_MALLOC="tcmalloc"))
        assert bad.returncode == 2 and bad.stderr.strip() == (
            "error: NEMOSPEC_MALLOC: expected one of mimalloc, system, got 'tcmalloc'")
        # `build` keeps glibc's malloc (its memory estimate was measured on it): no re-exec, no check
        build = subprocess.run([*entry, "build", "--help"], capture_output=True, text=True, timeout=120,
                               env=_env(NEMOSPEC_MALLOC="tcmalloc"))
        assert build.returncode == 0, build.stderr


def test_generate_json_names_the_allocator(tmp_path):
    """`nemospec generate` of the embedded target reports the allocator it ran on."""
    import json
    exe = Path(sys.executable).parent / "nemospec"
    for choice, expect in (("mimalloc", "mimalloc "), ("system", "system")):
        run = subprocess.run([str(exe), "generate", "--input_ids", "5,6,7", "--max_new_tokens", "2", "--json"],
                             capture_output=True, text=True, timeout=300, env=_env(NEMOSPEC_MALLOC=choice))
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout.strip().splitlines()[-1])["allocator"].startswith(expect)


def test_tritonserver_gets_the_preload():
    from serving.tritonserver import Tritonserver, server_env
    env = server_env(Tritonserver(binary=Path("/bin/true")))
    assert env["LD_PRELOAD"].split()[0] == str(allocator.library())
