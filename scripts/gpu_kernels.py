"""The ``triton_kernels`` section of scripts/gpu_check.py: each Triton op registered in
builder/backends/gpu at full width (bf16, CUDA) against the torch op it stands behind.

Rows: Mamba-2 of Nemotron-H-8B (``ssm_scan``, ``causal_conv1d``, ``mamba_dt`` at T = 1 and 5, the conv with its SiLU at 5; ``tree_ssm_scan``,
``tree_conv1d`` over a 17-node tree), its attention over an 8192-slot cache (T = 1, 5; a 17-node
``tree_attention``), ``linear_nvfp4`` at 4096x4096 for 1 and 5 rows, ``rms_norm`` and
``gated_rms_norm`` (the hidden size; Mamba's inner width in its groups) for 5 rows, and, where
builder/backends/gpu/moe.py exists, ``moe`` at Nemotron-3-Nano-30B-A3B's shape for 1 and 5 rows.

Per row: the kernel's time through ``gpu.dispatch`` and the torch op's with the kernels off (medians of
CUDA event pairs), max |kernel - torch| and whether it is within a bound from the dtypes' unit
roundoffs and the magnitudes summed (each op computed on |inputs| in float64), the bytes the op must
move over the kernel's time against the device's copy bandwidth, and ``fallback`` with the logged
reason where dispatch returned None. ``device="cpu"`` runs the same rows at tiny shapes under
TRITON_INTERPRET=1 inside ``gpu.forced()``, timed with perf_counter: the section's shakedown.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import statistics
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE_PARENTS = (-1, 0, 0, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9, 10)   # 17 nodes, depth 4


def _u(dtype) -> float:
    import torch
    return torch.finfo(dtype).eps / 2


def _gamma(n, dtype=None) -> float:
    """Higham's gamma_n (relative error of an n-term sum), fp32 unless ``dtype``."""
    import torch
    nu = math.ceil(n) * _u(dtype or torch.float32)
    return nu / (1 - nu) if nu < 1 else float("inf")


def _config(name: str) -> dict:
    return json.loads((ROOT / "benchmarks" / "configs" / f"{name}.json").read_text())


def shapes(device: str) -> dict:
    """Full width from benchmarks/configs (Nemotron-H-8B; the MoE of Nemotron-3-Nano-30B-A3B), or tiny
    ones for the CPU shakedown."""
    if device == "cpu":
        return {"mamba": dict(heads=4, head_dim=8, state=16, groups=2, conv=4),
                "attention": dict(heads=4, kv_heads=2, head_dim=16, cache=64), "nvfp4": (64, 64),
                "moe": dict(experts=8, hidden=32, inter=16, top_k=2, n_group=1, topk_group=1, norm=True,
                            scale=2.5, act="relu2")}
    h8, nano = _config("nemotron-h-8b-base-8k"), _config("nemotron-3-nano-30b-a3b-bf16")
    return {"mamba": dict(heads=h8["mamba_num_heads"], head_dim=h8["mamba_head_dim"], state=h8["ssm_state_size"],
                          groups=h8["n_groups"], conv=h8["conv_kernel"]),
            "attention": dict(heads=h8["num_attention_heads"], kv_heads=h8["num_key_value_heads"],
                              head_dim=h8["attention_head_dim"], cache=h8["max_position_embeddings"]),
            "nvfp4": (4096, 4096),
            "moe": dict(experts=nano["n_routed_experts"], hidden=nano["hidden_size"],
                        inter=nano["moe_intermediate_size"],
                        top_k=nano["num_experts_per_tok"], n_group=nano["n_group"], topk_group=nano["topk_group"],
                        norm=nano["norm_topk_prob"], scale=nano["routed_scaling_factor"], act=nano["mlp_hidden_act"])}


@contextlib.contextmanager
def _torch_op(exact: bool = False):
    """Kernels off (the torch ops run); ``exact`` also keeps cuBLAS's reductions in fp32, as the bounds
    assume (timings run with the defaults)."""
    from builder.backends import gpu
    import torch
    m = torch.backends.cuda.matmul
    flags = ("allow_tf32", "allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")
    saved = gpu.ENABLED, [getattr(m, f) for f in flags]
    gpu.ENABLED = False
    for f in flags if exact else ():
        setattr(m, f, False)
    try:
        yield
    finally:
        gpu.ENABLED = saved[0]
        for f, v in zip(flags, saved[1]):
            setattr(m, f, v)


