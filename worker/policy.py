"""How each method runs: one row per method, the only place these rules are written.

The session (worker/session.py) puts a request on its row's lane and decides from the rows
what it waits behind, admission (worker/admission.py) which model-lane request starts when,
the scheduler (worker/scheduler.py) which ones run side by side as tasks, and the responder
(worker/responder.py) what a request cancelled before it ran answers. A new method gets a
row here, a handler in worker/handlers.py and its route in worker/dispatcher.py; the
dispatcher checks that every protocol method has a route, and this module that it has a row.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import msgspec

from protocol.methods import METHODS


class Lane(enum.Enum):
    INLINE = enum.auto()  # answered by the reader thread at once
    TEXT = enum.auto()  # the text lane, unless a load or unload is still ahead of it (then the model lane)
    MODEL = enum.auto()  # queued for the model thread, in order
    AFTER_CACHE_USE = enum.auto()  # inline, unless a request that uses a cache is ahead of it (then the model lane)


def _never(params: Any) -> bool:
    return False


def _always(params: Any) -> bool:
    return True


def _names_a_cache(params: Any) -> bool:
    return params.cache is not None


class Policy(msgspec.Struct, frozen=True):
    """How one method runs."""

    lane: Lane
    # A task: made, then run side by side with others in the model lane's rounds (up to
    # --max-batch); every other model-lane request runs with nothing else on that lane.
    batched: bool = False
    # Starts only after the text requests received before it have answered (they see the model
    # as it was), and text requests received after it wait for it (they see the model it leaves).
    changes_model: bool = False
    # Stops when cancelled while it runs (a running load cannot stop halfway: it answers as usual).
    stoppable: bool = False
    # A cancel before it starts answers with a result (finish_reason "cancelled") instead of -32800.
    cancelled_result: bool = False
    # Keeps its place and runs even when cancelled (shutdown: the host's way out is exit).
    runs_when_cancelled: bool = False
    # Reads or writes stored caches: cache/* requests received after it wait for it (a cache/*
    # request itself is queued only behind another, so the order among them holds).
    uses_cache: Callable[[Any], bool] = _never


POLICY: dict[str, Policy] = {
    "capabilities": Policy(Lane.INLINE),
    "cancel": Policy(Lane.INLINE),
    "load": Policy(Lane.MODEL, changes_model=True),
    "unload": Policy(Lane.MODEL, changes_model=True),
    "shutdown": Policy(Lane.MODEL, changes_model=True, runs_when_cancelled=True),
    "tokenize": Policy(Lane.TEXT),
    "detokenize": Policy(Lane.TEXT),
    "render": Policy(Lane.TEXT),
    "generate": Policy(Lane.MODEL, batched=True, stoppable=True, cancelled_result=True, uses_cache=_names_a_cache),
    "prefill": Policy(Lane.MODEL, batched=True, stoppable=True, uses_cache=_always),
    "cache/list": Policy(Lane.AFTER_CACHE_USE, uses_cache=_always),
    "cache/info": Policy(Lane.AFTER_CACHE_USE, uses_cache=_always),
    "cache/delete": Policy(Lane.AFTER_CACHE_USE, uses_cache=_always),
    # reads directories and headers other programs wrote: off the reader thread, like tokenize
    "models/list": Policy(Lane.TEXT),
}
assert POLICY.keys() == METHODS.keys(), "every protocol method needs a policy"


def waits_behind(lane: Lane, earlier: str, earlier_params: Any) -> bool:
    """Whether a request on ``lane`` waits behind an earlier, unfinished model-lane request,
    so that it sees that request's effect (the model it loads, the cache it writes or reads)."""
    policy = POLICY[earlier]
    if lane is Lane.TEXT:
        return policy.changes_model
    if lane is Lane.AFTER_CACHE_USE:
        return policy.uses_cache(earlier_params)
    return False
