"""The compiled CPU path: the runtime's recurring fixed-shape steps (decode, verify, rollback, a
draft's rows and catch-up) run through ``torch.compile``, the rest eagerly. ``runner`` holds the
runners that choose which calls run compiled (``CompiledRunner`` for a target, ``CompiledDraft``
for a draft, the warm-ups), ``steps`` compiles one function per recurring shape key (``_Steps``:
``aot_compile``, inductor's options and cache directory, the compile log), ``store`` keeps compiled
steps on disk so a later process loads them instead of tracing again, and ``direct_call`` calls a
compiled step at its innermost function, past the wrappers around it. The small-row GEMM kernel
that the compiled graphs call lives in ``runtime.small_linear`` and ``runtime/kernels/``.
"""
