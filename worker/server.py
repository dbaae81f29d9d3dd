"""Dispatch: bytes from the host in, replies to the writer out.

Four threads do the work. The reader thread (whoever calls :meth:`Server.feed`)
decodes frames and answers quick requests at once. Requests that use the model
go to the model lane, one thread that runs the scheduler (worker/scheduler.py):
generates and prefills run side by side, batched, and the other model requests
run alone, in order; the cache I/O thread makes and finishes their tasks (reads
and stores KV caches), so decoding goes on meanwhile. Text requests (``tokenize``, ``detokenize``, ``render``) go
to the text lane, so that a huge one delays neither the reading of a ``cancel``
nor a generation. So ``cancel``, ``capabilities`` and ``tokenize`` are answered
while generations stream, and a cancel only has to set an event that the
scheduler checks between decode steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from protocol.envelope import (
    Notification,
    Rejected,
    Request,
    RequestId,
    Response,
    encode_error,
    encode_notification,
    encode_result,
    parse_incoming,
)
from protocol.errors import ErrorKind, RpcError
from protocol.framing import Frame, FrameDecoder
from protocol.methods import (
    HOST_NOTIFICATIONS,
    METHODS,
    WORKER_NOTIFICATIONS,
    AckParams,
    CancelParams,
    CancelResult,
    Params,
)
from worker.generation import cancelled_before_start
from worker.handlers import Context, Handlers
from worker.scheduler import DEFAULT_MAX_BATCH, Scheduler, Task
from worker.policy import POLICY
from worker.session import Job, Session
from worker.transcript import Recorder
from worker.writer import Writer

log = logging.getLogger(__name__)


class Server:
    def __init__(
        self,
        writer: Writer,
        handlers: Handlers,
        *,
        max_message_bytes: int,
        recorder: Recorder | None = None,
        drain_on_eof: bool = False,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> None:
        self._writer = writer
        self._handlers = handlers
        self._decoder = FrameDecoder(max_message_bytes)
        self._recorder = recorder
        self._drain_on_eof = drain_on_eof
        # Each method's handler; how it runs (lane, batching, cancels) is its row in worker/policy.py.
        self._routes: dict[str, Callable[[Context, Any], Any]] = {
            "capabilities": handlers.capabilities,
            "load": handlers.load,
            "unload": handlers.unload,
            "tokenize": handlers.tokenize,
            "detokenize": handlers.detokenize,
            "render": handlers.render,
            "generate": handlers.generate,
            "prefill": handlers.prefill,
            "cache/list": handlers.cache_list,
            "cache/info": handlers.cache_info,
            "cache/delete": handlers.cache_delete,
            "cancel": self._cancel,
            "shutdown": lambda ctx, params: None,
        }
        assert self._routes.keys() == METHODS.keys(), "every protocol method needs a route"
        # The session's state (worker/session.py) is read and changed under this lock only;
        # lanes wait on it for their next request.
        self._lock = threading.Condition()
        self._session = Session(max_batch)
        self._cancelled_at: float | None = None  # when end() cancelled everything
        self.ended = threading.Event()
        self.exit_code = 0
        # A task is made (its prompt tokenized, its cache read and checked) and finished (its
        # cache stored) on this thread, so that the requests decoding meanwhile go on.
        self._cache_io = ThreadPoolExecutor(1, thread_name_prefix="lm-worker-cache-io")
        self._lanes = [
            threading.Thread(target=Scheduler(self).run, name="lm-worker-model", daemon=True),
            threading.Thread(target=self._run_text_lane, name="lm-worker-text", daemon=True),
        ]
        for lane in self._lanes:
            lane.start()

    @staticmethod
    def method_names() -> list[str]:
        return list(METHODS)

    @staticmethod
    def notification_names() -> list[str]:
        return [*HOST_NOTIFICATIONS, *WORKER_NOTIFICATIONS]

    # --- input ------------------------------------------------------------

    def feed(self, data: bytes) -> bool:
        """Handle bytes from the host; False once no more input should be read."""
        for event in self._decoder.feed(data):
            self._on_event(event)
            if self._session.stopping:
                return False
        return True

    def feed_eof(self) -> None:
        for event in self._decoder.feed_eof():
            self._on_event(event)
        self.end("end of input", cancel=not self._drain_on_eof)

    def _on_event(self, event: Any) -> None:
        if self._session.stopping:
            return
        if not isinstance(event, Frame):
            if self._recorder is not None:
                self._recorder.record_unframed(event.message)
            self._send_error(None, RpcError(event.kind, event.message, limit=event.limit))
            return
        self._writer.adopt_framing(event.framing)
        if self._recorder is not None:
            self._recorder.record_in(event.body, event.framing.value)
        message = parse_incoming(event.body)
        match message:
            case Request():
                self._on_request(message)
            case Notification():
                self._on_notification(message)
            case Rejected():
                self._send_error(message.id, message.error)
            case Response():
                log.warning("ignored a response (id %r): the worker sends no requests", message.id)

    def _on_request(self, request: Request) -> None:
        handler = self._routes.get(request.method)
        if handler is None:
            self._send_error(request.id, _unknown_method(request.method, list(self._routes)))
            return
        try:
            params = _decode_params(request.method, request.params, METHODS[request.method].params)
        except RpcError as exc:
            self._send_error(request.id, exc)
            return
        try:
            with self._lock:
                job = self._session.receive(request.id, request.method, params, time.perf_counter())
                self._lock.notify_all()
        except RpcError as exc:
            self._send_error(request.id, exc)
            return
        if job is None:
            ctx = Context(request.id, threading.Event(), 0.0, self._send_notification)
            self._answer(request.id, request.method, lambda: handler(ctx, params))

    def _on_notification(self, notification: Notification) -> None:
        params_type = HOST_NOTIFICATIONS.get(notification.method)
        if params_type is None:
            if notification.method in self._routes:
                log.warning("ignored %r without an id: a request needs an id to be answered", notification.method)
            elif not notification.method.startswith("$/"):  # "$/" notifications are optional by LSP rules
                log.warning("ignored unknown notification %r", notification.method)
            return
        try:
            params = _decode_params(notification.method, notification.params, params_type)
        except RpcError as exc:
            log.warning("ignored notification: %s", exc.message)
            return
        if isinstance(params, CancelParams):
            self._cancel(None, params)
        elif isinstance(params, AckParams):
            with self._lock:
                self._session.ack(params.id, params.index)
        else:  # exit: 0 after a shutdown request, 1 without one (as LSP does)
            self.end("exit notification", cancel=True, exit_code=0 if self._session.shutdown_requested else 1)

    def _cancel(self, ctx: Context | None, params: CancelParams) -> CancelResult:
        with self._lock:
            self._lock.notify_all()  # the model lane answers a cancelled queued request at once
            return self._session.cancel(params.id)

    # --- the lanes ---------------------------------------------------------------

    def _run_text_lane(self) -> None:
        while True:
            with self._lock:
                while (job := self._session.next_text_job()) is None:
                    if self._session.text_lane_done:
                        return
                    self._lock.wait()
            self.run_job(job)

    # The model lane, as the scheduler sees it (scheduler.ModelLane):

    def next_job(self, wait: bool, woken: Callable[[], bool]) -> Job | None:
        with self._lock:
            while (job := self._session.next_model_job()) is None:
                if not wait or woken() or self._session.model_lane_done:
                    return None
                self._lock.wait()
            return job

    def run_job(self, job: Job) -> None:
        """Run a request to its answer on this thread (a model-lane request that is not a task,
        a text request, or one cancelled while it waited)."""

        def run() -> Any:
            policy = POLICY[job.method]
            if job.cancelled.is_set() and not policy.runs_when_cancelled:
                if policy.cancelled_result:
                    return cancelled_before_start(_ms_since(job.queued_at))
                raise RpcError(ErrorKind.REQUEST_CANCELLED, f"Request {job.id!r} was cancelled before it ran.")
            return self._routes[job.method](self._context(job), job.params)

        self._answer(job.id, job.method, run, job)

    def wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def start_task(self, job: Job, ready: Callable[[Task | None], None]) -> None:
        def make() -> None:
            try:
                task = self._routes[job.method](self._context(job), job.params)
            except Exception as exc:
                self._release(job)
                self._writer.send(self._error_body(job.id, job.method, exc))
                task = None
            ready(task)

        self._on_cache_io(make)

    def finish_task(self, job: Job, task: Task, error: Exception | None = None) -> None:
        def fail() -> Any:
            raise error  # type: ignore[misc]

        self._on_cache_io(self._answer, job.id, job.method, task.finish if error is None else fail, job)

    def _on_cache_io(self, work: Callable[..., Any], *args: Any) -> None:
        """Run ``work`` on the cache I/O thread (prepared for the model's work off its own thread)."""

        def run() -> None:
            self._handlers.prepare_side_thread()
            work(*args)

        self._cache_io.submit(run)

    def _context(self, job: Job) -> Context:
        return Context(job.id, job.cancelled, _ms_since(job.queued_at), self._send_notification, lambda: job.acked)

    # --- replies --------------------------------------------------------------

    def _answer(self, msg_id: RequestId, method: str, run: Callable[[], Any], job: Job | None = None) -> None:
        try:
            body = encode_result(msg_id, run())
        except Exception as exc:
            body = self._error_body(msg_id, method, exc)
        if job is not None:  # the id is free again before the host can see the answer
            self._release(job)
        self._writer.send(body)

    def _release(self, job: Job) -> None:
        with self._lock:
            self._session.release(job)
            self._lock.notify_all()

    @staticmethod
    def _error_body(msg_id: RequestId, method: str, exc: Exception) -> bytes:
        if isinstance(exc, RpcError):
            exc.data.method = exc.data.method or method
            return encode_error(msg_id, exc)
        log.error("internal error in %r", method, exc_info=exc)
        return encode_error(
            msg_id,
            RpcError(
                ErrorKind.INTERNAL_ERROR,
                f"Internal error in {method!r}: {exc!r}. The worker keeps serving; if this repeats, "
                "record the session with --record and report it.",
                method=method,
            ),
        )

    def _send_error(self, msg_id: RequestId | None, error: RpcError) -> None:
        self._writer.send(encode_error(msg_id, error))

    def _send_notification(self, method: str, params: msgspec.Struct) -> None:
        self._writer.send(encode_notification(method, params))

    # --- lifecycle --------------------------------------------------------------

    def end(self, reason: str, *, cancel: bool, exit_code: int = 0) -> None:
        """Stop reading; cancel what is in flight (or let it finish), then let the lane drain."""
        with self._lock:
            if self._session.end(cancel=cancel):
                log.info("stopping: %s", reason)
                self.exit_code = exit_code
            if cancel:
                self._cancelled_at = self._cancelled_at or time.monotonic()
            self._lock.notify_all()
        self.ended.set()

    def wait_stopped(self, grace_s: float) -> bool:
        """Wait for the lanes to finish their queues. Once everything is cancelled,
        wait at most ``grace_s`` more; False if they did not stop in time."""
        while True:
            for lane in self._lanes:
                lane.join(0.05)
            if not any(lane.is_alive() for lane in self._lanes):
                self._cache_io.shutdown(wait=True)  # the last answers may still be on their way
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


def _ms_since(moment: float) -> float:
    return (time.perf_counter() - moment) * 1000.0
