"""Every Triton kernel of builder/backends/gpu (mamba, attention, moe) and of the plugins the GPU path
launches (nvfp4_rows: linear_nvfp4 and the FP4 Markov head; hidden_capture) compiled to a cubin for sm_90 without a GPU, exactly as its
launch code would have it compiled.

The interpreter tests (test_gpu_*.py) run plain Python, so a construct only the real compiler refuses
(a type it cannot lower, a layout it cannot convert, shared memory over the device's limit) passes
them. Here a separate process (TRITON_INTERPRET=0: a process that jitted triton's stdlib for the
interpreter cannot compile) calls each module's own ops on CPU tensors shaped as the model passes
them, with each module's ``jit`` swapped for one whose ``kernel[grid](...)`` is ``kernel.warmup(...)``
under a stand-in driver that reports an sm_90 target: triton's own JIT then specialises the
arguments (pointer dtypes, 16-byte alignment, ints equal to 1 as constants) and takes the launcher's
constexprs, and compiles, but launches nothing. The scenarios cover each launcher's branches
(:data:`MUST` lists the constexpr values each kernel must have been compiled with), and every
``*_kernel`` of those modules must be among the compiled ones."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SM90_SHARED = 232448          # bytes of shared memory a block may opt into on sm_90 (227 KiB)
F, T = False, True

# per kernel: constexpr name (or tuple of names) -> the values (tuples) some compile must have had
MUST = {
    "mamba": {
        "_conv_kernel": {("TREE", "HAS_BIAS"): {(F, T), (F, F), (T, T)}, ("TREE", "SILU"): {(F, T), (T, T), (F, F)},
                         "T": {1}},
        "_dt_kernel": {("HAS_LO", "HAS_HI", "BF16"): {(T, F, T), (T, T, F), (F, F, F)}},
        "_ssm_kernel": {("WRITE_Y", "WRITE_STATES"): {(T, F), (F, F), (T, T)}, "T": {1},
                        "heads_per_group": {1}},
        "_tree_ssm_kernel": {"BLOCK_N": {128}},
    },
    "attention": {
        "_attn_kernel": {("MODE", "SPLIT"): {(m, s) for m in (0, 1, 2) for s in (F, T)},
                         ("HAS_WINDOW", "HAS_SINKS", "SPLIT"): {(F, F, F), (T, T, F), (T, T, T)},
                         ("F32_DOT", "ROUND_BF16"): {(F, T), (F, F), (T, F)}, "BLOCK_D": {64, 128, 256},
                         "T": {1}},
        "_merge_kernel": {("HAS_SINKS", "ROUND_BF16"): {(F, T), (T, T), (F, F)}},
    },
    "nvfp4_rows": {   # linear_nvfp4 (builder/backends/gpu/nvfp4.py) and the FP4 Markov head (GATHER, ADD)
        "_nvfp4_kernel": {("HAS_BIAS", "ROUND"): {(F, 2), (T, 2), (T, 1), (F, 0)}, "F32_DOT": {F, T},
                          ("GATHER", "HAS_ADD"): {(F, F), (T, T)}, "S2_PTR": {F, T},
                          "BLOCK_K": {32, 64, 128}, "BLOCK_N": {16, 64}, "M": {1}},
    },
    "norms": {
        "_norm_kernel": {("GATED", "X_ROUND", "OUT_ROUND"): {(F, 2, 2), (T, 2, 2), (T, 2, 0), (F, 0, 0)},
                         "BLOCK": {4096, 1024}},
    },
    "hidden_capture": {   # the GPU path's hidden_capture (builder/backends/gpu/capture.py)
        "_hidden_capture_kernel": {("HAS_DELTA", "WRITE_X", "COPY_BUFFER"): {(T, T, T), (F, F, T)},
                                   "BF16": {F, T}},
    },
    "moe": {
        "_route_kernel": {("TWO", "NORM"): {(T, T), (T, F), (F, F)}, "GSIZE": {1}},
        "_up_kernel": {("ACT", "ROUND", "F32_DOT"): {(0, 2, F), (2, 2, F), (3, 1, F), (1, 0, T)}, "SLOTS": {1}},
        "_down_kernel": {("ROUND", "F32_DOT"): {(2, F), (1, F), (0, T)}},
        "_sum_kernel": {"ROUND": {0, 1, 2}},
    },
}


def _scenarios():
    """(label, call) pairs: each module's ops on CPU tensors of the model's dtypes and layouts."""
    import torch

    from builder.backends.gpu import attention as ga
    from builder.backends.gpu import mamba as gm
    from builder.backends.gpu import moe as gmoe
    from builder.backends.gpu import nvfp4 as gn

    bf16, f16, f32, i32, i64 = torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64
    z = torch.zeros

    # --- mamba: bf16 activations, fp32 A/D/state, int lengths/parents, uint8 ancestors
    def conv(seq, tree, bias, index_dtype, batch=2, chans=256, width=4, act=None):
        x, state = z(batch, seq, chans, dtype=bf16), z(batch, width - 1, chans, dtype=bf16)
        w, b = z(chans, width, dtype=bf16), (z(chans, dtype=bf16) if bias else None)
        if tree:
            parents = torch.arange(-1, seq - 1, dtype=index_dtype).expand(batch, seq)
            return gm.tree_conv1d(x, state, w, b, parents, act)
        return gm.causal_conv1d(x, state, w, b, torch.full((batch,), seq, dtype=index_dtype), act)

    def dt(seq, lo, hi, dtype=bf16, batch=2, heads=128):
        return gm.mamba_dt(z(batch, seq, heads, dtype=dtype), z(heads, dtype=dtype), lo, hi,
                           torch.full((batch,), seq, dtype=i32))

    def ssm(seq, groups=2, dt_dtype=bf16, batch=2, heads=8, dim=64, n=128):
        x, dt = z(batch, seq, heads, dim, dtype=bf16), z(batch, seq, heads, dtype=dt_dtype)
        B, C = z(batch, seq, groups, n, dtype=bf16), z(batch, seq, groups, n, dtype=bf16)
        return x, dt, z(heads), B, C, z(heads), z(batch, heads, dim, n)

    def pick(args, *which):
        return [args[i] for i in which]

    def chain(seq):
        return torch.ones(2, seq, seq, dtype=torch.bool).tril()

    # --- attention: bf16 q/caches, int32/int64 positions, fp32 sinks, uint8 ancestors/visible
    def qkv(seq, keys, dtype=bf16, dim=128, q_heads=8, kv_heads=2, batch=1):
        return (z(batch, seq, q_heads, dim, dtype=dtype), z(batch, keys, kv_heads, dim, dtype=dtype),
                z(batch, keys, kv_heads, dim, dtype=dtype))

    def pos(seq, dtype=i32, batch=1):
        return torch.zeros(batch, seq, dtype=dtype)

    def causal(seq, keys, dtype=bf16, dim=128, window=None, sinks=False, pos_dtype=i32):
        q, k, v = qkv(seq, keys, dtype, dim)
        return ga.attention(q, k, v, pos(seq, pos_dtype), dim ** -0.5, window, z(8) if sinks else None)

    def tree(seq, keys):
        q, k, v = qkv(seq, keys)
        return ga.tree_attention(q, k, v, pos(seq, i64), chain(seq)[:1], 128 ** -0.5)

    def masked(seq, keys):
        q, k, v = qkv(seq, keys)
        return ga.masked_attention(q, k, v, torch.ones(1, seq, keys, dtype=torch.bool), 128 ** -0.5)

    # --- nvfp4: uint8 FP4 codes, FP8 E4M3 block scales (passed as uint8), fp32 global scale
    def fp4(rows_shape, n, k, dtype, bias):
        x = z(*rows_shape, k, dtype=dtype)
        packed, scale = z(n, k // 2, dtype=torch.uint8), z(n, k // 16).to(torch.float8_e4m3fn)
        return gn.linear_nvfp4(x, packed, scale, torch.ones(1), (n, k), z(n, dtype=dtype) if bias else None)

    def markov(rows, vocab, rank, w1_dtype, scale_2):
        logits, prev = z(rows, vocab), torch.zeros(rows, dtype=i64)
        packed, scale = z(vocab, rank // 2, dtype=torch.uint8), z(vocab, rank // 16).to(torch.float8_e4m3fn)
        return gn.fp4_markov_head(logits, prev, z(300, rank, dtype=w1_dtype), packed, scale, scale_2)

    # --- norms: 8B's RMSNorm (4096 wide) and gated RMSNorm (8 groups of 1024), bf16 and an fp32 weight
    def norm(gated, w_dtype=bf16, dtype=bf16):
        from builder.backends.gpu import norms as gnorm
        if gated:
            x = z(5, 8192, dtype=dtype)
            return gnorm.gated_rms_norm(x, x, z(8192, dtype=w_dtype), 1e-5, 1024)
        return gnorm.rms_norm(z(5, 4096, dtype=dtype), z(4096, dtype=w_dtype), 1e-5)

    # --- hidden capture: the residual add writing slot 1 of 3 (4096 wide), and the first capture (no add)
    def capture(dtype, delta):
        from builder.backends.gpu import capture as gc
        x = z(2, 5, 4096, dtype=dtype)
        return gc.hidden_capture(x, x if delta else None, z(2, 5, 3 * 4096, dtype=dtype), 1)

    # --- moe: bf16 x and experts, fp32 router weight/bias (the model's .float()), int64 routes
    def moe(rows, dtype, act, experts=128, top_k=6, n_group=1, topk_group=1, norm=True, inter=128, hin=256):
        x = z(rows, hin, dtype=dtype)
        return gmoe.moe(x, x, z(experts, hin), z(experts), z(experts, inter, hin, dtype=dtype),
                        z(experts, hin, inter, dtype=dtype), top_k, n_group, topk_group, norm, 2.5, act)

    return [
        ("mamba causal_conv1d T=5 bias", lambda: conv(5, False, True, i64)),
        ("mamba causal_conv1d T=1 no bias", lambda: conv(1, False, False, i32)),
        ("mamba tree_conv1d T=7 bias", lambda: conv(7, True, True, i64)),
        ("mamba tree_conv1d T=1 width 2 no bias", lambda: conv(1, True, False, i32, width=2)),
        ("mamba causal_conv1d T=5 silu", lambda: conv(5, False, True, i64, act="silu")),
        ("mamba tree_conv1d T=17 silu", lambda: conv(17, True, True, i64, act="silu")),
        ("mamba_dt T=5 bf16 (0, inf)", lambda: dt(5, 0.0, float("inf"))),
        ("mamba_dt T=1 fp32 (0.001, 0.1)", lambda: dt(1, 0.001, 0.1, f32)),
        ("mamba_dt T=40 fp16 no limits", lambda: dt(40, None, None, f16)),
        ("mamba ssm_scan T=5", lambda: gm.ssm_scan(*ssm(5), 128)),
        ("mamba ssm_scan T=1 fp32 dt", lambda: gm.ssm_scan(*ssm(1, dt_dtype=f32), 128)),
        ("mamba ssm_state T=1 heads_per_group=1", lambda: gm.ssm_state(*pick(ssm(1, groups=8), 0, 1, 2, 3, 6))),
        ("mamba ssm_scan_states T=5", lambda: gm.ssm_scan_states(*ssm(5))),
        ("mamba tree_ssm_scan T=7", lambda: gm.tree_ssm_scan(*ssm(7), chain(7))),
        ("attention causal T=1 (decode)", lambda: causal(1, 256)),
        ("attention causal T=4 split", lambda: causal(4, 4096, pos_dtype=i64)),
        ("attention causal T=4 window+sinks", lambda: causal(4, 512, window=128, sinks=True)),
        ("attention causal T=1 window+sinks split", lambda: causal(1, 4096, window=1024, sinks=True)),
        ("attention causal fp32 D=256 split", lambda: causal(2, 4096, f32, 256)),
        ("attention causal fp16 D=64", lambda: causal(2, 256, f16, 64)),
        ("attention causal bf16 D=256 T=16 split", lambda: causal(16, 4096, dim=256)),
        ("tree_attention T=8", lambda: tree(8, 256)),
        ("tree_attention T=8 split", lambda: tree(8, 4096)),
        ("masked_attention T=8", lambda: masked(8, 256)),
        ("masked_attention T=8 split", lambda: masked(8, 4096)),
        ("nvfp4 bf16 1 row no bias", lambda: fp4((1,), 256, 512, bf16, False)),
        ("nvfp4 bf16 6 rows bias", lambda: fp4((2, 3), 256, 320, bf16, True)),
        ("nvfp4 fp16 4 rows bias", lambda: fp4((4,), 16, 80, f16, True)),
        ("nvfp4 fp32 16 rows no bias", lambda: fp4((16,), 100, 256, f32, False)),
        ("fp4 markov head 8 rows V=1024 rank 256 bf16 W1", lambda: markov(8, 1024, 256, bf16, torch.ones(()))),
        ("fp4 markov head 20 rows V=100 rank 32 host scale", lambda: markov(20, 100, 32, f32, 0.5)),
        ("rms_norm bf16 4096", lambda: norm(False)),
        ("rms_norm fp32 4096", lambda: norm(False, f32, f32)),
        ("gated_rms_norm bf16 groups of 1024", lambda: norm(True)),
        ("gated_rms_norm bf16 x, fp32 weight", lambda: norm(True, f32)),
        ("hidden capture bf16 with the residual add", lambda: capture(bf16, True)),
        ("hidden capture fp32 first slot", lambda: capture(f32, False)),
        ("moe bf16 relu2 1 row top-6 of 128", lambda: moe(1, bf16, "relu2")),
        ("moe bf16 silu 32 rows", lambda: moe(32, bf16, "silu")),
        ("moe fp16 gelu 4 rows 4 groups", lambda: moe(4, f16, "gelu", 16, 4, 4, 2, False)),
        ("moe fp32 relu 3 rows top-1, groups of one", lambda: moe(3, f32, "relu", 8, 1, 8, 1, False)),
    ]


class _Sm90Driver:
    """Stands in for triton's CUDA driver: the JIT asks it only for the device, stream and target."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)