def _tree(dev):
    import torch
    t = len(TREE_PARENTS)
    anc = torch.zeros(1, t, t, dtype=torch.bool)
    for i, p in enumerate(TREE_PARENTS):
        if p >= 0:
            anc[0, i] = anc[0, p]
        anc[0, i, i] = True
    return torch.tensor([TREE_PARENTS], device=dev), anc.to(dev)


def _abs64(*ts):
    return tuple(t.double().abs() for t in ts)


# --- rows: each builder returns (args, torch op, bound(want) -> tuple, bytes moved, shape) ----------
def _conv(s, dev, dtype, T, tree, act=None):
    import torch
    from builder.backends import torch_backend as tb, torch_tree as tt
    ch, w = s["heads"] * s["head_dim"] + 2 * s["groups"] * s["state"], s["conv"]
    x, state = torch.randn(1, T, ch, device=dev).to(dtype), torch.randn(1, w - 1, ch, device=dev).to(dtype)
    weight, bias = (torch.randn(ch, w, device=dev) / 2).to(dtype), torch.randn(ch, device=dev).to(dtype)
    index = _tree(dev)[0] if tree else torch.full((1,), T, device=dev)
    ref = tt.tree_conv1d if tree else tb.causal_conv1d

    def bound(want):
        """K products and the bias, each summed in another order: 2 gamma_(K+2) in dtype; SiLU (the
        model's) moves that by at most 1.1x and adds its own fp32 work and a rounding each side."""
        with _torch_op():
            mag = ref(*_abs64(x, state, weight, bias), index)
        y = 2 * _gamma(w + 2, dtype) * (mag if tree else mag[0])
        if act is not None:
            got = want if tree else want[0]
            y = 1.1 * y + (2 * _u(dtype) + 8 * _u(torch.float32)) * (got.double().abs() + y)
        return y if tree else (y, torch.zeros_like(mag[1]))   # the new conv state is a copy: exact
    moved = (2 * T * ch + (1 if tree else 2) * (w - 1) * ch + ch * w + ch) * x.element_size()
    return ((x, state, weight, bias, index, act), ref, bound, moved,
            f"T={T}, {ch} channels, kernel {w}" + (f", {act}" if act else ""))


def _ssm(s, dev, dtype, T, tree):
    import torch
    from builder.backends import torch_backend as tb, torch_tree as tt
    h, p, n, g = s["heads"], s["head_dim"], s["state"], s["groups"]
    x = torch.randn(1, T, h, p, device=dev).to(dtype)
    dt = (0.01 + 0.09 * torch.rand(1, T, h, device=dev)).to(dtype)
    A, D = -(1 + 15 * torch.rand(h, device=dev)), torch.randn(h, device=dev)
    B, C = torch.randn(1, T, g, n, device=dev).to(dtype), torch.randn(1, T, g, n, device=dev).to(dtype)
    state = torch.randn(1, h, p, n, device=dev)
    anc = _tree(dev)[1] if tree else None
    args = (x, dt, A, B, C, D, state) + ((anc,) if tree else (128,))
    ref = tt.tree_ssm_scan if tree else tb.ssm_scan

    def bound(want):
        """A state after t rows carries (8 + |dt A|) roundings a row on its magnitude (the recurrence on
        |inputs|), y adds C . h's N+1 terms and one rounding to dtype each side."""
        ax, aB, aC, aD, ah = _abs64(x, B, C, D, state)
        with _torch_op():
            mag = ref(ax, dt.double(), A.double(), aB, aC, aD, ah, args[-1])
        steps = int(anc.sum(-1).max()) if tree else T
        spread = float((dt.double() * A.double()).abs().sum(1).max())
        a = 2 * _gamma(steps * (8 + spread) + 1)
        y = (a + 2 * _gamma(n + 1) + (2 * _u(dtype) if dtype != torch.float32 else 0)) * (mag if tree else mag[0])
        return y if tree else (y, a * mag[1])
    moved = (2 * x.numel() + dt.numel() + 2 * B.numel()) * x.element_size() + (1 if tree else 2) * state.numel() * 4
    return args, ref, bound, moved, f"T={T}, H={h} P={p} N={n} G={g}"


