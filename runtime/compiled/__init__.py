"""The compiled CPU path: the runtime's recurring fixed-shape steps (decode, verify, rollback, a
draft's rows and catch-up) run through ``torch.compile``, the rest eagerly. ``runner`` holds the
target's runner (``CompiledRunner``) and the warm-ups, ``draft`` the draft's (``CompiledDraft``),
``shapes`` how a step's inputs are laid out and padded so one graph serves many calls, ``steps``
compiles one function per recurring shape key (``_Steps``: ``aot_compile``, inductor's options and
cache directory, the compile log), ``store`` keeps compiled steps on disk so a later process loads
them instead of tracing again, and ``direct_call`` calls a compiled step at its innermost function,
past the wrappers around it. ``small_linear`` builds and loads the C++ kernels the compiled graphs
call for few-row products and routed MoE experts (``kernels/``).
"""
