"""Thinking told apart from the answer: the splitter, whole and piece by piece."""

from __future__ import annotations

import json

import pytest

from worker.reasoning import Markers, ReasoningSplitter, markers, opens_thinking

THINK = Markers("<think>", "</think>")

# (text, whether the prompt ended inside the thinking) -> (content, reasoning)
CASES = {
    "thinking then answer": (("<think>\nI should greet.\n</think>\n\nHello!", False), ("Hello!", "I should greet.\n")),
    "the prompt opened it": (("I think.\n</think>\n\nAnswer", True), ("Answer", "I think.\n")),
    "no markers at all": (("a < b and <thin ice> </thin>", False), ("a < b and <thin ice> </thin>", "")),
    "an end marker outside is text": (("x </think> y", False), ("x </think> y", "")),
    "a start marker inside is thought": (("<think> a <think> b </think>c", False), ("c", "a <think> b ")),
    "a marker after its own first character": (("<<think>x</think>y", False), ("<y", "x")),
    "a marker after a false start": (("<th<think>x<</</think>y", False), ("<thy", "x<</")),
    "a cut-off start marker at the end": (("answer <thi", False), ("answer <thi", "")),
    "a cut-off end marker at the end": (("<think>still </thi", False), ("", "still </thi")),
    "thinking never closed": (("<think>\n日本 🙂", False), ("", "日本 🙂")),
    "two thoughts": (("<think>a</think>b<think>c</think>d", False), ("bd", "ac")),
    "nothing": (("", True), ("", "")),
}


def split(text: str, inside: bool, pieces: list[str]) -> tuple[str, str]:
    splitter = ReasoningSplitter(THINK, inside=inside)
    content, reasoning = [], []
    for piece in pieces:
        part = splitter.push(piece)
        content.append(part.content)
        reasoning.append(part.reasoning)
    rest = splitter.flush()
    return "".join(content) + rest.content, "".join(reasoning) + rest.reasoning


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_the_splitter_gives_the_same_answer_and_thinking_whole_char_by_char_and_split_anywhere(case: str):
    (text, inside), expected = CASES[case]
    assert split(text, inside, [text]) == expected
    assert split(text, inside, list(text)) == expected
    for cut in range(len(text) + 1):
        assert split(text, inside, [text[:cut], text[cut:]]) == expected, cut
    encoded = text.encode()  # byte by byte, as tokens that end inside a character would give it
    pieces, start = [], 0
    for end in range(1, len(encoded) + 1):
        try:
            pieces.append(encoded[start:end].decode())
            start = end
        except UnicodeDecodeError:
            continue
    assert split(text, inside, pieces) == expected


def test_a_possible_marker_is_held_back_until_it_is_known_and_nothing_is_taken_back():
    splitter = ReasoningSplitter(THINK)
    assert splitter.push("Hi <th") == ("Hi ", "", False) and splitter.holding
    assert splitter.push("ink>") == ("", "", True) and not splitter.holding and splitter.inside
    assert splitter.push(" deep") == ("", "deep", True)
    assert splitter.push("</") == ("", "", True) and splitter.holding
    assert splitter.push("p>") == ("", "</p>", True)
    assert splitter.push("</think>") == ("", "", True) and not splitter.inside
    assert splitter.push("\n\nok") == ("ok", "", False)


def test_markers_are_read_from_the_chat_template():
    qwen3 = "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    assert markers(qwen3) == THINK
    assert markers("{{ '<|im_start|>assistant\\n' }}") is None and markers(None) is None


def test_a_prompt_ends_inside_the_thinking_when_its_last_marker_opens_it():
    assert opens_thinking(THINK, "<|im_start|>assistant\n<think>\n")
    assert not opens_thinking(THINK, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens_thinking(THINK, "<|im_start|>assistant\n")


async def test_a_model_whose_template_opens_the_thinking_streams_it_as_reasoning_apart_from_the_content(
    spawn_worker, tiny_thinking_model
):
    host = await spawn_worker()
    await host.call("load", {"model": str(tiny_thinking_model)})
    request_id, answer = host.start("generate", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12})
    result = (await answer)["result"]
    chunks = host.chunks[request_id]
    assert result["reasoning"] and result["reasoning"] == result["text"].lstrip()  # the random model never closes it
    assert result["content"] == "" and all(chunk["content"] == "" for chunk in chunks)
    assert "".join(chunk["reasoning"] for chunk in chunks) == result["reasoning"]
    assert "".join(chunk["text"] for chunk in chunks) == result["text"]
    assert result["usage"]["reasoning_tokens"] == result["usage"]["completion_tokens"] == 12


async def test_a_prompt_that_closed_the_thinking_and_a_model_without_markers_give_content_only(
    spawn_worker, tiny_thinking_model, tiny_model_dir
):
    closed = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    opened = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    host = await spawn_worker()
    await host.call("load", {"model": str(tiny_thinking_model)})
    answered = await host.call("generate", {"prompt": closed, "max_tokens": 8})
    thinking = await host.call("generate", {"prompt": opened, "max_tokens": 8})
    await host.call("load", {"model": str(tiny_model_dir)})  # the same weights, a template without markers
    plain = await host.call("generate", {"prompt": opened, "max_tokens": 8})
    assert answered["content"] == answered["text"] and answered["reasoning"] == ""
    assert answered["usage"]["reasoning_tokens"] == 0
    assert plain["content"] == plain["text"] and plain["reasoning"] == "" and plain["usage"]["reasoning_tokens"] == 0
    assert thinking["tokens"] == plain["tokens"] and thinking["reasoning"] == plain["text"].lstrip()


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}
THINKING_JSON = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
    "type": "object", "properties": {"says": {"enum": ["<think> in a string", "</think> too"]}}, "required": ["says"],
    "additionalProperties": False}}}


async def test_a_constrained_output_is_the_answer_even_where_the_prompt_opens_the_thinking(spawn_worker, tiny_thinking_model):
    """Issue 47 item 11: the forced call was written inside the thinking the generation prompt
    opened, so the result had no tool calls and finish "stop"; JSON was all reasoning."""
    host = await spawn_worker()
    await host.call("load", {"model": str(tiny_thinking_model)})
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    called = await host.call("generate", {"messages": messages, "tools": [WEATHER], "tool_choice": "required",
                                          "parallel_tool_calls": False, "max_tokens": 150})
    assert called["finish_reason"] == "tool_calls" and called["tool_calls"][0]["name"] == "get_weather"
    assert (called["reasoning"], called["usage"]["reasoning_tokens"]) == ("", 0)
    request_id, answer = host.start("generate", {"messages": messages, "response_format": THINKING_JSON, "max_tokens": 40})
    answered = (await answer)["result"]
    assert answered["finish_reason"] == "stop" and json.loads(answered["content"]) == json.loads(answered["text"])
    assert (answered["reasoning"], answered["usage"]["reasoning_tokens"]) == ("", 0)
    assert "".join(chunk["content"] for chunk in host.chunks[request_id]) == answered["content"]


async def test_a_marker_inside_a_constrained_answer_after_a_closed_thinking_stays_in_the_content(
    spawn_worker, tiny_thinking_model
):
    closed = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    host = await spawn_worker()
    await host.call("load", {"model": str(tiny_thinking_model)})
    opening = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"const": "a <think> b"}}}
    answered = await host.call("generate", {"prompt": closed, "response_format": opening, "max_tokens": 40})
    assert json.loads(answered["content"]) == "a <think> b"
    assert answered["content"] == answered["text"] and answered["reasoning"] == ""
