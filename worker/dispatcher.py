"""Dispatch: parsed messages in (from the transport), each request to its handler on its lane,
replies out through the transport; and the worker's lifecycle (ending, the lanes' drain).

Threads: :meth:`Dispatcher.receive` runs on the reader thread (``lm-worker-reader``,
worker/transport.py). It validates params, registers each request with the session
(worker/locked_session.py) and answers at once the requests that run inline
(``capabilities``, ``cancel``, and ``cache/*`` with nothing ahead); the rest wait on the
session for their lane: the text lane (worker/text_lane.py, ``lm-worker-text``) or the model
lane (worker/model_lane.py, ``lm-worker-model``), whose tasks are made and finished on the
cache I/O thread (worker/cache_io.py, ``lm-worker-cache-io``), after their messages were
rendered on a render thread (worker/render_threads.py, ``lm-worker-render``). The dispatcher
owns these and the session. So ``cancel``, ``capabilities`` and ``tokenize`` are answered while
generations stream, and a cancel only sets an event that the model lane checks between
decode steps. ``end`` may be called from any thread (a signal, the writer finding stdout
closed).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import msgspec

from protocol.envelope import Incoming, Notification, Rejected, Request, Response
from protocol.errors import ErrorKind, RpcError
from protocol.methods import (
    HOST_NOTIFICATIONS,
    METHODS,
    WORKER_NOTIFICATIONS,
    AckParams,
    CancelParams,
    Params,
)
from worker.cache_io import CacheIO
from worker.handlers import Handlers
from worker.locked_session import LockedSession
from worker.model_lane import ModelLane
from worker.render_threads import RenderThreads
from worker.policy import POLICY
from worker.responder import Replies, Responder
from worker.scheduler import DEFAULT_MAX_BATCH
from worker.text_lane import TextLane

log = logging.getLogger(__name__)


class Dispatcher:
    """The transport's :class:`~worker.transport.Receiver`."""

    def __init__(
        self,
        handlers: Handlers,
        replies: Replies,
        *,
        drain_on_eof: bool = False,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> None:
        self._replies = replies
        self._drain_on_eof = drain_on_eof
        self._session = LockedSession(max_batch, wake_model=handlers.wake_model)
        self._responder = Responder(handlers, replies, self._session)
        self._cache_io = CacheIO(handlers.prepare_side_thread)
        self._renders = RenderThreads()
        self._lanes = [
            ModelLane(self._session, self._responder, self._cache_io, self._renders).thread,
            TextLane(self._session, self._responder).thread,
        ]
        self._ending = threading.Lock()  # one end at a time: the first one's exit code is set before `ended`
        self._cancelled_at: float | None = None  # when end() cancelled everything
        self.ended = threading.Event()
        self.exit_code = 0
        for lane in self._lanes:
            lane.start()

    @staticmethod
    def method_names() -> list[str]:
        return list(METHODS)

    @staticmethod
    def notification_names() -> list[str]:
        return [*HOST_NOTIFICATIONS, *WORKER_NOTIFICATIONS]

    # --- input (worker/transport.py's Receiver) -----------------------------------

    @property
    def accepting(self) -> bool:
        return not self._session.stopping

    def receive(self, message: Incoming) -> None:
        match message:
            case Request():
                self._on_request(message)
            case Notification():
                self._on_notification(message)
            case Rejected():
                self._replies.send_error(message.id, message.error)
            case Response():
                log.warning("ignored a response (id %r): the worker sends no requests", message.id)
        self._answer_withdrawn()

    def input_ended(self) -> None:
        self.end("end of input", cancel=not self._drain_on_eof, withdraw=True)
        self._answer_withdrawn()

    def _answer_withdrawn(self) -> None:
        """Answer the queued requests a cancel, shutdown or end just withdrew, after the answer
        of the message that withdrew them: at once, not when their lane comes to them (behind
        a running load, as long as it takes)."""
        for job in self._session.take_withdrawn():
            self._responder.run(job)

    def _on_request(self, request: Request) -> None:
        declared = POLICY.get(request.method)
        if declared is None:
            self._replies.send_error(request.id, _unknown_method(request.method, list(POLICY)))
            return
        try:
            params = _decode_params(request.method, request.params, declared.spec.params)
            job = self._session.receive(request.id, request.method, params, time.perf_counter())
        except RpcError as exc:
            self._replies.send_error(request.id, exc)
            return
        if job is None:
            self._responder.answer_now(request.id, request.method, params)

    def _on_notification(self, notification: Notification) -> None:
        params_type = HOST_NOTIFICATIONS.get(notification.method)
        if params_type is None:
            if notification.method in POLICY:
                twin = _ANSWERLESS.get(notification.method)
                also = f", or send {twin!r}, which does the same without an answer" if twin else ""
                log.warning(
                    "ignored %r without an id: a request needs an id to be answered; give it one%s",
                    notification.method, also,
                )
            elif not notification.method.startswith("$/"):  # "$/" notifications are optional by LSP rules
                log.warning("ignored unknown notification %r", notification.method)
            return
        try:
            params = _decode_params(notification.method, notification.params, params_type)
        except RpcError as exc:
            log.warning("ignored notification: %s", exc.message)
            return
        if isinstance(params, CancelParams):
            self._session.cancel(params.id)
        elif isinstance(params, AckParams):
            self._session.ack(params.id, params.index)
        else:  # exit: 0 after a shutdown request, 1 without one (as LSP does)
            exit_code = 0 if self._session.shutdown_requested else 1
            self.end("exit notification", cancel=True, exit_code=exit_code, withdraw=True)

    # --- lifecycle --------------------------------------------------------------

    def end(self, reason: str, *, cancel: bool, exit_code: int = 0, withdraw: bool = False) -> None:
        """Stop reading; cancel what is in flight (or let it finish), then let the lanes drain.
        ``withdraw``: the caller is the reader, which answers the queued requests cancelled
        (_answer_withdrawn); from another thread (a signal, the writer) their lanes answer them."""
        with self._ending:
            if self._session.end(cancel=cancel, withdraw=withdraw):
                log.info("stopping: %s", reason)
                self.exit_code = exit_code
            if cancel:
                self._cancelled_at = self._cancelled_at or time.monotonic()
        self.ended.set()

    def wait_stopped(self, grace_s: float) -> bool:
        """Wait for the lanes to finish their queues. Once everything is cancelled,
        wait at most ``grace_s`` more; False if they did not stop in time."""
        while True:
            for lane in self._lanes:
                lane.join(0.05)
            if not any(lane.is_alive() for lane in self._lanes):
                self._renders.shutdown()  # first: a render hands its request on to the cache I/O thread
                self._cache_io.shutdown()
                return True
            cancelled_at = self._cancelled_at
            if cancelled_at is not None and time.monotonic() - cancelled_at > grace_s:
                return False


def _decode_params(method: str, raw: dict[str, Any] | None, params_type: type[Params]) -> Params:
    try:
        return msgspec.convert(raw or {}, params_type)
    except msgspec.ValidationError as exc:
        raise _invalid_params(method, str(exc), params_type) from None


def _closest(word: str, candidates: list[str], cutoff: float) -> str | None:
    import difflib  # only on the error path: keeps start-up fast

    if len(word) > 2 * max(map(len, candidates), default=0):  # no close match, and comparing would take long
        return None
    matches = difflib.get_close_matches(word, candidates, n=1, cutoff=cutoff)
    return matches[0] if matches else None


def _invalid_params(method: str, text: str, params_type: type[Params]) -> RpcError:
    """A msgspec validation message as an invalid-params error naming the field."""
    detail, _, path = text.partition(" - at `")
    path = path.rstrip("`")
    field_path = "params" + path[1:] if path.startswith("$") else "params"
    hint = ""
    if detail.startswith("Object contains unknown field `"):
        unknown = _shown(detail.split("`")[1])
        detail = f"Object contains unknown field `{unknown}`"
        field_path = f"{field_path}.{unknown}"
        known = list(params_type.__struct_fields__) if field_path.count(".") == 1 else []
        close = _closest(unknown, known, 0.7)
        hint = f" (did you mean {close!r}?)" if close else (f" (known: {', '.join(known)})" if known else "")
    elif detail.startswith("Object missing required field `"):
        field_path = f"{field_path}.{detail.split('`')[1]}"
    return RpcError(
        ErrorKind.INVALID_PARAMS,
        f"Invalid params for {method!r}: {detail} at {field_path}{hint}; fix it and send the request again.",
        field=field_path,
        method=method,
    )


def _shown(name: str, limit: int = 100) -> str:
    """A name as an error message repeats it: a host's megabytes come back as a short excerpt."""
    return name if len(name) <= limit else f"{name[:limit]}… ({len(name)} characters)"


# A method and the notification that does what it does without an answer (PROTOCOL 6.12).
_ANSWERLESS = {"cancel": "$/cancelRequest"}


def _unknown_method(method: str, known: list[str]) -> RpcError:
    if method in HOST_NOTIFICATIONS:
        return RpcError(
            ErrorKind.METHOD_NOT_FOUND,
            f"{method!r} is a notification, not a request: send it without an 'id'.",
            method=method,
        )
    close = _closest(method, known, 0.6)
    hint = f"did you mean {close!r}? " if close else ""
    return RpcError(
        ErrorKind.METHOD_NOT_FOUND,
        f"Unknown method {_shown(method)!r}; {hint}known methods: {', '.join(known)}.",
        method=_shown(method),
    )
