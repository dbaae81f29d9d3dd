"""Generated text split into the text outside calls and the calls, as it streams, per call format.

A call format is where a call opens and closes (its delimiters) and how its body is read.
Text that may be the start of an opening delimiter is held back until the next piece tells;
a call is handed on once its closing delimiter has arrived (or, for a format whose call is the
whole rest of the answer, at the end). So the same text gives the same content and calls
however it is cut into pieces.

The formats (tool_calls.py says which model families write each):

- ``hermes``: ``<tool_call>`` body ``</tool_call>``, the body JSON (an object, or a list of them);
- ``llama3_json``: the whole answer, when it starts (after white space and an optional
  ``<|python_tag|>``) with ``{"name"``; its body JSON;
- ``functiongemma``: ``<start_function_call>call:NAME`` body ``<end_function_call>``, the body
  JSON with bare keys and strings between ``<escape>`` marks; read as {"name", "arguments"}.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_SPACE = re.compile(r"\s*")


def _past_space(text: str, at: int) -> int:
    found = _SPACE.match(text, at)
    return at if found is None else found.end()


@dataclass(frozen=True)
class Found:
    """A whole delimiter at ``start:end`` of the text (with the call's name where it holds one)."""

    start: int
    end: int
    name: str | None = None


@dataclass(frozen=True)
class Pending:
    """Text from ``start`` on may be a delimiter: it waits for the next piece."""

    start: int


Delimiter = Callable[[str, int, bool], "Found | Pending | None"]


def literal(delimiter: str) -> Delimiter:
    """A delimiter that is one string."""

    def find(text: str, start: int, at_end: bool) -> Found | Pending | None:
        where = text.find(delimiter, start)
        if where >= 0:
            return Found(where, where + len(delimiter))
        if not at_end:
            for begin in range(max(start, len(text) - len(delimiter) + 1), len(text)):
                if delimiter.startswith(text[begin:]):
                    return Pending(begin)
        return None

    return find


_PYTHON_TAG = "<|python_tag|>"
_LLAMA3_CALL = re.compile(r"\s*(?:<\|python_tag\|>)?\s*(?=\{\s*\"name\")")


def _llama3_opening(text: str, start: int, at_end: bool) -> Found | Pending | None:
    """A Llama 3 call opens the answer, or nowhere: white space and an optional python tag
    before ``{"name"``, which is the body's start."""
    if start > 0:
        return None
    found = _LLAMA3_CALL.match(text)
    if found:
        return Found(0, found.end())
    return None if at_end or not _may_open_llama3(text) else Pending(0)


def _may_open_llama3(text: str) -> bool:
    """Whether more text could make ``text`` the start of a Llama 3 call."""
    at = _past_space(text, 0)
    if text.startswith(_PYTHON_TAG, at):
        at = _past_space(text, at + len(_PYTHON_TAG))
    elif _PYTHON_TAG.startswith(text[at:]):
        return True
    if at == len(text):
        return True
    if text[at] != "{":
        return False
    return '"name"'.startswith(text[_past_space(text, at + 1) :])


_FUNCTIONGEMMA_OPEN = literal("<start_function_call>call:")
_FUNCTIONGEMMA_NAME = re.compile(r"[^{\s]+")


def _functiongemma_opening(text: str, start: int, at_end: bool) -> Found | Pending | None:
    """``<start_function_call>call:`` and the name, which ends at ``{`` or white space (until one
    arrives, the name may still grow)."""
    while (found := _FUNCTIONGEMMA_OPEN(text, start, at_end)) is not None:
        if isinstance(found, Pending):
            return found
        name = _FUNCTIONGEMMA_NAME.match(text, found.end)
        if name and (name.end() < len(text) or at_end):
            return Found(found.start, name.end(), name.group())
        if not at_end and found.end + (len(name.group()) if name else 0) == len(text):
            return Pending(found.start)
        start = found.start + 1
    return None


def _json_or_text(body: str) -> Any:
    """The body as JSON; the text itself (stripped) where it is not JSON."""
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body.strip()


_ESCAPED = re.compile(r"<escape>(.*?)<escape>", re.DOTALL)
# A quoted string (kept as it is, so that key-like text inside it is never rewritten) or a bare key.
_BARE_KEY = re.compile(r'"(?:\\.|[^"\\])*"|(?<=[{,])(\s*)(\w+)(\s*):')


def _functiongemma_body(body: str) -> Any:
    """FunctionGemma's arguments: JSON but for bare keys and strings between <escape> marks."""
    parts = _ESCAPED.split(body)  # text, then each escaped string and the text after it
    written = [
        json.dumps(part) if odd else _BARE_KEY.sub(_quoted_key, part)
        for odd, part in ((i % 2 == 1, part) for i, part in enumerate(parts))
    ]
    try:
        return json.loads("".join(written))
    except json.JSONDecodeError:
        return body.strip()


def _quoted_key(match: re.Match) -> str:
    if match.group(2) is None:
        return match.group(0)
    return f'{match.group(1)}"{match.group(2)}"{match.group(3)}:'


@dataclass(frozen=True)
class CallFormat:
    opening: Delimiter
    close: str | None  # None: the call runs to the end of the answer
    read: Callable[[str, str | None], Any]  # (body, name from the opening) -> the call's value

    @property
    def closing(self) -> Delimiter | None:
        return None if self.close is None else literal(self.close)


FORMATS: dict[str, CallFormat] = {
    "hermes": CallFormat(literal("<tool_call>"), "</tool_call>", lambda body, _: _json_or_text(body)),
    "llama3_json": CallFormat(_llama3_opening, None, lambda body, _: _json_or_text(body)),
    "functiongemma": CallFormat(
        _functiongemma_opening,
        "<end_function_call>",
        lambda body, name: {"name": name, "arguments": _functiongemma_body(body)},
    ),
}


@dataclass(frozen=True)
class Call:
    """A call's text between its delimiters, and its value as the format reads it."""

    body: str
    value: Any


class CallSplitter:
    """Generated text in, piece by piece; out: the text outside calls so far, and each call once closed."""

    def __init__(self, format: str) -> None:
        self._format = FORMATS[format]
        self._closing = self._format.closing
        self._text = ""
        self._at = 0  # what is before this has been handed on
        self._call: tuple[str | None, list[str]] | None = None  # inside a call: its name and body so far

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self._text += text
        return self._split(at_end=False)

    def finish(self) -> tuple[str, list[Call]]:
        return self._split(at_end=True)

    def _split(self, *, at_end: bool) -> tuple[str, list[Call]]:
        content: list[str] = []
        calls: list[Call] = []
        while True:
            delimiter = self._format.opening if self._call is None else self._closing
            found = None if delimiter is None else delimiter(self._text, self._at, at_end)
            if isinstance(found, Found):
                self._hand_on(self._text[self._at : found.start], content)
                self._at = found.end
                if self._call is None:
                    self._call = (found.name, [])
                else:
                    calls.append(self._close())
                continue
            until = len(self._text) if at_end or found is None else found.start
            self._hand_on(self._text[self._at : until], content)
            self._at = until
            if at_end and self._call is not None:
                calls.append(self._close())
            return "".join(content), calls

    def _hand_on(self, text: str, content: list[str]) -> None:
        if text:
            (content if self._call is None else self._call[1]).append(text)

    def _close(self) -> Call:
        assert self._call is not None
        name, pieces = self._call
        self._call = None
        body = "".join(pieces)
        return Call(body, self._format.read(body, name))
