"""Chat messages -> prompt text with the checkpoint's ``chat_template`` (``tokenizer_config.json``),
rendered with jinja2 the way transformers renders it: a sandboxed environment with trim_blocks and
lstrip_blocks, ``messages``, ``add_generation_prompt``, ``bos_token``/``eos_token`` and a
``raise_exception`` helper."""
from __future__ import annotations

import json
from pathlib import Path

from serving.openai.errors import APIError, bad


class TemplateError(Exception):
    pass


def _raise(message):
    raise TemplateError(message)


def _token_text(value) -> str:
    if isinstance(value, dict):          # {"content": "<s>", ...} in older tokenizer configs
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_engine_dir(cls, engine_dir) -> "ChatTemplate | None":
        """The engine directory's template (copied from the checkpoint at build), None without one."""
        path = Path(engine_dir) / "tokenizer_config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        source = config.get("chat_template")
        if isinstance(source, list):     # named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: list, add_generation_prompt: bool = True) -> str:
        if not isinstance(messages, list) or not messages:
            raise bad("messages", "expected a non-empty list of {role, content} objects")
        normalised = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad(f"messages[{i}]", "expected an object with a string 'role'")
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}] parts
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise bad(f"messages[{i}].content", "only text parts are supported")
                content = "".join(str(p.get("text", "")) for p in content)
            if content is None or not isinstance(content, str):
                raise bad(f"messages[{i}].content", "expected a string or a list of text parts")
            normalised.append({**m, "content": content})
        try:
            return self.template.render(messages=normalised, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, tools=None)
        except TemplateError as e:
            raise bad("messages", f"the chat template refused them: {e}") from None
        except Exception as e:
            raise APIError(500, f"chat template failed: {type(e).__name__}: {e}") from None
