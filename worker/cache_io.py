"""The cache I/O thread: where generate and prefill tasks are made and finished, off the model
lane's thread.

Threads: one, ``lm-worker-cache-io``, runs the work submitted to it in order. Making a task
resolves its prompt and may read and verify a stored cache; finishing one may store a cache
and sends the answer: done here, the requests decoding meanwhile on the model lane go on.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class CacheIO:
    def __init__(self, prepare_thread: Callable[[], None]) -> None:
        """``prepare_thread`` runs before each piece of work (the loaded model's work off its own
        thread needs it: Handlers.prepare_side_thread)."""
        self._prepare_thread = prepare_thread
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lm-worker-cache-io")

    def submit(self, work: Callable[..., Any], *args: Any) -> None:
        def run() -> None:
            self._prepare_thread()
            work(*args)

        self._executor.submit(run)

    def shutdown(self) -> None:
        """Wait for the work already submitted (the last answers may still be on their way)."""
        self._executor.shutdown(wait=True)
