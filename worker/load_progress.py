"""Progress of a long load: the stages a backend goes through, as load/progress notifications.

A backend reports a stage where it has work to do, from anywhere below its ``load``:
``report = stage("hashing", total, "bytes")`` announces it (done 0), then ``report(done)``
as it goes. The handler of a ``load`` that asked for progress makes the reports reach the
host (:func:`reporting`); elsewhere they cost nothing. The Backend contract stays
``load(params, data_dir=...)``: the reporter travels in a context variable, so that the
code deep in a load (the digests of files, the quantization of a model) need not pass it
along. Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import get_args

from protocol.envelope import RequestId
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


_current: ContextVar[_Reporter | None] = ContextVar("load_progress", default=None)


def _ignore(done: int) -> None:
    pass


def stage(name: str, total: int, unit: str) -> Report:
    """Announce a stage of ``total`` units (done 0); call what it returns with the units done
    so far. Outside a load that reports, nothing is sent."""
    reporter = _current.get()
    return _ignore if reporter is None else reporter.stage(name, total, unit)


@contextmanager
def reporting(
    send: Callable[[LoadProgress], None] | None, request_id: RequestId, *, clock: Callable[[], float] = time.monotonic
) -> Iterator[None]:
    """Within this block (on this thread), the stages reported go to ``send`` (None: nowhere)."""
    token = _current.set(None if send is None else _Reporter(send, request_id, clock))
    try:
        yield
    finally:
        _current.reset(token)
