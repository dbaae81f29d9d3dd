"""The session's state: the requests in flight, where each waits, cancels, acks and the end.

A plain object in the spirit of h11: it does no I/O and starts no thread, and every rule about
who runs when is here, so that tests drive it call by call. worker/locked_session.py holds it
under one lock for the threads that call it (the reader, the lanes, the cache I/O thread), and
the lanes wait on that lock when it says nothing is ready yet.

- A request runs on the lane its method's declaration in worker/policy.py names: answered at once by
  the reader (``INLINE``), on the text lane, or on the model lane, whose order and batching
  :class:`~worker.admission.Admission` decides. Some wait behind earlier model-lane requests
  to see their effect (``policy.waits_behind``): text requests behind a ``load``/``unload``
  (they run on the model lane then), ``cache/*`` behind a ``prefill`` or a ``generate`` that
  uses a cache.
- An id is in flight from the request until its answer is sent; a second request with it is
  refused. After ``shutdown`` (``ends_session``) every new request is refused, and what was in
  flight is cancelled.
- A queued request cancelled by the host (``cancel``, ``shutdown``, the end of input) is
  withdrawn from its queue, for the reader to answer at once (``take_withdrawn``), rather than
  when its lane comes to it: a running ``load`` holds the model lane for as long as it takes.
- A ``load``, ``unload`` or ``shutdown`` starts only after the text requests received before it
  have answered (they see the model as it was; ``shutdown`` answers last).
"""

from __future__ import annotations

import threading
from collections import deque

import msgspec

from protocol.envelope import RequestId
from protocol.errors import ErrorKind, RpcError
from protocol.methods import CancelResult, Params
from worker.admission import Admission
from worker.policy import POLICY, Lane, waits_behind
from worker.stopping import Stop


class Job(msgspec.Struct):
    id: RequestId
    method: str
    params: Params
    queued_at: float
    text_lane: bool = False
    cancelled: threading.Event = msgspec.field(default_factory=threading.Event)
    running: bool = False
    withdrawn: bool = False  # cancelled while queued and taken off its queue, to be answered at once
    stop: Stop = msgspec.field(default_factory=Stop)  # stops it while it runs, where it waits on another program
    prompt: list[int] | None = None  # a generate's or prefill's messages, rendered before its task is made
    acked: int = -1  # the last generate/chunk the host acknowledged (generate/ack)

    def is_cancelled(self) -> bool:
        return self.cancelled.is_set()



class Session:
    def __init__(self, max_batch: int) -> None:
        self.jobs: dict[RequestId, Job] = {}  # queued or running on a lane
        self.admission: Admission[Job] = Admission(max_batch)  # the model lane's queue
        self.text_queue: deque[Job] = deque()
        self.shutdown_requested = False
        self.stopping = False  # no more input is read; the lanes finish their queues
        self._starting: Job | None = None  # a load/unload/shutdown waiting for earlier text requests
        self._withdrawn: list[Job] = []  # cancelled while queued, taken off their queues: to answer now

    def receive(self, request_id: RequestId, method: str, params: Params, now: float) -> Job | None:
        """A request to queue (a method of worker/policy.py's POLICY): its job, or None when the
        reader answers it at once.
        Raises RpcError for an id already in flight and for any request after shutdown."""
        if request_id in self.jobs:
            raise RpcError(
                ErrorKind.DUPLICATE_ID,
                f"Request id {request_id!r} is already in flight; give every request its own id.",
                field="id",
            )
        if self.shutdown_requested:
            raise RpcError(
                ErrorKind.SHUTTING_DOWN,
                "The worker is shutting down after a 'shutdown' request and takes no more requests; "
                "send 'exit', or start a new worker.",
            )
        declared = POLICY[method]
        lane = declared.lane
        behind = lane is Lane.MODEL or any(
            not job.text_lane and waits_behind(lane, job.method, job.params) for job in self.jobs.values()
        )
        job = None
        if behind or lane is Lane.TEXT:
            job = Job(request_id, method, params, now, text_lane=not behind, stop=Stop(sticky=declared.stoppable))
            self.jobs[request_id] = job
            if behind:
                self.admission.add(job)
            else:
                self.text_queue.append(job)
        if declared.ends_session:
            self.shutdown_requested = True
            self.cancel_all(withdraw=True, but=job)
        return job

    def cancel(self, request_id: RequestId) -> CancelResult:
        job = self.jobs.get(request_id)
        if job is None:
            return CancelResult(cancelled=False, state="unknown")
        job.cancelled.set()
        if job.running:  # a running load or unload cannot stop halfway, unless it waits on another program
            stopped = job.stop.stop()
            return CancelResult(cancelled=POLICY[job.method].stoppable or stopped, state="running")
        self._withdraw(job)
        return CancelResult(cancelled=True, state="queued")

    def cancel_all(self, *, withdraw: bool, but: Job | None = None) -> None:
        """Cancel every request in flight (``but`` one); ``withdraw`` the queued ones too, where
        the caller answers them (take_withdrawn), else their lanes answer them in turn."""
        for job in self.jobs.values():
            if job is not but:
                job.cancelled.set()
                if job.running:  # a wait on another program (a server, a chat template) ends now
                    job.stop.stop()
                elif withdraw:
                    self._withdraw(job)

    def _withdraw(self, job: Job) -> None:
        """Take a cancelled queued request off its queue, to be answered at once; a shutdown
        keeps its place (it runs when cancelled), and one withdrawn already stays so."""
        if POLICY[job.method].runs_when_cancelled or job.withdrawn:
            return
        job.withdrawn = True
        if job.text_lane:
            self.text_queue.remove(job)
        elif job is self._starting:  # taken off the queue already, counted as running until answered
            self._starting = None
        else:
            self.admission.withdraw(job)
        self._withdrawn.append(job)

    def take_withdrawn(self) -> list[Job]:
        """The requests withdrawn since the last call, for the caller to answer (each is released
        as usual once answered)."""
        withdrawn, self._withdrawn = self._withdrawn, []
        return withdrawn

    def ack(self, request_id: RequestId, index: int) -> None:
        job = self.jobs.get(request_id)  # a stream that already ended needs no acks
        if job is not None:
            job.acked = max(job.acked, index)

    def next_text_job(self) -> Job | None:
        """The text lane's next request, marked running; None while there is none."""
        if not self.text_queue:
            return None
        job = self.text_queue.popleft()
        job.running = True
        return job

    @property
    def text_lane_done(self) -> bool:
        return self.stopping and not self.text_queue

    def next_model_job(self) -> Job | None:
        """The model lane's next request, marked running; None while none may start."""
        job = self._starting or self.admission.next()
        if job is None:
            return None
        if POLICY[job.method].changes_model and any(j.text_lane for j in self.jobs.values()):
            self._starting = job  # taken off the queue: it starts once those have answered
            return None
        self._starting = None
        job.running = True
        return job

    @property
    def model_lane_done(self) -> bool:
        return self.stopping and self.admission.idle

    def release(self, job: Job) -> None:
        """The job has its answer: its id is free again."""
        del self.jobs[job.id]
        if not job.text_lane:
            self.admission.done(job)

    def end(self, *, cancel: bool, withdraw: bool = False) -> bool:
        """Stop taking input; cancel what is in flight (``withdraw``: see cancel_all), or let it
        finish. True the first time."""
        first = not self.stopping
        self.stopping = True
        if cancel:
            self.cancel_all(withdraw=withdraw)
        return first
