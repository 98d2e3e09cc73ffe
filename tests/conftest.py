import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# pytest-xdist's workers share the machine's cores (make test runs one per core): a thread each
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """kind -> directory of a tiny transformers-written NemotronH checkpoint (made once)."""
    from tiny_models import tiny_checkpoint

    class _Lazy(dict):
        def __missing__(self, kind):
            self[kind] = tiny_checkpoint(kind, tmp_path_factory)
            return self[kind]

    return _Lazy()


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of compiled-path tests: inductor builds its kernels for the thread
    count it compiles under, and two OpenMP threads on a CI machine shared with other work can run a
    step 10-100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
