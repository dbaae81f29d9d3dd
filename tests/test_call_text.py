"""The splitting of generated text into content and calls: text that may still open a call is
held back until the next piece tells, and nothing else is."""

from __future__ import annotations

import pytest

from worker.call_text import CallSplitter


def pieces(format: str, *texts: str) -> list[tuple[str, list]]:
    splitter = CallSplitter(format)
    out = [splitter.feed(text) for text in texts]
    return [(content, [(call.body, call.value) for call in calls]) for content, calls in [*out, splitter.finish()]]


@pytest.mark.parametrize(
    ("format", "texts", "expected"),
    [
        # a Llama 3 call opens the answer, after white space and an optional python tag, or not at all
        ("llama3_json", [" ", "<|pyth", "on_tag|>", '{"na', 'me": "f"}'],
         [("", []), ("", []), ("", []), ("", []), ("", []), ("", [('{"name": "f"}', {"name": "f"})])]),
        ("llama3_json", [" ", "Hi ", '{"name": "f"}'], [("", []), (" Hi ", []), ('{"name": "f"}', []), ("", [])]),
        ("llama3_json", ["<|pyth", "x"], [("", []), ("<|pythx", []), ("", [])]),
        # a FunctionGemma name may still grow until { or white space arrives
        ("functiongemma", ["a <start_function", "_call>call:get_", "time{", "}<end_function_call>b"],
         [("a ", []), ("", []), ("", []), ("b", [("{}", {"name": "get_time", "arguments": {}})]), ("", [])]),
        # a hermes delimiter held back in part is content once it turns out not to be one
        ("hermes", ["x <tool_", "y"], [("x ", []), ("<tool_y", []), ("", [])]),
        ("hermes", ["<tool_call>{}</tool_", "call>"], [("", []), ("", [("{}", {})]), ("", [])]),
    ],
)
def test_text_that_may_open_or_close_a_call_waits_for_the_next_piece(format: str, texts: list[str], expected) -> None:
    assert pieces(format, *texts) == expected


def test_functiongemma_strings_and_bare_keys_are_read_as_json() -> None:
    body = "{city:<escape>Paris, {x:1} France<escape>,note:\"a:b\",days:3}"
    [(_, [(_, value)]), _] = pieces("functiongemma", f"<start_function_call>call:f{body}<end_function_call>")
    assert value == {"name": "f", "arguments": {"city": "Paris, {x:1} France", "note": "a:b", "days": 3}}
