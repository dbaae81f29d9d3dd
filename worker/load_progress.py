"""Progress of a long load: the stages a backend goes through, as load/progress notifications.

A backend reports a stage where it has work to do, from anywhere below its ``load``:
``report = stage("hashing", total, "bytes")`` announces it (done 0), then ``report(done)``
as it goes. The handler of a ``load`` that asked for progress makes the reports reach the
host (:func:`reporting`); elsewhere they cost nothing. The Backend contract stays
``load(params, data_dir=...)``: the reporter travels in a context variable, so that the
code deep in a load (the digests of files, the quantization of a model) need not pass it
along. Torch-free.

The same context says whether the load was cancelled (:func:`check`, :func:`cancelled`):
``stage`` and every report end a cancelled load there with -32800 (PROTOCOL 9), and code
that waits on another program polls :func:`cancelled` (exact_attention's compiler). It also
keeps what one load shares among its steps (:func:`shared`: the kernels' one compile bound).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar, get_args

from protocol.envelope import RequestId
from protocol.errors import ErrorKind, RpcError
from protocol.methods import LoadProgress, LoadStage

STAGES: tuple[str, ...] = get_args(LoadStage)  # the order a load goes through them
# A stage's reports between its first and its last are at most this often: a host sees
# a long stage move without a message per tensor.
INTERVAL_S = 0.25

Report = Callable[[int], None]


class _Reporter:
    def __init__(self, send: Callable[[LoadProgress], None], request_id: RequestId, clock: Callable[[], float]) -> None:
        self._send = send
        self._id = request_id
        self._clock = clock

    def stage(self, name: str, total: int, unit: str) -> Report:
        assert name in STAGES, name
        last_sent = float("-inf")
        last_done = -1

        def report(done: int) -> None:
            nonlocal last_sent, last_done
            now = self._clock()
            # The first report, the last, and the ones between at most every INTERVAL_S.
            if done == last_done or (0 < done < total and now - last_sent < INTERVAL_S):
                return
            last_sent, last_done = now, done
            self._send(LoadProgress(id=self._id, stage=name, done=done, total=total, unit=unit))  # type: ignore[arg-type]

        report(0)
        return report


class _Load:
    """One load in progress: where its reports go (None: nowhere), whether it was cancelled,
    and what its steps share."""

    def __init__(self, reporter: _Reporter | None, is_cancelled: Callable[[], bool]) -> None:
        self.reporter = reporter
        self.is_cancelled = is_cancelled
        self.shared: dict[str, Any] = {}


_current: ContextVar[_Load | None] = ContextVar("load_progress", default=None)

T = TypeVar("T")


def _never() -> bool:
    return False


def _ignore(done: int) -> None:
    pass


def cancelled() -> bool:
    """Whether the load in progress on this thread was cancelled (False outside a load)."""
    load = _current.get()
    return load is not None and load.is_cancelled()


def check() -> None:
    """End a cancelled load here: raises -32800 request_cancelled (PROTOCOL 9)."""
    if cancelled():
        raise RpcError(ErrorKind.REQUEST_CANCELLED, "The load was cancelled; no model is loaded.")


def stage(name: str, total: int, unit: str) -> Report:
    """Announce a stage of ``total`` units (done 0); call what it returns with the units done
    so far. Outside a load that reports, nothing is sent. A cancelled load ends at the stage's
    start and at each report (after the report is sent: a stage ends with its last one)."""
    check()
    load = _current.get()
    if load is None:
        return _ignore
    send = _ignore if load.reporter is None else load.reporter.stage(name, total, unit)

    def report(done: int) -> None:
        send(done)
        check()

    return report


def shared(key: str, make: Callable[[], T]) -> T:
    """What the steps of the load in progress share under ``key``, made by ``make`` at the first
    ask; outside a load, a new one each time."""
    load = _current.get()
    if load is None:
        return make()
    if key not in load.shared:
        load.shared[key] = make()
    return load.shared[key]


@contextmanager
def reporting(
    send: Callable[[LoadProgress], None] | None, request_id: RequestId, *, clock: Callable[[], float] = time.monotonic,
    is_cancelled: Callable[[], bool] = _never,
) -> Iterator[None]:
    """Within this block (on this thread) a load is in progress: the stages reported go to
    ``send`` (None: nowhere), and ``is_cancelled`` says whether it was cancelled."""
    token = _current.set(_Load(None if send is None else _Reporter(send, request_id, clock), is_cancelled))
    try:
        yield
    finally:
        _current.reset(token)
