"""Unit tests of the sans-I/O codec: protocol.framing.FrameDecoder and encode_frame.

Every test that feeds a stream checks the events for the whole input and for
the same input fed byte by byte: the decoder's output must not depend on how
the bytes were chunked.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.errors import ErrorKind
from protocol.framing import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_HEADER_BYTES,
    Frame,
    FrameDecoder,
    Framing,
    FramingError,
    encode_frame,
)

NDJSON, LSP = Framing.NDJSON, Framing.LSP
PARSE, TOO_LARGE = ErrorKind.PARSE_ERROR, ErrorKind.MESSAGE_TOO_LARGE


def decode_chunks(chunks: list[bytes], *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, eof: bool = True) -> list:
    decoder = FrameDecoder(max_bytes)
    events = []
    for chunk in chunks:
        events += decoder.feed(chunk)
    if eof:
        events += decoder.feed_eof()
    return events


def decode(data: bytes, *, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, eof: bool = True) -> list:
    """Events for ``data`` fed whole; asserts byte-by-byte feeding gives the same events."""
    whole = decode_chunks([data], max_bytes=max_bytes, eof=eof)
    bytewise = decode_chunks([data[i : i + 1] for i in range(len(data))], max_bytes=max_bytes, eof=eof)
    assert bytewise == whole, "byte-by-byte input decoded differently from whole input"
    return whole


def random_chunks(data: bytes, rng: random.Random, max_size: int = 17) -> list[bytes]:
    chunks, i = [], 0
    while i < len(data):
        size = rng.randint(0, max_size)  # empty feeds are allowed too
        chunks.append(data[i : i + size])
        i += size
    return chunks


def lsp(body: bytes, *, line_end: bytes = b"\r\n", extra: list[bytes] = ()) -> bytes:
    headers = [b"Content-Length: %d" % len(body), *extra]
    return b"".join(h + line_end for h in headers) + line_end + body


def frames(events: list) -> list[Frame]:
    assert all(isinstance(e, Frame) for e in events), events
    return events


def kinds(events: list) -> list:
    return [e.framing if isinstance(e, Frame) else e.kind for e in events]


# --- NDJSON -----------------------------------------------------------------


def test_ndjson_line_is_one_frame_without_its_newline():
    assert decode(b'{"a":1}\n') == [Frame(b'{"a":1}', NDJSON)]


def test_ndjson_lines_are_separate_frames():
    assert decode(b'{"a":1}\n{"b":2}\n{"c":3}\n') == [
        Frame(b'{"a":1}', NDJSON),
        Frame(b'{"b":2}', NDJSON),
        Frame(b'{"c":3}', NDJSON),
    ]


def test_ndjson_line_drops_trailing_carriage_return():
    assert decode(b'{"a":1}\r\n{"b":2}\r\n') == [Frame(b'{"a":1}', NDJSON), Frame(b'{"b":2}', NDJSON)]


def test_ndjson_line_keeps_carriage_return_inside_the_line():
    assert decode(b'{"a":"x\ry"}\n') == [Frame(b'{"a":"x\ry"}', NDJSON)]


def test_blank_lines_and_whitespace_between_messages_are_skipped():
    data = b'\n\n  \t\r\n{"a":1}\n\n\r\n   \t{"b":2}\n \n\t\n'
    assert decode(data) == [Frame(b'{"a":1}', NDJSON), Frame(b'{"b":2}', NDJSON)]


def test_whitespace_only_input_yields_nothing():
    assert decode(b" \t\r\n\n\r\n  ") == []
    assert decode(b"") == []


def test_final_line_without_newline_is_framed_at_eof():
    assert decode(b'{"a":1}\n{"b":2}') == [Frame(b'{"a":1}', NDJSON), Frame(b'{"b":2}', NDJSON)]


def test_final_line_without_newline_drops_trailing_carriage_return_at_eof():
    assert decode(b'{"b":2}\r') == [Frame(b'{"b":2}', NDJSON)]


def test_final_line_without_newline_waits_until_eof():
    decoder = FrameDecoder()
    assert decoder.feed(b'{"a":1}') == []
    assert decoder.feed(b',"b":2}') == []
    assert decoder.feed_eof() == [Frame(b'{"a":1},"b":2}', NDJSON)]


def test_open_bracket_line_is_framed_so_the_envelope_can_refuse_the_batch():
    assert decode(b'[{"jsonrpc":"2.0","id":1,"method":"capabilities"}]\n[]\n') == [
        Frame(b'[{"jsonrpc":"2.0","id":1,"method":"capabilities"}]', NDJSON),
        Frame(b"[]", NDJSON),
    ]


def test_ndjson_line_is_framed_byte_exact_without_json_validation():
    # The codec frames; it never parses JSON. Broken JSON on a '{' line is a frame.
    assert decode(b'{"a":\xff\n') == [Frame(b'{"a":\xff', NDJSON)]


# --- LSP base protocol ------------------------------------------------------


def test_lsp_frame_with_crlf_line_ends():
    assert decode(b'Content-Length: 7\r\n\r\n{"a":1}') == [Frame(b'{"a":1}', LSP)]


def test_lsp_frame_with_lf_line_ends():
    assert decode(b'Content-Length: 7\n\n{"a":1}') == [Frame(b'{"a":1}', LSP)]


def test_lsp_frame_with_crlf_header_and_lf_blank_line():
    assert decode(b'Content-Length: 7\r\n\n{"a":1}') == [Frame(b'{"a":1}', LSP)]


@pytest.mark.parametrize(
    "name", [b"Content-Length", b"content-length", b"CONTENT-LENGTH", b"cOnTeNt-LeNgTh", b"Content-length"]
)
def test_lsp_header_names_are_case_insensitive(name):
    assert decode(name + b": 2\r\n\r\n{}") == [Frame(b"{}", LSP)]


def test_lsp_header_value_whitespace_is_ignored():
    assert decode(b"Content-Length:2\r\n\r\n{}Content-Length:   2  \r\n\r\n{}") == [Frame(b"{}", LSP)] * 2


@pytest.mark.parametrize("first", [True, False], ids=["type-first", "type-last"])
def test_lsp_content_type_header_is_accepted(first):
    content_type = b"Content-Type: application/vscode-jsonrpc; charset=utf-8"
    body = b'{"a":1}'
    length = b"Content-Length: %d" % len(body)
    headers = [content_type, length] if first else [length, content_type]
    data = b"\r\n".join(headers) + b"\r\n\r\n" + body
    assert decode(data) == [Frame(body, LSP)]


def test_lsp_unknown_headers_are_ignored():
    data = lsp(b"{}", extra=[b"X-Trace: abc:def", b"Foo:", b"content-encoding: identity"])
    assert decode(data) == [Frame(b"{}", LSP)]


def test_lsp_body_may_contain_newlines_and_any_bytes():
    body = b'{\n"a":\r\n1}\n\nContent-Length: 3\r\n\r\n\xff'
    assert decode(lsp(body) + lsp(b"{}")) == [Frame(body, LSP), Frame(b"{}", LSP)]


def test_lsp_content_length_counts_bytes_not_characters():
    body = '{"text":"héllo ☃ 😀"}'.encode()
    assert len(body) > len(body.decode())
    assert decode(lsp(body)) == [Frame(body, LSP)]


def test_lsp_frames_back_to_back_and_separated_by_whitespace():
    data = lsp(b'{"a":1}') + lsp(b'{"b":2}') + b"\r\n\n " + lsp(b'{"c":3}', line_end=b"\n")
    assert decode(data) == [Frame(b'{"a":1}', LSP), Frame(b'{"b":2}', LSP), Frame(b'{"c":3}', LSP)]


def test_lsp_zero_content_length_is_an_empty_frame():
    assert decode(b"Content-Length: 0\r\n\r\n") == [Frame(b"", LSP)]


def test_lsp_body_waits_for_all_announced_bytes():
    decoder = FrameDecoder()
    assert decoder.feed(b'Content-Length: 9\r\n\r\n{"a":') == []
    assert decoder.feed(b"12") == []
    assert decoder.feed(b'3}{"b"') == [Frame(b'{"a":123}', LSP)]
    assert decoder.feed_eof() == [Frame(b'{"b"', NDJSON)]


def test_ndjson_and_lsp_messages_mixed_in_one_stream():
    data = (
        b'{"n":1}\n'
        + lsp(b'{"n":2}')
        + b'{"n":3}\r\n'
        + lsp(b'{"n":4}', line_end=b"\n")
        + b"\n"
        + lsp(b'{"n":5}', extra=[b"Content-Type: application/json"])
        + b'{"n":6}'
    )
    assert decode(data) == [
        Frame(b'{"n":1}', NDJSON),
        Frame(b'{"n":2}', LSP),
        Frame(b'{"n":3}', NDJSON),
        Frame(b'{"n":4}', LSP),
        Frame(b'{"n":5}', LSP),
        Frame(b'{"n":6}', NDJSON),
    ]


# --- garbage and resynchronisation ------------------------------------------


def test_garbage_is_one_parse_error_and_decoding_resumes_at_next_newline():
    events = decode(b'hello {"not":"this"} world\n{"a":1}\n')
    assert kinds(events) == [PARSE, NDJSON]
    assert events[1] == Frame(b'{"a":1}', NDJSON)
    assert "b'h'" in events[0].message and events[0].limit is None


def test_each_garbage_line_is_one_parse_error():
    events = decode(b'garbage\nmore garbage\n{"a":1}\n')
    assert kinds(events) == [PARSE, PARSE, NDJSON]


def test_garbage_followed_directly_by_content_length_header_resyncs_at_the_header():
    events = decode(b"xyzzy" + lsp(b'{"a":1}'))
    assert kinds(events) == [PARSE, LSP]
    assert events[1] == Frame(b'{"a":1}', LSP)


def test_garbage_resyncs_at_a_lowercase_content_length_header():
    events = decode(b"\x00\x01\x02content-length: 2\n\n{}")
    assert kinds(events) == [PARSE, LSP]


def test_garbage_at_eof_without_newline_is_one_parse_error():
    assert kinds(decode(b"garbage")) == [PARSE]


def test_partial_header_name_at_eof_is_one_parse_error():
    assert kinds(decode(b"Content-Len")) == [PARSE]


def test_header_name_lookalike_is_garbage():
    events = decode(b'Content-Lengthy: 2\r\n\r\n{}\n{"a":1}\n')
    # The garbage line is skipped; what follows it is read as ordinary lines.
    assert events[1:] == [Frame(b"{}", NDJSON), Frame(b'{"a":1}', NDJSON)]
    assert events[0].kind is PARSE


def test_utf8_bom_before_a_message_is_garbage_up_to_the_newline():
    assert kinds(decode(b'\xef\xbb\xbf{"a":1}\n{"b":2}\n')) == [PARSE, NDJSON]


# --- limits -------------------------------------------------------------------


def test_line_longer_than_limit_is_one_message_too_large_error_and_next_line_is_decoded():
    limit = 64
    data = b'{"x":"' + b"a" * 500 + b'"}\n{"a":1}\n'
    events = decode(data, max_bytes=limit)
    assert kinds(events) == [TOO_LARGE, NDJSON]
    assert events[0].limit == limit
    assert str(limit) in events[0].message
    assert events[1] == Frame(b'{"a":1}', NDJSON)


def test_line_longer_than_limit_at_eof_is_one_message_too_large_error():
    events = decode(b"{" + b"a" * 200, max_bytes=64)
    assert kinds(events) == [TOO_LARGE]


def test_line_of_exactly_the_limit_is_accepted_and_one_more_byte_is_not():
    limit = 32
    exact = b"{" + b"a" * (limit - 2) + b"}"
    assert decode(exact + b"\n", max_bytes=limit) == [Frame(exact, NDJSON)]
    assert decode(exact, max_bytes=limit) == [Frame(exact, NDJSON)]  # at EOF
    over = b"{" + b"a" * (limit - 1) + b"}"
    assert kinds(decode(over + b"\n{}\n", max_bytes=limit)) == [TOO_LARGE, NDJSON]


@pytest.mark.parametrize("length", [30, 31, 32, 33, 34])
@pytest.mark.parametrize("line_end", [b"\n", b"\r\n", b"<eof>"])
def test_line_limit_bites_at_the_same_byte_whatever_the_chunking(length, line_end):
    line = b"{" + b"a" * (length - 1)
    tail = b"" if line_end == b"<eof>" else line_end + b'{"a":1}\n'
    events = decode(line + tail, max_bytes=32)  # decode() checks byte-by-byte against whole
    expected_first = Frame(line, NDJSON) if length <= 32 else None
    if line_end == b"\r\n":
        pass  # (whether a line's '\r' counts towards the limit is not pinned here)
    elif expected_first is not None:
        assert events[0] == expected_first
    else:
        assert events[0].kind is TOO_LARGE and events[0].limit == 32
    if tail:
        assert events[-1] == Frame(b'{"a":1}', NDJSON) and len(events) == 2
    else:
        assert len(events) == 1


def test_absurd_content_length_is_one_message_too_large_error_and_next_frame_is_decoded():
    data = b"Content-Length: 99999999999999\r\n\r\n" + lsp(b'{"a":1}')
    events = decode(data)
    assert kinds(events) == [TOO_LARGE, LSP]
    assert events[0].limit == DEFAULT_MAX_MESSAGE_BYTES
    assert "99999999999999" in events[0].message
    assert events[1] == Frame(b'{"a":1}', LSP)


def test_content_length_at_the_limit_is_accepted_and_above_is_too_large():
    limit = 16
    body = b'{"a":"' + b"x" * (limit - 8) + b'"}'
    assert len(body) == limit
    assert decode(lsp(body), max_bytes=limit) == [Frame(body, LSP)]
    events = decode(lsp(body + b" ") + b"\n" + lsp(b"{}"), max_bytes=limit)
    assert kinds(events) == [TOO_LARGE, LSP]
    assert events[0].limit == limit


@pytest.mark.parametrize(
    "value", [b"abc", b"-1", b"+5", b"5.0", b"", b"0x10", b"1e3", b"5 5", b"1" * 25, "٣".encode()]
)
def test_non_numeric_content_length_is_a_parse_error(value):
    events = decode(b"Content-Length: " + value + b"\r\n\r\n{}\n" + b'{"a":1}\n')
    assert events[0].kind is PARSE
    assert "Content-Length" in events[0].message
    assert events[-1] == Frame(b'{"a":1}', NDJSON)  # decoding resumes


def test_missing_content_length_is_a_parse_error():
    events = decode(b"Content-Type: application/json\r\n\r\n{}\n" + b'{"a":1}\n')
    assert events[0].kind is PARSE
    assert "without a Content-Length" in events[0].message
    assert events[-1] == Frame(b'{"a":1}', NDJSON)


def test_header_line_without_colon_is_a_parse_error():
    events = decode(b"Content-Length: 2\r\nnot a header\r\n\r\n{}\n" + lsp(b'{"a":1}'))
    assert events[0].kind is PARSE
    assert events[-1] == Frame(b'{"a":1}', LSP)


def test_over_long_header_block_is_a_parse_error_and_decoding_resumes():
    data = b"Content-Length: 2\r\nX-Pad: " + b"p" * (MAX_HEADER_BYTES + 100) + b"\r\n\r\n{}\n" + lsp(b'{"a":1}')
    events = decode(data)
    assert events[0].kind is PARSE
    assert "header block longer" in events[0].message
    assert events[-1] == Frame(b'{"a":1}', LSP)


def test_endless_header_block_is_one_parse_error_then_skipped():
    data = b"Content-Length: 2\r\n" + b"X-Pad: p\r\n" * 2000
    events = decode(data + b"\n" + b'{"a":1}\n')
    assert events[0].kind is PARSE and "header block longer" in events[0].message
    assert events[-1] == Frame(b'{"a":1}', NDJSON)


def test_header_block_well_within_the_limit_is_accepted():
    pad = b"X-Pad: " + b"p" * (MAX_HEADER_BYTES - 200)
    assert decode(lsp(b"{}", extra=[pad])) == [Frame(b"{}", LSP)]


@pytest.mark.parametrize("delta", range(-3, 4))
@pytest.mark.parametrize("line_end", [b"\r\n", b"\n"])
def test_header_limit_bites_at_the_same_byte_whatever_the_chunking(delta, line_end):
    head = b"Content-Length: 2" + line_end + b"X-Pad: "
    pad = MAX_HEADER_BYTES - len(head) - 2 * len(line_end) + delta
    block = head + b"p" * pad + line_end + line_end
    events = decode(block + b"{}" + b"\n" + lsp(b'{"a":1}'))  # decode() checks byte-by-byte against whole
    assert events[-1] == Frame(b'{"a":1}', LSP)
    if len(block) <= MAX_HEADER_BYTES:
        assert events == [Frame(b"{}", LSP), Frame(b'{"a":1}', LSP)]
    elif len(block) > MAX_HEADER_BYTES + 1:
        assert events[0].kind is PARSE and "header block longer" in events[0].message


# --- end of input -------------------------------------------------------------


@pytest.mark.parametrize("data", [b"Content-Length: 2", b"Content-Length: 2\r\n", b"Content-Length: 2\r\nX: y\r\n\r"])
def test_eof_inside_a_header_block_is_a_parse_error(data):
    events = decode(data)
    assert kinds(events) == [PARSE]
    assert "header block" in events[0].message


def test_eof_inside_a_body_is_a_parse_error():
    events = decode(b'{"a":1}\nContent-Length: 10\r\n\r\n{"a"')
    assert kinds(events) == [NDJSON, PARSE]
    assert "4 of the 10 body bytes" in events[1].message


def test_eof_right_after_the_header_block_is_a_parse_error():
    assert kinds(decode(b"Content-Length: 10\r\n\r\n")) == [PARSE]


def test_feed_after_feed_eof_raises():
    decoder = FrameDecoder()
    decoder.feed_eof()
    with pytest.raises(RuntimeError):
        decoder.feed(b"{}\n")


# --- UTF-8 ------------------------------------------------------------------------


@pytest.mark.parametrize("framing", [NDJSON, LSP])
def test_multibyte_utf8_body_split_across_feeds_is_intact(framing):
    body = '{"text":"é☃😀 héllo wörld 你好"}'.encode()
    data = encode_frame(body, framing)
    for split in range(1, len(data)):
        decoder = FrameDecoder()
        events = decoder.feed(data[:split]) + decoder.feed(data[split:]) + decoder.feed_eof()
        assert events == [Frame(body, framing)], split
        events[0].body.decode("utf-8")  # still valid UTF-8


# --- chunking independence ----------------------------------------------------

PIECES = [
    b'{"a":1}\n',
    b'{"b":"x"}\r\n',
    b'[{"c":3}]\n',
    b"\n\r\n \t",
    lsp(b'{"d":4}'),
    lsp(b'{"e":5}', line_end=b"\n"),
    lsp(b'{"f":"\n"}', extra=[b"Content-Type: application/json"]),
    lsp("{\"g\":\"☃😀\"}".encode()),
    b"garbage\n",
    b"xx",
    b"Content-Length: abc\r\n\r\n",
    b"Content-Length: 99999999999999\r\n\r\n",
    b"content-type: text\n\n",
    b"Content-Length: 5\r\n",
    b"Content-Len",
    b"{" + b"z" * 80 + b"}\n",  # over the 64-byte limit used below
    b"{" + b"z" * 62 + b"\n",  # exactly at it
    lsp(b"{" + b"y" * 70 + b"}"),  # body over the limit
    b'"Content-Length: 10"}',  # header text inside a message
    b"Content-Length: 3\r\nContent-Type: x\r\n\r\n",
    "é☃".encode(),
    b"\r",
    b"{",
    b"}",
]


def check_chunking(data: bytes, rng: random.Random, max_bytes: int = 64) -> None:
    whole = decode_chunks([data], max_bytes=max_bytes)
    bytewise = decode_chunks([data[i : i + 1] for i in range(len(data))], max_bytes=max_bytes)
    assert bytewise == whole
    for _ in range(3):
        assert decode_chunks(random_chunks(data, rng), max_bytes=max_bytes) == whole


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pieces=st.lists(st.sampled_from(PIECES) | st.binary(max_size=12), max_size=12),
    seed=st.integers(0, 2**32 - 1),
)
def test_decoder_gives_identical_events_whole_byte_by_byte_and_in_random_chunks(pieces, seed):
    check_chunking(b"".join(pieces), random.Random(seed))


def test_decoder_gives_identical_events_for_seeded_random_streams_and_chunkings():
    rng = random.Random(20240611)
    for _ in range(300):
        pieces = [
            rng.choice(PIECES) if rng.random() < 0.8 else rng.randbytes(rng.randint(0, 16))
            for _ in range(rng.randint(0, 10))
        ]
        check_chunking(b"".join(pieces), rng)


def test_decoder_never_raises_and_always_makes_progress_on_random_bytes():
    rng = random.Random(7)
    alphabet = b'{}[]"\\:\r\n \tContent-Length0123456789\xff\xc3'
    for _ in range(300):
        data = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 120)))
        events = decode_chunks(random_chunks(data, rng), max_bytes=48)
        assert all(isinstance(e, Frame | FramingError) for e in events)
        for e in events:
            if isinstance(e, FramingError):
                assert e.kind in (PARSE, TOO_LARGE) and e.message


# --- encode_frame -------------------------------------------------------------------


def test_encode_frame_ndjson_appends_one_newline():
    assert encode_frame(b'{"a":1}', NDJSON) == b'{"a":1}\n'


def test_encode_frame_lsp_writes_a_crlf_header_with_the_byte_length():
    body = '{"t":"é"}'.encode()
    assert encode_frame(body, LSP) == b"Content-Length: %d\r\n\r\n" % len(body) + body
    assert encode_frame(body, LSP).startswith(b"Content-Length: 10\r\n\r\n")


@pytest.mark.parametrize("framing", [NDJSON, LSP])
def test_encode_frame_round_trips_through_the_decoder(framing):
    bodies = [b'{"a":1}', '{"t":"héllo ☃"}'.encode(), b"[]", b'{"x":"\\n"}']
    data = b"".join(encode_frame(b, framing) for b in bodies)
    assert decode(data) == [Frame(b, framing) for b in bodies]



def test_an_over_limit_body_is_skipped_by_its_length_so_no_line_of_it_runs():
    body = b'{\n "jsonrpc": "2.0",\n "id": 5,\n "method": "capabilities"\n}'
    events = decode(lsp(body) + b'{"a":1}\n', max_bytes=20)
    assert kinds(events) == [TOO_LARGE, NDJSON]
    assert events[1].body == b'{"a":1}'


def test_a_content_length_header_inside_an_over_limit_body_ends_the_skip():
    events = decode(b"Content-Length: 999999\r\n\r\nabc" + lsp(b"{}"), max_bytes=20)
    assert kinds(events) == [TOO_LARGE, LSP] and events[1].body == b"{}"


def test_an_over_limit_body_cut_short_by_end_of_input_still_frees_the_last_line():
    events = decode(lsp(b"x" * 30) + b"{}\n", max_bytes=20)
    assert kinds(events) == [TOO_LARGE, NDJSON]


def test_content_length_text_inside_a_skipped_body_does_not_swallow_the_next_message():
    body = b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"note":"Content-Length: 10"}}'
    events = decode(lsp(body) + lsp(b'{"a":1}'), max_bytes=40)
    assert kinds(events) == [TOO_LARGE, LSP] and events[1].body == b'{"a":1}'


def test_content_length_text_past_the_limit_of_a_long_line_does_not_swallow_the_next_message():
    line = b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"note":"Content-Length: 10"}}\n'
    events = decode(line + lsp(b'{"a":1}') + b'{"b":2}\n', max_bytes=40)
    assert kinds(events) == [TOO_LARGE, LSP, NDJSON] and events[1].body == b'{"a":1}'


def test_content_length_text_in_garbage_does_not_swallow_the_next_message():
    events = decode(b'oops "Content-Length: 3"}' + lsp(b'{"a":1}'))
    assert kinds(events) == [PARSE, LSP] and events[1].body == b'{"a":1}'


@pytest.mark.parametrize("line_end", [b"\r\n", b"\n"])
def test_a_lying_length_still_ends_at_a_whole_header_block_with_other_headers(line_end):
    extra = [b"Content-Type: application/vscode-jsonrpc; charset=utf-8"]
    events = decode(b"Content-Length: 999999\r\n\r\n{}" + lsp(b'{"a":1}', line_end=line_end, extra=extra), max_bytes=20)
    assert kinds(events) == [TOO_LARGE, LSP] and events[1].body == b'{"a":1}'
