"""Running a request's handler and sending its answer: a result, or one precise error.

Threads: whichever thread calls it, on that thread. The reader answers inline requests
(``answer_now``); the text lane and the model lane run queued jobs (``run``); a render thread
renders a task's messages (``render_prompt``); the cache I/O thread makes tasks
(``make_task``) and answers with them (``finish``). Answers go out through
the transport's sending half (:class:`Replies`). A queued job's id is freed in the session
just before its answer is sent, so that the host, once it has the answer, may use the id again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from protocol.envelope import RequestId
from protocol.errors import ErrorKind, RpcError
from protocol.methods import Params
from worker import stopping
from worker.generation import cancelled_before_start
from worker.handlers import Context, Handlers
from worker.locked_session import LockedSession
from worker.policy import POLICY, BatchedMethod, Method
from worker.scheduler import Task
from worker.session import Job

log = logging.getLogger(__name__)


class Replies(Protocol):
    """The transport's sending half (worker/transport.py's StdioTransport)."""

    def send_result(self, msg_id: RequestId, result: Any) -> None: ...

    def send_error(self, msg_id: RequestId | None, error: RpcError) -> None: ...

    def send_notification(self, method: str, params: msgspec.Struct) -> None: ...


class Responder:
    def __init__(self, handlers: Handlers, replies: Replies, session: LockedSession) -> None:
        """Each method's handler is its declaration's (worker/policy.py), run on ``handlers``."""
        self._handlers = handlers
        self._replies = replies
        self._session = session

    def answer_now(self, request_id: RequestId, method: str, params: Params) -> None:
        """A request that is not queued: run its handler on this thread and answer."""
        ctx = Context(request_id, threading.Event(), 0.0, self._replies.send_notification, cancel=self._session.cancel)
        self._answer(request_id, method, lambda: _answered(method).handler(self._handlers, ctx, params))

    def run(self, job: Job) -> None:
        """Run a queued job to its answer (one that is not a task, or one cancelled while it waited)."""

        def run() -> Any:
            declared = POLICY[job.method]
            if job.is_cancelled() and not declared.runs_when_cancelled:
                if declared.cancelled_result:
                    return cancelled_before_start(_ms_since(job.queued_at))
                raise RpcError(ErrorKind.REQUEST_CANCELLED, f"Request {job.id!r} was cancelled before it ran.")
            with stopping.scope(job.stop):  # a wait on a server in it stops with a cancel
                return _answered(job.method).handler(self._handlers, self._context(job), job.params)

        self._answer(job.id, job.method, run, job)

    def render_prompt(self, job: Job) -> bool:
        """Render a generate's or prefill's messages into its prompt (``job.prompt``), before its
        task is made; False when that failed or the request was cancelled meanwhile (answered then)."""
        try:
            with stopping.scope(job.stop):  # a cancel ends the template's rendering at once
                job.prompt = _batched(job.method).prompt(self._handlers, self._context(job), job.params)
            return True
        except BaseException as exc:  # a library's BaseException too (_answer says why)
            if job.is_cancelled():
                self.run(job)  # as a request cancelled before it started
            else:
                self._session.release(job)
                self._replies.send_error(job.id, _as_rpc_error(job.method, exc))
            return False

    def make_task(self, job: Job) -> Task | None:
        """The task of a generate or prefill; None when making it failed (answered then)."""
        try:
            return _batched(job.method).task(self._handlers, self._context(job), job.params)
        except BaseException as exc:  # a library's BaseException too (_answer says why)
            self._session.release(job)
            self._replies.send_error(job.id, _as_rpc_error(job.method, exc))
            return None

    def finish(self, job: Job, task: Task, error: BaseException | None = None) -> None:
        """Answer with the task's result, or with ``error`` when its computation failed."""

        def fail() -> Any:
            raise error  # type: ignore[misc]

        self._answer(job.id, job.method, task.finish if error is None else fail, job)

    def _context(self, job: Job) -> Context:
        return Context(
            job.id, job.cancelled, _ms_since(job.queued_at), self._replies.send_notification, lambda: job.acked,
            job.prompt, self._session.cancel,
        )

    def _answer(self, msg_id: RequestId, method: str, run: Callable[[], Any], job: Job | None = None) -> None:
        try:
            result, error = run(), None
        # Not only Exceptions: a library may raise a BaseException of its own (a Rust panic in
        # tokenizers is pyo3's PanicException), which would end the lane and leave this request,
        # and every one after it on that lane, unanswered.
        except BaseException as exc:
            result, error = None, _as_rpc_error(method, exc)
        if job is not None:  # the id is free again before the host can see the answer
            self._session.release(job)
        if error is None:
            try:
                self._replies.send_result(msg_id, result)
                return
            except Exception as exc:  # a result that does not encode
                error = _as_rpc_error(method, exc)
        self._replies.send_error(msg_id, error)


def _answered(method: str) -> Method[Any, Any]:
    declared = POLICY[method]
    assert isinstance(declared, Method), f"{method!r} is batched: its task answers it (make_task, finish)"
    return declared


def _batched(method: str) -> BatchedMethod[Any, Any]:
    declared = POLICY[method]
    assert isinstance(declared, BatchedMethod), f"{method!r} is not batched: its handler answers it (run)"
    return declared


def _as_rpc_error(method: str, exc: BaseException) -> RpcError:
    if isinstance(exc, RpcError):
        exc.data.method = exc.data.method or method
        return exc
    log.error("internal error in %r", method, exc_info=exc)
    return RpcError(
        ErrorKind.INTERNAL_ERROR,
        f"Internal error in {method!r}: {exc!r}. The worker keeps serving; if this repeats, "
        "record the session with --record and report it.",
        method=method,
    )


def _ms_since(moment: float) -> float:
    return (time.perf_counter() - moment) * 1000.0
