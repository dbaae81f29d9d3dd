"""Replay a transcript against a fresh worker and report every difference.

    python -m worker.replay tests/transcripts/*.jsonl

Each incoming message is sent once the worker has written as many messages as
it had written before that message in the recording, so a request that was sent
mid-stream is sent mid-stream again. Responses are matched by id,
notifications in order per request, errors without an id in order; timings,
pids and versions are ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec

from protocol.framing import Framing, encode_frame
from worker import transcript
from worker.host import Host

VOLATILE_KEYS = frozenset({"timings", "load_time_ms", "resident_bytes", "time_ms", "last_used", "pid", "worker_version"})


def normalize(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: normalize(v) for k, v in value.items() if k not in VOLATILE_KEYS}
    if isinstance(value, list):
        return [normalize(v) for v in value]
    return value


def _streams(messages: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Messages keyed so that order matters only where the protocol promises it."""
    streams: dict[str, list[Any]] = defaultdict(list)
    for message in messages:
        message = normalize(message)
        if "method" in message:
            params = message.get("params")
            owner = params.get("id") if isinstance(params, dict) else None
            streams[f"notification {message['method']} for id {owner!r}"].append(message)
        elif message.get("id") is None:
            streams["errors without an id"].append(message)
        else:
            streams[f"response to id {message['id']!r}"].append(message)
    return streams


def compare(expected: list[dict[str, Any]], actual: list[dict[str, Any]]) -> list[str]:
    want, got = _streams(expected), _streams(actual)
    differences = []
    for key in sorted(want.keys() | got.keys()):
        if want.get(key) != got.get(key):
            differences.append(
                f"{key}:\n  expected {_show(want.get(key))}\n  actual   {_show(got.get(key))}"
            )
    return differences


def _show(messages: list[Any] | None) -> str:
    return msgspec.json.encode(messages).decode() if messages else "nothing"


def _frame(entry: transcript.Entry) -> bytes:
    if entry.send is not None:
        return entry.send.encode()
    body = entry.raw.encode() if entry.raw is not None else msgspec.json.encode(entry.msg)
    return encode_frame(body, Framing(entry.framing))


async def replay(path: str | Path, *, timeout: float = 30.0) -> list[str]:
    """The differences between the recording and a fresh run; empty when they agree."""
    header, entries = transcript.read(path)
    unframed = [e.unframed for e in entries if e.unframed is not None]
    if unframed:
        return [f"cannot replay input that was not a frame ({unframed[0]}); give its bytes under 'send'"]
    expected = [e.msg for e in entries if e.dir == "out"]
    async with await Host.spawn(*header.args) as host:
        written_before = 0
        try:
            for entry in entries:
                if entry.dir == "out":
                    written_before += 1
                    continue
                await host.wait_until(lambda n=written_before: len(host.messages) >= n, timeout=timeout)
                await host.send_raw(_frame(entry))
            await host.wait_until(lambda: len(host.messages) >= len(expected), timeout=timeout)
        except TimeoutError:
            pass  # the comparison below says what is missing
        await host.close()
    return compare(expected, host.messages)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.replay", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("transcripts", nargs="+", type=Path)
    args = parser.parse_args(argv)
    failed = 0
    for path in args.transcripts:
        differences = asyncio.run(replay(path))
        print(f"{'ok  ' if not differences else 'FAIL'} {path}")
        for difference in differences:
            print(f"  {difference}")
        failed += bool(differences)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
