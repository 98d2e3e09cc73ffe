"""Finding ``tritonserver`` and what it needs to run: a ``tritonserver`` on PATH where a GPU is
present (the NGC image's), else the binary inside the ``nvidia-pytriton`` wheel with a python backend
directory assembled from the wheel's backend and the stub for this Python, and the environment the
stub needs (this interpreter first on PATH, the checkout on PYTHONPATH, the wheel's libraries)."""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from builder.errors import NemospecError
from runtime import allocator
from serving.repository import ROOT


@dataclass
class Tritonserver:
    binary: Path
    backend_dir: Path | None = None      # python backend to assemble (wheel); None: the binary's default
    stub: Path | None = None
    libs: Path | None = None             # LD_LIBRARY_PATH addition (the wheel's bundled libraries)
    source: str = "PATH"


def gpu_present() -> bool:
    return Path("/dev/nvidiactl").exists()


def _wheel_tritonserver() -> Tritonserver | None:
    try:
        import pytriton
    except ImportError:
        return None
    base = Path(pytriton.__file__).parent / "tritonserver"
    stub = base / "python_backend_stubs" / f"{sys.version_info[0]}.{sys.version_info[1]}" / "triton_python_backend_stub"
    binary = base / "bin" / "tritonserver"
    if not (binary.is_file() and stub.is_file()):
        return None
    return Tritonserver(binary, base / "backends" / "python", stub, base.parent.parent / "nvidia_pytriton.libs",
                        "nvidia-pytriton wheel")


def find_tritonserver() -> Tritonserver:
    """``NEMOSPEC_TRITONSERVER`` if set; on a GPU machine a ``tritonserver`` on PATH (the NGC image);
    otherwise the nvidia-pytriton wheel's binary (CPU-only machines), else PATH."""
    forced = os.environ.get("NEMOSPEC_TRITONSERVER")
    if forced:
        if not Path(forced).is_file():
            raise NemospecError(f"NEMOSPEC_TRITONSERVER: {forced} is not a file")
        return Tritonserver(Path(forced), source="NEMOSPEC_TRITONSERVER")
    on_path = shutil.which("tritonserver")
    wheel = _wheel_tritonserver()
    if on_path and (gpu_present() or wheel is None):
        return Tritonserver(Path(on_path))
    if wheel is not None:
        return wheel
    raise NemospecError("tritonserver not found: install the nvidia-pytriton wheel (`pip install nvidia-pytriton==0.7.0`, "
                        "CPU-only machines) or run inside the NGC Triton image (docker/Dockerfile)")


def assemble_backends(server: Tritonserver, run_dir: Path) -> Path | None:
    """The wheel's python backend + the stub for this Python, in one backend directory."""
    if server.backend_dir is None:
        return None
    target = run_dir / "backends" / "python"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(server.backend_dir, target, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(server.stub, target / "triton_python_backend_stub")
    return target.parent

def server_env(server: Tritonserver) -> dict:
    env = allocator.preload_env()   # the stubs that run the models allocate through mimalloc
    # the python backend stub starts the interpreter found first on PATH: this one (and its venv)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUTF8", "1")   # the stubs' interpreter starts in an ASCII locale; inductor reads UTF-8 templates
    libs = [str(server.libs)] if server.libs else []
    libdir = sysconfig_libdir()
    if libdir and server.libs:
        libs.append(libdir)
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    return env


def sysconfig_libdir() -> str | None:
    """This interpreter's shared libpython directory, for a stub that links it (None if not shared)."""
    import sysconfig
    libdir = sysconfig.get_config_var("LIBDIR")
    if libdir and sysconfig.get_config_var("Py_ENABLE_SHARED") and Path(libdir).is_dir():
        return libdir
    return None


