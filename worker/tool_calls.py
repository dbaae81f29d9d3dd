"""Tools in, tool calls out: how a model is told about tools and how its calls are read back.

A model's chat template decides how tools reach it and how its calls look. The worker
recognizes the call formats of the common templates from the template's source:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, Qwen3,
  SmolLM3, Hermes; a JSON list inside the tags, as SmolLM2 writes, is read as several calls);
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}``, after an optional
  ``<|python_tag|>`` (Llama 3.1, 3.2, 3.3);
- ``functiongemma``: ``<start_function_call>call:name{key:<escape>text<escape>}<end_function_call>``.

A template that does not render tools (SmolLM2, Gemma 3) gets them from the worker instead, as a
system message in the ``hermes`` format, which is also the format read back.

Calls are read as the text streams (call_text.py), each reported as soon as its closing
delimiter arrives.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any

import msgspec

from protocol.errors import ErrorKind, RpcError
from protocol.methods import ChatMessage, GenerateParams, NamedToolChoice, Tool, ToolCall, ToolCallSupport
from worker.call_text import FORMATS, Call, CallSplitter

# Formats whose calls are JSON throughout, so that a grammar can force them.
_FORCEABLE = {"hermes", "llama3_json"}


def support(chat_template: str | None) -> ToolCallSupport:
    """What the worker can do with tools for a model with this chat template."""
    source = chat_template or ""
    takes_tools = "tools" in source
    if not takes_tools:  # the worker writes the tools as a system message, in its own format
        return ToolCallSupport(template_takes_tools=False, format="hermes", forced=True)
    if "<tool_call>" in source:
        found = "hermes"
    elif "<start_function_call>" in source:
        found = "functiongemma"
    elif "<|python_tag|>" in source or '"parameters"' in source:
        found = "llama3_json"
    else:
        found = None
    return ToolCallSupport(template_takes_tools=True, format=found, forced=found in _FORCEABLE)


def request_tools(params: GenerateParams) -> list[Tool]:
    """The tools a request gives the model (also with tool_choice "none": the prompt, and so a
    cache of it, stays the same across the steps of a tool loop), checked against tool_choice."""
    if not params.tools and params.tool_choice not in ("auto", "none"):
        raise RpcError(
            ErrorKind.INVALID_PARAMS,
            "tool_choice asks for a tool call, but no tools are given; give 'tools' or leave out tool_choice.",
            field="params.tool_choice",
        )
    if not params.tools:
        return []
    first: dict[str, int] = {}
    for i, tool in enumerate(params.tools):
        if (earlier := first.setdefault(tool.function.name, i)) != i:
            raise RpcError(
                ErrorKind.INVALID_PARAMS,
                f"Tools {earlier} and {i} are both named {tool.function.name!r}; give each tool its own name.",
                field=f"params.tools[{i}].function.name",
            )
    if isinstance(params.tool_choice, NamedToolChoice):
        names = [tool.function.name for tool in params.tools]
        if params.tool_choice.function.name not in names:
            raise RpcError(
                ErrorKind.INVALID_PARAMS,
                f"tool_choice names the tool {params.tool_choice.function.name!r}, which is not among the "
                f"tools given ({', '.join(map(repr, names))}); name one of them.",
                field="params.tool_choice.function.name",
            )
    return params.tools


def for_template(
    messages: Sequence[ChatMessage], tools: Sequence[Tool], support: ToolCallSupport
) -> tuple[list[ChatMessage], list[Tool]]:
    """The conversation and tools as the chat template gets them. A template that does not
    render tools gets them as a system message, and earlier calls and their results as text."""
    if support.template_takes_tools:
        return list(messages), list(tools)
    conversation = [_as_text(m) for m in messages]
    if tools:
        described = _HERMES_SYSTEM.format(tools="\n".join(json.dumps(msgspec.to_builtins(t)) for t in tools))
        if conversation[0].role == "system":
            conversation[0] = ChatMessage(role="system", content=conversation[0].content + "\n\n" + described)
        else:
            conversation.insert(0, ChatMessage(role="system", content=described))
    return conversation, []


_HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_dict(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it: the arguments of earlier calls as objects."""
    as_dict = msgspec.to_builtins(message)
    for call in as_dict.get("tool_calls") or []:
        arguments = call["function"]["arguments"]
        if isinstance(arguments, str):
            try:
                call["function"]["arguments"] = json.loads(arguments)
            except json.JSONDecodeError:
                pass  # a template prints a string as it is
    return as_dict


def _as_text(message: ChatMessage) -> ChatMessage:
    """A message for a template that knows no tools: calls written as the model writes them,
    results as a user turn."""
    if message.role == "tool":
        return ChatMessage(role="user", content=f"<tool_response>\n{message.content}\n</tool_response>")
    content = message.content
    for call in template_dict(message).get("tool_calls") or []:
        # As a forced call is written (forced_grammar), so that the next prompt continues its text.
        written = json.dumps(
            {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}, ensure_ascii=False
        )
        content += f"\n<tool_call>\n{written}\n</tool_call>"
    return ChatMessage(role=message.role, content=content.lstrip("\n"), name=message.name)


