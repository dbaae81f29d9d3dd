"""Admission: which queued model-lane request may start now, as a plain object.

It does no I/O and starts no thread: the session (worker/session.py) holds it as the model
lane's queue, and whichever thread holds the session's lock calls it (the reader adds, the
model lane takes the next job, the thread that answers a job lets it go); the tests drive it
call by call. The rules come from each method's declaration in worker/policy.py.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Generic, Protocol, TypeVar

from worker.generation import AUTO
from worker.policy import POLICY


class Queued(Protocol):
    """What admission needs to know about a request (worker/session.py's Job)."""

    method: str
    params: Any

    def is_cancelled(self) -> bool: ...


# The session's job type (worker/session.py's Job): admission hands each job back as it got it.
J = TypeVar("J", bound=Queued)


class Admission(Generic[J]):
    """Model-lane requests in arrival order, and which of them may start now.

    - Requests start in the order they arrive; one that must wait holds back those behind it.
    - A batched request (worker/policy.py: ``generate``, ``prefill``) starts while fewer than
      ``max_batch`` run, unless it reads or writes a cache that a running one is still writing
      (``writes``: a prefill's; it would not see it). A request with ``cache: "auto"`` may start
      from any stored cache, so it waits for every running prefill; it does not wait for auto
      generates (each is a separate conversation and uses what is stored when it starts).
    - Any other request starts once nothing runs, and nothing starts while it runs.
    - A cancelled request is let out at once, wherever it is in the queue (it answers without
      running), except one that runs when cancelled (``shutdown``), which keeps its place.
    """

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.queue: deque[J] = deque()
        self.running: list[J] = []

    def add(self, job: J) -> None:
        self.queue.append(job)

    def next(self) -> J | None:
        """The request to start now, taken off the queue; None while none may start."""
        for job in self.queue:
            if not POLICY[job.method].runs_when_cancelled and job.is_cancelled():
                self.queue.remove(job)
                self.running.append(job)  # until answered, like any other
                return job
        if not self.queue:
            return None
        head = self.queue[0]
        if POLICY[head.method].batched:
            if len(self.running) >= self.max_batch or any(_waits_for(head, job) for job in self.running):
                return None
        elif self.running:
            return None
        self.queue.popleft()
        self.running.append(head)
        return head

    def withdraw(self, job: J) -> None:
        """A cancelled request leaves the queue to be answered now; it counts as running until
        then (``done``), like any other."""
        self.queue.remove(job)
        self.running.append(job)

    def done(self, job: J) -> None:
        self.running.remove(job)

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running


def _waits_for(job: Queued, running: Queued) -> bool:
    """Whether ``job`` must wait for ``running`` to end before it starts."""
    if not POLICY[running.method].batched:
        return True
    used = POLICY[job.method].caches(job.params)
    return any(ref in used or AUTO in used for ref in POLICY[running.method].writes(running.params))
