"""The process a chat template renders in (worker/chat_template.py starts it and talks to it).

A chat template is a program that comes with the model: it may loop 10^10 times or build a
string of a terabyte. Rendered here, in a process of its own, its memory is bounded by the
kernel (the address space this process may take), its time by the worker, which kills it
past its deadline or at a cancel, and the worker's threads never run it. The environment is
transformers' own for chat templates (its ``apply_chat_template``): jinja2's immutable sandbox,
``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and ``{% generation %}``
tag, the ``tojson`` filter and the ``raise_exception``, ``strftime_now``, ``dict`` and
``namespace`` globals, so the text is the one transformers renders.

Requests and replies are msgpack frames, each after its length in 4 bytes (little-endian), on
stdin and stdout. Imports only msgspec and jinja2 (the worker starts it with ``python -I``).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from datetime import datetime
from typing import Any, Literal

import msgspec

# What the watchdog waits between looks at its parent: a process whose worker died ends.
_PARENT_CHECK_S = 0.5
_MESSAGE_CHARS = 2000  # of an exception's text, in a reply
_COMPILED_KEPT = 4  # templates kept compiled (a model has one or two)


class RenderRequest(msgspec.Struct, frozen=True):
    template: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    add_generation_prompt: bool
    variables: dict[str, Any]  # the tokenizer's special tokens, as transformers passes them
    max_chars: int  # the most text the template may write


class RenderReply(msgspec.Struct, frozen=True):
    text: str = ""
    # Why there is no text: the template raised (``detail`` says what), wrote more than
    # max_chars, or ran out of the memory this process may take.
    failed: Literal["raised", "too_long", "memory"] | None = None
    detail: str = ""


def frame(reply_or_request: msgspec.Struct) -> bytes:
    body = msgspec.msgpack.encode(reply_or_request)
    return len(body).to_bytes(4, "little") + body


def serve(parent: int, memory_bytes: int) -> None:
    """Render requests from stdin until it ends."""
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    _limit_memory(memory_bytes)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    decoder = msgspec.msgpack.Decoder(RenderRequest)
    compiled: dict[str, Any] = {}
    while len(header := stdin.read(4)) == 4:
        request = decoder.decode(stdin.read(int.from_bytes(header, "little")))
        reply = _render(request, compiled)
        stdout.write(frame(reply))
        stdout.flush()
        if reply.failed == "memory":  # what the failed render left is not worth keeping
            return


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_PARENT_CHECK_S)
    os._exit(1)


def _limit_memory(memory_bytes: int) -> None:
    """At most ``memory_bytes`` of address space more than this process holds now."""
    try:
        with open("/proc/self/statm") as statm:
            held = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no /proc: the bound counts from nothing
        held = 0
    resource.setrlimit(resource.RLIMIT_AS, (held + memory_bytes, held + memory_bytes))


def _render(request: RenderRequest, compiled: dict[str, Any]) -> RenderReply:
    try:
        template = compiled.get(request.template)
        if template is None:
            if len(compiled) >= _COMPILED_KEPT:
                compiled.clear()
            template = compiled[request.template] = _environment().from_string(request.template)
        pieces, written = [], 0
        for piece in template.generate(
            messages=request.messages, tools=request.tools, documents=None,
            add_generation_prompt=request.add_generation_prompt, **request.variables,
        ):
            written += len(piece)
            if written > request.max_chars:
                return RenderReply(failed="too_long")
            pieces.append(piece)
        return RenderReply(text="".join(pieces))
    except MemoryError:
        return RenderReply(failed="memory")
    except Exception as exc:  # a template may raise on roles or tools it does not know
        return RenderReply(failed="raised", detail=str(exc)[:_MESSAGE_CHARS])


def _environment():
    """transformers' environment for chat templates (chat_template_utils._compile_jinja_template)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}…{% endgeneration %}`` marks the assistant's text for training masks: its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        """``dict`` without the class's attributes."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore-prefixed attributes (CPython's internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
                )

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                               namespace=TemplateNamespace)
    return environment
