"""A tokenizer.json loaded for a command: a damaged or missing file is one line naming it (exit 2 in
the CLI), not the tokenizers library's bare exception."""
from __future__ import annotations

from pathlib import Path

from builder.errors import NemospecError


def load_tokenizer(path):
    from tokenizers import Tokenizer
    path = Path(path)
    if not path.is_file():
        raise NemospecError(f"{path}: expected a tokenizer.json file"
                            f"{', got a directory' if path.is_dir() else ', no such file'}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:   # the library raises a bare Exception with serde's message
        raise NemospecError(f"{path}: not a readable tokenizer.json ({e})") from None
