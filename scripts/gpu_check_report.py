"""The Markdown page of a scripts/gpu_check.py report: what ran on the GPU, in tables a reader can
compare with docs/bench/report.md (the CPU) and docs/bench/scale (the projections)."""
from __future__ import annotations


def markdown(report: dict) -> str:
    probe = report.get("probe", {})
    cuda = probe.get("cuda", {})
    lines = [f"# GPU check ({report.get('created', '?')})", "",
             f"Device: {cuda.get('device', 'none')} (compute {cuda.get('capability', '?')}), torch "
             f"{probe.get('torch', {}).get('version', '?')}, triton {probe.get('triton', {}).get('version', 'absent')}, "
             f"TensorRT {'present' if probe.get('tensorrt', {}).get('available') else 'absent'}."]
    if report.get("runs"):
        lines += ["", report["runs"] + "."]
    lines += _plugins(report.get("plugin_kernels"))
    lines += _triton(report.get("triton_kernels"))
    for key, title in (("embedded_model", "Embedded model, eager (TorchRunner)"),
                       ("wide_model", "Embedded model widened (16x on a GPU: hidden 3072), compiled, CUDA graphs"),
                       ("wide_model_kernels_in_graphs",
                        "The same, with the Triton kernels inside the compiled steps (NEMOSPEC_KERNELS_IN_GRAPHS=1)"),
                       ("wide_model_trees", "The same widened model, trees beside the chain"),
                       ("wide_model_adaptive", "The same widened model, eagle3 with --draft_len_adaptive on (K up to 8)"),
                       ("embedded_model_trees", "Embedded model, eager, tree speculation beside the chain"),
                       ("embedded_model_compiled", "Embedded model, compiled (runtime.compiled: inductor)"),
                       ("embedded_model_no_cuda_graphs", "Embedded model, compiled, CUDA graphs off")):
        lines += _embedded(report.get(key), title)
        if key == "wide_model":
            lines += _batches(report.get("wide_model_batches"))
    lines += _full_width(report.get("full_width"), "steps", "projection",
                         "Full width, eager (one random layer per kind, bf16; op by op, launch-bound)")
    lines += _full_width(report.get("full_width_graphs"), "graph_steps", "graph_projection",
                         "Full width, each step replayed as one CUDA graph (the GPU's own time)")
    return "\n".join(lines) + "\n"


def _note_row(first, note: str, columns: int) -> str:
    """A table row of ``columns`` cells that says why a row has no figures (an error, a skip)."""
    return f"| {first} | {note[:80]} |" + " |" * (columns - 2)


def _plugins(p) -> list[str]:
    if not p or "copy_bandwidth_gb_s" not in p:
        return []
    out = ["", "## Plugin kernels (Triton)", "", f"Device copy bandwidth: {p['copy_bandwidth_gb_s']:.0f} GB/s.", "",
           "| kernel | us | GB/s | of copy bandwidth | matches reference |", "| --- | --- | --- | --- | --- |"]
    for name in ("hidden_capture", "fp4_markov_head"):
        k = p.get(name)
        if k:
            ok = k.get("exact", k.get("close"))
            out.append(f"| {name} | {k['us']:.1f} | {k['gb_s']:.1f} | {k['of_copy_bandwidth']:.3f} | {ok} |")
    return out