def _dt(s, dev, dtype, T):
    import torch
    from builder.backends import torch_backend as tb
    h = s["heads"]
    dt = (4 * torch.randn(1, T, h, device=dev)).to(dtype)
    bias = torch.randn(h, device=dev).to(dtype)
    args = (dt, bias, 0.0, float("inf"), torch.full((1,), T, device=dev, dtype=torch.int32))

    def bound(want):   # the same dt + bias; fp32 softplus in another form, one rounding each side
        return (2 * _u(dtype) + 8 * _u(torch.float32)) * want.double().abs() + torch.finfo(dtype).smallest_normal
    moved = (2 * dt.numel() + h) * dt.element_size() + 4
    return args, tb.mamba_dt, bound, moved, f"T={T}, H={h}"


def _attention(s, dev, dtype, T, tree):
    import torch
    from builder.backends import torch_backend as tb, torch_tree as tt
    hq, hk, d, S = s["heads"], s["kv_heads"], s["head_dim"], s["cache"]
    q = torch.randn(1, T, hq, d, device=dev).to(dtype)
    k, v = torch.randn(1, S, hk, d, device=dev).to(dtype), torch.randn(1, S, hk, d, device=dev).to(dtype)
    positions = (S - T + torch.arange(T, device=dev))[None]
    scale = d ** -0.5
    args = (q, k, v, positions) + ((_tree(dev)[1],) if tree else ()) + (scale,)
    ref = tt.tree_attention if tree else tb.attention

    def bound(want):
        """Scores differ by scale |q|.|k| (2 gamma_D + 2u: the reference rounds them to dtype), so each
        probability by e^(2 ds) - 1; each side rounds p and the output to dtype and sums S terms."""
        with _torch_op():
            mag = ref(q.double(), k.double(), v.double().abs(), *args[3:])
            qk = tb.gqa_scores(q.float().abs(), k.float().abs(), 1.0).amax(-1)       # [1, Hkv, g, T]
        ds = scale * qk.permute(0, 3, 1, 2).reshape(1, T, hq, 1).double() * (2 * _gamma(d) + 2 * _u(dtype))
        return (4 * _u(dtype) + 4 * _gamma(S) + 2 * torch.expm1(2 * ds)) * mag
    moved = 2 * (q.numel() + k.numel() + v.numel()) * q.element_size()
    return args, ref, bound, moved, f"T={T}, {hq}/{hk} heads x {d}, {S}-slot cache"


def _nvfp4(shape, dev, dtype, rows):
    import torch
    from builder.backends import torch_backend as tb
    from builder.nvfp4_format import dequantize_nvfp4, quantize_nvfp4
    n, k = shape
    packed, scale, scale_2 = (t.to(dev) for t in quantize_nvfp4(torch.randn(n, k) * 0.02))
    x = torch.randn(rows, k, device=dev).to(dtype)
    args = (x, packed, scale, scale_2, (n, k))

    def bound(want):   # the same weights in dtype: K fp32 products in another order, one rounding each side
        w = dequantize_nvfp4(packed, scale, scale_2, (n, k), dtype).to(dev).double().abs()
        return (2 * _gamma(k) + 2 * _u(dtype)) * (x.double().abs() @ w.T)
    moved = packed.numel() + scale.numel() + 4 + (x.numel() + rows * n) * x.element_size()
    return args, tb.linear_nvfp4, bound, moved, f"{rows} rows, {n}x{k}"


