"""The jinja2 environment chat templates are parsed in (at build, when the checkpoint's is copied)
and rendered in (the OpenAI frontend): transformers' own, so a template that renders there renders
here: sandboxed, trim_blocks and lstrip_blocks, loop controls (``break``, ``continue``), the
``generation`` block (rendered as its body), ``strftime_now`` and a ``tojson`` that takes
``json.dumps``'s keywords."""
from __future__ import annotations

import json
from datetime import datetime

import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks the assistant's part for training masks in
    transformers; a prompt is its body as it is."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _Generation])
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env