def call_reader(params: GenerateParams, support: ToolCallSupport) -> ToolCallReader | None:
    """What reads a request's calls back; None when nothing is read ("none", no tools, or a
    template whose call format the worker does not know). The tools were checked with the
    prompt (request_tools)."""
    if not params.tools or params.tool_choice == "none" or support.format is None:
        return None
    return ToolCallReader(support.format, params.tools)


class ToolCallReader:
    """Generated text in, piece by piece; out: the text outside calls, and each call once whole."""

    def __init__(self, format: str, tools: Sequence[Tool]) -> None:
        self._close = FORMATS[format].close
        self._names = {tool.function.name for tool in tools}
        self._splitter = CallSplitter(format)
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        return self._read(*self._splitter.feed(text))

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._read(*self._splitter.finish())

    def _read(self, content: str, found: list[Call]) -> tuple[str, list[ToolCall]]:
        calls = [call for each in found for call in self._calls(each)]
        self.calls.extend(calls)
        return content, calls

    def _calls(self, found: Call) -> list[ToolCall]:
        if isinstance(found.value, list) and found.value:  # several calls in one region
            return [self._call(found.body, item) for item in found.value]
        return [self._call(found.body, found.value)]

    def _call(self, body: str, value: Any) -> ToolCall:
        raw = body.strip()
        if not isinstance(value, dict) and self._close is not None:
            raw, value = _cut_in_close(raw, self._close, value)
        if not isinstance(value, dict):
            return _malformed(raw, None, "the call is not a JSON object")
        name = value.get("name")
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass
        if not isinstance(name, str):
            return _malformed(raw, None, "the call names no function ('name' is missing or not a string)")
        if name not in self._names:
            return _malformed(raw, name, f"there is no tool named {name!r} among the tools given")
        if not isinstance(arguments, dict):
            return _malformed(raw, name, "the call's arguments are not a JSON object")
        return ToolCall(id=_call_id(), name=name, arguments=arguments, raw=raw, error=None)


def _cut_in_close(raw: str, close: str, value: Any) -> tuple[str, Any]:
    """A call whose text ends inside its closing delimiter (cut by max_tokens): its JSON read
    without that part, when it is whole."""
    for length in range(len(close) - 1, 0, -1):
        if raw.endswith(close[:length]):
            body = raw[:-length].rstrip()
            try:
                return body, json.loads(body)
            except json.JSONDecodeError:
                return body, value
    return raw, value


def _malformed(raw: str, name: str | None, error: str) -> ToolCall:
    return ToolCall(id=_call_id(), name=name, arguments=None, raw=raw, error=error)


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


def forced_grammar(format: str, tools: Sequence[Tool], only: str | None, *, parallel: bool) -> str:
    """A llguidance grammar for output that is nothing but calls (one, or one or more when
    ``parallel``) of the given tools, or of the one named ``only``, each with arguments matching
    the tool's schema. Each schema goes under ``$defs`` with its local refs rewritten, so that
    ``#/$defs/...`` (what Pydantic writes) still points into it. The JSON is written as
    ``json.dumps`` writes it, as the worker writes earlier calls back into a conversation, so a
    tool loop's next prompt continues this one's text."""
    from llguidance import LLMatcher

    key = "parameters" if format == "llama3_json" else "arguments"
    chosen = [(i, t) for i, t in enumerate(tools) if only is None or t.function.name == only]
    defs = {f"tool_{i}": _moved(arguments_schema(t, i), f"#/$defs/tool_{i}") for i, t in chosen}
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, key: {"$ref": f"#/$defs/tool_{i}"}},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for i, t in chosen
    ]
    spaced = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    call = json.dumps({"$defs": defs, "anyOf": calls, "x-guidance": spaced})
    if format == "llama3_json":  # one call is the whole answer
        return LLMatcher.grammar_from_lark(f"start: %json {call}\n")
    more = ' ("\\n" call)*' if parallel else ""
    return LLMatcher.grammar_from_lark(f'start: call{more}\ncall: "<tool_call>\\n" %json {call} "\\n</tool_call>"\n')


def arguments_schema(tool: Tool, index: int) -> dict[str, Any]:
    """A tool's ``parameters`` as the schema of an arguments object."""
    schema = tool.function.parameters or {}
    if "type" not in schema:
        return {**schema, "type": "object"}
    if schema["type"] != "object":
        raise RpcError(
            ErrorKind.INVALID_PARAMS,
            f"The parameters of tool {tool.function.name!r} describe a {json.dumps(schema['type'])}, but a call's "
            'arguments are a JSON object; give "type": "object" with properties.',
            field=f"params.tools[{index}].function.parameters",
        )
    return schema


def _moved(schema: Any, to: str) -> Any:
    """``schema`` with its local refs ("#...") rewritten for the place ``to`` (a JSON pointer)."""
    if isinstance(schema, dict):
        return {
            k: to + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _moved(v, to)
            for k, v in schema.items()
        }
    if isinstance(schema, list):
        return [_moved(v, to) for v in schema]
    return schema
