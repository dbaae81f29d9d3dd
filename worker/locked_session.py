"""The session shared by the worker's threads: every read and change of worker/session.py's
state under one lock, and the lanes' waits for their next job on that lock.

Threads: the reader calls ``receive``, ``cancel``, ``ack``, ``end`` and ``take_withdrawn``; the text lane
(``lm-worker-text``) waits in ``next_text_job`` and the model lane (``lm-worker-model``) in
``next_model_job``; whichever thread sends a job's answer (a lane, the cache I/O thread)
calls ``release``; a task made on the cache I/O thread ``wake``s the model lane. Every change
that could let a job start, or that the model lane's running requests must see (a cancel, an
ack), wakes the waiting lanes, and ``wake_model`` (a model whose step waits on another program,
an engine, returns from that wait).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from protocol.envelope import RequestId
from protocol.methods import CancelResult, Params
from worker.session import Job, Session


class LockedSession:
    def __init__(self, max_batch: int, wake_model: Callable[[], None] = lambda: None) -> None:
        self._session = Session(max_batch)
        self._changed = threading.Condition()
        self._wake_model = wake_model  # called after the lock is let go

    @property
    def stopping(self) -> bool:
        """No more input is read (read without the lock: it only ever turns true)."""
        return self._session.stopping

    @property
    def shutdown_requested(self) -> bool:
        return self._session.shutdown_requested

    @contextmanager
    def _change(self, *, notify: bool = True) -> Iterator[Session]:
        """A change of the session's state: made under the lock, the waiting lanes woken
        (``notify``: a job may start now), then, the lock let go, ``wake_model``."""
        with self._changed:
            yield self._session
            if notify:
                self._changed.notify_all()
        self._wake_model()

    def receive(self, request_id: RequestId, method: str, params: Params, now: float) -> Job | None:
        """See Session.receive: the request's job, or None when the caller answers it at once."""
        with self._change() as session:
            return session.receive(request_id, method, params, now)

    def cancel(self, request_id: RequestId) -> CancelResult:
        with self._change() as session:  # the model lane answers a cancelled queued request at once
            return session.cancel(request_id)

    def ack(self, request_id: RequestId, index: int) -> None:
        with self._change(notify=False) as session:  # only the running stream sees it, in its step
            session.ack(request_id, index)

    def release(self, job: Job) -> None:
        """The job has its answer: its id is free again, and what waited for it may start."""
        with self._change() as session:
            session.release(job)

    def end(self, *, cancel: bool, withdraw: bool = False) -> bool:
        """See Session.end; True the first time."""
        with self._change() as session:
            return session.end(cancel=cancel, withdraw=withdraw)

    def take_withdrawn(self) -> list[Job]:
        """See Session.take_withdrawn: the cancelled queued requests for the caller to answer."""
        with self._changed:
            return self._session.take_withdrawn()

    def next_text_job(self) -> Job | None:
        """The text lane's next job, waiting for one; None once the lane is done."""
        with self._changed:
            while (job := self._session.next_text_job()) is None:
                if self._session.text_lane_done:
                    return None
                self._changed.wait()
            return job

    # The model lane's jobs, as the scheduler takes them (scheduler.Jobs):

    def next_model_job(self, wait: bool, woken: Callable[[], bool]) -> Job | None:
        with self._changed:
            while (job := self._session.next_model_job()) is None:
                if not wait or woken() or self._session.model_lane_done:
                    return None
                self._changed.wait()
            return job

    def wake(self) -> None:
        with self._change():
            pass
