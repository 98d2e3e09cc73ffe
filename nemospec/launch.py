"""The `nemospec` console entry: a command that runs models (``nemospec.MODEL_COMMANDS``)
re-executes itself once with mimalloc preloaded (``runtime.allocator``) before it imports anything
heavy; then the command runs."""
from __future__ import annotations

import sys


def main() -> int:
    from nemospec import preload_for
    preload_for(sys.argv[1:])
    from nemospec.cli import main as run
    return run()


if __name__ == "__main__":
    sys.exit(main())