def main() -> int:
    import importlib
    import inspect
    import time
    import traceback

    import triton
    from triton.runtime.driver import driver

    from builder.backends import gpu

    assert not gpu.interpreting(), "run with TRITON_INTERPRET=0"
    driver.set_active(_Sm90Driver())
    seen = {}        # (module, kernel) -> list of {name: value} of the constants compiled with
    failures = []
    distinct = set()

    class Warm:
        """``jit(fn)[grid](*args, **meta)`` compiles (JIT specialisation as a launch) and returns."""

        def __init__(self, fn):
            self.fn, self.kernel = fn, triton.jit(fn)

        def __getitem__(self, grid):
            def compile_only(*args, **meta):
                compiled = self.kernel.warmup(*args, grid=grid, **meta)
                names = self.kernel.arg_names
                consts = {names[k[0]]: v for k, v in compiled.src.constants.items()}
                key = (self.fn.__module__.rsplit(".", 1)[1], self.fn.__name__)
                assert compiled.metadata.target.arch == 90 and compiled.asm.get("cubin"), key
                assert compiled.metadata.shared <= SM90_SHARED, (
                    f"{key[1]} {consts}: {compiled.metadata.shared} bytes of shared memory, "
                    f"over sm_90's {SM90_SHARED}")
                seen.setdefault(key, []).append(consts)
                if compiled.hash not in distinct:
                    distinct.add(compiled.hash)
                    print(f"  {key[1]} {sorted(consts.items())} shared={compiled.metadata.shared}")
            return compile_only

    jitted = {}

    def warm(fn):
        return jitted.setdefault(fn, Warm(fn))

    gpu.jit = warm
    homes = {"nvfp4_rows": "plugins.nvfp4_rows", "hidden_capture": "plugins.hidden_capture"}
    importlib.import_module("builder.backends.gpu.capture")
    modules = {name: importlib.import_module(homes.get(name, f"builder.backends.gpu.{name}")) for name in MUST}
    modules["mamba"].jit = warm          # mamba imported jit by name
    importlib.import_module("plugins.fp4_markov_head").jit = warm   # so did the Markov head
    modules["hidden_capture"].jit = warm                              # and hidden capture
    start = time.time()
    for label, call in _scenarios():
        print(label, flush=True)
        gpu._warned.clear()
        try:
            call()
        except Exception:
            failures.append(f"{label}:\n{traceback.format_exc()[-1500:]}")
            continue
        if gpu._warned:
            failures.append(f"{label}: the op declined ({sorted(gpu._warned)}), so nothing compiled")
    for name, mod in modules.items():
        kernels = {n for n, f in vars(mod).items() if n.endswith("_kernel") and inspect.isfunction(f)}
        if kernels != set(MUST[name]):
            failures.append(f"{name}: kernels {sorted(kernels)}, but MUST lists {sorted(MUST[name])}")
        for kernel, want in MUST[name].items():
            compiled = seen.get((name, kernel), [])
            if not compiled:
                failures.append(f"{name}.{kernel}: never compiled")
            for keys, values in want.items():
                keys = keys if isinstance(keys, tuple) else (keys,)
                got = {tuple(c.get(k) for k in keys) for c in compiled}
                missing = {v if isinstance(v, tuple) else (v,) for v in values} - got
                if missing:
                    failures.append(f"{name}.{kernel}: no compile with {keys} = {sorted(missing)}")
    print(f"{len(distinct)} distinct kernels in {time.time() - start:.1f}s")
    for f in failures:
        print("FAILED", f)
    if not failures:
        print("compiled")
    return 1 if failures else 0


def test_every_gpu_kernel_compiles_to_an_sm90_cubin_as_launched():
    """One process for all the modules (see the module docstring); its output names each failure."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    run = subprocess.run([sys.executable, str(Path(__file__).resolve())], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=540)
    assert run.returncode == 0 and run.stdout.rstrip().endswith("compiled"), (
        run.stdout[-6000:] + "\n" + run.stderr[-3000:])


if __name__ == "__main__":
    sys.exit(main())
