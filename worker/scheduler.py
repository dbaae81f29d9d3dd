"""The model lane's loop: the requests it runs side by side, and the chunk each round feeds.

``generate`` and ``prefill`` requests become tasks that run side by side, up to
``max_batch`` of them: between two decode steps, the lane lets new requests join
and finished ones leave, feeds one chunk of one waiting prompt, then advances
every decoding request by one token in a single ``Model.step``. A prompt is fed in
chunks small enough that the streams already decoding keep flowing (the chunk is
sized from measured times so that a round with it costs under twice a step of one
stream alone; a model that can computes it in the same pass as the step, reading its
weights once for both), and a request alone gets the full chunk; :class:`RoundCosts`
keeps those times and sizes the chunk. Requests that start together are fed first and
step together from their first step (up to two chunks' worth of their prompts), rather than
the later ones trickling in beside the first; a model that feeds chunks in its step's pass
takes as many of those prompts as fit a chunk in one pass (reading its weights once for
all). Every other model-lane request (``load``, ``unload``, ``shutdown``, and those queued
behind them) runs alone: it waits for the tasks before it to end, and the requests after it
wait for it.

Which request may start when is worker/admission.py's (inside the session); the
:class:`Scheduler` takes the jobs it lets out from :class:`Jobs` (the session) and hands
their work to :class:`Work` (worker/model_lane.py). Threads: :meth:`Scheduler.run` is the
model lane's thread (``lm-worker-model``); a task made off that thread (on the cache I/O
thread) is handed back through ``ready``, from that thread.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from worker.admission import J, Queued
from worker.backends.base import PREFILL_CHUNK_TOKENS, Decoding, Model
from worker.policy import POLICY

# While others decode, a round is promised to cost at most this many times a step of one stream
# alone, or ROUND_ALLOWANCE_S more than that step where that is more (round_limit). A round
# that feeds a chunk is sized to cost this share of the promise: under it, because the times it
# is sized from vary by a fifth or more from one step to the next on a busy CPU (sized to the
# promise itself, half the rounds went past it); the round that finishes a prompt may cost up
# to the promise.
PROMISED_ROUND_OVER_SOLO = 2.0
SHARED_ROUND_SHARE = 0.875
# A round may always cost this much more than a step alone: where a step takes a millisecond or
# two (a tiny model, a GPU), twice a step would leave a joining prompt one token a round, while
# the streams would still run at over 80 tokens per second with this added.
ROUND_ALLOWANCE_S = 0.010
# Recent times kept: steps for each batch size, and rounds that fed a chunk beside a step.
RECENT_STEPS = 5
RECENT_CHUNKS = 8
# A chunk tried while nothing says what a chunk of several tokens costs beside streams, and
# after this many rounds in a row that could afford one token only.
PROBE_CHUNK_TOKENS = 2
RECENT_CHUNK_ROUNDS = 24
MIN_TOKEN_S = 1e-6  # a token's cost is never taken as nothing (a chunk's size divides by it)
DEFAULT_MAX_BATCH = 8
# How long requests that start together wait, before their first step, for the others begun
# with them to be made (a millisecond or two each, one after another, unless one reads a
# stored cache): their first tokens come from their prompts, so this holds back only the
# second. A task made later joins beside their steps.
TOGETHER_WAIT_S = 0.05
# Requests that start together are fed whole before their first step while their prompts come
# to at most this many tokens since the last step: two chunks' worth, so that eight requests of
# a few dozen tokens each (chat turns, a host's batch) decode together from the first step; the
# first request's second token waits for them.
TOGETHER_PROMPT_TOKENS = 2 * PREFILL_CHUNK_TOKENS

# The session's job type, as admission's J: what Jobs hands out, Work gets back.
J_out = TypeVar("J_out", bound=Queued, covariant=True)
J_in = TypeVar("J_in", bound=Queued, contravariant=True)


class Task(Protocol):
    """A generate or prefill in progress (generation.Generation, caching.Prefill)."""

    @property
    def model(self) -> Model: ...  # read only: a task's own may be a narrower type (CachingModel)

    @property
    def decoding(self) -> Decoding: ...

    def feed(self, chunk_tokens: int) -> None: ...

    def chunk_taken(self) -> None:
        """After its decoding was fed a chunk inside a step."""
        ...

    def advance(self) -> None: ...

    @property
    def done(self) -> bool: ...

    def finish(self) -> Any: ...


class Jobs(Protocol[J_out]):
    """Where the model lane's jobs come from: the session, in the order admission lets them
    out (worker/locked_session.py)."""

    def next_model_job(self, wait: bool, woken: Callable[[], bool]) -> J_out | None:
        """The next job to start. With ``wait``, blocks until there is one or ``woken()`` turns
        true (call ``wake`` then); None while waiting, with nothing woken, means the lane has
        stopped: no job is queued or running any more."""
        ...

    def wake(self) -> None:
        """Make a waiting ``next_model_job`` check ``woken`` again."""
        ...


class Work(Protocol[J_in]):
    """Who does a job's work beside the loop (worker/model_lane.py)."""

    def run(self, job: J_in) -> None:
        """Run a job that is not a task (or a cancelled one) to its answer, on this thread."""
        ...

    def start_task(self, job: J_in, ready: Callable[[Task | None], None]) -> None:
        """Make the task of a generate or prefill and hand it to ``ready``, from any thread
        (it may read a stored cache first); None when it failed (already answered)."""
        ...

    def finish_task(self, job: J_in, task: Task, error: BaseException | None = None) -> None:
        """Answer with the task's result (it may store a cache first), or with ``error`` when
        its computation failed. The model thread no longer touches the task."""
        ...


