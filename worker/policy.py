"""Every method as the worker serves it, declared once: its wire types (its constant in
protocol/methods.py), how it runs and its handler (worker/handlers.py), one row of DECLARATIONS.

The session (worker/session.py) puts a request on its row's lane and decides from the rows
what it waits behind, admission (worker/admission.py) which model-lane request starts when,
the scheduler (worker/scheduler.py) which ones run side by side as tasks, and the responder
(worker/responder.py) runs its handler, or answers a request cancelled before it ran. A new
method is a constant in protocol/methods.py and a row of DECLARATIONS here; pyright checks
the row's handler against the constant's params and result.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import msgspec

from protocol.methods import (
    CACHE_DELETE,
    CACHE_INFO,
    CACHE_LIST,
    CANCEL,
    CAPABILITIES,
    DETOKENIZE,
    GENERATE,
    LOAD,
    MODELS_LIST,
    PREFILL,
    RENDER,
    SHUTDOWN,
    TOKENIZE,
    UNLOAD,
    CacheRefParams,
    GenerateParams,
    MethodSpec,
    Params,
    PrefillParams,
    Result,
)
from worker.generation import AUTO
from worker.handlers import Context, Handlers

if TYPE_CHECKING:  # the scheduler imports this module
    from worker.scheduler import Task

    R_co = TypeVar("R_co", covariant=True)

    class TaskOf(Task, Protocol[R_co]):
        """A task whose result is R_co."""

        def finish(self) -> R_co: ...


P = TypeVar("P", bound=Params)
R = TypeVar("R", bound="Result | None")

# Stored caches by ref; AUTO stands for any of them (where auto reuse may start from).
Refs = tuple[str, ...]


class Lane(enum.Enum):
    INLINE = enum.auto()  # answered by the reader thread at once
    TEXT = enum.auto()  # the text lane, unless a load or unload is still ahead of it (then the model lane)
    MODEL = enum.auto()  # queued for the model thread, in order
    AFTER_CACHE_USE = enum.auto()  # inline, unless a request that uses a cache is ahead of it (then the model lane)


def _no_cache(params: Params) -> Refs:
    return ()


def _every_cache(params: Params) -> Refs:
    return (AUTO,)


def _named_cache(params: CacheRefParams) -> Refs:
    return (params.cache,)


def _generate_caches(params: GenerateParams) -> Refs:
    return () if params.cache is None else (params.cache,)


def _prefill_caches(params: PrefillParams) -> Refs:
    return (params.cache,) if params.base is None else (params.cache, params.base)


def _prefill_writes(params: PrefillParams) -> Refs:
    return (params.cache,)


class Rules(msgspec.Struct, Generic[P], frozen=True, kw_only=True):
    """How one method runs."""

    lane: Lane
    # Starts only after the text requests received before it have answered (they see the model
    # as it was), and text requests received after it wait for it (they see the model it leaves).
    changes_model: bool = False
    # Stops when cancelled while it runs (a running load cannot stop halfway: it answers as usual).
    stoppable: bool = False
    # A cancel before it starts answers with a result (finish_reason "cancelled") instead of -32800.
    cancelled_result: bool = False
    # Keeps its place and runs even when cancelled (shutdown: the host's way out is exit).
    runs_when_cancelled: bool = False
    # Receiving it cancels what is in flight and refuses every later request.
    ends_session: bool = False
    # The stored caches it reads or writes: cache/* requests received after a request with any
    # wait for it (a cache/* request itself is queued only behind another, so the order among
    # them holds), and a batched request waits for a running one that writes one of its own.
    caches: Callable[[P], Refs] = _no_cache
    # Of those, the ones it writes that later requests must see (what an auto generate stores
    # is not one: each conversation uses what is stored when it starts).
    writes: Callable[[P], Refs] = _no_cache


class Method(Rules[P], Generic[P, R], frozen=True, kw_only=True):
    """A method whose handler answers it, on its lane's thread."""

    batched: ClassVar[bool] = False
    spec: MethodSpec[P, R]
    handler: Callable[[Handlers, Context, P], R]


class BatchedMethod(Rules[P], Generic[P, R], frozen=True, kw_only=True):
    """A method whose handler makes a task, run side by side with others in the model lane's
    rounds (up to --max-batch) and answered with what it finishes with; every other
    model-lane request runs with nothing else on that lane."""

    batched: ClassVar[bool] = True
    spec: MethodSpec[P, R]
    # Its messages rendered into its prompt, on a render thread before its task is made.
    prompt: Callable[[Handlers, Context, P], list[int] | None]
    task: Callable[[Handlers, Context, P], TaskOf[R]]


# One per protocol method, in the protocol's order.
DECLARATIONS = (
    Method(spec=CAPABILITIES, handler=Handlers.capabilities, lane=Lane.INLINE),
    Method(spec=LOAD, handler=Handlers.load, lane=Lane.MODEL, changes_model=True),
    Method(spec=UNLOAD, handler=Handlers.unload, lane=Lane.MODEL, changes_model=True),
    Method(spec=TOKENIZE, handler=Handlers.tokenize, lane=Lane.TEXT),
    Method(spec=DETOKENIZE, handler=Handlers.detokenize, lane=Lane.TEXT),
    Method(spec=RENDER, handler=Handlers.render, lane=Lane.TEXT),
    BatchedMethod(
        spec=GENERATE, prompt=Handlers.prompt, task=Handlers.generate, lane=Lane.MODEL, stoppable=True,
        cancelled_result=True, caches=_generate_caches,
    ),
    BatchedMethod(
        spec=PREFILL, prompt=Handlers.prompt, task=Handlers.prefill, lane=Lane.MODEL, stoppable=True,
        caches=_prefill_caches, writes=_prefill_writes,
    ),
    Method(spec=CACHE_LIST, handler=Handlers.cache_list, lane=Lane.AFTER_CACHE_USE, caches=_every_cache),
    Method(spec=CACHE_INFO, handler=Handlers.cache_info, lane=Lane.AFTER_CACHE_USE, caches=_named_cache),
    Method(
        spec=CACHE_DELETE, handler=Handlers.cache_delete, lane=Lane.AFTER_CACHE_USE, caches=_named_cache,
        writes=_named_cache,
    ),
    # reads directories and headers other programs wrote: off the reader thread, like tokenize
    Method(spec=MODELS_LIST, handler=Handlers.models_list, lane=Lane.TEXT),
    Method(spec=CANCEL, handler=Handlers.cancel, lane=Lane.INLINE),
    Method(
        spec=SHUTDOWN, handler=Handlers.shutdown, lane=Lane.MODEL, changes_model=True, runs_when_cancelled=True,
        ends_session=True,
    ),
)
# Each method's declaration by its name, as the session, admission, the scheduler and the responder look it up.
POLICY: dict[str, Method[Any, Any] | BatchedMethod[Any, Any]] = {served.spec.name: served for served in DECLARATIONS}


def waits_behind(lane: Lane, earlier: str, earlier_params: Any) -> bool:
    """Whether a request on ``lane`` waits behind an earlier, unfinished model-lane request,
    so that it sees that request's effect (the model it loads, the cache it writes or reads)."""
    declared = POLICY[earlier]
    if lane is Lane.TEXT:
        return declared.changes_model
    if lane is Lane.AFTER_CACHE_USE:
        return bool(declared.caches(earlier_params))
    return False
