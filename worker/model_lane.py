"""The model lane: the requests that use the model, run by the scheduler's loop.

Threads: the loop (worker/scheduler.py's Scheduler) runs on one thread, ``lm-worker-model``: it
takes its jobs from the session (worker/locked_session.py) and runs ``load``, ``unload``,
``shutdown`` (and a job cancelled while it waited) to their answers on that thread. A
``generate`` or ``prefill`` task is made and finished on the cache I/O thread
(worker/cache_io.py), so that the requests decoding meanwhile go on, after its messages, if it
has any, were rendered on a render thread (worker/render_threads.py); only its rounds (chunks
of its prompt, decode steps) run on the model lane's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from protocol.methods import PromptParams
from worker.cache_io import CacheIO
from worker.locked_session import LockedSession
from worker.render_threads import RenderThreads
from worker.responder import Responder
from worker.scheduler import Scheduler, Task
from worker.session import Job


class ModelLane:
    """The scheduler's :class:`~worker.scheduler.Work`: where each part of a job runs."""

    def __init__(self, session: LockedSession, responder: Responder, cache_io: CacheIO, renders: RenderThreads) -> None:
        self._responder = responder
        self._cache_io = cache_io
        self._renders = renders
        self.thread = threading.Thread(target=Scheduler(session, self).run, name="lm-worker-model", daemon=True)

    def run(self, job: Job) -> None:
        self._responder.run(job)

    def start_task(self, job: Job, ready: Callable[[Task | None], None]) -> None:
        def make() -> None:
            ready(self._responder.make_task(job))

        if not (isinstance(job.params, PromptParams) and job.params.messages is not None):
            self._cache_io.submit(make)
            return

        def render() -> None:  # a chat template may take its whole deadline: not on the cache I/O thread
            if self._responder.render_prompt(job):
                self._cache_io.submit(make)
            else:
                ready(None)

        self._renders.submit(render)

    def finish_task(self, job: Job, task: Task, error: BaseException | None = None) -> None:
        self._cache_io.submit(self._responder.finish, job, task, error)