class RoundCosts:
    """What a round costs, as measured so far, and the chunk a round beside running streams
    can carry.

    A step's time is the median of the recent steps of that many sequences (one step's time
    varies by a fifth or more on a busy CPU). A round that carries a chunk costs more than a
    step plus its tokens' arithmetic: attention over the prompt so far and the shapes of the
    products add a part that does not shrink with the chunk (while a 1-token chunk costs
    about what one more decoding sequence does: it takes the same one-query path). So a
    round is estimated as a fixed part, learnt from the recent rounds that carried several
    tokens beside as many streams, plus a part per token, and a chunk is the most tokens that
    fit; one token when not even two do, but two again after RECENT_CHUNK_ROUNDS rounds of
    one (the machine may be less busy by then)."""

    def __init__(self) -> None:
        self._steps: dict[int, deque[float]] = {}
        self._rounds: dict[int, deque[tuple[int, int, float]]] = {}  # (round number, tokens, time)
        self._counted = 0  # rounds that carried a chunk, of any size
        self._alone_token_s: float | None = None  # a prompt token's time when fed without streams

    def stepped(self, decoding: int, took_s: float) -> None:
        self._steps.setdefault(decoding, deque(maxlen=RECENT_STEPS)).append(took_s)

    def chunk_fed(self, decoding: int, tokens: int, round_s: float) -> None:
        """A round took ``round_s`` to feed ``tokens`` of a prompt and step ``decoding`` streams."""
        self._counted += 1
        if tokens > 1:
            self._rounds.setdefault(decoding, deque(maxlen=RECENT_CHUNKS)).append((self._counted, tokens, round_s))

    def fed_alone(self, tokens: int, took_s: float, *, in_step_pass: bool = False) -> None:
        """A chunk fed with no stream running took ``took_s``: the first guess at a token's cost
        beside streams. ``in_step_pass``: the model feeds chunks in its step's pass, so that
        pass over the weights is the step's, and a step of one stream's time is taken out."""
        if in_step_pass:
            took_s -= self.step_s(1) or 0.0
        if tokens > 0 and took_s > 0:
            self._alone_token_s = took_s / tokens

    @property
    def timed(self) -> bool:
        return bool(self._steps)

    def step_s(self, decoding: int) -> float | None:
        """A step's time for this many decoding sequences; while none of that many was timed (a
        chunk rode along every one), a step of the nearest number timed. None: no step yet."""
        if not self._steps:
            return None
        return statistics.median(self._steps[min(self._steps, key=lambda n: (abs(n - decoding), n))])

    def chunk_tokens(self, decoding: int, left: int, *, in_step: bool = True) -> int:
        """Tokens to feed of a prompt with ``left`` to go, beside ``decoding`` running streams,
        in their step's pass (``in_step``) or on its own before it.

        - The rest of the prompt at once where that round stays within the streams' promise
          (round_limit) and it is no longer than a chunk fed alone: its first token comes a
          round sooner.
        - Otherwise the most whose round is estimated to cost at most SHARED_ROUND_SHARE of
          the promise, and at most twice the largest chunk measured beside as many (an
          estimate is trusted only near what was measured).
        - When not even two tokens fit: one in the step's pass (it costs about what a decoding
          sequence does; two again now and then, in case more fits by then); fed on its own,
          where any chunk costs a pass over the weights, as many tokens as that pass is worth
          (a prompt must progress, and the streams wait for that pass either way)."""
        step_s, solo_s = self.step_s(decoding), self.step_s(1)
        cost = None if step_s is None else self._round_cost(decoding, step_s)
        if step_s is None or solo_s is None or cost is None:
            return PROBE_CHUNK_TOKENS
        base_s, token_s = cost
        alone_s = min(solo_s, step_s)
        if left <= PREFILL_CHUNK_TOKENS and base_s + left * token_s <= round_limit(alone_s):
            return left
        tokens = int((SHARED_ROUND_SHARE * round_limit(alone_s) - base_s) / token_s)
        recent = self._rounds.get(decoding)
        if tokens < 2:
            if not in_step:
                tokens = max(PROBE_CHUNK_TOKENS, int((base_s - step_s) / token_s))
            elif recent and self._counted - recent[-1][0] >= RECENT_CHUNK_ROUNDS:
                return PROBE_CHUNK_TOKENS
            else:
                return 1
        largest = 2 * max(fed for _, fed, _ in recent) if recent else PREFILL_CHUNK_TOKENS
        return min(PREFILL_CHUNK_TOKENS, largest, tokens)

    def _round_cost(self, decoding: int, step_s: float) -> tuple[float, float] | None:
        """A round's time beside ``decoding`` streams as (fixed part, part per token). The part
        per token is a prompt token's time fed alone (a chunk of hundreds of tokens, so a steady
        figure; beside a step a token's arithmetic is the same); the fixed part is the median of
        what the recent rounds beside as many streams took beyond their tokens' part (a step's
        time ``step_s`` before any). None when nothing says what a token costs (a small chunk
        is tried)."""
        recent = [(tokens, took_s) for _, tokens, took_s in self._rounds.get(decoding, ())]
        if self._alone_token_s is None and not recent:
            return None
        token_s = self._alone_token_s
        if token_s is None:  # prompts came from caches: what the rounds took beyond a step
            token_s = max(statistics.median((took_s - step_s) / tokens for tokens, took_s in recent), MIN_TOKEN_S)
        if not recent:
            return step_s, token_s
        return statistics.median(took_s - token_s * tokens for tokens, took_s in recent), token_s


