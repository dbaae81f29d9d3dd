"""The model lane: which queued request starts when, and the loop that runs them together.

``generate`` and ``prefill`` requests become tasks that run side by side, up to
``max_batch`` of them: between two decode steps, the lane lets new requests join
and finished ones leave, feeds one chunk of one waiting prompt, then advances
every decoding request by one token in a single ``Model.step``. A prompt is fed in
chunks small enough that the streams already decoding keep flowing (the chunk is
sized from measured times so that a round with it costs under twice a step of one
stream alone; a model that can computes it in the same pass as the step, reading its
weights once for both), and a request alone gets the full chunk. Every other
model-lane request (``load``, ``unload``, ``shutdown``, and those queued behind them)
runs alone: it waits for the tasks before it to end, and the requests after it wait
for it.

:class:`Admission` holds these rules as a plain object, driven without threads in
the tests; :class:`Scheduler` is the loop, run by the model thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from worker.backends.base import PREFILL_CHUNK_TOKENS, Decoding, Model

TASK_METHODS = frozenset({"generate", "prefill"})
# While others decode, a round that feeds a chunk is sized to cost this many times a step of
# one stream alone: under the 2x the running streams are promised, because the times it is
# sized from vary by a fifth or more from one step to the next on a busy CPU...
SHARED_ROUND_OVER_SOLO = 1.75
# ...but a chunk is never smaller than this (a prompt must progress; below it each round's
# fixed costs outweigh the tokens).
MIN_SHARED_CHUNK_TOKENS = 4
DEFAULT_MAX_BATCH = 8


class Queued(Protocol):
    """What admission needs to know about a request (the server's Job)."""

    method: str
    params: Any

    def is_cancelled(self) -> bool: ...


class Task(Protocol):
    """A generate or prefill in progress (generation.Generation, caching.Prefill)."""

    model: Model
    decoding: Decoding

    def feed(self, max_tokens: int) -> None: ...

    def fed(self) -> None:
        """After its decoding was fed a chunk inside a step."""
        ...

    def advance(self) -> None: ...

    @property
    def done(self) -> bool: ...

    def finish(self) -> Any: ...


class Admission:
    """Model-lane requests in arrival order, and which of them may start now.

    - Requests start in the order they arrive; one that must wait holds back those behind it.
    - A ``generate`` or ``prefill`` starts while fewer than ``max_batch`` run, unless it
      reads or writes a cache that a running prefill is still writing (it would not see it).
      A generate with ``cache: "auto"`` may use any stored cache, so it waits for every
      running prefill; it does not wait for other auto generates (each is a separate
      conversation and uses what is stored when it starts).
    - Any other request starts once nothing runs, and nothing starts while it runs.
    - A cancelled request is let out at once, wherever it is in the queue (it answers without
      running), except ``shutdown``, which keeps its place.
    """

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.queue: deque[Queued] = deque()
        self.running: list[Queued] = []

    def add(self, job: Queued) -> None:
        self.queue.append(job)

    def next(self) -> Queued | None:
        """The request to start now, taken off the queue; None while none may start."""
        for job in self.queue:
            if job.method != "shutdown" and job.is_cancelled():
                self.queue.remove(job)
                self.running.append(job)  # until answered, like any other
                return job
        if not self.queue:
            return None
        head = self.queue[0]
        if head.method in TASK_METHODS:
            if len(self.running) >= self.max_batch or any(_waits_for(head, job) for job in self.running):
                return None
        elif self.running:
            return None
        self.queue.popleft()
        self.running.append(head)
        return head

    def done(self, job: Queued) -> None:
        self.running.remove(job)

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running


def _waits_for(job: Queued, running: Queued) -> bool:
    """Whether ``job`` must wait for ``running`` to end before it starts."""
    if running.method not in TASK_METHODS:
        return True
    if running.method != "prefill":  # a generate writes only auto caches, which nothing waits for
        return False
    written = running.params.cache
    if job.method == "prefill":
        return written in (job.params.cache, job.params.base)
    return job.params.cache in (written, "auto")


class ModelLane(Protocol):
    """What the scheduler needs from the server: jobs to start, and where answers go."""

    def next_job(self, wait: bool, woken: Callable[[], bool]) -> Queued | None:
        """The next job to start (see Admission). With ``wait``, blocks until there is one or
        ``woken()`` turns true (call ``wake`` then); None while waiting, with nothing woken,
        means the lane has stopped: no job is queued or running any more."""
        ...

    def wake(self) -> None:
        """Make a waiting ``next_job`` check ``woken`` again."""
        ...

    def run_job(self, job: Queued) -> None:
        """Run a job that is not a task (or a cancelled one) to its answer."""
        ...

    def start_task(self, job: Queued, ready: Callable[[Task | None], None]) -> None:
        """Make the task of a generate or prefill and hand it to ``ready``, from any thread
        (it may read a stored cache first); None when it failed (already answered)."""
        ...

    def finish_task(self, job: Queued, task: Task, error: Exception | None = None) -> None:
        """Answer with the task's result (it may store a cache first), or with ``error`` when
        its computation failed. The model thread no longer touches the task."""
        ...


class Scheduler:
    def __init__(self, lane: ModelLane, clock: Callable[[], float] = time.perf_counter) -> None:
        self._lane = lane
        self._clock = clock
        self._tasks: list[tuple[Queued, Task]] = []
        self._lock = threading.Lock()
        self._made_one = threading.Condition(self._lock)
        self._starting = 0  # tasks being made off this thread
        self._ready: list[tuple[Queued, Task | None]] = []  # made, not yet joined
        self._step_s: dict[int, float] = {}  # a step's time (recent ones averaged), by how many it decoded
        self._token_s: float | None = None  # a prompt token's time in chunks fed beside steps

    def run(self) -> None:
        """The model thread's loop: returns when the lane has stopped and no task is left."""
        while True:
            job = self._lane.next_job(wait=not self._tasks, woken=self._has_ready)
            if job is None and not self._tasks and not self._starting and not self._has_ready():
                return
            begun = job is not None
            while job is not None:
                self.begin(job)
                job = self._lane.next_job(wait=False, woken=self._has_ready)
            if begun and self._tasks:
                self._await_starting()
            self.advance()

    def begin(self, job: Queued) -> None:
        """Start a job the lane let out: a task joins the running ones once made, anything
        else runs now."""
        if job.method not in TASK_METHODS or job.is_cancelled():
            self._lane.run_job(job)
            return
        with self._lock:
            self._starting += 1
        self._lane.start_task(job, lambda task: self._made(job, task))

    def _made(self, job: Queued, task: Task | None) -> None:
        with self._lock:
            self._starting -= 1
            self._ready.append((job, task))
            self._made_one.notify_all()
        self._lane.wake()

    def _await_starting(self) -> None:
        """Give tasks just begun a moment (a quarter of a step) to be made, so that they join
        this round rather than the next: making one takes a millisecond or two unless it reads a
        stored cache, and the running ones are held up no longer than that quarter."""
        timeout = (self._step_time(len(self._tasks)) or 0.0) / 4
        with self._made_one:
            self._made_one.wait_for(lambda: not self._starting, timeout)

    def _has_ready(self) -> bool:
        with self._lock:
            return bool(self._ready)

    def _join_ready(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        self._tasks += [(job, task) for job, task in ready if task is not None]

    def advance(self) -> None:
        """One round: a chunk of the first waiting prompt, then a step of every decoding task."""
        self._join_ready()
        self._let_finished_go()
        waiting = [task for _, task in self._tasks if task.decoding.prompt_left]
        decoding = [task for _, task in self._tasks if not task.decoding.prompt_left]
        feeding = waiting[0] if waiting else None
        if feeding is not None and decoding and not self._step_s:
            feeding = None  # a step alone first: chunks beside steps are sized from its time
        if feeding is not None and decoding and feeding.model.chunks_in_step:
            before, started = feeding.decoding.prompt_left, self._clock()
            chunk = (feeding.decoding, self.chunk_tokens(len(decoding)))
            stepped = self._guarded([*decoding, feeding], lambda: self._step(decoding, chunk))
            step_s = self._step_s.get(len(decoding))  # learn from a round only beside a step measured
            if stepped:
                if step_s is not None:
                    self._timed_tokens(self._clock() - started - step_s, before - feeding.decoding.prompt_left)
                self._guarded([feeding], feeding.fed)
        else:
            if feeding is not None:
                self._guarded([feeding], lambda: self._feed(feeding, beside=len(decoding)))
            stepped = bool(decoding) and self._guarded(decoding, lambda: self._step(decoding))
        if stepped:
            for task in decoding:  # each takes its token; one that fails there fails alone
                self._guarded([task], task.advance)
        self._let_finished_go()

    def _step(self, decoding: list[Task], chunk: tuple[Decoding, int] | None = None) -> None:
        """One step of the decoding tasks; with ``chunk``, a part of a prompt fed in the same pass."""
        started = self._clock()
        decoding[0].model.step([task.decoding for task in decoding], *([chunk] if chunk else []))
        if chunk is None:  # averaged with the ones before: one step's time is noisy
            self._step_s[len(decoding)] = _averaged(self._step_s.get(len(decoding)), self._clock() - started)

    def _guarded(self, tasks: list[Task], work: Callable[[], None]) -> bool:
        """Run ``work``; if it fails, the tasks it was for fail with its error, and only they."""
        try:
            work()
        except Exception as exc:
            failed = [(job, task) for job, task in self._tasks if any(task is t for t in tasks)]
            for job, task in failed:
                self._tasks.remove((job, task))
                self._lane.finish_task(job, task, exc)
            return False
        return True

    def _feed(self, task: Task, *, beside: int) -> None:
        """Feed a chunk of ``task``'s prompt on its own, ``beside`` that many decoding tasks
        (a full chunk when none decodes)."""
        before, started = task.decoding.prompt_left, self._clock()
        task.feed(self.chunk_tokens(beside) if beside else PREFILL_CHUNK_TOKENS)
        took_s = self._clock() - started
        if not beside and task.model.chunks_in_step:  # beside a step, the pass over the weights is the step's
            took_s -= self._step_time(1) or 0.0
        self._timed_tokens(took_s, before - task.decoding.prompt_left)

    def _timed_tokens(self, took_s: float, fed: int) -> None:
        """``fed`` prompt tokens took ``took_s`` more than the step: a token's time, averaged
        with the ones before (a small chunk's time is noisy), the first from a prompt fed alone
        (cheaper per token, so the first chunk beside streams may be too big; the next ones
        correct it)."""
        if fed > 0 and took_s > 0:
            self._token_s = _averaged(self._token_s, took_s / fed)

    def _step_time(self, decoding: int) -> float | None:
        """A step's time for this many decoding tasks: as measured, or, while a chunk has ridden
        along every step of that many, a step of the nearest number measured (None: no step yet)."""
        if not self._step_s:
            return None
        return self._step_s[min(self._step_s, key=lambda n: (abs(n - decoding), n))]

    def chunk_tokens(self, decoding: int) -> int:
        """Prompt tokens to feed beside ``decoding`` running streams: what a round can add to
        their step and still cost SHARED_ROUND_OVER_SOLO steps of one stream alone."""
        step_s, solo_s = self._step_time(decoding), self._step_time(1)
        if step_s is None or solo_s is None or not self._token_s:
            return MIN_SHARED_CHUNK_TOKENS
        budget_s = SHARED_ROUND_OVER_SOLO * min(solo_s, step_s) - step_s
        return max(MIN_SHARED_CHUNK_TOKENS, min(PREFILL_CHUNK_TOKENS, int(budget_s / self._token_s)))

    def _let_finished_go(self) -> None:
        finished = [(job, task) for job, task in self._tasks if task.done]
        for job, task in finished:
            self._tasks.remove((job, task))
            self._lane.finish_task(job, task)

    @property
    def tasks(self) -> Sequence[Task]:
        return [task for _, task in self._tasks]


def _averaged(before: float | None, now: float) -> float:
    """A time as just measured, averaged with the one before (recent times weigh most)."""
    return now if before is None else (before + now) / 2