def _moe(s, dev, dtype, rows):
    import torch
    from builder.backends import torch_backend as tb
    e, hid, inter = s["experts"], s["hidden"], s["inter"]
    x = torch.randn(rows, hid, device=dev).to(dtype)
    rw, rb = torch.randn(e, hid, device=dev) * 0.02, torch.randn(e, device=dev) * 0.01
    up = (torch.randn(e, inter, hid, device=dev, dtype=dtype) * 0.02).to(dtype)
    down = (torch.randn(e, hid, inter, device=dev, dtype=dtype) * 0.02).to(dtype)
    route = (s["top_k"], s["n_group"], s["topk_group"], s["norm"], s["scale"])
    args = (x, x, rw, rb, up, down) + route + (s["act"],)
    with _torch_op(exact=True):
        index, weights = tb.route(x, rw, rb, *route)

    def bound(want):
        """Per chosen (row, expert): z = up x (2 gamma_H + 2u of |up| |x|), the activation (relu2: 2a + a^2,
        else slope 1.13) and its rounding, down (2 gamma_I + 2u), the router weights' own fp32 error, the
        k-term sum and the output rounding; on the weighted magnitudes sum_k w |down| act(|up| |x|)."""
        u, ax = _u(dtype), x.double().abs()
        mag = torch.zeros(rows, hid, dtype=torch.float64, device=dev)
        for ex in index.unique().tolist():
            r, slot = torch.where(index == ex)
            mz = ax[r] @ up[ex].double().abs().T
            mh = mz * mz if s["act"] == "relu2" else 1.13 * mz
            mag.index_add_(0, r, (mh @ down[ex].double().abs().T) * weights[r, slot, None].double())
        a = 2 * _gamma(hid) + 2 * u
        act = 2 * a + a * a if s["act"] == "relu2" else 1.13 * a
        w_err = 4 * _gamma(hid) * float((ax @ rw.double().abs().T).max()) + 8 * _u(torch.float32)
        return (act + 2 * u + 2 * _gamma(inter) + 2 * u + w_err + 2 * _gamma(s["top_k"]) + 2 * u) * mag
    moved = (rw.numel() + rb.numel()) * 4 + 3 * x.numel() * x.element_size() \
        + index.unique().numel() * 2 * inter * hid * up.element_size()   # only the chosen experts' matrices
    return args, tb.moe, bound, moved, f"{rows} rows, {e} experts top {s['top_k']}, {hid} -> {inter}"


def _norm(s, dev, dtype, rows, gated):
    import torch
    from builder.backends import torch_backend as tb
    m = s["mamba"]
    width = m["heads"] * m["head_dim"] if gated else s["nvfp4"][1]     # Mamba's inner width; the hidden size
    group = width // m["groups"] if gated else width
    x = torch.randn(rows, width, device=dev).to(dtype)
    w = (1 + 0.1 * torch.randn(width, device=dev)).to(dtype)
    if gated:
        args, ref = (x, torch.randn(rows, width, device=dev).to(dtype), w, 1e-5, group), tb.gated_rms_norm
    else:
        args, ref = (x, w, 1e-5), tb.rms_norm

    def bound(want):   # the group's sum in another order, rsqrt's last bits; each rounding may move a unit
        return (2 * _gamma(group) + 8 * _u(torch.float32) + 2 * _u(dtype) * (2 if gated else 1)) * want.double().abs()
    moved = (x.numel() * (3 if gated else 2) + width) * x.element_size()
    return args, ref, bound, moved, f"{rows} rows, {width} wide" + (f", groups of {group}" if gated else "")


def _rows(s, dev, dtype):
    """(op, builder) per row, built one at a time so each row's tensors are freed before the next."""
    out = []
    for op, fn, tree in (("ssm_scan", _ssm, False), ("causal_conv1d", _conv, False)):
        out += [(op, functools.partial(fn, s["mamba"], dev, dtype, T, tree)) for T in (1, 5)]
    out += [("causal_conv1d", functools.partial(_conv, s["mamba"], dev, dtype, 5, False, "silu"))]   # as the model calls it
    out += [("mamba_dt", functools.partial(_dt, s["mamba"], dev, dtype, t)) for t in (1, 5)]
    T = len(TREE_PARENTS)
    out += [("tree_ssm_scan", functools.partial(_ssm, s["mamba"], dev, dtype, T, True)),
            ("tree_conv1d", functools.partial(_conv, s["mamba"], dev, dtype, T, True))]
    out += [("attention", functools.partial(_attention, s["attention"], dev, dtype, t, False)) for t in (1, 5)]
    out += [("tree_attention", functools.partial(_attention, s["attention"], dev, dtype, T, True))]
    out += [("linear_nvfp4", functools.partial(_nvfp4, s["nvfp4"], dev, dtype, r)) for r in (1, 5)]
    out += [("rms_norm", functools.partial(_norm, s, dev, dtype, 5, False)),
            ("gated_rms_norm", functools.partial(_norm, s, dev, dtype, 5, True))]
    if (ROOT / "builder" / "backends" / "gpu" / "moe.py").exists():
        out += [("moe", functools.partial(_moe, s["moe"], dev, dtype, r)) for r in (1, 5)]
    return out


