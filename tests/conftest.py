import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """kind -> directory of a tiny transformers-written NemotronH checkpoint (made once)."""
    from tiny_models import tiny_checkpoint

    class _Lazy(dict):
        def __missing__(self, kind):
            self[kind] = tiny_checkpoint(kind, tmp_path_factory)
            return self[kind]

    return _Lazy()
