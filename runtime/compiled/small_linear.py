"""``nemospec::small_linear``: x @ w^T for the few rows of a decode or verify step, on the compiled
CPU path (``runtime.compiled``).

The C++ kernel (``kernels/small_linear.cpp``) comes in two forms, one source built with two sets of
flags: AVX-512 and AVX2 + FMA. ``load`` picks one per process from the CPU's flags (AVX-512 where
the CPU has AVX-512F, else AVX2 where it has AVX2 and FMA; ``NEMOSPEC_SMALL_LINEAR_ISA=avx2`` runs
the AVX2 form on an AVX-512 CPU), builds it once per machine kind with ``torch.utils.cpp_extension``
into the compile cache, and registers it as a torch op with a fake (shape-only) implementation, so
inductor calls it from a compiled graph like any extern kernel; ``form()`` names the form loaded.
Only one form can register the ``nemospec`` ops in a process. ``install`` hands it to the torch
backend, which uses it only while ``torch.compile`` traces: the eager path keeps
``torch.nn.functional.linear`` and stays the reference. Where the CPU has neither form or the build
fails, nothing is installed (one warning) and the compiled path keeps MKL.

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
returned. Where the CPU lacks AVX512-BF16 (the AVX2 form, or ``NEMOSPEC_BF16_DOT=0``) the same dot
products run as fp32 FMAs over the bf16 pairs widened in registers: the same sums in the same order
(``small_linear_bf16_hardware`` says which ran).

Several-row products run tiles of column blocks as wide as the registers allow, except where the
packed weights exceed an Intel CPU's L3: there tiles of two blocks, faster from memory
(``nemospec::small_linear_tiles``, ``small_linear_streaming``; ``NEMOSPEC_SMALL_LINEAR_TILES`` forces
``wide`` or ``streaming``). The sums are the same either way.
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
HEADERS = [SOURCE.with_name(name) for name in ("bf16_dot.h", "bf16_fma.h", "moe_routed.h")]
# per form: the compiler flags (the source's vectors follow __AVX512F__) and the CPU flags it needs.
# -fopenmp: ATen's parallel_for runs on one thread in code built without it; -ffp-contract=off: a
# product and a sum written apart stay two roundings, as torch's ops round them (the kernels' FMAs
# are written as intrinsics)
_COMMON = ["-O3", "-mfma", "-std=c++17", "-fopenmp", "-ffp-contract=off"]
FORMS = {"avx512": (["-mavx512f", *_COMMON], {"avx512f"}),
         "avx2": (["-mavx2", *_COMMON], {"avx2", "fma"})}
ISA_ENV = "NEMOSPEC_SMALL_LINEAR_ISA"
TILES_ENV = "NEMOSPEC_SMALL_LINEAR_TILES"   # auto (default), wide or streaming: small_linear_tiles
C_SHIMS = {name: f"AOTITorchError aoti_torch_cpu_{name}(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0)"
           for name in ("small_linear", "small_linear_bf16w", "small_linear_bf16")}
C_SHIMS["moe_routed"] = ("AOTITorchError aoti_torch_cpu_moe_routed(AtenTensorHandle x, AtenTensorHandle index, "
                         "AtenTensorHandle weights, AtenTensorHandle up, AtenTensorHandle down, int64_t act, "
                         "int64_t form, AtenTensorHandle* ret0)")
_loaded: str | None = None   # the form whose ops this process registered


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def choose(flags: set[str] | None = None, forced: str | None = None) -> str | None:
    """The form this CPU runs: the fastest whose flags it has, or ``forced`` (``NEMOSPEC_SMALL_LINEAR_ISA``
    when not given) where the CPU has that one's; None where it runs neither."""
    if forced is None:
        forced = os.environ.get(ISA_ENV) or None
    if forced is not None and forced not in FORMS:
        raise ValueError(f"{ISA_ENV}: expected one of {', '.join(FORMS)}, got {forced!r}")
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    flags = _cpu_flags() if flags is None else flags
    for name in [forced] if forced else FORMS:
        if FORMS[name][1] <= flags:
            return name
    return None


def supported() -> bool:
    """An x86-64 Linux CPU that runs one of the kernel's forms (AVX-512F, or AVX2 and FMA)."""
    return choose() is not None


def form() -> str | None:
    """The kernel's form loaded in this process ("avx512" or "avx2"; "avx512, streaming tiles" while
    its several-row products take the tiles for weights from memory), None where none was (not
    loaded yet, not built, or not runnable here): what a report names."""
    if _loaded == "avx512" and torch.ops.nemospec.small_linear_streaming():
        return "avx512, streaming tiles"
    return _loaded


