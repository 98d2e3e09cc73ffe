"""The `nemospec` commands: the one place that wires command lines to the modules doing the work
(build -> builder, generate -> runtime, serve -> serving, bench and demo -> all three). Top of the
import graph: nothing in builder, runtime or serving imports it."""

# the commands whose processes run models: started on mimalloc (runtime.allocator); `build` keeps
# glibc's malloc, whose peak RSS the build's memory estimate was measured against
MODEL_COMMANDS = ("generate", "serve", "bench")
