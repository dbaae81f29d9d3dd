"""A hostile host, third round (issue 27): each case through a real worker over real pipes.
Whatever a host sends or leaves in the data directory, the worker answers precisely, loses
no result, never hangs, and keeps serving."""

from __future__ import annotations

import time

import pytest

from protocol.methods import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tests.conftest import SpawnWorker
from worker.host import Host, WorkerError


# --- 1: stop strings ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stop", "field"),
    [(["x" * (MAX_STOP_CHARS + 1)], "params.stop[0]"), ([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)], "params.stop")],
)
async def test_stop_strings_past_the_bounds_are_refused_naming_the_field(echo_worker: Host, stop, field):
    with pytest.raises(WorkerError) as caught:
        await echo_worker.call("generate", {"prompt": "abc", "stop": stop})
    assert (caught.value.code, caught.value.kind, caught.value.data["field"]) == (-32602, "invalid_params", field)


async def test_the_largest_stop_strings_allowed_cost_little_per_token(echo_worker: Host):
    """Each stop string is always one character from complete: every token extends the text
    held back, the worst case for matching (quadratic before: seconds for this generation)."""
    stops = ["a" * (MAX_STOP_CHARS - 1) + chr(ord("A") + i) for i in range(MAX_STOP_STRINGS)]
    started = time.perf_counter()
    result = await echo_worker.call("generate", {"prompt": "a" * 2000, "stop": stops, "max_tokens": 4000})
    elapsed = time.perf_counter() - started
    assert result["text"] == "a" * 2000 and result["stop_reason"]["kind"] == "eos"
    assert elapsed < 3.0, elapsed