def lanes() -> int:
    """fp32 outputs per vector of the loaded form: the packed layout's column block ([N/lanes][K][lanes])."""
    return 16 if _loaded == "avx512" else 8


def _build_dir(cache: Path, name: str) -> Path:
    """One build directory per source, flags, torch and where they live: ninja's build file names the
    source's and the interpreter's absolute paths, so two checkouts (or a venv and Triton's stub) that
    shared a directory rebuilt the kernel each time the other had run (14 s each)."""
    import sysconfig
    code = b"".join(f.read_bytes() for f in [SOURCE, *HEADERS])
    where = f"{SOURCE} {sys.prefix} {sysconfig.get_paths()['include']} {torch.__file__}"
    key = hashlib.sha256(code + " ".join(FORMS[name][0]).encode() + torch.__version__.encode()
                         + where.encode()).hexdigest()[:16]
    path = cache / "kernels" / f"small_linear-{name}-{key}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.lru_cache(maxsize=1)
def load(cache: Path) -> bool:
    """Builds (first time on a machine, under ``cache``) or loads the kernel's form for this CPU
    (``choose``) and registers the op; False where it cannot run here."""
    global _loaded
    if os.environ.get("NEMOSPEC_SMALL_LINEAR", "1") == "0" or not supported():
        return False
    if not hasattr(torch.ops.nemospec, "small_linear"):   # else loaded already: one form per process
        name = choose()
        from torch.utils.cpp_extension import load as load_extension
        if shutil.which("ninja") is None:  # the venv's own ninja (pyproject), off PATH when not activated
            os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        start = time.perf_counter()
        library = "nemospec_small_linear" if name == "avx512" else f"nemospec_small_linear_{name}"
        try:
            build = _build_dir(cache, name)
            built = build / f"{library}.so"
            try:   # the directory's key names source, flags, torch and paths: a built library is current
                torch.ops.load_library(str(built))
            except OSError:   # not built yet (or another process is still linking it): ninja, under its lock
                load_extension(name=library, sources=[str(SOURCE)], extra_cflags=FORMS[name][0],
                               extra_ldflags=["-fopenmp"],
                               build_directory=str(build), is_python_module=False, verbose=False)
        except Exception as e:  # no compiler, no ninja, a header missing: MKL it is
            warnings.warn(f"nemospec::small_linear not built ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                          "compiled steps use torch's own GEMM", stacklevel=2)
            return False
        _loaded = name
        seconds = time.perf_counter() - start
        if seconds > 2:
            print(f"built nemospec::small_linear ({name}) in {seconds:.1f} s", file=sys.stderr, flush=True)

        for op in C_SHIMS:
            if op != "moe_routed":
                torch.library.register_fake(f"nemospec::{op}")(lambda x, w: x.new_empty((*x.shape[:-1], w.shape[0])))
        torch.library.register_fake("nemospec::moe_routed")(
            lambda x, index, weights, up, down, act, form: x.new_empty(x.shape))

        # the C shim's symbol, global, so that compiled graphs' wrappers resolve it when loaded
        ctypes.CDLL(str(build / f"{library}.so"), mode=os.RTLD_GLOBAL)
        tiles = os.environ.get(TILES_ENV)
        if tiles and not torch.ops.nemospec.small_linear_tiles(tiles):
            warnings.warn(f"{TILES_ENV}={tiles}: expected auto, wide or streaming; the products choose (auto)",
                          stacklevel=2)
        import torch._inductor.config as inductor
        inductor.aot_inductor.custom_ops_to_c_shims = {
            **inductor.aot_inductor.custom_ops_to_c_shims,
            **{getattr(torch.ops.nemospec, op).default: [shim] for op, shim in C_SHIMS.items()}}
    return True


def moe_counts():
    """``nemospec::moe_routed``'s running counts, [2, 49] int64: per row count (1..48, more in the
    last slot), calls and experts run by them; None where the kernel is not loaded."""
    return torch.ops.nemospec.moe_routed_counts() if _loaded else None


def install(cache: Path) -> bool:
    """Makes the torch backend's ``linear`` call the kernel inside compiled graphs (idempotent);
    ``cache`` is the compile cache the kernel is built into."""
    from builder.backends import torch_backend
    if not load(Path(cache)):
        return False
    ops = torch.ops.nemospec
    torch_backend.use_small_linear(ops.small_linear, ops.small_linear_bf16w, bf16=True,
                                   bf16_products_kernel=ops.small_linear_bf16, moe_kernel=ops.moe_routed)
    return True
