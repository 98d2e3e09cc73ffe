"""Writing an output directory so that a failure leaves nothing half-written behind."""
from __future__ import annotations

import shutil
import time
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_dir(final):
    """Yields a fresh temporary directory next to ``final``; renames it into place when the block
    succeeds (replacing an existing ``final``), deletes it when the block raises."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{time.time_ns()}")
    tmp.mkdir()
    try:
        yield tmp
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{time.time_ns()}")
            final.rename(old)
        tmp.rename(final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
