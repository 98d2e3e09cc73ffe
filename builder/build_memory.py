"""Peak host memory of `nemospec build`, estimated before anything heavy happens, and the refusal.

The build holds, at its peak (one engine at a time; measured on full-width Nemotron-H slices, see
``benchmarks/scale.py`` and the README):

* the process itself (Python, torch, TensorRT): ``BASE_BYTES``;
* the weights, memory-mapped from the engine directory's safetensors: every byte is paged in while
  TensorRT reads it (resident, though the kernel may drop those pages again): ``W``;
* TensorRT's working copy of the engine's weights while it builds: ``BUILDER_COPY`` x the weights the
  engine uses (target and verify: the target's; draft: the draft's);
* the serialized plan, which holds the weights again: ``PLAN_FACTOR`` x those weights, or nearly
  nothing with ``--strip_plan`` (weights are refit or bound at load).

With ``--strip_plan`` where TensorRT cannot build refittable engines (tensorrt_rtx without a GPU) the
weights are engine inputs: TensorRT never reads them, and the build holds only the process, the graph
(``GRAPH_BYTES_PER_LAYER``) and a small plan. NVFP4 weights (linears and expert stacks) count as their
packed bytes and scales: they stay FP4 in the file and in the engine, dequantized in the network.

The runtime state the engine directory's runners allocate at load (KV caches for ``max_batch_size``
x ``max_seq_len``, Mamba conv/SSM states) is reported beside it: it is not part of the build, but a
smaller ``--max_batch_size``/``--max_seq_len`` is what helps when it is large.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from builder.errors import BuildError

GIB = 2 ** 30
BASE_BYTES = int(0.6 * GIB)
BUILDER_COPY = 1.5
PLAN_FACTOR = 1.3
STRIPPED_PLAN_BYTES = 64 << 20
GRAPH_BYTES_PER_LAYER = 32 << 20   # TensorRT's graph of one layer without its weights (measured: README)


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be used without swapping), else physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def tensor_dict_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() if hasattr(t, "element_size") else _nvfp4_bytes(t)
               for t in tensors.values())


def _nvfp4_bytes(w) -> int:
    return sum(x.numel() * x.element_size() for x in w.tensors().values())


@dataclass(frozen=True)
class MemoryEstimate:
    weight_bytes: int          # target + draft weights, as the engines hold them
    target_bytes: int
    draft_bytes: int
    peak_bytes: int            # the build's estimated peak RSS
    state_bytes: int           # runtime state at max_batch_size x max_seq_len (not part of the build)
    strip_plan: bool

    def as_dict(self) -> dict:
        return asdict(self)


def runtime_state_bytes(config, options) -> int:
    """KV cache (K and V, build dtype) of every attention layer + Mamba conv (build dtype) and SSM
    (fp32) state of every Mamba layer, for max_batch_size sequences of max_seq_len tokens."""
    item = 4 if options.resolve_dtype(config.dtype) == "float32" else 2   # (auto: the checkpoint's)
    b, s = options.max_batch_size, options.max_seq_len
    kv = len(config.layer_indices("attention")) * 2 * b * s * config.num_key_value_heads * config.head_dim * item
    mamba = len(config.layer_indices("mamba"))
    conv = mamba * b * config.conv_dim * (config.conv_kernel - 1) * item
    ssm = mamba * b * config.mamba_num_heads * config.mamba_head_dim * config.ssm_state_size * 4
    return kv + conv + ssm


def estimate(config, target_weights, draft_bytes: int, options, method: str | None = None) -> MemoryEstimate:
    """The peak for building the engines (target [+ verify + draft], one after the other; the target's
    are the largest). ``draft_bytes``: the draft checkpoint's safetensors bytes (0: none, or MTP).
    ``method``: None (weights in the plan), "refit" (STRIP_PLAN: TensorRT still reads the weights) or
    "inputs" (weights are engine inputs: TensorRT never sees their bytes, and the weights file is
    streamed through page-released mappings)."""
    target = tensor_dict_bytes(target_weights)
    draft = int(draft_bytes)
    largest = max(target, draft)
    if method == "inputs":  # NVFP4 weights too: their FP4 bytes, block and global scales are inputs
        peak = BASE_BYTES + STRIPPED_PLAN_BYTES + GRAPH_BYTES_PER_LAYER * config.num_layers
    else:
        plan = STRIPPED_PLAN_BYTES if method == "refit" else int(PLAN_FACTOR * largest)
        peak = BASE_BYTES + target + draft + int(BUILDER_COPY * largest) + plan
    return MemoryEstimate(target + draft, target, draft, peak, runtime_state_bytes(config, options), method is not None)


def check(est: MemoryEstimate, limit_bytes: int, options, num_layers: int) -> None:
    """Raise a one-line BuildError (exit 2) naming the flags that help when the build will not fit."""
    if est.peak_bytes <= limit_bytes:
        return
    hints = []
    stripped = BASE_BYTES + STRIPPED_PLAN_BYTES + GRAPH_BYTES_PER_LAYER * num_layers
    if not est.strip_plan and stripped < est.peak_bytes:   # (a small model's stripped build needs more, not less)
        hints.append(f"--strip_plan (weights bound or refit at load from the directory's one safetensors copy: "
                     f"~{stripped / GIB:.1f} GiB)")
    per_layer = max(1, (est.peak_bytes - BASE_BYTES) // max(1, num_layers))
    fits = max(1, int((limit_bytes - BASE_BYTES) // per_layer))
    if fits < num_layers and limit_bytes > BASE_BYTES + per_layer:
        hints.append(f"--num_layers {min(fits, num_layers - 1)} for a trial build of the first layers")
    if est.state_bytes > 0.1 * limit_bytes:
        hints.append(f"a smaller --max_batch_size/--max_seq_len (runtime state {est.state_bytes / GIB:.1f} GiB "
                     f"at {options.max_batch_size} x {options.max_seq_len})")
    raise BuildError(f"host memory: this build needs ~{est.peak_bytes / GIB:.1f} GiB at its peak (weights "
                     f"{est.weight_bytes / GIB:.2f} GiB) but --max_host_memory_gb allows {limit_bytes / GIB:.1f} GiB; "
                     f"try {' or '.join(hints) if hints else 'a machine with more memory'}")
