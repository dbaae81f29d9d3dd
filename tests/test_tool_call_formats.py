"""Tool calls read back from the outputs of each template family, whole and piece by piece.

The outputs are as the models of each family write them (Qwen2.5 and Qwen3 in the hermes
format, SmolLM2's JSON list inside the same tags, Llama 3.1 and 3.2 JSON, FunctionGemma); the
template excerpts are the parts of each family's chat template that tell its format apart.
"""

from __future__ import annotations

import msgspec
import pytest

from protocol.methods import Tool, ToolFunction
from worker.tool_calls import ToolCallReader, forced_grammar, support

TOOLS = [
    Tool(function=ToolFunction(name="get_weather", parameters={"type": "object"})),
    Tool(function=ToolFunction(name="get_time", parameters={"type": "object"})),
]

RECORDED = {
    "qwen2.5": (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>',
        "\n",
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})],
    ),
    "qwen3": (
        "hermes",
        "<think>\nThe user asks for the weather in Paris; I call get_weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "<think>\nThe user asks for the weather in Paris; I call get_weather.\n</think>\n\n",
        [("get_weather", {"city": "Paris"})],
    ),
    "smollm2": (
        "hermes",
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"timezone": "CET"}}]</tool_call>',
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "CET"})],
    ),
    "llama3.1": (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "San Francisco, CA", "unit": "fahrenheit"}}',
        "",
        [("get_weather", {"city": "San Francisco, CA", "unit": "fahrenheit"})],
    ),
    "llama3.2": (
        "llama3_json",
        '<|python_tag|>{"name": "get_time", "parameters": {"timezone": "UTC"}}',
        "",
        [("get_time", {"timezone": "UTC"})],
    ),
    "functiongemma": (
        "functiongemma",
        "<start_function_call>call:get_weather{city:<escape>Paris, France<escape>,days:3}<end_function_call>",
        "",
        [("get_weather", {"city": "Paris, France", "days": 3})],
    ),
}


def read(format: str, text: str, piece: int) -> tuple[str, list]:
    reader = ToolCallReader(format, TOOLS)
    content = []
    for start in range(0, len(text), piece):
        content.append(reader.feed(text[start : start + piece])[0])
    content.append(reader.finish()[0])
    return "".join(content), reader.calls


@pytest.mark.parametrize("family", RECORDED)
@pytest.mark.parametrize("piece", [1, 3, 10_000])
def test_calls_of_each_family_are_read_whole_or_piece_by_piece(family: str, piece: int) -> None:
    format, text, content, expected = RECORDED[family]
    got_content, calls = read(format, text, piece)
    assert [(c.name, c.arguments) for c in calls] == expected
    assert all(c.error is None and c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    assert got_content == content
    assert len({c.id for c in calls}) == len(calls)


def test_each_call_is_reported_as_soon_as_its_closing_tag_arrives() -> None:
    reader = ToolCallReader("hermes", TOOLS)
    assert reader.feed('Let me check. <tool_call>\n{"name": "get_time", "arguments": {}}\n') == ("Let me check. ", [])
    content, calls = reader.feed("</tool_call> done")
    assert [c.name for c in calls] == ["get_time"] and calls[0].arguments == {}
    assert content + reader.finish()[0] == " done"


@pytest.mark.parametrize(
    ("text", "name", "error"),
    [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None, "not a JSON object"),
        ('<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>', "launch_rockets", "no tool named"),
        ('<tool_call>{"arguments": {"city": "Paris"}}</tool_call>', None, "names no function"),
        ('<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>', "get_weather", "not a JSON object"),
    ],
)
def test_a_malformed_call_is_reported_with_its_raw_text(text: str, name: str | None, error: str) -> None:
    _, calls = read("hermes", text, 5)
    assert len(calls) == 1
    call = calls[0]
    assert call.arguments is None and call.name == name and error in call.error
    assert call.raw and call.raw in text