# --- measuring --------------------------------------------------------------------------------------
def _median_s(fn, cuda: bool, runs: int) -> float:
    import torch
    if not cuda:   # the interpreter compiles nothing: no warm-up
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
    torch.cuda.synchronize()
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events) / 1e3


def _compare(got, want, bound):
    """(max |got - want|, worst |got - want| / bound) over every output (bound 0: must be equal)."""
    import torch
    got, want, bound = ((t,) if isinstance(t, torch.Tensor) else tuple(t) for t in (got, want, bound))
    diff, ratio = 0.0, 0.0
    for g, w, b in zip(got, want, bound):
        d = (g.double() - w.double()).abs()
        b = torch.as_tensor(b, dtype=torch.float64, device=d.device).expand_as(d)
        r = torch.where(b > 0, d / b.clamp_min(1e-300), (d > 0).double() * 1e300)
        diff, ratio = max(diff, float(d.max())), max(ratio, float(r.max()))
    return diff, ratio


def _measure(op, build, cuda, runs, copy_bw) -> dict:
    import torch
    from builder.backends import gpu
    args, ref, bound, moved, shape = build()
    row = {"op": op, "shape": shape, "bytes": int(moved)}
    t0 = time.perf_counter()
    got = gpu.dispatch(op, *args)
    if cuda:
        torch.cuda.synchronize()
    row["first_call_s"] = round(time.perf_counter() - t0, 3)     # the jit's compile, on the first row of a kernel
    row["fallback"] = got is None
    if got is None:
        row["fallback_reason"] = "; ".join(sorted(r for o, r in gpu._warned if o == op)) or "no kernel registered"
    with _torch_op(exact=True):
        want = ref(*args)
    with _torch_op():
        row["torch_us"] = round(1e6 * _median_s(lambda: ref(*args), cuda, runs), 2)
    if got is None:
        return row
    kernel_s = _median_s(lambda: gpu.dispatch(op, *args), cuda, runs)
    diff, ratio = _compare(got, want, bound(want))
    row.update(kernel_us=round(1e6 * kernel_s, 2), torch_over_kernel=round(row["torch_us"] / (1e6 * kernel_s), 2),
               max_abs_diff=diff, diff_over_bound=round(ratio, 4), within_bound=ratio <= 1.0,
               gb_s=round(moved / kernel_s / 1e9, 2),
               of_copy_bandwidth=round(moved / kernel_s / copy_bw, 3) if copy_bw else None)
    return row


def triton_kernels(deadline: float, device: str = "cuda", copy_bandwidth=None) -> dict:
    """The section: one row per (op, shape) until ``deadline`` (then ``"stopped": "budget"``)."""
    import torch
    from builder.backends import gpu
    cuda = torch.device(device).type == "cuda"
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"     # before the first kernel is jitted (gpu.jit keys on it); triton's
        # own @jit helpers need it before triton's import (gpu_check's main sets it for --device cpu)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    out = {"device": device, "dtype": str(dtype).replace("torch.", ""), "interpreted": not cuda, "rows": []}
    copy_bw = copy_bandwidth() if cuda and copy_bandwidth else None
    out["copy_bandwidth_gb_s"] = round(copy_bw / 1e9, 1) if copy_bw else None
    with (contextlib.nullcontext() if cuda else gpu.forced()):
        for op, build in _rows(shapes("cuda" if cuda else "cpu"), device, dtype):
            if time.time() > deadline:
                out["stopped"] = "budget"
                break
            try:
                row = _measure(op, build, cuda, 25 if cuda else 2, copy_bw)
            except Exception as e:   # a kernel's error under forced(), or the machine's
                row = {"op": op, "error": f"{type(e).__name__}: {e}"[:400], "trace": traceback.format_exc()[-1500:]}
            out["rows"].append(row)
            print(f"triton_kernels: {json.dumps(row)[:300]}", flush=True)
            if cuda:
                torch.cuda.empty_cache()
    return out
