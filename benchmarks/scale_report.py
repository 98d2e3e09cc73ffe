"""Markdown table and PNG of a benchmarks/scale.py result (scale.json)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

GIB = 2 ** 30


def _build_cell(b: dict | None) -> str:
    if not b:
        return "-"
    if "skipped" in b:
        return f"skipped ({b['skipped']})"
    if "error" in b:
        return f"error: {b['error'][:80]}"
    return (f"{b['build_seconds']:.0f} s build ({b['seconds']:.0f} s run), {b['peak_rss_gb']:.2f} GB RSS "
            f"(est. {b['estimate_gb']:.1f}), engines {b['engine_bytes'] / GIB:.2f} / weights "
            f"{b['weight_bytes'] / GIB:.2f} GiB, dir {b['dir_bytes'] / max(1, b['weight_bytes']):.2f}x")


def write_markdown(result: dict, path: Path) -> None:
    lines = [f"# Scale benchmark ({result['created']}, {result['threads']} CPU thread, eager bf16, K={result['k']})", "",
             *([f"Updated {result['updated']}.", ""] if result.get("updated") else []),
             "## Builds per layer kind (one full-width layer, vocabulary 1024)", "",
             "| config | kind | plain build | --strip_plan build |", "|---|---|---|---|"]
    for row in result["rows"]:
        for kind, e in row["kinds"].items():
            if "plain" in e or "strip_plan" in e:
                lines.append(f"| {row['config']} | {kind} | {_build_cell(e.get('plain'))} | {_build_cell(e.get('strip_plan'))} |")
    if result.get("whole"):
        lines += ["", "## Whole-model and first-layers builds (structure-only weights, --strip_plan)", "",
                  "| config | build | peak RSS | engines | weights | directory / weights |", "|---|---|---|---|---|---|"]
        for w in result["whole"]:
            if "error" in w:
                lines.append(f"| {w['config']} | error: {w['error'][:100]} | | | | |")
                continue
            label = w["config"] + (f" (first {w['num_layers']} layers, vocabulary 1024)" if w.get("num_layers") else "")
            lines.append(f"| {label} | {w['build_seconds']:.0f} s ({w['seconds']:.0f} s with writing the weights) | "
                         f"{w['peak_rss_gb']:.2f} GB (est. {w['estimate_gb']:.1f}) | {w['engine_bytes'] / 2**20:.1f} MiB | "
                         f"{w['weight_bytes'] / GIB:.2f} GiB | {w['dir_bytes'] / w['weight_bytes']:.3f}x |")
    lines += ["", "## Eager CPU step costs at full width and the projected speedup", "",
              "Per layer kind: ms of one block (decode T=1 / verify T=K+1). Whole model: the sum over its pattern "
              "plus the LM head at the full vocabulary. Speedup = tokens_per_step x decode / (draft + verify), "
              f"tokens_per_step from {result['acceptance_source']}: **a projection, not a measurement**.", "",
              "| config | batch | per-kind block ms (T=1 / T=K+1) | decode ms | verify ms | verify/decode | "
              "eagle3 | dflash | mtp |", "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        for b, p in row["projection"].items():
            blocks = ", ".join(f"{k} {1e3 * e['steps'][b]['1']:.1f}/{1e3 * e['steps'][b][str(result['k'] + 1)]:.1f}"
                               for k, e in row["kinds"].items())
            modes = p["modes"]

            def cell(m):
                return (f"{modes[m]['projected_speedup']:.2f}x (draft {modes[m]['draft_ms']:.0f} ms, "
                        f"{modes[m]['tokens_per_step']:.2f} tok/step)") if m in modes else "-"
            lines.append(f"| {row['config']} | {b} | {blocks} | {p['decode_ms']:.0f} | {p['verify_ms']:.0f} | "
                         f"{p['verify_over_decode']:.2f} | {cell('eagle3')} | {cell('dflash')} | {cell('mtp')} |")
    lines += ["", "## The memory-bound regime (a model: H200 HBM 4.8 TB/s, bf16 weights read once per step)", "",
              "Decode reads the dense weights and the routed experts; verify of K+1 tokens the same dense bytes "
              "and the union of its tokens' experts. **A projection from byte counts, not a measurement.**", "",
              "| config | batch | decode ms | verify ms | verify/decode | eagle3 | dflash | mtp |",
              "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        for b, p in row.get("bandwidth_projection", {}).items():
            modes = p["modes"]
            cell = lambda m: f"{modes[m]['projected_speedup']:.2f}x" if m in modes else "-"  # noqa: E731
            lines.append(f"| {row['config']} | {b} | {p['decode_ms']:.2f} | {p['verify_ms']:.2f} | "
                         f"{p['verify_over_decode']:.2f} | {cell('eagle3')} | {cell('dflash')} | {cell('mtp')} |")
    path.write_text("\n".join(lines) + "\n")


def write_plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    names, width = [r["config"].replace("nemotron-", "") for r in result["rows"]], 0.12
    series = [(b, m) for b in ("1", "8") for m in ("eagle3", "dflash", "mtp")]
    for i, (b, m) in enumerate(series):
        vals = [r["projection"][b]["modes"].get(m, {}).get("projected_speedup", 0) for r in result["rows"]]
        ax1.bar([x + i * width for x in range(len(names))], vals, width, label=f"{m}, batch {b}")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_xticks([x + 2.5 * width for x in range(len(names))], names, rotation=20, ha="right", fontsize=8)
    ax1.set_ylabel("projected speedup (x)")
    ax1.set_title("Projected speculative speedup at full width (cost model)")
    ax1.legend(fontsize=7)
    for r in result["rows"]:
        for kind, e in r["kinds"].items():
            for key, marker in (("plain", "o"), ("strip_plan", "s")):
                b = e.get(key)
                if b and "peak_rss_gb" in b:
                    ax2.scatter(b["weight_bytes"] / GIB, b["peak_rss_gb"], marker=marker,
                                color="#76b900" if key == "strip_plan" else "#444")
    ax2.set_xlabel("weights of the slice (GiB)")
    ax2.set_ylabel("peak RSS of the build (GB)")
    ax2.set_title("Build memory per one-layer slice (o plain, s --strip_plan)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    res = json.loads((out / "scale.json").read_text())
    write_markdown(res, out / "scale.md")
    write_plot(res, out / "scale.png")
