"""pyproject.toml's package data covers every file a package needs that is not Python: a
non-editable install (a wheel) carries only what the globs name, and a kernel source or a shipped
checkpoint left out breaks that install while the editable checkout keeps working."""
import fnmatch
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _package_roots() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [p.rstrip("*") for p in config["tool"]["setuptools"]["packages"]["find"]["include"]]


def _package_files() -> list[str]:
    """Tracked files under the packages setuptools finds, other than Python sources."""
    tracked = subprocess.run(["git", "ls-files", *_package_roots()], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    return [f for f in tracked if not f.endswith(".py")]


def _covered(path: str, package_data: dict) -> bool:
    """Whether a glob of the deepest package holding ``path`` names it (setuptools' rule)."""
    for package, globs in package_data.items():
        prefix = package.replace(".", "/") + "/"
        if path.startswith(prefix) and any(fnmatch.fnmatch(path[len(prefix):], g) for g in globs):
            return True
    return False


def test_every_non_python_package_file_is_package_data():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    files = _package_files()
    assert any(f.endswith("small_linear.cpp") for f in files), files   # the check sees the kernel sources
    missing = [f for f in files if not _covered(f, package_data)]
    assert not missing, f"pyproject.toml [tool.setuptools.package-data] leaves out: {missing}"


def test_a_glob_of_another_package_does_not_count():
    """The check's own rule: a glob is relative to its package's directory."""
    assert _covered("runtime/compiled/kernels/a.cpp", {"runtime.compiled": ["kernels/*.cpp"]})
    assert not _covered("runtime/compiled/kernels/a.cpp", {"runtime": ["kernels/*.cpp"]})


def test_the_image_copies_every_package_and_takes_its_pins_from_pyproject():
    """docker/Dockerfile had copied four of the six packages (`nemospec serve --help`, its own build
    check, failed on the missing `nemospec`) and repeated pins that had drifted from pyproject.toml."""
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    ignore = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().split()
    copied = {line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ")}
    for root in _package_roots() + ["model_repo"]:
        assert root in copied, f"docker/Dockerfile does not COPY {root}/"
        assert f"!{root}/**" in ignore, f"docker/Dockerfile.dockerignore leaves out {root}/"
    install = [line for line in dockerfile.splitlines() if "pip install" in line and "==" in line]
    assert all("TENSORRT_VERSION" in line for line in install), install    # nothing pinned twice
    assert "tomllib.load(open('pyproject.toml'" in dockerfile
