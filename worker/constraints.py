"""Constrained output: a grammar decides which tokens may come next.

``response_format`` (JSON, or JSON matching a schema) and a forced ``tool_choice`` become a
llguidance grammar; at each token the backend sets the logits of every token the grammar does
not allow to minus infinity before it chooses, and the grammar then takes the token chosen.
Once the grammar is complete only an end-of-sequence token is allowed, so the output ends there.
This module decides which grammar a request asks for; the grammar object a backend advances,
and the model's vocabulary it needs, are worker/grammar.py's.

llguidance (MIT) computes a token mask in well under a millisecond on the CPU for the schemas
the tests use (bench/constraint_bench.py), checks a schema before any token is computed, and
names what it cannot enforce ("Unimplemented keys: ["not"]"), which the request's error repeats.

JSON is written without optional whitespace (compactly for response_format; forced tool calls
as ``json.dumps`` writes them, see tool_calls.py): a model cannot wander off into newlines and
spaces, a failure of small models that flexible whitespace allows.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from protocol.errors import ErrorKind, RpcError
from protocol.methods import GenerateParams, JsonObjectFormat, JsonSchemaFormat, NamedToolChoice
from worker.backends.base import Model
from worker.grammar import GrammarError, OutputConstraint, short
from worker.tool_calls import arguments_schema, forced_grammar

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

COMPACT_JSON: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def output_constraint(model: Model, params: GenerateParams) -> OutputConstraint | None:
    """The constraint a generate request asks for, checked against the model; None: none."""
    forces_calls = bool(params.tools) and (
        params.tool_choice == "required" or isinstance(params.tool_choice, NamedToolChoice)
    )
    if not forces_calls and not isinstance(params.response_format, JsonObjectFormat | JsonSchemaFormat):
        return None
    if model.grammar_tokenizer is None:
        raise RpcError(
            ErrorKind.UNSUPPORTED,
            f"The {model.info.backend} backend cannot constrain its output; load a model of the transformers "
            "backend, or leave out response_format and a tool_choice that forces a call.",
            field="params.tool_choice" if forces_calls else "params.response_format",
        )
    support = model.info.tool_calls
    grammar, field = grammar_for(params, forces_calls, support.format, support.forced)
    tokenizer = model.grammar_tokenizer.get()
    try:
        return OutputConstraint(tokenizer, grammar, field)
    except GrammarError as exc:
        if forces_calls:  # name the tool whose schema it is, when it is one
            field = next((f for f in _tool_schema_problems(params, tokenizer)), field)
        raise RpcError(
            ErrorKind.INVALID_PARAMS,
            f"The output cannot be constrained to this: {exc}. Remove or rewrite that part.",
            field=field,
        ) from None


def _tool_schema_problems(params: GenerateParams, tokenizer: Any):
    """The fields of the tools' parameters that no grammar can be made of, one by one."""
    from llguidance import LLMatcher

    for i, tool in enumerate(params.tools or []):
        try:
            grammar = LLMatcher.grammar_from_json_schema(arguments_schema(tool, i))
        except ValueError:
            yield f"params.tools[{i}].function.parameters"
            continue
        if LLMatcher.validate_grammar(grammar, tokenizer):
            yield f"params.tools[{i}].function.parameters"


def grammar_for(
    params: GenerateParams, forces_calls: bool, tool_format: str | None, forceable: bool
) -> tuple[str, str]:
    """The grammar a request's output must follow, and the field it comes from."""
    fmt = params.response_format
    if forces_calls and isinstance(fmt, JsonObjectFormat | JsonSchemaFormat):
        raise RpcError(
            ErrorKind.INVALID_PARAMS,
            "response_format and a tool_choice that forces a call both constrain the output; give one of them.",
            field="params.response_format",
        )
    if forces_calls:
        if not forceable or tool_format is None:
            raise RpcError(
                ErrorKind.INVALID_PARAMS,
                f"tool_choice {_choice(params)} forces the output into tool calls, which this model's call "
                f"format ({tool_format or 'unknown'}) does not allow; use tool_choice \"auto\".",
                field="params.tool_choice",
            )
        only = params.tool_choice.function.name if isinstance(params.tool_choice, NamedToolChoice) else None
        grammar = forced_grammar(tool_format, params.tools or [], only, parallel=params.parallel_tool_calls)
        return grammar, "params.tool_choice"
    if isinstance(fmt, JsonSchemaFormat):
        field = "params.response_format.json_schema.schema"
        return _json_grammar(fmt.json_schema.schema or {}, field), field
    return _json_grammar({"type": "object"}, "params.response_format"), "params.response_format"


def _json_grammar(schema: dict[str, Any], field: str) -> str:
    from llguidance import LLMatcher

    try:
        return LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT_JSON)
    except ValueError as exc:  # not JSON llguidance can read (an integer past 64 bits, say)
        raise RpcError(ErrorKind.INVALID_PARAMS, f"The JSON Schema is not valid: {short(str(exc))}", field=field) from exc


def _choice(params: GenerateParams) -> str:
    choice = params.tool_choice
    return json.dumps(choice if isinstance(choice, str) else {"function": {"name": choice.function.name}})