def test_a_call_cut_inside_its_closing_tag_is_whole_when_its_json_is() -> None:
    _, calls = read("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</to', 3)
    assert (calls[0].name, calls[0].arguments, calls[0].error) == ("get_time", {"zone": "UTC"}, None)
    assert calls[0].raw == '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    _, calls = read("hermes", '<tool_call>\n{"name": "get_time", "argu</tool_c', 3)
    assert calls[0].error and calls[0].raw == '{"name": "get_time", "argu'


def test_arguments_written_as_a_json_string_are_read_as_an_object() -> None:
    _, calls = read("hermes", '<tool_call>{"name": "get_time", "arguments": "{\\"timezone\\": \\"UTC\\"}"}</tool_call>', 4)
    assert calls[0].arguments == {"timezone": "UTC"} and calls[0].error is None


def test_text_that_only_looks_like_a_call_stays_content() -> None:
    text = "Use the <tool_ tag, or {\"name\": 1} in prose."
    content, calls = read("hermes", text, 2)
    assert (content, calls) == (text, [])


# The parts of each family's chat template that tell its call format apart.
TEMPLATE_EXCERPTS = {
    "qwen2.5": (
        "{%- if tools %}{{- '<|im_start|>system\\n' }}...{{- \"<tool_call>\\n{\\\"name\\\": <function-name>, "
        "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}{%- endif %}"
    ),
    "llama3.1": (
        "{%- if tools is not none %}...{{- 'Respond in the format {\"name\": function name, \"parameters\": "
        "dictionary of argument name and its value}.' }}...{{- '<|python_tag|>' + tool_call.name }}{%- endif %}"
    ),
    "functiongemma": "{%- if tools %}...{{- '<start_function_call>call:' + tool_call.function.name }}{%- endif %}",
    "gemma3": "{{ bos_token }}{%- for message in messages %}{{ '<start_of_turn>' + role + '\\n' }}{%- endfor %}",
    "smollm2": "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}{% endfor %}",
    "mistral": "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}",
}


@pytest.mark.parametrize(
    ("family", "takes_tools", "format", "forced"),
    [
        ("qwen2.5", True, "hermes", True),
        ("llama3.1", True, "llama3_json", True),
        ("functiongemma", True, "functiongemma", False),
        ("gemma3", False, "hermes", True),
        ("smollm2", False, "hermes", True),
        ("mistral", True, None, False),
    ],
)
def test_the_call_format_is_recognized_from_the_chat_template(
    family: str, takes_tools: bool, format: str | None, forced: bool
) -> None:
    found = support(TEMPLATE_EXCERPTS[family])
    assert (found.template_takes_tools, found.format, found.forced) == (takes_tools, format, forced)


@pytest.mark.parametrize("parallel", [True, False])
def test_a_forced_call_grammar_allows_a_second_call_only_when_parallel(tiny_model_dir, parallel: bool) -> None:
    import llguidance.hf
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    vocabulary = llguidance.hf.from_tokenizer(tokenizer, eos_token=tokenizer.eos_token_id)
    one = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    matcher = LLMatcher(vocabulary, forced_grammar("hermes", TOOLS, None, parallel=parallel))
    assert matcher.consume_tokens(tokenizer(one, add_special_tokens=False).input_ids), matcher.get_error()
    assert matcher.is_accepting()
    second = matcher.try_consume_tokens(tokenizer("\n" + one, add_special_tokens=False).input_ids)
    assert (second > 0) == parallel


# Every character a tool name may hold, in one name.
ODD_NAME = "ns.sub:tool/v2-x_Y9"
ODD_CALLS = {
    "hermes": f'<tool_call>\n{{"name": "{ODD_NAME}", "arguments": {{"a": 1}}}}\n</tool_call>',
    "llama3_json": f'{{"name": "{ODD_NAME}", "parameters": {{"a": 1}}}}',
    "functiongemma": f"<start_function_call>call:{ODD_NAME}{{a:1}}<end_function_call>",
}


@pytest.mark.parametrize("format", ODD_CALLS)
@pytest.mark.parametrize("piece", [1, 4, 10_000])
def test_a_name_of_every_character_a_tool_name_may_hold_is_read_back_in_every_format(format: str, piece: int):
    reader = ToolCallReader(format, [Tool(function=ToolFunction(name=ODD_NAME))])
    text = ODD_CALLS[format]
    content = "".join(reader.feed(text[i : i + piece])[0] for i in range(0, len(text), piece)) + reader.finish()[0]
    assert content == "" and [(c.name, c.arguments, c.error) for c in reader.calls] == [(ODD_NAME, {"a": 1}, None)]


@pytest.mark.parametrize(
    "name", ["x</tool_call>y", "<tool_call>", "a<end_function_call>", "a{b", "a b", "a\nb", 'a"b', "a<escape>", "é", "a\n"]
)
def test_a_tool_name_holding_a_delimiter_of_any_call_format_is_refused(name: str):
    with pytest.raises(msgspec.ValidationError, match="Expected `str` matching regex"):
        msgspec.convert({"function": {"name": name}}, Tool)
