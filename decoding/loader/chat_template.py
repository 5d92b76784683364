"""A model's chat template, rendered exactly as transformers' ``apply_chat_template`` renders it.

The Jinja text comes from the model file (``tokenizer.chat_template``) and was
written for transformers' environment, so rendering it anywhere else must give
the same bytes, or the model sees a prompt it was not trained on. What that
environment has and plain Jinja lacks, mirrored here without importing
transformers (seconds, on every CLI call):

* ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension
  (``{% break %}``) and the ``{% generation %}`` tag (which only marks the
  assistant's tokens for training: it renders its body);
* ``tojson`` without HTML escaping, keys in the given order, non-ASCII kept;
* the globals ``raise_exception``, ``strftime_now`` (Llama 3.2 prints today's
  date), ``dict`` and a ``namespace`` that refuses underscore names;
* the inputs as transformers hands them over: keys whose value is None are
  dropped from each message (templates test ``'tool_calls' in message``),
  ``tools``/``documents`` are always defined (None when absent), and a
  message's reasoning, under any of its names, is passed as both
  ``reasoning_content`` (Qwen3) and ``thinking`` (gpt-oss).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from decoding.errors import ModelLoadError

# The names a message's reasoning arrives under; templates read the first (gpt-oss's: "thinking").
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ModelLoadError):
    """The template refused the conversation (its ``raise_exception``) or could not render it."""


class ChatTemplate:
    """One compiled template; :meth:`render` takes what ``apply_chat_template`` takes."""

    def __init__(self, source: str):
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ModelLoadError(f"the model's chat template does not compile: {exc}") from exc

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, special_tokens: Mapping[str, str] | None = None,
               **variables: Any) -> str:
        """The prompt text; ``variables`` are the template's own switches (``enable_thinking``)."""
        context = {**(special_tokens or {}), **variables}
        try:
            return self._template.render(
                messages=[_as_template_sees(m) for m in messages], tools=tools, documents=None,
                add_generation_prompt=add_generation_prompt, **context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template cannot render this conversation: {exc}") from exc

    def mentions(self, text: str) -> bool:
        """Whether the template's source contains ``text`` (a tag it teaches, a variable it reads)."""
        return text in self.source


def _as_template_sees(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` as transformers passes it: None-valued keys dropped, reasoning under both names."""
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _raise_exception(message):
    raise ChatTemplateError(f"the model's chat template refused the conversation: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates, without handing them the ``dict`` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(Namespace):
    """Jinja's ``namespace``, refusing underscore attributes as transformers' does."""

    def __init__(*args, **kwargs):  # noqa: N805 - Jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}``: renders its body (transformers tracks it for masks)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_Namespace)
    return env
