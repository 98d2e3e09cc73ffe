"""``nemospec::small_linear``: x @ w^T for the few rows of a decode or verify step, on the compiled
CPU path (``runtime.compiled``).

The C++ kernel (``kernels/small_linear.cpp``, AVX-512) is built once per machine kind with
``torch.utils.cpp_extension`` into the compile cache, and registered as a torch op with a fake
(shape-only) implementation, so inductor calls it from a compiled graph like any extern kernel.
``install`` hands it to the torch backend, which uses it only while ``torch.compile`` traces: the
eager path keeps ``torch.nn.functional.linear`` and stays the reference. Where the CPU has no
AVX-512 or the build fails, nothing is installed (one warning) and the compiled path keeps MKL.

The kernel copies a weight into a packed layout at its second use (kept while the weight lives,
within a byte budget, 4 GiB by default); ``nemospec::small_linear_packing``,
``small_linear_pack_budget`` and ``small_linear_packed_bytes`` switch, bound and report it.
``nemospec::small_linear_bf16w`` multiplies by the weight rounded to bf16 (a packed bf16 copy made at
its first use): the compiled path's draft weights when the build asks for them
(``--draft_weight_dtype bfloat16``), half the bytes per proposal. Given bf16 x and w (a bf16 model)
``small_linear`` multiplies them with AVX512-BF16 dot products (fp32 sums, bf16 result) where the CPU
has them: twice the multiply-adds per instruction of fp32, and each row's result independent of the
call's row count (a bf16 verify's products are a bf16 decode's; the graphs' other fused ops may still
round apart, see the README). ``nemospec::small_linear_bf16`` is ``--matmul_precision medium``: fp32 x
and w rounded to bf16 (w once, when packed) and multiplied by the same dot products, the fp32 sums
returned (where the CPU lacks AVX512-BF16: x rounded, times the bf16 copy of w, in fp32 FMAs).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels") / "small_linear.cpp"
HEADERS = [SOURCE.with_name("bf16_dot.h")]
FLAGS = ["-O3", "-mavx512f", "-mfma", "-std=c++17"]
C_SHIMS = {name: f"AOTITorchError aoti_torch_cpu_{name}(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0)"
           for name in ("small_linear", "small_linear_bf16w", "small_linear_bf16")}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def supported() -> bool:
    """An x86-64 Linux CPU with AVX-512F (the kernel's instruction set)."""
    return platform.machine() in ("x86_64", "AMD64") and "avx512f" in _cpu_flags()


def _build_dir(cache: Path) -> Path:
    code = b"".join(f.read_bytes() for f in [SOURCE, *HEADERS])
    key = hashlib.sha256(code + " ".join(FLAGS).encode() + torch.__version__.encode()).hexdigest()[:16]
    path = cache / "kernels" / f"small_linear-{key}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.lru_cache(maxsize=1)
def load(cache: Path) -> bool:
    """Builds (first time on a machine, under ``cache``) or loads the kernel and registers the op;
    False where it cannot run here."""
    if os.environ.get("NEMOSPEC_SMALL_LINEAR", "1") == "0" or not supported():
        return False
    if not hasattr(torch.ops.nemospec, "small_linear"):
        from torch.utils.cpp_extension import load as load_extension
        if shutil.which("ninja") is None:  # the venv's own ninja (pyproject), off PATH when not activated
            os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        start = time.perf_counter()
        try:
            build = _build_dir(cache)
            load_extension(name="nemospec_small_linear", sources=[str(SOURCE)], extra_cflags=FLAGS,
                           build_directory=str(build), is_python_module=False, verbose=False)
        except Exception as e:  # no compiler, no ninja, a header missing: MKL it is
            warnings.warn(f"nemospec::small_linear not built ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                          "compiled steps use torch's own GEMM", stacklevel=2)
            return False
        seconds = time.perf_counter() - start
        if seconds > 2:
            print(f"built nemospec::small_linear in {seconds:.1f} s", file=sys.stderr, flush=True)

        for name in C_SHIMS:
            torch.library.register_fake(f"nemospec::{name}")(lambda x, w: x.new_empty((*x.shape[:-1], w.shape[0])))

        # the C shim's symbol, global, so that compiled graphs' wrappers resolve it when loaded
        ctypes.CDLL(str(build / "nemospec_small_linear.so"), mode=os.RTLD_GLOBAL)
        import torch._inductor.config as inductor
        inductor.aot_inductor.custom_ops_to_c_shims = {
            **inductor.aot_inductor.custom_ops_to_c_shims,
            **{getattr(torch.ops.nemospec, name).default: [shim] for name, shim in C_SHIMS.items()}}
    return True


def install(cache: Path) -> bool:
    """Makes the torch backend's ``linear`` call the kernel inside compiled graphs (idempotent);
    ``cache`` is the compile cache the kernel is built into."""
    from builder.backends import torch_backend
    if not load(Path(cache)):
        return False
    ops = torch.ops.nemospec
    torch_backend.use_small_linear(ops.small_linear, ops.small_linear_bf16w, bf16=ops.small_linear_bf16_supported(),
                                   bf16_products_kernel=ops.small_linear_bf16)
    return True
