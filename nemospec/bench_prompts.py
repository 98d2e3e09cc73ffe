"""The bench's prompts: its built-in code completions, or a user's own (``--prompt_file``), whose
acceptance is what speculation earns on their traffic."""
from __future__ import annotations

import json
from pathlib import Path

from builder.errors import NemospecError

# code to complete (written for this benchmark; the embedded model was trained on the stdlib's style)
PROMPTS = (
    "import os\nimport sys\n\n\ndef main(argv=None):\n    ",
    "class Error(Exception):\n    \"\"\"Base class for exceptions in this module.\"\"\"\n\n    def __init__(self, msg):\n",
    "    def __repr__(self):\n        return ",
    "def _check_arg(name, value):\n    if not isinstance(value, str):\n        raise TypeError(",
    "        for key, value in self.items():\n            if ",
    "    @property\n    def name(self):\n        ",
)
FIELDS = ("prompt", "text")   # vLLM's custom dataset's field, and a plain text one


def read_prompt_file(path) -> list[str]:
    """JSON lines, each a string or an object with a ``prompt`` (or ``text``) string; blank lines are
    skipped. A line that is neither, or a file without prompts, is an error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise NemospecError(f"--prompt_file {path}: no such file")
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as e:
            raise NemospecError(f"--prompt_file {path}:{n}: not a JSON line ({e})") from None
        if isinstance(value, dict):
            value = next((value[f] for f in FIELDS if f in value), None)
        if not isinstance(value, str) or not value:
            raise NemospecError(f"--prompt_file {path}:{n}: expected a non-empty string or an object with a "
                                f"\"prompt\" string")
        prompts.append(value)
    if not prompts:
        raise NemospecError(f"--prompt_file {path}: no prompts in it")
    return prompts
