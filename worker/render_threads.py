"""The render threads: where a generate's or prefill's messages are rendered into its prompt,
before the cache I/O thread makes its task.

Threads: up to RENDER_THREADS, ``lm-worker-render``, each rendering one request's chat template
at a time (in a process of its own, worker/chat_template.py, waiting at most its deadline). A
template that takes its whole deadline holds only the request it renders: the cache I/O thread,
which every generate and prefill needs to start and finish, never runs one.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

RENDER_THREADS = 4


class RenderThreads:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="lm-worker-render")

    def submit(self, work: Callable[[], None]) -> None:
        self._executor.submit(work)

    def shutdown(self) -> None:
        """Wait for the renders already submitted (each hands its request on to the cache I/O thread)."""
        self._executor.shutdown(wait=True)
