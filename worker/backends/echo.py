"""The echo backend: deterministic, torch-free, for tests and for debugging a host.

Tokens are the UTF-8 bytes of the text (ids 0-255) plus two special tokens,
BOS (256) and EOS (257). The continuation of a prompt is the prompt's own
bytes, echoed back one token per step, then EOS. Multi-byte characters span
several tokens, so streaming exercises incremental detokenization;
``token_delay_ms`` makes a generation slow enough to cancel.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.methods import ChatMessage, GenerateParams, LoadParams, ModelInfo, SpecialToken, Tool, ToolCallSupport

BOS, EOS = 256, 257
_SPECIAL_TEXT = {BOS: "<s>", EOS: "</s>"}
CONTEXT_LENGTH = 1 << 20

if TYPE_CHECKING:
    from worker.backends.base import Decoding
    from worker.grammar import GrammarTokenizer, OutputConstraint


class EchoModel:
    def __init__(self, params: LoadParams, load_time_ms: float) -> None:
        self._delay_s = params.token_delay_ms / 1000.0
        self.eos_token_ids = frozenset({EOS})
        self.grammar_tokenizer: GrammarTokenizer | None = None  # no grammar can constrain the echo
        self.info = ModelInfo(
            model=params.model,
            backend="echo",
            path=None,
            vocab_size=258,
            context_length=CONTEXT_LENGTH,
            special_tokens=[
                SpecialToken(role="bos", id=BOS, text=_SPECIAL_TEXT[BOS]),
                SpecialToken(role="eos", id=EOS, text=_SPECIAL_TEXT[EOS]),
            ],
            has_chat_template=True,
            device="cpu",
            dtype="none",
            quantization="none",
            tool_calls=ToolCallSupport(template_takes_tools=False, format="hermes", forced=False),
            load_time_ms=load_time_ms,
        )

    def tokenize(self, text: str, *, add_special_tokens: bool) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS, *ids] if add_special_tokens else ids

    def detokenize(self, tokens: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        parts: list[str] = []
        run = bytearray()
        for token in tokens:
            if 0 <= token < 256:
                run.append(token)
                continue
            if token not in _SPECIAL_TEXT:
                raise ValueError(f"token id {token} is outside the echo vocabulary (0-257)")
            parts.append(run.decode("utf-8", "replace"))
            run.clear()
            if not skip_special_tokens:
                parts.append(_SPECIAL_TEXT[token])
        parts.append(run.decode("utf-8", "replace"))
        return "".join(parts)

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Tool],
        add_generation_prompt: bool,
    ) -> tuple[str, list[int]]:
        assert not tools, "the worker writes tools into the messages for a template that takes none"
        text = "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return text, self.tokenize(text, add_special_tokens=True)

    def start(
        self, prompt: Sequence[int], params: GenerateParams | None, *, constraint: OutputConstraint | None = None
    ) -> EchoDecoding:
        assert constraint is None, "no grammar_tokenizer: the worker never constrains the echo"
        return EchoDecoding(prompt, self._delay_s)

    chunks_in_step = False

    def step(self, decodings: Sequence[Decoding], chunks: Sequence[tuple[Decoding, int]] = ()) -> None:
        if self._delay_s:  # one delay per step, however many requests it advances: a batch
            time.sleep(self._delay_s)

    def close(self) -> None:
        pass


class EchoDecoding:
    """The prompt is "fed" at once; the continuation is its bytes, then EOS."""

    def __init__(self, prompt: Sequence[int], delay_s: float) -> None:
        self._continuation = [t for t in prompt if t < 256] + [EOS]
        self._next = 0
        self._delay_s = delay_s
        self.prompt_left = len(prompt)

    def feed(self, chunk_tokens: int) -> None:
        self.prompt_left = max(0, self.prompt_left - max(1, chunk_tokens))
        if not self.prompt_left and self._delay_s:  # the first token takes a step too
            time.sleep(self._delay_s)

    def next_token(self) -> int:
        token = self._continuation[min(self._next, len(self._continuation) - 1)]
        self._next += 1
        return token


class EchoBackend:
    name = "echo"
    description = "Deterministic torch-free backend: echoes the prompt's UTF-8 bytes back, one token each."

    def unavailable_reason(self) -> str | None:
        return None

    def check(self, params: LoadParams, *, data_dir: Path) -> None:
        pass  # every load params work

    def load(self, params: LoadParams, *, data_dir: Path) -> EchoModel:
        started = time.perf_counter()
        return EchoModel(params, (time.perf_counter() - started) * 1000.0)


if TYPE_CHECKING:  # the registry finds backends by import path: these hold the classes to the boundary
    from worker.backends.base import CheckingBackend, Model

    _backend: type[CheckingBackend] = EchoBackend
    _model: type[Model] = EchoModel
