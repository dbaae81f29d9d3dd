"""Rendering a model's chat template, bounded: in a process of its own (worker/template_process.py),
with a deadline, a memory bound, an output bound, and a cancel that ends it at once.

A chat template comes with the model, and the model is anyone's download: rendered in the
worker, a template that loops 10^10 times held the thread it ran on for good, and one that
doubled a string 40 times grew the worker until the kernel killed it. Rendered in a child
process, its memory is the child's (at most RENDER_MEMORY_BYTES), and the thread that waits
for its text gives up after RENDER_TIMEOUT_S, or when the request is cancelled (a wait marked
with worker.stopping), killing the child; a later render starts another. The text is at most
twice the characters of the messages and tools it renders plus CHARS_PER_CONTEXT_TOKEN for
each token of the model's context: more cannot be a prompt for the model, and tokenizing it
would take hundreds of bytes a character. Each of these is -32602 naming the template.

A few children stay started between renders (a start costs about 50 ms); each renders one
template at a time, so requests that render at once each get their own. Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from protocol.errors import ErrorKind, RpcError
from worker import stopping
from worker.template_process import RenderReply, RenderRequest, frame

RENDER_TIMEOUT_S = 10.0
RENDER_MEMORY_BYTES = 1 << 30
CHARS_PER_CONTEXT_TOKEN = 32
_KEPT_IDLE = 2  # children kept started between renders
_ROOT = Path(__file__).resolve().parent.parent  # where the child imports worker.template_process from


def render(
    template: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    add_generation_prompt: bool,
    variables: dict[str, Any],
    context_length: int,
) -> str:
    """The template's text for these messages and tools (``variables``: the tokenizer's special
    tokens); -32602 naming the template where it raises or runs past a bound, -32800 where the
    request is cancelled meanwhile."""
    given = len(msgspec.json.encode([messages, tools]))
    request = RenderRequest(template, messages, tools, add_generation_prompt, variables,
                            max_chars=2 * given + CHARS_PER_CONTEXT_TOKEN * max(context_length, 0))
    reply = _CHILDREN.render(request)
    if reply.failed is None:
        return reply.text
    if reply.failed == "raised":
        raise _refused(f"The model's chat template refused these messages: {reply.detail}")
    if reply.failed == "too_long":
        raise _refused(
            f"The model's chat template wrote more than {request.max_chars} characters, more than any prompt "
            f"this model takes (twice the {given} characters of the messages and tools, and "
            f"{CHARS_PER_CONTEXT_TOKEN} for each of the {context_length} tokens of its context): it cannot be "
            "rendered. Fix the chat template, or use 'prompt' or 'tokens'."
        )
    raise _refused(
        f"The model's chat template took more than {RENDER_MEMORY_BYTES >> 20} MiB of memory to render these "
        "messages, so it was stopped. Fix the chat template, or use 'prompt' or 'tokens'."
    )


def _refused(message: str) -> RpcError:
    return RpcError(ErrorKind.INVALID_PARAMS, message, field="params.messages")


class _Child:
    """One rendering process."""

    def __init__(self) -> None:
        code = (f"import sys; sys.path.insert(0, {str(_ROOT)!r}); from worker.template_process import serve; "
                f"serve({os.getpid()}, {RENDER_MEMORY_BYTES})")
        self.process = subprocess.Popen([sys.executable, "-I", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.killed = False  # by a cancel

    def kill(self) -> None:
        self.killed = True
        self.process.kill()

    def render(self, request: RenderRequest) -> RenderReply:
        """The reply; RpcError past the deadline or at a cancel (the child is killed then)."""
        deadline = time.monotonic() + RENDER_TIMEOUT_S
        assert self.process.stdin is not None
        with stopping.while_waiting(self.kill):  # a cancel kills the child: its output ends at once
            try:
                self.process.stdin.write(frame(request))
                self.process.stdin.flush()
                length = int.from_bytes(self._read(4, deadline), "little")
                return msgspec.msgpack.decode(self._read(length, deadline), type=RenderReply)
            except TimeoutError:
                raise _refused(
                    f"The model's chat template did not finish rendering these messages within "
                    f"{RENDER_TIMEOUT_S:g} s, so it was stopped. Fix the chat template, or use 'prompt' or 'tokens'."
                ) from None
            except (OSError, EOFError, msgspec.DecodeError) as exc:
                if self.killed:
                    raise RpcError(ErrorKind.REQUEST_CANCELLED,
                                   "The request was cancelled while its chat template rendered.") from None
                raise RuntimeError(f"the chat template's renderer ended without an answer ({exc})") from exc

    def _read(self, count: int, deadline: float) -> bytes:
        """``count`` bytes of the child's output (from its descriptor: the buffered pipe object is
        never read); EOFError where it ends, TimeoutError at the deadline."""
        assert self.process.stdout is not None
        fd, out = self.process.stdout.fileno(), bytearray()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while len(out) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if not poller.poll(left * 1000):
                continue
            chunk = os.read(fd, min(count - len(out), 1 << 20))
            if not chunk:
                raise EOFError("its output ended")
            out += chunk
        return bytes(out)

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):  # what a killed child left unread is let go
                    pipe.close()


class _Children:
    """The rendering processes: one per render in progress, a few kept idle between renders."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Child] = []

    def render(self, request: RenderRequest) -> RenderReply:
        child = self._take()
        try:
            reply = child.render(request)
        except BaseException:
            child.close()
            raise
        self._give_back(child, keep=reply.failed in (None, "raised"))
        return reply

    def _take(self) -> _Child:
        with self._lock:
            while self._idle:
                child = self._idle.pop()
                if child.process.poll() is None:
                    return child
                child.close()
        try:
            return _Child()
        except OSError as exc:
            raise RuntimeError(f"cannot start the chat template's renderer ({sys.executable}): {exc}") from exc

    def _give_back(self, child: _Child, *, keep: bool) -> None:
        with self._lock:
            if keep and len(self._idle) < _KEPT_IDLE:
                self._idle.append(child)
                return
        child.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.close()


_CHILDREN = _Children()


def close() -> None:
    """End the idle rendering processes (a render later starts one again)."""
    _CHILDREN.close()


def as_template_data(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as chat templates get them: keys whose value is null left out, as transformers does."""
    return [{key: value for key, value in message.items() if value is not None} for message in messages]
