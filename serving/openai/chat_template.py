"""Chat messages -> prompt text with the checkpoint's ``chat_template`` (``tokenizer_config.json``),
rendered with jinja2 the way transformers renders it (``builder.chat_template_env``) with
``messages``, ``add_generation_prompt``, ``bos_token``/``eos_token`` and a ``raise_exception`` helper.
Text parts of one message are joined with a newline, as vLLM joins them (joined with nothing, "Hello"
and "world" would reach the model as "Helloworld")."""
from __future__ import annotations

from pathlib import Path

from serving.openai.errors import APIError, bad


#: OpenAI's message roles; another is refused (OpenAI refuses it; a template would render it blindly)
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
PART_SEPARATOR = "\n"
RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "raise_exception")


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
        from jinja2 import meta

        from builder.chat_template_env import environment
        env = environment()
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(source)
        self.variables = frozenset(meta.find_undeclared_variables(env.parse(source)))   # what it reads
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_engine_dir(cls, engine_dir) -> "ChatTemplate | None":
        """The engine directory's template (copied from the checkpoint at build), None without one."""
        path = Path(engine_dir) / "tokenizer_config.json"
        if not path.is_file():
            return None
        from builder.tokenizer_file import read_tokenizer_config
        config = read_tokenizer_config(path)   # a damaged file: one line naming it
        source = config.get("chat_template")
        if isinstance(source, list):     # named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render(self, messages: list, add_generation_prompt: bool = True, kwargs: dict | None = None) -> str:
        """The prompt; ``kwargs`` (vLLM's chat_template_kwargs) must each be a variable the template
        reads: one it ignores would be silently dropped (``enable_thinking`` on a template without it)."""
        if not isinstance(messages, list) or not messages:
            raise bad("messages", "expected a non-empty list of {role, content} objects")
        contents = [_content(m, i) for i, m in enumerate(messages)]   # checks each is an object first
        normalised = [{**m, "content": c} for m, c in zip(messages, contents)]
        for key in kwargs or {}:
            if key in RESERVED:      # the prompt would no longer be the one the request's fields describe
                raise bad(f"chat_template_kwargs.{key}", "set by the server (use the request's own field)")
            if key not in self.variables:
                reads = ", ".join(sorted(self.variables - set(RESERVED))) or "nothing else"
                raise bad(f"chat_template_kwargs.{key}", f"the chat template does not read it (it reads: {reads})")
        try:
            return self.template.render(**(kwargs or {}), messages=normalised,
                                        add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, tools=None)
        except TemplateError as e:
            raise bad("messages", f"the chat template refused them: {e}") from None
        except Exception as e:
            raise APIError(500, f"chat template failed: {type(e).__name__}: {e}") from None


def _content(m, i: int) -> str:
    """Message ``i``'s text: a string, or its text parts joined by PART_SEPARATOR (each part's
    ``text`` a string: a null one would reach the model as "None")."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad(f"messages[{i}]", "expected an object with a string 'role'")
    if m["role"] not in ROLES:
        raise bad(f"messages[{i}].role", f"expected one of {', '.join(ROLES)}, got {m['role']!r}")
    content = m.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}] parts
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise bad(f"messages[{i}].content", "only text parts are supported")
        if not all(isinstance(p.get("text"), str) for p in content):
            raise bad(f"messages[{i}].content", "each text part needs a string 'text'")
        return PART_SEPARATOR.join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad(f"messages[{i}].content", "expected a string or a list of text parts")
    return content
