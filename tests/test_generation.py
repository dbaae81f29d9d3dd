"""One generation loop over a token source: a local model's steps and an engine's stream meet the
same limits, written once (worker/generation.py, worker/backends/openai/generation.py)."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import msgspec
import pytest

from protocol.errors import ErrorKind, RpcError
from protocol.methods import GenerateParams, GenerateResult, LoadParams
from worker.backends.base import PREFILL_CHUNK_TOKENS, Model, Piece, StreamEnd
from worker.backends.echo import EchoBackend
from worker.backends.openai.generation import EngineStream
from worker.generation import Generation, LocalSteps, TokenSource, prompt_tokens

ROOT = Path(__file__).resolve().parent.parent
TEXT = "hello world"


class ScriptedStream:
    """An engine's stream that has received ``pieces`` (and, once they are taken, ``end``); the
    prompt's count arrives with the first step, as an engine says it once its stream begins."""

    prompt_left = 0

    def __init__(self, pieces: list[Piece], end: StreamEnd | None, prompt_tokens: int) -> None:
        self._pieces = collections.deque(pieces)
        self._end, self._counted = end, prompt_tokens
        self.prompt_tokens, self.cached_tokens, self.exact, self.end = 0, None, True, None
        self.closed = False

    def step(self) -> None:
        self.prompt_tokens = self._counted
        self.end = self._end

    def has_next(self) -> bool:
        return bool(self._pieces)

    def next_piece(self) -> Piece:
        return self._pieces.popleft()

    def feed(self, chunk_tokens: int) -> None:
        raise AssertionError("an engine's prompt is never fed")

    def next_token(self) -> int:
        raise AssertionError("an engine's stream is taken by piece")

    def close(self) -> None:
        self.closed = True


def echo(tmp_path: Path, context_length: int | None = None) -> Model:
    model = EchoBackend().load(LoadParams(backend="echo"), data_dir=tmp_path)
    if context_length is not None:
        model.info.context_length = context_length
    return model


def generate(model: Model, params: GenerateParams, source: TokenSource, step=lambda: None) -> GenerateResult:
    generation = Generation(
        model, params, source, request_id=1, is_cancelled=lambda: False, send_chunk=lambda chunk: None, queued_ms=0.0
    )
    while generation.decoding.prompt_left:
        generation.feed(PREFILL_CHUNK_TOKENS)
    while not generation.done:
        model.step([generation.decoding])
        step()
        generation.advance()
    return generation.finish()


def local(model: Model, params: GenerateParams) -> GenerateResult:
    return generate(model, params, LocalSteps(model, params, prompt_tokens(model, params)))


def engine(model: Model, params: GenerateParams, stream: ScriptedStream) -> GenerateResult:
    return generate(model, params, EngineStream(stream, params), stream.step)


def one_token_a_piece(text: str) -> list[Piece]:
    return [Piece(tokens=[byte], text=chr(byte)) for byte in text.encode()]


def outcome(result: GenerateResult) -> tuple:
    return result.text, result.tokens, result.finish_reason, result.stop_reason, result.usage.completion_tokens


@pytest.mark.parametrize(
    "limits",
    [{"max_tokens": 1}, {"max_tokens": 4}, {"max_tokens": 9, "stop": ["o w"]}, {"max_tokens": 30, "stop": ["wor"]}],
    ids=["one token", "max_tokens", "a stop string first", "a stop string long before max_tokens"],
)
def test_max_tokens_and_stop_strings_end_local_steps_and_an_engine_stream_alike(tmp_path: Path, limits: dict):
    model = echo(tmp_path)
    params = GenerateParams(tokens=list(TEXT.encode()), **limits)
    stream = ScriptedStream(one_token_a_piece(TEXT), StreamEnd(reason="length"), prompt_tokens=len(TEXT))
    by_steps, by_stream = local(model, params), engine(model, params, stream)
    assert outcome(by_stream) == outcome(by_steps)
    assert by_steps.finish_reason == ("length" if "stop" not in limits else "stop")
    assert stream.closed and stream.has_next(), "the pieces past the end are left untaken"


def test_the_max_tokens_stop_counts_an_engine_s_tokens_in_pieces_of_several(tmp_path: Path):
    model = echo(tmp_path)
    params = GenerateParams(tokens=list(TEXT.encode()), max_tokens=4)
    pieces = [Piece(tokens=[104, 101], text="he", counted=2), Piece(tokens=[108, 108], text="ll", counted=2)]
    stream = ScriptedStream([*pieces, Piece(tokens=[111], text="o")], None, prompt_tokens=len(TEXT))
    assert outcome(engine(model, params, stream)) == outcome(local(model, params))


def test_a_prompt_past_the_context_is_refused_alike_before_local_steps_and_once_an_engine_counts_it(tmp_path: Path):
    model = echo(tmp_path, context_length=len(TEXT) + 3)
    params = GenerateParams(tokens=list(TEXT.encode()), max_tokens=4)
    with pytest.raises(RpcError) as before:
        prompt_tokens(model, params)
    stream = ScriptedStream(one_token_a_piece(TEXT), None, prompt_tokens=len(TEXT))
    with pytest.raises(RpcError) as counted:
        engine(model, GenerateParams(prompt=TEXT, max_tokens=4), stream)
    assert before.value.kind is counted.value.kind is ErrorKind.CONTEXT_OVERFLOW
    assert msgspec.to_builtins(counted.value.data) == msgspec.to_builtins(before.value.data)
    assert counted.value.message == before.value.message
    assert stream.closed and len(stream._pieces) == len(TEXT), "the engine's request stops, none of it taken"


def test_an_engine_s_end_is_taken_only_after_every_piece_it_sent(tmp_path: Path):
    model = echo(tmp_path)
    params = GenerateParams(prompt=TEXT, max_tokens=30)
    result = engine(model, params, ScriptedStream(one_token_a_piece("hi"), StreamEnd(reason="stop"), len(TEXT)))
    assert (result.text, result.finish_reason, result.stop_reason.kind, result.stop_reason.token) == ("hi", "stop", "eos", 105)


# The modules a generate's params pass through, the higher first: each imports only those after it.
ONE_WAY = [
    "worker.backends.openai.generation",
    "worker.generation",
    "worker.constraints",
    "worker.tool_calls",
    "worker.call_text",
    "worker.reasoning",
    "worker.streaming",
    "worker.backends.base",
    "worker.grammar",
]


def imported_worker_modules(module: str) -> set[str]:
    """Every worker module ``module`` imports: at its top, inside functions, or for types only."""
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("worker"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("worker"))
    return found


def test_the_modules_a_generate_passes_through_import_one_way_down():
    climbs = {
        module: sorted(m for m in imported_worker_modules(module) if m in ONE_WAY[: ONE_WAY.index(module) + 1])
        for module in ONE_WAY
    }
    assert {module: up for module, up in climbs.items() if up} == {}
    assert "worker.generation" in imported_worker_modules("worker.backends.openai.generation"), "the test reads imports"
