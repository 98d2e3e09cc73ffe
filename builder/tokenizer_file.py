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


def read_tokenizer_config(path) -> dict:
    """tokenizer_config.json as an object, its ``chat_template`` (one, or a list of named ones) parsed
    by jinja2: a damaged file is one line naming it when a build copies it, not a failure of the
    server's chat endpoint later."""
    import json

    from jinja2 import TemplateSyntaxError

    from builder.chat_template_env import environment
    path = Path(path)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise NemospecError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise NemospecError(f"{path}: expected a JSON object, got {type(config).__name__}")
    templates = config.get("chat_template")
    for entry in [] if templates is None else templates if isinstance(templates, list) else [templates]:
        source = entry.get("template") if isinstance(entry, dict) else entry
        if not isinstance(source, str):
            raise NemospecError(f"{path}: field 'chat_template': expected a template string (or a list of "
                                f"{{name, template}} objects), got {json.dumps(entry)[:60]}")
        try:
            environment().parse(source)
        except TemplateSyntaxError as e:
            raise NemospecError(f"{path}: field 'chat_template': not a valid jinja2 template (line {e.lineno}: "
                                f"{e.message})") from None
    return config


def tokenizer_eos_id(directory, tokenizer) -> int | None:
    """The id of tokenizer_config.json's ``eos_token`` in ``directory`` (None without one): vLLM and
    the TensorRT-LLM backend stop on it beside the model's own end ids; a chat template ends each turn
    with it."""
    path = Path(directory) / "tokenizer_config.json"
    if not path.is_file():
        return None
    token = read_tokenizer_config(path).get("eos_token")
    if isinstance(token, dict):          # {"content": "</s>", ...} in older tokenizer configs
        token = token.get("content")
    return tokenizer.token_to_id(token) if isinstance(token, str) and token else None
