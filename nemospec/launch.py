"""The `nemospec` console entry: a model process re-executes itself once with mimalloc preloaded
(``runtime.allocator``) before it imports anything heavy, then runs its command."""
from __future__ import annotations

import sys


def main() -> int:
    from runtime.allocator import preload
    preload()
    from nemospec.cli import main as run
    return run()


if __name__ == "__main__":
    sys.exit(main())
