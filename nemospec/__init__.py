"""The `nemospec` commands: the one place that wires command lines to the modules doing the work
(build -> builder, generate -> runtime, serve -> serving, bench and demo -> all three). Top of the
import graph: nothing in builder, runtime or serving imports it."""

# the commands whose processes run models: started on mimalloc (runtime.allocator); `build` keeps
# glibc's malloc, whose peak RSS the build's memory estimate was measured against
MODEL_COMMANDS = ("generate", "serve", "bench")


def preload_for(argv: list) -> None:
    """An entry point's first act: mimalloc preloaded (``runtime.allocator.preload``, one re-exec)
    when ``argv`` (the arguments after the program) names a command in ``MODEL_COMMANDS``."""
    if argv[:1] and argv[0] in MODEL_COMMANDS:
        from runtime.allocator import preload
        preload()