def _triton(section) -> list[str]:
    """The triton_kernels section: each op's kernel against its torch op."""
    if not section or not section.get("rows"):
        return []
    bw = section.get("copy_bandwidth_gb_s")
    where = " under TRITON_INTERPRET (tiny shapes)" if section.get("interpreted") else ""
    out = ["", "## Triton kernels of the op surface (builder/backends/gpu) against their torch ops", "",
           f"{section['dtype']} on {section['device']}{where}; medians; copy bandwidth "
           f"{f'{bw:.0f} GB/s' if bw else 'not measured'}."
           + (" Stopped at the budget." if section.get("stopped") else ""), "",
           "| op | shape | kernel us | torch us | torch / kernel | max abs diff | within bound (diff / bound) "
           "| of copy bandwidth | fallback |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in section["rows"]:
        if "error" in r:
            out.append(_note_row(r["op"], r["error"], 9))
        elif r.get("fallback"):
            out.append(f"| {r['op']} | {r['shape']} | | {r['torch_us']:.1f} | | | | | {r['fallback_reason'][:80]} |")
        else:
            frac = r.get("of_copy_bandwidth")
            out.append(f"| {r['op']} | {r['shape']} | {r['kernel_us']:.1f} | {r['torch_us']:.1f} | "
                       f"{r['torch_over_kernel']:.2f}x | {r['max_abs_diff']:.3g} | {r['within_bound']} "
                       f"({r['diff_over_bound']:.3f}) | {'' if frac is None else f'{frac:.3f}'} | no |")
    return out


def _embedded(section, title) -> list[str]:
    if not section or "modes" not in section:
        return []
    out = ["", f"## {title}", "",
           (f"Widened {section['embedded_factor']}x, {section['backend']} backend. " if "embedded_factor" in section else "")
           + f"{section['prompts']} prompts x {section['new_tokens']} new tokens, batch 1, K = {section['k']}; "
           "each prompt target-only then speculative. Step parts are host-timed (a GPU's queue drains where "
           "the host waits).", "",
           "| mode | target-only tok/s | speculative tok/s | speedup | exact | decode ms | verify ms | draft ms/step |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode, row in section["modes"].items():
        if "speedup" not in row:
            out.append(_note_row(mode, row.get("error", row.get("skipped", "?")), 8))
            continue
        runs = [r for r in row["runs"] if r.get("cost") and r.get("target_only_cost")]
        mean = lambda f: sum(f(r) for r in runs) / len(runs) if runs else float("nan")  # noqa: E731
        out.append(f"| {mode} | {row['target_only_tokens_per_second']:.0f} | {row['speculative_tokens_per_second']:.0f} "
                   f"| {row['speedup']:.2f}x | {row['exact']} | {mean(lambda r: r['target_only_cost']['verify_ms']):.2f} "
                   f"| {mean(lambda r: r['cost']['verify_ms']):.2f} | {mean(lambda r: r['cost']['draft_ms']):.2f} |")
        by_k = {}
        for r in row["runs"]:
            for kk, n in (r.get("steps_by_draft_len") or {}).items():
                by_k[kk] = by_k.get(kk, 0) + n
        if section.get("draft_len_adaptive") and by_k:
            out.append(f"| {mode}: verify steps by K | {', '.join(f'K={kk} {n}' for kk, n in sorted(by_k.items(), key=lambda x: int(x[0])))} | | | | | | |")
        if row.get("compiled_during_timing"):
            out.append(f"| {mode}: compiled inside the timings | {'; '.join(row['compiled_during_timing'])} | | | | | | |")
    if section.get("kernel_calls") is not None:
        calls = ", ".join(f"{op} x{n}" for op, n in sorted(section["kernel_calls"].items()))
        out += ["", f"Kernels run inside the compiled steps: {calls or 'none'}."]
    trees = {m: r for m, r in section["modes"].items() if "tree_speedup" in r}
    if trees:
        out += ["", "| mode | tree (nodes, top-k, depth) | accepted chain / tree | tree tok/s | tree speedup | tree / chain |",
                "| --- | --- | --- | --- | --- | --- |"]
        for mode, r in trees.items():
            t = r["tree"]
            out.append(f"| {mode} | {t['max_nodes']}, {t['topk']}, {t['depth']} | {r['mean_accepted']:.2f} / "
                       f"{r['tree_mean_accepted']:.2f} | {r['tree_tokens_per_second']:.0f} | {r['tree_speedup']:.2f}x | "
                       f"{r['tree_over_chain']:.2f}x |")
    sizing = section.get("sizing")
    if sizing:
        if "error" in sizing:
            out += ["", f"--max_tree_nodes auto: {sizing['error'][:120]}"]
        else:
            kept = "the chain" if sizing["max_tree_nodes"] is None else f"{sizing['max_tree_nodes']} nodes"
            table = ", ".join(f"{c} {v:.2f}x" for c, v in sizing["predicted"].items())
            out += ["", f"--max_tree_nodes auto ({sizing['mode']}, up to {sizing['cap']} nodes) keeps {kept}; "
                        f"predicted speedups: {table}."]
    return out


def _batches(section) -> list[str]:
    """wide_model_batches: target-only against speculation with many sequences at once."""
    if not section or "rows" not in section:
        return []
    out = ["", f"## The widened model, batches of sequences ({section['mode']})", "",
           f"Widened {section['embedded_factor']}x, {section['backend']} backend, {section['new_tokens']} new tokens "
           "per sequence; the bench's prompts cycled into each batch."
           + (f" {section['error'][:120]}" if "error" in section else "")
           + (" Stopped at the budget." if section.get("stopped") else ""), "",
           "| batch | target-only tok/s | K | speculative tok/s | speedup | accepted / verify | exact |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in section["rows"]:
        if "error" in row:
            out.append(_note_row(row["batch"], row["error"], 7))
            continue
        for k, r in row["by_k"].items():
            accepted = r["mean_accepted"]
            out.append(f"| {row['batch']} | {row['target_only_tokens_per_second']:.0f} | {k} | "
                       f"{r['speculative_tokens_per_second']:.0f} | {r['speedup']:.2f}x | "
                       f"{'' if accepted is None else f'{accepted:.2f}'} | {r['exact']} |")
        if row.get("compiled_during_timing"):
            out.append(f"| {row['batch']}: compiled inside the timings | {'; '.join(row['compiled_during_timing'])} | | | | | |")
    return out


def _full_width(section, steps_key, projection_key, title) -> list[str]:
    if not section or not section.get("rows"):
        return []
    out = ["", f"## {title}", "", "Per layer, milliseconds at batch 1 (decode T=1 / verify T=K+1); the whole model's "
           "decode and verify composed from them plus the LM head, and the projected speedup from the embedded "
           "model's measured tokens per step (a projection).", "",
           "| config | per layer (T=1 / T=5) | decode ms | verify ms | verify/decode | projected (batch 1) |",
           "| --- | --- | --- | --- | --- | --- |"]
    for row in section["rows"]:
        if "error" in row:
            out.append(_note_row(row["config"], row["error"], 6))
            continue
        layers = []
        for kind, entry in row["kinds"].items():
            steps = entry.get(steps_key, {})
            layers.append(f"{kind} {steps['error'][:40]}" if "error" in steps else
                          f"{kind} {1e3 * steps['1']['1']:.3f}/{1e3 * steps['1']['5']:.3f}")
        p = row.get(projection_key, {}).get("1")
        if p is None:
            out.append(f"| {row['config']} | {', '.join(layers)} | | | | |")
            continue
        modes = ", ".join(f"{m} {v['projected_speedup']:.2f}x" for m, v in p["modes"].items())
        out.append(f"| {row['config']} | {', '.join(layers)} | {p['decode_ms']:.2f} | {p['verify_ms']:.2f} | "
                   f"{p['verify_over_decode']:.2f} | {modes} |")
    return out
