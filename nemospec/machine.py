"""What a bench reads of the machine it runs on: the CPU (a report's figures depend on which machine
of a mixed pool ran them) and its L3, which sizes the wide embedded model so that a decode streams
its weights from memory as a served model's does."""
from __future__ import annotations

import platform
from pathlib import Path


def l3_bytes() -> int | None:
    """The largest last-level cache of CPU 0 (Linux sysfs), None where it cannot be read: a bench report
    names it beside the target's weight bytes (weights beyond it decode from memory)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (entry / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes) if sizes else None


def cpu_name() -> str:
    """The CPU as /proc/cpuinfo names it, with its family/model and widest vector ISA (a report's
    figures depend on which machine of a mixed pool ran them: Zen 1 AVX2 vs Zen 4 AVX-512)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "cpu family", "model", "flags") and key.strip() not in fields:
                fields[key.strip()] = value.strip()
            if line == "" and fields:
                break
    except OSError:
        return platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    isa = next((name for name, need in (("avx512_bf16", {"avx512_bf16"}), ("avx512f", {"avx512f"}),
                                         ("avx2+fma", {"avx2", "fma"})) if need <= flags), "no avx2")
    return (f"{fields.get('model name', platform.machine())} (family {fields.get('cpu family', '?')} "
            f"model {fields.get('model', '?')}, {isa})")


def memory_bound_factor(l3: int | None, largest: int = 16) -> int:
    """The wide model's width multiple for a bench on this CPU: the default (4), or, where the
    default's fp32 target weights (estimated as the small model's times the factor squared) are under
    1.5x the L3, the smallest factor whose weights reach it, so that a
    decode streams its weights from memory as a served model's does. A Xeon with 480 MiB of L3 held
    the 4x model's 186 MiB: its 5-row verify cost 1.51x a decode and eagle3 measured 1.79x target-only;
    at 8x (717 MiB) 2.23x, as the 4x model measured on a 32 MiB-L3 Zen 4."""
    from builder import embedded
    from builder.embedded.sources import DEFAULT_WIDE_FACTOR
    small = (embedded.target_dir() / "model.safetensors").stat().st_size   # the weights grow as the factor squared
    factor = DEFAULT_WIDE_FACTOR
    while l3 and small * factor ** 2 < 1.5 * l3 and factor < largest:
        factor += 1
    return factor
