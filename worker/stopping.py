"""Stopping a running request where it waits on another program.

Most running requests cannot stop halfway (a tokenize); one that waits on another program
can: on a server's answer (the openai backend's ``load``, ``tokenize``, ``detokenize``,
``render``) letting go of the connection ends the wait at once, and on a chat template's
rendering process (worker/chat_template.py) killing it does. A ``load`` marks its whole
course as such a wait (Handlers.load: the cancel sets the flag that load_progress's checks
and a kernel's compiler read), so waits nest: a cancel lets go of every one in progress. The
responder runs each queued job's handler, and a generate's or prefill's rendering of its
messages, inside ``scope(job.stop)``; code deep below it marks such a wait with
``while_waiting(let_go)``; a cancel calls ``Stop.stop``, which lets go of the wait in
progress and says whether there was one (the cancel then answers ``cancelled: true``, and
the request answers -32800). The Backend and Model contracts stay as they are: the scope
travels in a context variable, as load_progress's reporter does. Torch-free.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import ContextManager


class Stop:
    """One request's way to be stopped while it runs. Any thread.

    ``sticky``: the request stops whenever it is cancelled (a generate or prefill, whose cancel
    always answers ``cancelled: true``), so a wait that begins after the cancel is let go of
    as it begins."""

    def __init__(self, *, sticky: bool = False) -> None:
        self._lock = threading.Lock()
        self._let_go: list[Callable[[], None]] = []  # the waits in progress, outermost first (they nest)
        self._sticky = sticky
        self._stopped = False

    def stop(self) -> bool:
        """Let go of the wait in progress; True when there was one. Under the lock, so that a
        wait that ends meanwhile has either been let go of or is over (``waiting``'s end)."""
        with self._lock:
            self._stopped = self._sticky
            for let_go in reversed(self._let_go):
                let_go()
            return bool(self._let_go)

    @contextmanager
    def waiting(self, let_go: Callable[[], None]) -> Iterator[None]:
        with self._lock:
            if self._stopped:
                let_go()
            self._let_go.append(let_go)
        try:
            yield
        finally:
            with self._lock:
                self._let_go.pop()  # this one: waits nest on the one thread that runs the request


_current: ContextVar[Stop | None] = ContextVar("stopping", default=None)


@contextmanager
def scope(stop: Stop) -> Iterator[None]:
    """Within this block (on this thread), waits marked with ``while_waiting`` stop with ``stop``."""
    token = _current.set(stop)
    try:
        yield
    finally:
        _current.reset(token)


def while_waiting(let_go: Callable[[], None]) -> ContextManager[None]:
    """Mark a wait that ``let_go`` ends at once (from another thread), for the request in scope."""
    stop = _current.get()
    return nullcontext() if stop is None else stop.waiting(let_go)
