"""scripts/gpu_check.py: the probe (--dry_run) runs here; the GPU sections skip without a CUDA device.
The GPU image has no TensorRT: the project's runtime modules must import without it."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK_TENSORRT = """
import runpy, sys
for name in ('tensorrt', 'tensorrt_rtx'):   # None in sys.modules: importing it fails, find_spec says absent
    sys.modules[name] = None
sys.argv = ['scripts/gpu_check.py'] + sys.argv[1:]
runpy.run_path('scripts/gpu_check.py', run_name='__main__')
"""


def _run(tmp_path, *args, code=None, env=None):
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "scripts/gpu_check.py", *args]
    run = subprocess.run(cmd + ["--output", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(out.read_text())


def test_dry_run_probes_versions_and_imports(tmp_path):
    """Also: the compile store the script makes for itself (none given) is gone when it exits."""
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "NEMOSPEC_COMPILE_CACHE"} | {"TMPDIR": str(temp)}
    report = _run(tmp_path, "--dry_run", env=env)
    assert list(temp.iterdir()) == []
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


def test_embedded_model_section_runs_every_mode_without_tensorrt(tmp_path):
    """The model section on the CPU with TensorRT hidden, as the GPU image has none: every draft kind
    loads (a block draft's TensorRT-RTX workaround must not import TensorRT) and generates exactly
    what target-only generates; each mode reports both rates and its per-step costs."""
    report = _run(tmp_path, "--device", "cpu", "--sections", "embedded_model", "--new_tokens", "4",
                  code=BLOCK_TENSORRT)
    modes = report["embedded_model"]["modes"]
    assert set(modes) == {"eagle3", "dflash", "mtp", "eagle", "dspark", "peagle", "draft_target"}
    for mode, row in modes.items():
        assert row.get("exact") is True, (mode, row.get("error"))
        assert row["speculative_tokens_per_second"] > 0 and row["target_only_tokens_per_second"] > 0
        assert row["runs"][0]["cost"]["verify_ms"] > 0, mode


def test_report_page_of_the_committed_gpu_run():
    """docs/bench/gpu/gpu_check.md is what scripts/gpu_check_report.py writes of the committed JSON (a
    run on an H200): every section's table, the modes' speedups as the JSON has them."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_check_report import markdown
    report = json.loads((ROOT / "docs" / "bench" / "gpu" / "gpu_check.json").read_text())
    page = markdown(report)
    assert page == (ROOT / "docs" / "bench" / "gpu" / "gpu_check.md").read_text()
    for mode, row in report["embedded_model"]["modes"].items():
        assert f"| {mode} | {row['target_only_tokens_per_second']:.0f} | " in page
        assert f"| {row['speedup']:.2f}x |" in page
    assert "Plugin kernels" in page and "CUDA graph" in page


def test_tree_section_reports_trees_beside_the_chain(tmp_path):
    """The tree section (issue 14's measurement for a device day) on the CPU: eagle3, dflash and mtp grow
    16-node trees whose output equals target-only greedy; the page shows the tree table."""
    report = _run(tmp_path, "--device", "cpu", "--sections", "embedded_model_trees", "--new_tokens", "6")
    modes = report["embedded_model_trees"]["modes"]
    assert set(modes) == {"eagle3", "dflash", "mtp"}
    for mode, row in modes.items():
        assert row["exact"] is True and all(r["tree_exact"] for r in row["runs"]), mode
        assert row["tree"]["max_nodes"] == 16 and row["tree_mean_accepted"] >= 1.0
    page = (tmp_path / "report.md").read_text()
    assert "| mode | tree (nodes, top-k, depth) |" in page and "| eagle3 | 16, 4, 4 |" in page


def test_wide_model_section_speculates_exactly_on_the_widened_model(tmp_path):
    """The wide_model section (a GPU's real-sized run: widened 16x, compiled) as the CPU shakedown runs
    it: widened 2x, eager; eagle3, dflash and mtp generate exactly what target-only does, and the page
    names the factor."""
    report = _run(tmp_path, "--device", "cpu", "--sections", "wide_model", "--new_tokens", "4")
    section = report["wide_model"]
    assert section["embedded_factor"] == 2 and set(section["modes"]) == {"eagle3", "dflash", "mtp"}
    for mode, row in section["modes"].items():
        assert row.get("exact") is True, (mode, row.get("error"))
    assert "Widened 2x, torch backend." in (tmp_path / "report.md").read_text()


def test_kernels_in_graphs_section_runs_the_wide_model_with_the_kernels_in_its_steps(monkeypatch):
    """wide_model_kernels_in_graphs: the wide_model run with gpu.IN_GRAPHS on while it runs (and off
    after), the kernels' custom-op calls in the section, and a line on the page."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check
    import gpu_models
    from gpu_check_report import markdown
    from builder.backends import gpu
    from builder.backends.gpu import graph_ops

    seen = []

    def fake_wide_model(deadline, device, new, modes):
        seen.append((gpu.IN_GRAPHS, modes))
        graph_ops.CALLS["ssm_scan"] += 3
        return {"modes": {}, "prompts": 1, "new_tokens": new, "k": 4}
    monkeypatch.setattr(gpu_models, "wide_model", fake_wide_model)
    monkeypatch.setattr(gpu, "IN_GRAPHS", False)
    section = gpu_check.SECTIONS["wide_model_kernels_in_graphs"](0.0, "cuda", 8)
    assert seen == [(True, ("eagle3",))] and gpu.IN_GRAPHS is False and section["kernel_calls"] == {"ssm_scan": 3}
    assert "Kernels run inside the compiled steps: ssm_scan x3." in markdown({"wide_model_kernels_in_graphs": section})


def test_adaptive_section_runs_eagle3_on_the_wide_model_up_to_k_8(monkeypatch):
    """wide_model_adaptive: eagle3 on the widened model (16x on a GPU) with an adaptive policy up to
    K = 8 through the same measurement as the fixed-K rows, and the page counts its steps by K."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check
    import gpu_models
    from gpu_check_report import markdown
    seen = {}

    def fake_embedded_model(deadline, device, new, **kwargs):
        seen.update(kwargs)
        run = {"steps_by_draft_len": {"2": 3, "8": 5}, "cost": {"verify_ms": 1.0, "draft_ms": 0.5},
               "target_only_cost": {"verify_ms": 0.9}}
        return {"modes": {"eagle3": {"speedup": 2.0, "exact": True, "target_only_tokens_per_second": 100.0,
                                     "speculative_tokens_per_second": 200.0, "runs": [run, run]}},
                "prompts": 1, "new_tokens": new, "k": kwargs["k"], "draft_len_adaptive": True}
    monkeypatch.setattr(gpu_models, "embedded_model", fake_embedded_model)
    section = gpu_check.SECTIONS["wide_model_adaptive"](0.0, "cuda", 8)
    assert seen["k"] == 8 and seen["factor"] == 16 and seen["modes"] == ("eagle3",) and seen["policy"].adaptive
    assert seen["backend"] == "compiled"
    assert "| eagle3: verify steps by K | K=2 6, K=8 10 |" in markdown({"wide_model_adaptive": section})


def test_triton_kernels_section_runs_every_kernel_within_its_bound(tmp_path):
    """The triton_kernels section on the CPU (tiny shapes, TRITON_INTERPRET=1 inside gpu.forced()): each
    row ran its kernel (no fallback, no error), is within its bound, and the page shows the table."""
    report = _run(tmp_path, "--device", "cpu", "--sections", "triton_kernels")
    section = report["triton_kernels"]
    assert section["interpreted"] is True and "stopped" not in section
    ops = [row["op"] for row in section["rows"]]
    assert {"ssm_scan", "causal_conv1d", "tree_ssm_scan", "tree_conv1d", "attention", "tree_attention",
            "linear_nvfp4", "rms_norm", "gated_rms_norm"} <= set(ops)
    for row in section["rows"]:
        assert "error" not in row and row["fallback"] is False, row
        assert row["within_bound"] is True and row["kernel_us"] > 0 and row["torch_us"] > 0, row
    assert "| op | shape | kernel us |" in (tmp_path / "report.md").read_text()


def test_batches_section_speculates_exactly_at_each_batch_size():
    """wide_model_batches (16 streams, the goal a 2-core CPU cannot reach, measured on a device) as the
    CPU shakedown runs it, widened 2x, eager: each batch of the cycled prompts speculates at the bench's
    K and at K = 1 exactly as target-only decodes, and the page has a row per batch and K."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import time
    import gpu_models
    from gpu_check_report import markdown
    section = gpu_models.wide_model_batches(time.time() + 300, "cpu", 4, batches=(1, 5))
    assert section["embedded_factor"] == 2 and [r["batch"] for r in section["rows"]] == [1, 5]
    for row in section["rows"]:
        assert set(row["by_k"]) == {str(section["k"]), "1"}, row
        for k, r in row["by_k"].items():
            assert r["exact"] is True and r["speculative_tokens_per_second"] > 0 and r["mean_accepted"] >= 1.0, (k, r)
    page = markdown({"wide_model": {"modes": {}, "prompts": 4, "new_tokens": 4, "k": 4}, "wide_model_batches": section})
    assert "| batch | target-only tok/s | K |" in page and page.count("| 5 | ") == 2


def test_wide_trees_section_measures_trees_and_the_auto_size(monkeypatch):
    """wide_model_trees: eagle3 and dflash grow their trees exactly on the widened model, and
    ``--max_tree_nodes auto``'s calibration reports its choice on the page (CPU shakedown, 4-node cap)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import time
    import gpu_models
    from gpu_check_report import markdown
    monkeypatch.setattr(gpu_models, "PROMPTS", gpu_models.PROMPTS[:1])
    section = gpu_models.wide_model_trees(time.time() + 300, "cpu", 4, nodes=4, topk=2, cap=4)
    assert set(section["modes"]) == {"eagle3", "dflash"}
    for mode, row in section["modes"].items():
        assert row["exact"] is True and row["tree"] == {"max_nodes": 4, "topk": 2, "depth": 4}, (mode, row)
    sizing = section["sizing"]
    assert set(sizing["predicted"]) == {"chain", "4"} and sizing["max_tree_nodes"] in (None, 4)
    page = markdown({"wide_model_trees": section})
    assert "--max_tree_nodes auto (eagle3, up to 4 nodes) keeps " in page and "| eagle3 | 4, 2, 4 |" in page
