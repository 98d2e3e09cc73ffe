"""scripts/gpu_check.py: the probe (--dry_run) runs here; the GPU sections skip without a CUDA device.
The GPU image has no TensorRT: the project's runtime modules must import without it."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK_TENSORRT = """
import importlib.abc, runpy, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('tensorrt', 'tensorrt_rtx'):
            raise ImportError('no TensorRT on this image: ' + name)
sys.meta_path.insert(0, Block())
sys.argv = ['scripts/gpu_check.py'] + sys.argv[1:]
runpy.run_path('scripts/gpu_check.py', run_name='__main__')
"""


def _run(tmp_path, *args, code=None):
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "scripts/gpu_check.py", *args]
    run = subprocess.run(cmd + ["--output", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(out.read_text())


def test_dry_run_probes_versions_and_imports(tmp_path):
    report = _run(tmp_path, "--dry_run")
    probe = report["probe"]
    assert report["dry_run"] is True and "embedded_model" not in report
    assert probe["python"] == ".".join(map(str, sys.version_info[:3]))
    import torch
    assert probe["torch"] == {"available": True, "version": torch.__version__}
    assert probe["cuda"]["available"] == torch.cuda.is_available()
    assert probe["tensorrt"]["available"] or probe["tensorrt_rtx"]["available"]
    assert "nvidia_smi" in probe and set(probe["imports"].values()) == {"ok"}


def test_without_tensorrt_and_gpu_the_project_imports_and_sections_skip(tmp_path):
    report = _run(tmp_path, "--budget_s", "60", code=BLOCK_TENSORRT)
    probe = report["probe"]
    assert not probe["tensorrt"]["available"] and not probe["tensorrt_rtx"]["available"]
    assert set(probe["imports"].values()) == {"ok"}, probe["imports"]
    import torch
    if not torch.cuda.is_available():
        assert {report[s]["skipped"] for s in ("embedded_model", "plugin_kernels", "tensorrt")} == {"no CUDA device"}