class Scheduler(Generic[J]):
    def __init__(self, jobs: Jobs[J], work: Work[J], clock: Callable[[], float] = time.perf_counter) -> None:
        self._jobs = jobs
        self._work = work
        self._clock = clock
        self._tasks: list[tuple[J, Task]] = []
        self._lock = threading.Lock()
        self._made_one = threading.Condition(self._lock)
        self._starting = 0  # tasks being made off this thread
        self._ready: list[tuple[J, Task | None]] = []  # made, not yet joined
        self.costs = RoundCosts()
        self._stepped: set[int] = set()  # ids of the running tasks that have taken a step
        self._together_tokens = 0  # prompt tokens fed first since the last step, while others waited for it

    def run(self) -> None:
        """The model thread's loop: returns when the lane has stopped and no task is left."""
        while True:
            job = self._jobs.next_model_job(wait=not self._tasks, woken=self._has_ready)
            if job is None and not self._tasks and not self._starting and not self._has_ready():
                return
            if job is not None:
                self._begin_all(job)
            self.advance()

    def begin(self, job: J) -> None:
        """Start a job the lane let out: a task joins the running ones once made, anything
        else runs now."""
        if not POLICY[job.method].batched or job.is_cancelled():
            self._work.run(job)
            return
        with self._lock:
            self._starting += 1
        self._work.start_task(job, lambda task: self._made(job, task))

    def _made(self, job: J, task: Task | None) -> None:
        with self._lock:
            self._starting -= 1
            self._ready.append((job, task))
            self._made_one.notify_all()
        self._jobs.wake()

    def _begin_all(self, job: J | None) -> None:
        """Begin ``job`` and the jobs let out with it, and give their tasks a moment to be made,
        so that they join this round rather than the next: making one takes a millisecond or two
        unless it reads a stored cache. Running tasks that have stepped are held up no longer
        than a quarter of a step; otherwise (requests that start together, the first ones
        included) the wait lasts up to TOGETHER_WAIT_S, and jobs let out meanwhile (requests
        sent together are read a moment apart) are begun and waited for too, so that the whole
        batch has its prompts fed and takes its first step together rather than its later
        requests trickling in beside it."""
        until = None  # from when the first jobs are begun (a job that runs alone, a load, runs in begin)
        while job is not None:
            while job is not None:
                self.begin(job)
                job = self._jobs.next_model_job(wait=False, woken=self._has_ready)
            if until is None:
                if any(id(task) in self._stepped for _, task in self._tasks):
                    until = self._clock() + (self.costs.step_s(len(self._tasks)) or 0.0) / 4
                else:
                    until = self._clock() + TOGETHER_WAIT_S
            with self._made_one:
                self._made_one.wait_for(lambda: not self._starting, max(0.0, until - self._clock()))
            if self._clock() < until:
                job = self._jobs.next_model_job(wait=False, woken=self._has_ready)

    def _has_ready(self) -> bool:
        with self._lock:
            return bool(self._ready)

    def _join_ready(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        self._tasks += [(job, task) for job, task in ready if task is not None]

    def advance(self) -> None:
        """One round: a chunk of the first waiting prompt (or several whole prompts that start
        together), then a step of every decoding task."""
        self._join_ready()
        self._let_finished_go()
        waiting = [task for _, task in self._tasks if task.decoding.prompt_left]
        decoding = [task for _, task in self._tasks if not task.decoding.prompt_left]
        feeding = waiting[0] if waiting else None
        if not decoding:
            self._together_tokens = 0
        together = feeding is not None and self._fed_before_first_step(feeding, decoding)
        if together:
            decoding = []  # they take their first step together, once this prompt is in too
        whole = self._whole_prompts(waiting, together) if feeding is not None and not decoding else []
        if len(whole) > 1:
            self._guarded(whole, lambda: self._feed_whole(whole, together))
            self._let_finished_go()
            return
        if feeding is not None and decoding and not self.costs.timed:
            feeding = None  # a step alone first: chunks beside steps are sized from its time
        before, started = feeding.decoding.prompt_left if feeding else 0, self._clock()
        in_step = feeding is not None and bool(decoding) and feeding.model.chunks_in_step
        if in_step and feeding is not None:
            chunk = (feeding.decoding, self.costs.chunk_tokens(len(decoding), before))
            stepped = carried = self._guarded([*decoding, feeding], lambda: self._step_together(decoding, chunk))
        else:
            fed = feeding is not None and self._guarded([feeding], lambda: self._feed(feeding, beside=len(decoding)))
            if together and feeding is not None:
                self._together_tokens += before - feeding.decoding.prompt_left
            stepped = bool(decoding) and self._guarded(decoding, lambda: self._step_together(decoding))
            carried = fed and stepped
        if carried and feeding is not None:  # a round that fed a chunk beside running streams: what it took
            self.costs.chunk_fed(len(decoding), before - feeding.decoding.prompt_left, self._clock() - started)
        if in_step and stepped and feeding is not None:
            self._guarded([feeding], feeding.chunk_taken)
        if stepped:
            for task in decoding:  # each takes its token; one that fails there fails alone
                self._guarded([task], task.advance)
        self._let_finished_go()

    def _fed_before_first_step(self, feeding: Task, decoding: list[Task]) -> bool:
        """Whether ``feeding``'s prompt is fed whole on its own, before a step of ``decoding``:
        requests that start together decode together from their first step. So while none of
        the decoding ones has taken a step (each has at most its first token), a waiting prompt
        that fits in what is left of TOGETHER_PROMPT_TOKENS (counted since the last step) is fed
        first; a longer one joins them in chunks beside their steps."""
        if not decoding or any(id(task) in self._stepped for task in decoding):
            return False
        return self._together_tokens + feeding.decoding.prompt_left <= TOGETHER_PROMPT_TOKENS

    def _whole_prompts(self, waiting: list[Task], together: bool) -> list[Task]:
        """The waiting prompts fed whole in one pass, while no task decodes or the decoding ones
        wait for them to take their first step (``together``): from the first, in order, as many
        as fit a chunk (and what is left of TOGETHER_PROMPT_TOKENS when ``together``); none where
        the model feeds its chunks on their own."""
        if not waiting[0].model.chunks_in_step:
            return []
        room = PREFILL_CHUNK_TOKENS
        if together:
            room = min(room, TOGETHER_PROMPT_TOKENS - self._together_tokens)
        whole: list[Task] = []
        for task in waiting:
            room -= task.decoding.prompt_left
            if room < 0:
                break
            whole.append(task)
        return whole

    def _feed_whole(self, tasks: list[Task], together: bool) -> None:
        """Prompts fed whole in one pass; each task takes its first token after it."""
        tokens, started = sum(task.decoding.prompt_left for task in tasks), self._clock()
        tasks[0].model.step([], [(task.decoding, task.decoding.prompt_left) for task in tasks])
        self.costs.fed_alone(tokens, self._clock() - started, in_step_pass=True)
        if together:
            self._together_tokens += tokens
        for task in tasks:  # each takes its first token; one that fails there fails alone
            self._guarded([task], task.chunk_taken)

    def _step_together(self, decoding: list[Task], chunk: tuple[Decoding, int] | None = None) -> None:
        """One step of the decoding tasks; with ``chunk``, a part of a prompt fed in the same pass."""
        started = self._clock()
        self._stepped.update(id(task) for task in decoding)
        self._together_tokens = 0
        decoding[0].model.step([task.decoding for task in decoding], [chunk] if chunk else [])
        if chunk is None:
            self.costs.stepped(len(decoding), self._clock() - started)

    def _guarded(self, tasks: list[Task], work: Callable[[], None]) -> bool:
        """Run ``work``; if it fails, the tasks it was for fail with its error, and only they."""
        try:
            work()
        except BaseException as exc:  # a library's BaseException too (a Rust panic): only these tasks fail
            failed = [(job, task) for job, task in self._tasks if any(task is t for t in tasks)]
            for job, task in failed:
                self._tasks.remove((job, task))
                self._stepped.discard(id(task))
                self._work.finish_task(job, task, exc)
            return False
        return True

    def _feed(self, task: Task, *, beside: int) -> None:
        """Feed a chunk of ``task``'s prompt on its own, ``beside`` that many decoding tasks
        (a full chunk when none decodes)."""
        before, started = task.decoding.prompt_left, self._clock()
        task.feed(self.costs.chunk_tokens(beside, before, in_step=False) if beside else PREFILL_CHUNK_TOKENS)
        if not beside:
            fed = before - task.decoding.prompt_left
            self.costs.fed_alone(fed, self._clock() - started, in_step_pass=task.model.chunks_in_step)

    def _let_finished_go(self) -> None:
        finished = [(job, task) for job, task in self._tasks if task.done]
        for job, task in finished:
            self._tasks.remove((job, task))
            self._stepped.discard(id(task))
            self._work.finish_task(job, task)

    @property
    def tasks(self) -> Sequence[Task]:
        return [task for _, task in self._tasks]


def round_limit(alone_s: float) -> float:
    """What a round beside running streams is promised to cost at most, given a step of one
    stream alone."""
    return max(PROMISED_ROUND_OVER_SOLO * alone_s, alone_s + ROUND_ALLOWANCE_S)
