"""Incremental detokenization and stop strings: text that never has to be taken back."""

from __future__ import annotations

import random
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.methods import LoadParams
from worker.backends.echo import EchoBackend
from worker.streaming import IncrementalDetokenizer, StopMatcher

ECHO = EchoBackend().load(LoadParams(backend="echo"), data_dir=Path("."))


def stream(text_or_tokens, stops=()) -> tuple[list[str], str | None]:
    tokens = ECHO.tokenize(text_or_tokens, add_special_tokens=False) if isinstance(text_or_tokens, str) else text_or_tokens
    detok, matcher = IncrementalDetokenizer(ECHO.detokenize), StopMatcher(stops)
    pieces: list[str] = []
    for token in tokens:
        piece, stop = matcher.push(detok.push(token))
        pieces.append(piece)
        if stop is not None:
            return pieces, stop
    piece, stop = matcher.push(detok.flush())
    pieces.append(piece if stop is not None else piece + matcher.flush())
    return pieces, stop


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_streamed_pieces_concatenate_to_the_text_and_never_split_a_character(text: str):
    pieces, _ = stream(text)
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces if "\ufffd" not in text)


def test_a_multi_byte_character_is_held_back_until_its_last_byte_arrives():
    pieces, _ = stream("a😀b")
    assert pieces == ["a", "", "", "", "😀", "b", ""]


def test_invalid_bytes_are_emitted_as_soon_as_a_later_byte_proves_them_invalid():
    pieces, _ = stream([0xC3] * 10)  # lead bytes that no continuation ever completes
    assert pieces == ["", *["\ufffd"] * 9, "\ufffd"]


def test_a_replacement_character_is_never_emitted_for_a_character_that_a_later_token_completes():
    tokens = [0x61, 0xE6, 0x97, 0xF0, 0x9F, 0x98, 0x80]  # "a", an invalid pair, then 😀 byte by byte
    pieces, _ = stream(tokens)
    assert "".join(pieces) == bytes(tokens).decode("utf-8", "replace") == "a\ufffd😀"
    assert pieces.count("\ufffd") == 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0x61, 0x20, 0xC3, 0xA9, 0xE6, 0x97, 0xA5, 0xF0, 0x9F, 0x98, 0x80, 0xFF]), max_size=60))
def test_any_byte_stream_streams_to_exactly_its_lossy_decoding(tokens: list[int]):
    pieces, _ = stream(tokens)
    assert "".join(pieces) == bytes(tokens).decode("utf-8", "replace")


def test_a_character_cut_off_at_the_end_is_flushed_as_a_replacement_character():
    pieces, _ = stream([104, 0xF0, 0x9F])
    assert "".join(pieces) == "h\ufffd"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abc", max_size=40), st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3))
def test_text_before_the_first_completed_stop_string_is_emitted_and_the_stop_string_never_is(text: str, stops: list[str]):
    pieces, stop = stream(text, stops)
    emitted = "".join(pieces)
    # the first stop string to complete, reading the text one character at a time
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    if hits:
        _, index = min(hits)
        assert stop is not None and emitted == text[:index]
        assert text[index:].startswith(stop)
    else:
        assert stop is None and emitted == text


def test_a_partial_stop_string_is_held_back_then_released_when_it_does_not_complete():
    matcher = StopMatcher(["END"])
    assert matcher.push("abcE") == ("abc", None)
    assert matcher.push("N") == ("", None)
    assert matcher.push("x") == ("ENx", None)
    assert matcher.push("EN") == ("", None)
    assert matcher.flush() == "EN"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab", max_size=40), st.lists(st.text(alphabet="ab", min_size=2, max_size=6), min_size=1, max_size=3))
def test_the_text_held_back_is_exactly_the_end_that_could_still_begin_a_stop_string(text: str, stops: list[str]):
    matcher, pushed, emitted = StopMatcher(stops), "", ""
    for char in text:
        piece, stop = matcher.push(char)
        pushed, emitted = pushed + char, emitted + piece
        if stop is not None:
            return
        could_begin = max((k for s in stops for k in range(1, len(s)) if pushed.endswith(s[:k])), default=0)
        assert emitted + pushed[len(emitted) :] == pushed and len(pushed) - len(emitted) == could_begin


def test_long_stop_strings_cost_the_same_per_character_late_in_a_long_text():
    """Every stop string one character from complete at every character: the worst case."""
    stops = ["a" * 1023 + chr(ord("A") + i) for i in range(32)]
    matcher = StopMatcher(stops)
    started = time.perf_counter()
    emitted = "".join(matcher.push("a")[0] for _ in range(5000))
    assert len(emitted) == 5000 - 1023 and time.perf_counter() - started < 2.0


def test_no_stop_strings_pass_text_straight_through():
    matcher = StopMatcher([])
    assert matcher.push("anything") == ("anything", None)


def test_chunking_of_tokens_does_not_change_the_text():
    rng = random.Random(7)
    text = "".join(rng.choice(["a", "é", "中", "🙂", " "]) for _ in range(300))
    pieces, _ = stream(text)
    assert "".join(pieces) == text
