"""Unit tests of the JSON-RPC 2.0 envelope: protocol.envelope.parse_incoming and encode_*."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from protocol.envelope import (
    MAX_PARAMS_DEPTH,
    Notification,
    Rejected,
    Request,
    Response,
    encode_error,
    encode_notification,
    encode_result,
    parse_incoming,
)
from protocol.errors import CODES, ErrorKind, RpcError
from protocol.methods import GenerateChunk
from worker.host import REPO_ROOT


def documented_codes() -> dict[str, int]:
    """Each error kind's code as docs/PROTOCOL.md's error table states it."""
    text = (REPO_ROOT / "docs" / "PROTOCOL.md").read_text()
    return {kind: int(code) for code, kind in re.findall(r"^\| (-32\d{3}) \| `([a-z_]+)` \|", text, flags=re.M)}


DOCUMENTED = documented_codes()


def test_every_error_kind_has_the_code_the_reference_gives_it():
    assert {kind.value: code for kind, code in CODES.items()} == DOCUMENTED
    assert set(CODES) == set(ErrorKind)


def request(**fields) -> bytes:
    return json.dumps({"jsonrpc": "2.0", **fields}).encode()


def rejected(body: bytes) -> Rejected:
    message = parse_incoming(body)
    assert isinstance(message, Rejected), message
    return message


# --- ids ------------------------------------------------------------------------


@pytest.mark.parametrize("msg_id", [0, "", 1, -1, "abc", 2**53, 2**70, -(2**70), "0", " "])
def test_integer_and_string_ids_are_valid_and_kept_exactly(msg_id):
    message = parse_incoming(request(id=msg_id, method="capabilities"))
    assert message == Request(msg_id, "capabilities", None)
    assert type(message.id) is type(msg_id)


def test_id_zero_is_a_request_not_a_notification():
    assert isinstance(parse_incoming(b'{"jsonrpc":"2.0","id":0,"method":"x"}'), Request)


def test_empty_string_id_is_a_request_not_a_notification():
    assert isinstance(parse_incoming(b'{"jsonrpc":"2.0","id":"","method":"x"}'), Request)


@pytest.mark.parametrize(
    "raw_id", [b"1.5", b"1.0", b"-0.0", b"1e3", b"true", b"false", b"null", b"{}", b'{"a":1}', b"[]", b"[1]"]
)
def test_invalid_id_is_invalid_request_with_reply_id_null(raw_id):
    message = rejected(b'{"jsonrpc":"2.0","id":' + raw_id + b',"method":"capabilities"}')
    assert message.id is None
    assert message.error.kind is ErrorKind.INVALID_REQUEST
    assert message.error.code == -32600
    assert message.error.data.field == "id"


def test_invalid_id_wins_over_a_missing_jsonrpc():
    message = rejected(b'{"id":true,"method":"x"}')
    assert message.id is None and message.error.kind is ErrorKind.INVALID_REQUEST


# --- the jsonrpc member -------------------------------------------------------------


@pytest.mark.parametrize("msg_id", [7, 0, "", "req-1"])
def test_missing_jsonrpc_is_invalid_request_carrying_the_request_id(msg_id):
    message = rejected(json.dumps({"id": msg_id, "method": "capabilities"}).encode())
    assert message.id == msg_id and type(message.id) is type(msg_id)
    assert message.error.kind is ErrorKind.INVALID_REQUEST
    assert message.error.data.field == "jsonrpc"
    assert "missing" in message.error.message


@pytest.mark.parametrize("version", ["1.0", "2", 2.0, 2, None, "2.0 ", ["2.0"]])
def test_wrong_jsonrpc_is_invalid_request_carrying_the_request_id(version):
    message = rejected(json.dumps({"jsonrpc": version, "id": 3, "method": "capabilities"}).encode())
    assert message.id == 3
    assert message.error.kind is ErrorKind.INVALID_REQUEST
    assert message.error.data.field == "jsonrpc"


def test_missing_jsonrpc_on_a_notification_is_invalid_request_with_id_null():
    message = rejected(b'{"method":"exit"}')
    assert message.id is None and message.error.kind is ErrorKind.INVALID_REQUEST


# --- not JSON, not an object ------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"{'a':1}",
        b'{"a":1,}',
        b'{"jsonrpc":"2.0","id":1,"method":"x"} trailing',
        b'{"jsonrpc":"2.0","id":1,"method":"x"}{}',
        b'{"a":NaN}',
        b'{"a":1e999}',
        b"{\"a\":\"\x01\"}",
        b"\xef\xbb\xbf{}",
        b"not json",
    ],
)
def test_invalid_json_is_parse_error_with_id_null(body):
    message = rejected(body)
    assert message.id is None
    assert message.error.kind is ErrorKind.PARSE_ERROR
    assert message.error.code == -32700
    assert message.error.message.startswith("Parse error")


@pytest.mark.parametrize(
    "body",
    [
        b'{"jsonrpc":"2.0","id":1,"method":"\xff"}',
        b'{"jsonrpc":"2.0","id":"\xc3","method":"x"}',
        b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"t":"\xed\xa0\x80"}}',  # an encoded surrogate
        b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"t":"\xed\xa0\x80 \\ud800"}}',  # and an escaped one
    ],
)
def test_invalid_utf8_is_parse_error(body):
    message = rejected(body)
    assert message.id is None
    assert message.error.kind is ErrorKind.PARSE_ERROR


@pytest.mark.parametrize(
    ("escaped", "decoded"),
    [("\\ud800", "\ufffd"), ("a\\udc00b", "a\ufffdb"), ("\\ud83d\\ud83d\\ude00", "\ufffd\U0001F600"),
     ("\\uDBFF", "\ufffd")],
)
def test_a_lone_escaped_surrogate_is_read_as_the_replacement_character(escaped, decoded):
    body = f'{{"jsonrpc":"2.0","id":1,"method":"x","params":{{"{escaped}":"{escaped}"}}}}'.encode()
    assert parse_incoming(body) == Request(1, "x", {decoded: decoded})


def test_a_lone_surrogate_does_not_let_other_invalid_json_through():
    for body in (b'{"id":1,"method":"x","params":{"t":"\\ud800","n":NaN}}', b'{"t":"\\ud800","n":1e999}'):
        assert rejected(body).error.kind is ErrorKind.PARSE_ERROR


def test_valid_utf8_and_escapes_are_decoded():
    message = parse_incoming('{"jsonrpc":"2.0","id":"é","method":"x","params":{"t":"\\u00e9\\ud83d\\ude00☃"}}'.encode())
    assert message == Request("é", "x", {"t": "é😀☃"})


@pytest.mark.parametrize("body", [b"[]", b"[1]", b'[{"jsonrpc":"2.0","id":1,"method":"capabilities"}]', b" [ ] "])
def test_batch_is_batch_not_supported(body):
    message = rejected(body)
    assert message.id is None
    assert message.error.kind is ErrorKind.BATCH_NOT_SUPPORTED
    assert message.error.code == -32600
    assert "Batch" in message.error.message


@pytest.mark.parametrize("body", [b"1", b"-2.5", b'"a string"', b"null", b"true", b"false"])
def test_non_object_is_invalid_request_with_id_null(body):
    message = rejected(body)
    assert message.id is None
    assert message.error.kind is ErrorKind.INVALID_REQUEST
    assert message.error.code == -32600


@pytest.mark.parametrize("body", [b"[" * 5000, b'{"a":' * 5000 + b"1" + b"}" * 5000], ids=["arrays", "objects"])
def test_deeply_nested_json_is_rejected_not_raised(body):
    message = parse_incoming(body)
    assert isinstance(message, Rejected)
    assert message.error.kind in (ErrorKind.PARSE_ERROR, ErrorKind.BATCH_NOT_SUPPORTED, ErrorKind.INVALID_REQUEST)


@pytest.mark.parametrize("depth", [600, 900])
def test_deeply_nested_json_with_a_lone_surrogate_is_rejected_with_its_id_not_raised(depth):
    """The lenient second reading of a lone surrogate walks the value, as deep as the first let it be."""
    body = b'{"jsonrpc":"2.0","id":1,"method":"x","params":{"x":' + b'{"a":' * depth + b'"\\ud83d"' + b"}" * depth + b"}}"
    message = rejected(body)
    assert (message.id, message.error.kind, message.error.data.field) == (1, ErrorKind.INVALID_PARAMS, "params.x.a.a.a")


def test_a_member_nested_past_what_the_decoder_takes_is_refused_with_the_id_whatever_strings_hold():
    """Brackets and escaped quotes inside strings are no structure to the reading that cuts the depth."""
    level = b'{"b":"[[{\\"]","c":'
    body = b'{"jsonrpc":"2.0","id":9,"method":"x","params":{"a":' + level * 5000 + b"1" + b"}" * 5000 + b"}}"
    message = rejected(body)
    assert (message.id, message.error.kind, message.error.data.field) == (9, ErrorKind.INVALID_PARAMS, "params.a.c.c.c")
    outside = rejected(b'{"jsonrpc":"2.0","id":9,"method":"x","meta":' + b"[" * 5000 + b"]" * 5000 + b"}")
    assert (outside.id, outside.error.kind) == (9, ErrorKind.INVALID_REQUEST)


# --- method and params ------------------------------------------------------------------


def nested(depth: int) -> bytes:
    """A request whose tool parameters hold a value ``depth`` levels below params."""
    schema = b'{"type":"string"}'
    for _ in range((depth - 4) // 2):  # params.tools[0].function.parameters is 4 levels down
        schema = b'{"type":"object","properties":{"a":' + schema + b"}}"
    return b'{"jsonrpc":"2.0","id":3,"method":"generate","params":{"tools":[{"function":{"parameters":' + schema + b"}}]}}"


def test_params_nested_up_to_the_bound_pass_and_deeper_ones_are_refused_naming_the_field():
    assert isinstance(parse_incoming(nested(MAX_PARAMS_DEPTH)), Request)
    message = rejected(nested(MAX_PARAMS_DEPTH + 2))
    assert (message.id, message.error.kind) == (3, ErrorKind.INVALID_PARAMS)
    assert message.error.data.field == "params.tools[0].function.parameters"
    assert f"nests more than {MAX_PARAMS_DEPTH} levels deep" in message.error.message
    notification = nested(MAX_PARAMS_DEPTH + 2).replace(b'"id":3,', b"")
    assert isinstance(parse_incoming(notification), Notification)  # ignored or refused by its own rules


def test_missing_method_is_invalid_request_carrying_the_id():
    message = rejected(b'{"jsonrpc":"2.0","id":4}')
    assert message.id == 4
    assert message.error.kind is ErrorKind.INVALID_REQUEST
    assert message.error.data.field == "method"


@pytest.mark.parametrize("method", [1, None, True, [], {}])
def test_non_string_method_is_invalid_request_carrying_the_id(method):
    message = rejected(json.dumps({"jsonrpc": "2.0", "id": 5, "method": method}).encode())
    assert message.id == 5
    assert message.error.kind is ErrorKind.INVALID_REQUEST
    assert message.error.data.field == "method"


@pytest.mark.parametrize("params", [[], [1, 2], "x", 3, True])
def test_params_that_are_not_an_object_are_invalid_params_with_field_params(params):
    message = rejected(json.dumps({"jsonrpc": "2.0", "id": 6, "method": "tokenize", "params": params}).encode())
    assert message.id == 6
    assert message.error.kind is ErrorKind.INVALID_PARAMS
    assert message.error.code == -32602
    assert message.error.data.field == "params"
    assert message.error.data.method == "tokenize"


def test_params_array_on_a_notification_is_invalid_params_with_id_null():
    message = rejected(b'{"jsonrpc":"2.0","method":"$/cancelRequest","params":[1]}')
    assert message.id is None
    assert message.error.kind is ErrorKind.INVALID_PARAMS
    assert message.error.data.field == "params"


@pytest.mark.parametrize("raw", [b"", b',"params":null', b',"params":{}', b',"params":{"text":"a","n":[1]}'])
def test_params_object_null_or_absent_are_accepted(raw):
    message = parse_incoming(b'{"jsonrpc":"2.0","id":1,"method":"tokenize"' + raw + b"}")
    assert isinstance(message, Request)
    expected = json.loads(b"{" + raw[1:] + b"}").get("params") if raw else None
    assert message.params == expected


def test_member_order_does_not_matter():
    message = parse_incoming(b'{"params":{"a":1},"method":"m","id":9,"jsonrpc":"2.0"}')
    assert message == Request(9, "m", {"a": 1})


# --- notifications and responses ------------------------------------------------------


def test_message_without_id_is_a_notification():
    message = parse_incoming(b'{"jsonrpc":"2.0","method":"$/cancelRequest","params":{"id":3}}')
    assert message == Notification("$/cancelRequest", {"id": 3})
    assert not hasattr(message, "id")


def test_notification_without_params():
    assert parse_incoming(b'{"jsonrpc":"2.0","method":"exit"}') == Notification("exit", None)


@pytest.mark.parametrize(
    "body",
    [
        b'{"jsonrpc":"2.0","id":1,"result":null}',
        b'{"jsonrpc":"2.0","id":1,"result":{"a":1}}',
        b'{"jsonrpc":"2.0","id":"x","error":{"code":-32601,"message":"no"}}',
        b'{"jsonrpc":"2.0","id":0,"result":0}',
    ],
)
def test_result_or_error_with_id_is_a_response(body):
    message = parse_incoming(body)
    assert isinstance(message, Response)
    assert message.id == json.loads(body)["id"]


@pytest.mark.parametrize(
    "body", [b'{"jsonrpc":"2.0","result":1}', b'{"jsonrpc":"2.0","id":null,"error":{}}', b'{"id":{},"result":1}']
)
def test_a_response_without_a_usable_id_is_still_a_response_and_never_answered(body):
    assert parse_incoming(body) == Response(None)


# --- encoding ---------------------------------------------------------------------------


@pytest.mark.parametrize("result", [None, 0, "", [], {}, {"a": None}, False])
@pytest.mark.parametrize("msg_id", [0, "", 42, "abc"])
def test_encode_result_always_carries_result_even_when_none(msg_id, result):
    decoded = json.loads(encode_result(msg_id, result))
    assert decoded == {"jsonrpc": "2.0", "id": msg_id, "result": result}
    assert "error" not in decoded


def test_encode_result_encodes_structs():
    chunk = GenerateChunk(
        id=1, index=0, text="é", tokens=[195, 169], generated_tokens=2, prompt_tokens=3, cache_read_tokens=0,
        content="é", reasoning="", tool_calls=[],
    )
    decoded = json.loads(encode_result(1, chunk))
    assert decoded["result"]["text"] == "é" and decoded["result"]["tokens"] == [195, 169]


@pytest.mark.parametrize("msg_id", [None, 0, "", 7, "x"])
@pytest.mark.parametrize("kind", list(ErrorKind))
def test_encode_error_never_carries_result(msg_id, kind):
    decoded = json.loads(encode_error(msg_id, RpcError(kind, f"{kind} happened; do something else.")))
    assert set(decoded) == {"jsonrpc", "id", "error"}
    assert decoded["jsonrpc"] == "2.0"
    assert decoded["id"] == msg_id
    assert decoded["error"]["code"] == DOCUMENTED[kind.value]
    assert decoded["error"]["message"] == f"{kind} happened; do something else."
    assert decoded["error"]["data"] == {"kind": kind.value}  # unset details are omitted


def test_encode_error_carries_field_method_and_limit_when_given():
    error = RpcError(ErrorKind.INVALID_PARAMS, "bad", field="params.x", method="generate", limit=3)
    decoded = json.loads(encode_error(1, error))
    assert decoded["error"]["data"] == {"kind": "invalid_params", "field": "params.x", "method": "generate", "limit": 3}


def test_encode_notification_has_method_and_params_and_no_id():
    decoded = json.loads(encode_notification("generate/chunk", {"id": 1, "index": 0}))
    assert decoded == {"jsonrpc": "2.0", "method": "generate/chunk", "params": {"id": 1, "index": 0}}


def test_encoded_messages_are_one_line_of_utf8_json():
    body = encode_result("é\n", {"text": "line1\nline2\r\u2028 ☃ 😀"})
    assert b"\n" not in body and b"\r" not in body
    assert json.loads(body.decode("utf-8"))["result"]["text"] == "line1\nline2\r\u2028 ☃ 😀"


@pytest.mark.parametrize("msg_id", [0, "", 2**70, "é"])
def test_parse_of_an_encoded_response_round_trips(msg_id):
    assert parse_incoming(encode_result(msg_id, None)) == Response(msg_id)
    assert parse_incoming(encode_error(msg_id, RpcError(ErrorKind.INTERNAL_ERROR, "x"))) == Response(msg_id)


def test_rejected_errors_encode_to_valid_error_responses():
    for body in [b"{", b"[]", b"1", b'{"id":1.5}', b'{"id":2,"method":"x"}', b'{"jsonrpc":"2.0","id":3,"method":"x","params":[]}']:
        message = rejected(body)
        decoded = msgspec.json.decode(encode_error(message.id, message.error))
        assert decoded["id"] == message.id
        assert decoded["error"]["code"] == DOCUMENTED[decoded["error"]["data"]["kind"]]


# --- the error code table ---------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "code"),
    [
        (ErrorKind.PARSE_ERROR, -32700),
        (ErrorKind.MESSAGE_TOO_LARGE, -32700),
        (ErrorKind.INVALID_REQUEST, -32600),
        (ErrorKind.BATCH_NOT_SUPPORTED, -32600),
        (ErrorKind.DUPLICATE_ID, -32600),
        (ErrorKind.METHOD_NOT_FOUND, -32601),
        (ErrorKind.INVALID_PARAMS, -32602),
        (ErrorKind.INTERNAL_ERROR, -32603),
        (ErrorKind.REQUEST_CANCELLED, -32800),
    ],
)
def test_error_codes_match_the_json_rpc_table(kind, code):
    assert CODES[kind] == code
    assert RpcError(kind, "x").code == code


def test_every_error_kind_has_a_code():
    assert set(CODES) == set(ErrorKind)


STANDARD_CODES = {-32700, -32600, -32601, -32602, -32603, -32800}


@pytest.mark.parametrize("kind", list(CODES))
def test_every_code_is_standard_or_a_worker_code_in_minus_32000_to_minus_32019(kind):
    code = CODES[kind]
    assert isinstance(code, int) and not isinstance(code, bool)
    assert code in STANDARD_CODES or -32019 <= code <= -32000, (kind, code)
    assert not -32099 <= code <= -32096, "reserved for vscode-jsonrpc"


# A kind that narrows another keeps its code, so that a host reading codes sees no change.
NARROWS = {ErrorKind.MODEL_NOT_FOUND: ErrorKind.MODEL_LOAD_FAILED}


def test_worker_codes_are_distinct_per_kind_but_for_a_kind_that_narrows_another():
    worker = [code for kind, code in CODES.items() if code not in STANDARD_CODES and kind not in NARROWS]
    assert len(worker) == len(set(worker))
    assert all(CODES[narrow] == CODES[wide] for narrow, wide in NARROWS.items())


def test_error_kind_values_are_stable_snake_case_names():
    for kind in ErrorKind:
        assert kind.value == kind.name.lower()
