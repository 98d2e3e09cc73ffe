"""Writing a `nemospec bench` report: report.json, report.md and PNG plots (matplotlib, no display)."""
from __future__ import annotations

import json
from pathlib import Path

PLOTS = ("acceptance.png", "histogram.png", "throughput.png", "costs.png")
PART_LABELS = {"draft": "draft", "verify": "verify (K+1 rows; greedy: with its accept + rollback)",
               "accept": "accept + rollback (sampled)", "host": "host"}


def _table(report: dict) -> list[str]:
    rows = ["| mode | mean accepted / verify | tokens/s speculative | tokens/s target-only | speedup | "
            "engine build s | engines MiB |", "|---|---:|---:|---:|---:|---:|---:|"]
    for mode, m in report["modes"].items():
        rows.append(f"| {mode} | {m['mean_accepted_tokens']:.2f} | {m['tokens_per_second']:.1f} | "
                    f"{m['target_only_tokens_per_second']:.1f} | {m['speedup']:.2f}x | {m['build_seconds']:.1f} | "
                    f"{m['engine_bytes'] / 2**20:.1f} |")
    return rows


def cost_table(report: dict) -> list[str]:
    """Per speculative step: where the milliseconds go, beside one target-only step; the speedup the
    costs predict next to the measured one."""
    rows = ["| mode | draft ms (per proposal) | verify ms (/ decode) | accept + rollback ms | host ms | step ms | "
            "tokens / step | target-only step ms (decode) | predicted speedup | prefill ms / request (target-only) | "
            "predicted with prefill | measured speedup |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, m in report["modes"].items():
        c = m.get("cost")
        if not c:
            continue
        s = c["speculative"]
        rows.append(f"| {mode} | {s['draft_ms']:.3f} ({s['draft_ms_per_proposal']:.3f}) | {s['verify_ms']:.3f} "
                    f"({c['verify_over_decode']:.2f}x) | {s['accept_ms']:.3f} | {s['host_ms']:.3f} | {s['step_ms']:.3f} | "
                    f"{s['tokens_per_step']:.2f} | {c['target_only_step_ms']:.3f} ({c['target_decode_ms']:.3f}) | "
                    f"{c['model_speedup']:.2f}x | {_prefill(c)} | {m['speedup']:.2f}x |")
    return rows


def _prefill(cost: dict) -> str:
    """The prefill columns: speculative (target-only) ms per request, and the speedup predicted with them
    ('- | -' for a report written before they were measured)."""
    p = cost.get("prefill_ms")
    if not p:
        return "- | -"
    return f"{p['speculative']:.1f} ({p['target_only']:.1f}) | {cost['model_speedup_with_prefill']:.2f}x"


def tree_table(report: dict) -> list[str]:
    """Tree speculation beside each mode's chain: acceptance, speed and the step's cost breakdown."""
    trees = {mode: m["tree"] for mode, m in report["modes"].items() if "tree" in m}
    if not trees:
        return []
    t0 = next(iter(trees.values()))
    rows = ["", "## Tree speculation", "",
            f"Each mode's chain beside a token tree of {t0['max_nodes']} drafted nodes (top-k children per expanded "
            f"node, k in the table; depth {t0['depth']}) verified in one target forward, interleaved on the same "
            "prompts; tree output equals target-only greedy output (checked).", "",
            "| mode | top-k | accepted / forward: chain | tree | tree - chain | tokens/s chain | tree | tree / chain | "
            "tree step ms: draft | verify | accept + rollback | host | paths off the top chain |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, t in trees.items():
        m, s = report["modes"][mode], t["cost"]["speculative"]
        rows.append(f"| {mode} | {t['topk']} | {m['mean_accepted_tokens']:.2f} | {t['mean_accepted_tokens']:.2f} | "
                    f"{t['over_chain_accepted']:+.2f} | {m['tokens_per_second']:.1f} | {t['tokens_per_second']:.1f} | "
                    f"{t['over_chain']:.2f}x | {s['draft_ms']:.3f} | {s['verify_ms']:.3f} | {s['accept_ms']:.3f} | "
                    f"{s['host_ms']:.3f} | {t['accepted_off_chain']} |")
    return rows


def _precisions(report: dict) -> str:
    dtype = report.get("draft_weight_dtype", "auto")
    precision = report.get("matmul_precision", "highest")
    return ("" if dtype == "auto" else f", draft weights in {dtype}") + (
        "" if precision == "highest" else f", matmul precision {precision} (fp32 products from bf16-rounded inputs)") + (
        f", draft LM heads cut by the token map `{report['token_map']}`" if report.get("token_map") else "")


def _kernel(report: dict) -> str:
    """The small-row kernel's form the runs used (reports before it was recorded: nothing)."""
    if "small_linear" not in report["machine"]:
        return ""
    cpu = f", CPU {report['machine']['cpu']}" if report["machine"].get("cpu") else ""
    return f", small-row kernel {report['machine']['small_linear'] or 'none (torch GEMM)'}{cpu}"


def _target(report: dict) -> str:
    """Which embedded model ran, and its weight bytes beside the machine's L3 (reports before they were
    recorded: nothing)."""
    out = ""
    e = report.get("embedded")
    if e:
        out += " (the embedded model" + (f" widened {e['factor']}x" if e["factor"] > 1 else ", as shipped") + ")"
    if report.get("target_weight_bytes"):
        l3 = report["machine"].get("l3_bytes")
        out += (f", target weights {report['target_weight_bytes'] / 2**20:.1f} MiB"
                + (f" (L3 {l3 / 2**20:.0f} MiB)" if l3 else ""))
    return out


def run_statistic(runs: int) -> str:
    """What the report's per-prompt figures are (bench._lower_median): the median of an odd count of
    runs, the lower of the two middle ones of an even count."""
    if runs % 2:
        return "one run" if runs == 1 else f"the median run of {runs}"
    return "the faster of 2 runs" if runs == 2 else f"the lower of the two middle runs of {runs}"


def markdown(report: dict) -> str:
    k = report["num_draft_tokens"]
    lines = [f"# nemospec bench ({report['created']}{', quick' if report['quick'] else ''})", "",
             f"Model: `{report['model']}`{_target(report)}. Greedy code completion, {report['prompts']} prompts x "
             f"{report['max_new_tokens']} new tokens, batch 1, K = {k} draft tokens per step, {run_statistic(report['runs'])} "
             f"per prompt (its time and its step costs), {report.get('backend', 'torch')} backend on both sides"
             f"{_precisions(report)}; CPU torch threads "
             f"{report['machine']['cpu_threads']}, allocator {report['machine'].get('allocator', 'system')}"
             f"{_kernel(report)}, CUDA "
             f"{report['machine']['cuda']}. Speculative output equals target-only greedy output in every mode "
             "(checked).", ""]
    lines += _table(report)
    adaptive = {mode: m for mode, m in report["modes"].items() if m.get("draft_len_adaptive")}
    if adaptive:
        lines += [""] + [f"{mode} (`--draft_len_adaptive on`, K up to {m['max_draft_len']}): verify steps by the K each "
                         "drafted: " + ", ".join(f"K={k} {n}" for k, n in m["steps_by_draft_len"].items())
                         for mode, m in adaptive.items()]
    late = {mode: m["compiled_during_timing"] for mode, m in report["modes"].items() if m.get("compiled_during_timing")}
    if late:
        lines += [""] + [f"**Warning: {mode}'s timings include steps compiled or loaded mid-run** (a warm-up gap): "
                         f"{'; '.join(v)}" for mode, v in late.items()]
    lines += ["", "## Where a step's time goes", "",
              "Milliseconds per decode step (prefill excluded), speculative vs target-only on the same engines "
              "(greedy rows verify, accept and roll back in one call: its time is the verify column's); "
              "predicted speedup = tokens per step x target-only step / speculative step; with prefill: each "
              "side's prefill per request, timed apart as a one-token run (the speculative side's includes the "
              "draft's pass over the prompt), plus its steps for the report's new tokens.", ""]
    lines += cost_table(report)
    lines += tree_table(report)
    moe = {mode: m["moe_experts_read"] for mode, m in report["modes"].items() if m.get("moe_experts_read")}
    if moe:
        lines += ["", "MoE experts read per MoE layer call, by the call's rows (routed experts only; "
                  "a decode is 1 row, a verify K+1):", ""]
        lines += [f"- {mode}: " + ", ".join(f"{n} row(s): {v} of {m['experts']}" for n, v in m["per_call_by_rows"].items())
                  for mode, m in moe.items()]
    lines += ["", "Acceptance histogram (tokens gained per verify, bonus included: count):", ""]
    for mode, m in report["modes"].items():
        lines.append(f"- {mode}: " + ", ".join(f"{n}: {c}" for n, c in m["histogram"].items()))
    peers = report.get("peers", {})
    if peers:
        lines += ["", "## Peers on the same model", ""]
        g = peers.get("transformers_generate", {})
        if "tokens_per_second" in g:
            lines.append(f"- transformers `generate` (greedy, fp32): {g['tokens_per_second']:.1f} tokens/s")
        a = peers.get("transformers_assisted", {})
        lines.append("- transformers assisted generation with the draft_target draft: " +
                     (f"{a['tokens_per_second']:.1f} tokens/s" if "tokens_per_second" in a else f"not run ({a.get('error')})"))
    s = report.get("serving")
    if s and "error" in s:
        lines += ["", "## Through the Triton server", "", f"- mode {s['mode']}: not measured, serving failed: {s['error']}"]
    elif s:
        where = f" ({s['backend']} backend, {s['torch_threads']} torch threads)" if "backend" in s else ""
        lines += ["", f"## Through the Triton server (gRPC streaming, one stream){where}", "",
                  f"- mode {s['mode']}: {s['tokens_per_second']:.1f} tokens/s speculative vs "
                  f"{s['target_only_tokens_per_second']:.1f} target-only (`speculative: false`, same server): "
                  f"**{s['speedup']:.2f}x**; mean accepted {s['mean_accepted_tokens']:.2f}",
                  _served_over_offline(report, s)]
    lines += ["", *[f"![{p}]({p})" for p in PLOTS], ""]
    return "\n".join(lines)


def _served_over_offline(report: dict, s: dict) -> str:
    """The served stream against the offline loop: serving's overhead only at the same thread count
    (the server defaults to a quarter of the cores, leaving the rest to Triton and its stubs)."""
    served, offline = s.get("torch_threads"), report["machine"]["cpu_threads"]
    what = ("serving overhead" if served in (None, offline) else
            f"served ({served} torch thread(s)) against offline ({offline}), not serving's overhead alone")
    return (f"- {what}: served {s['tokens_per_second']:.1f} vs offline {s['offline_tokens_per_second']:.1f} "
            f"tokens/s = {s['served_over_offline']:.2f}")


def plots(report: dict, root: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["modes"])
    m = report["modes"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(modes, [m[x]["mean_accepted_tokens"] for x in modes], color="#76b900")
    most = [m[x].get("max_draft_len", report["num_draft_tokens"]) + 1 for x in modes]   # an adaptive mode's K is its own
    ax.scatter(modes, most, color="grey", marker="_", s=400, label="maximum (K + 1)")
    ax.set_ylabel("tokens per verify")
    ax.set_title("Mean accepted tokens per verify")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(root / "acceptance.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / max(1, len(modes))
    for i, x in enumerate(modes):
        hist = m[x]["histogram"]
        total = sum(hist.values()) or 1
        ax.bar([int(n) + (i - len(modes) / 2) * width for n in hist], [c / total for c in hist.values()],
               width=width, label=x)
    ax.set_xlabel("tokens gained by one verify")
    ax.set_ylabel("fraction of forwards")
    ax.set_title("Acceptance histogram")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(root / "histogram.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(modes))
    ax.bar([x - 0.2 for x in xs], [m[x]["tokens_per_second"] for x in modes], width=0.4, label="speculative")
    ax.bar([x + 0.2 for x in xs], [m[x]["target_only_tokens_per_second"] for x in modes], width=0.4,
           label="target only")
    g = report.get("peers", {}).get("transformers_generate", {})
    if "tokens_per_second" in g:
        ax.axhline(g["tokens_per_second"], color="grey", linestyle="--", linewidth=1, label="transformers generate")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(modes, rotation=30, ha="right")
    ax.set_ylabel("tokens/s (batch 1, CPU)")
    ax.set_title("Offline throughput on the same engines")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(root / "throughput.png", dpi=100)
    plt.close(fig)

    costed = [x for x in modes if m[x].get("cost")]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bottom = [0.0] * len(costed)
    for part, label in PART_LABELS.items():  # per token: a step's parts / tokens per step
        values = [m[x]["cost"]["speculative"][f"{part}_ms"] / max(1e-9, m[x]["cost"]["speculative"]["tokens_per_step"])
                  for x in costed]
        ax.bar(costed, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    if costed:  # each mode's own target-only run (its target captures what its draft reads)
        ax.scatter(costed, [m[x]["cost"]["target_only_step_ms"] for x in costed], color="black", marker="_", s=900,
                   zorder=3, label="target-only ms / token")
    ax.set_ylabel("ms per generated token")
    ax.set_title("Cost of a token: speculative step parts vs target-only")
    ax.legend(fontsize=7)
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(root / "costs.png", dpi=100)
    plt.close(fig)


def write_report(report: dict, root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    plots(report, root)
    report = {**report, "plots": list(PLOTS)}
    (root / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (root / "report.md").write_text(markdown(report))


# --- the README's bench block ------------------------------------------------------------------
README_BEGIN = "<!-- bench:begin (generated by `python -m nemospec.bench_report --readme`; do not edit) -->"
README_END = "<!-- bench:end -->"


def readme_table(report: dict) -> str:
    """The README's bench block, rendered from a report (``docs/bench/report.json``): one line saying
    what was measured and where, the per-mode table with the speedup the step costs predict beside
    the measured one, and the served line. ``python -m nemospec.bench_report --readme`` writes it
    between ``README_BEGIN`` and ``README_END``; tests/test_docs.py checks the README holds exactly it."""
    m0 = report["machine"]
    lines = [f"`nemospec bench` of {report['created']} ([full report](docs/bench/report.md)): model "
             f"`{report['model']}`{_target(report)}, {report['prompts']} prompts x {report['max_new_tokens']} new tokens, batch 1, "
             f"K = {report['num_draft_tokens']}, {run_statistic(report['runs'])} per prompt, "
             f"{report.get('backend', 'torch')} backend on both sides{_precisions(report)}; "
             f"{m0['cpu_threads']} torch thread(s), torch {m0.get('torch', '?')}, allocator "
             f"{m0.get('allocator', 'system')}{_kernel(report)}, CUDA {m0['cuda']}. {_exactness(report)}", "",
             "| mode | accepted / verify | tokens/s speculative | tokens/s target-only | speedup | "
             "predicted by step costs (with prefill) |", "|---|---:|---:|---:|---:|---:|"]
    for mode, m in report["modes"].items():
        cost = m.get("cost") or {}
        predicted = f"{cost['model_speedup']:.2f}x" if cost.get("model_speedup") else "-"
        if cost.get("model_speedup_with_prefill"):
            predicted += f" ({cost['model_speedup_with_prefill']:.2f}x)"
        lines.append(f"| {mode} | {m['mean_accepted_tokens']:.2f} | {m['tokens_per_second']:.1f} | "
                     f"{m['target_only_tokens_per_second']:.1f} | {m['speedup']:.2f}x | {predicted} |")
    s = report.get("serving")
    if s and "error" not in s:
        lines += ["", f"Through Triton (one gRPC stream, mode {s['mode']}): {s['tokens_per_second']:.1f} tokens/s "
                      f"speculative against {s['target_only_tokens_per_second']:.1f} target-only on the same server, "
                      f"**{s['speedup']:.2f}x**; the served speculative stream ran at {s['served_over_offline']:.2f} of "
                      f"the offline loop's tokens/s"
                      + (f" (the server at {s['torch_threads']} torch thread(s), the offline loop at "
                         f"{report['machine']['cpu_threads']})." if "torch_threads" in s else ".")]
    elif s:
        lines += ["", f"Through Triton (mode {s['mode']}): not measured ({s['error']})."]
    return "\n".join(lines)


def _exactness(report: dict) -> str:
    inexact = [mode for mode, m in report["modes"].items() if not m.get("exact", False)]
    if not inexact:
        compared = sum(m.get("outputs_compared", 0) for m in report["modes"].values())
        # a report from before target-only's own repeats were counted apart counted them in too
        which = "speculative runs" if all("target_only_repeats_compared" in m for m in report["modes"].values()) else "runs"
        checked = f"checked: {compared} {which} against the target-only ids" if compared else "checked"
        return f"Every speculative output equals the target-only greedy output ({checked})."
    return f"Speculative output differs from target-only greedy output in: {', '.join(inexact)}."


def readme_block(text: str) -> str:
    """What stands between the README's bench markers (ValueError when they are missing or out of order)."""
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"README: expected the markers {README_BEGIN!r} ... {README_END!r}")
    return text[start + len(README_BEGIN):end].strip("\n")


def update_readme(readme: Path, report: dict) -> bool:
    """Rewrites the README's bench block from ``report``; True when the file changed."""
    text = readme.read_text()
    old = readme_block(text)
    start, end = text.find(README_BEGIN) + len(README_BEGIN), text.find(README_END)
    new = text[:start] + "\n" + readme_table(report) + "\n" + text[end:]
    if new != text:
        readme.write_text(new)
    return readme_table(report) != old


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m nemospec.bench_report",
                                description="render a nemospec bench report (the README's bench table)")
    p.add_argument("--report", default="docs/bench/report.json", help="report.json to render")
    p.add_argument("--readme", nargs="?", const="README.md", default=None, metavar="FILE",
                   help="rewrite the bench block of FILE (default README.md) from the report")
    p.add_argument("--check", action="store_true",
                   help="with --readme: change nothing, exit 1 when the block differs from the report")
    args = p.parse_args(argv)
    report = json.loads(Path(args.report).read_text())
    if args.readme is None:
        print(markdown(report))
        return 0
    readme = Path(args.readme)
    if args.check:
        same = readme_block(readme.read_text()) == readme_table(report)
        print(f"{readme}: bench block {'matches' if same else 'differs from'} {args.report}")
        return 0 if same else 1
    changed = update_readme(readme, report)
    print(f"{readme}: bench block {'rewritten' if changed else 'already current'} from {args.report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
