"""A reasoning model's thinking, told apart from its answer as the text streams.

Models such as Qwen3 and DeepSeek-R1 think before they answer, between markers their chat
template declares (``<think>`` and ``</think>``). :class:`ReasoningSplitter` takes the
generated text piece by piece and gives back what is answer and what is thinking, without
the markers. A marker may arrive split across tokens: text that could be the start of one
is held back until it is known, as stop strings are (worker/streaming.py). The whitespace
right after a marker (a template's own line breaks) is dropped.

A prompt may end inside the thinking (templates that open it in the generation prompt);
then the generation starts there. A constrained output (``response_format``, a forcing
``tool_choice``) is not split: the grammar wrote the answer (generation.py). Torch-free; the
splitting itself is pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from worker.backends.base import Markers, Model, ReasoningModel

# The markers lm-worker recognizes, as a chat template declares them.
KNOWN = (Markers("<think>", "</think>"),)


def markers(chat_template: str | None) -> Markers | None:
    """The thinking markers ``chat_template`` declares, or None (then nothing is split)."""
    source = chat_template or ""
    return next((known for known in KNOWN if known.start in source and known.end in source), None)


def opens_thinking(found: Markers, prompt: str) -> bool:
    """Whether ``prompt`` ends inside the thinking: its last marker is an opening one."""
    return prompt.rfind(found.start) > prompt.rfind(found.end)


def splitter_for(model: Model, prompt: Sequence[int]) -> ReasoningSplitter | None:
    """The splitter of a generation of ``model`` continuing ``prompt``; None for a model
    whose chat template declares no markers (``reasoning_markers``, optional)."""
    found = model.reasoning_markers if isinstance(model, ReasoningModel) else None
    if found is None:
        return None
    return ReasoningSplitter(found, inside=opens_thinking(found, model.detokenize(prompt)))


class Split(NamedTuple):
    content: str  # answer text
    reasoning: str  # thinking text
    thinking: bool  # whether any of the text was thinking or a marker


class ReasoningSplitter:
    def __init__(self, found: Markers, *, inside: bool = False) -> None:
        self._markers = found
        self.inside = inside
        self._held = ""  # the start of a marker, maybe
        self._skip_space = inside  # the whitespace after the marker the prompt ended with

    def push(self, text: str) -> Split:
        content: list[str] = []
        reasoning: list[str] = []
        thinking = self.inside
        for char in text:
            if self._skip_space and char.isspace():
                continue
            self._skip_space = False
            marker = self._markers.end if self.inside else self._markers.start
            held = self._held + char
            if held == marker:
                self._held, self.inside, self._skip_space, thinking = "", not self.inside, True, True
                continue
            keep = _longest_marker_start(held, marker)
            (reasoning if self.inside else content).append(held[: len(held) - keep])
            self._held = held[len(held) - keep :]
        return Split("".join(content), "".join(reasoning), thinking or self.inside)

    @property
    def holding(self) -> bool:
        """Whether text is held back (it may begin a marker)."""
        return bool(self._held)

    def flush(self) -> Split:
        """The end of the text: what was held back was not a marker."""
        held, self._held = self._held, ""
        return Split("" if self.inside else held, held if self.inside else "", self.inside)


def _longest_marker_start(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (shorter than it)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
