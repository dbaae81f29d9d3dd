"""A small asyncio host for lm-worker: spawns ``python -m worker`` and talks to it.

The demo, the transcript replayer, the benchmarks and the end-to-end tests all
drive the worker through this one class, over real pipes. A worker can also run in
the host's own process (``start_in_process``: the same pieces on threads, over real
pipes), which the tests use where a separate process shows nothing more.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from protocol.framing import Frame, FrameDecoder, Framing, encode_frame

REPO_ROOT = Path(__file__).resolve().parent.parent


class WorkerError(Exception):
    """An error response, as the host received it."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"{error.get('code')}: {error.get('message')}")
        self.code: int = error.get("code", 0)
        self.message: str = error.get("message", "")
        self.kind: str | None = (error.get("data") or {}).get("kind")
        self.data: dict[str, Any] = error.get("data") or {}


class Host:
    def __init__(self, process: asyncio.subprocess.Process, framing: Framing) -> None:
        self.process = process
        self.framing = framing
        self.messages: list[dict[str, Any]] = []  # everything received, in order
        self.arrival_times: list[float] = []  # when each of them was read (time.perf_counter)
        self.chunks: defaultdict[Any, list[dict[str, Any]]] = defaultdict(list)  # generate/chunk params by id
        self.stderr = bytearray()
        self.malformed: list[str] = []  # framing errors in what the worker wrote: always a bug
        self._ids = itertools.count(1)
        self._pending: dict[Any, asyncio.Future[dict[str, Any]]] = {}
        self._arrived = asyncio.Condition()
        self._reader = asyncio.create_task(self._read_stdout())
        self._stderr_reader = asyncio.create_task(self._read_stderr())

    @classmethod
    async def spawn(
        cls,
        *args: str,
        framing: Framing = Framing.NDJSON,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        checkout: Path = REPO_ROOT,
    ) -> Host:
        """``python -m worker args`` from ``checkout`` (another one's sources: bench/checkout_bench.py)."""
        process = await asyncio.create_subprocess_exec(
            python,
            "-m",
            "worker",
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=checkout,  # so that -m finds the sources in a checkout that is not installed
            env={**os.environ, **(env or {})},
        )
        return cls(process, framing)

    @classmethod
    async def start_in_process(cls, *args: str, framing: Framing = Framing.NDJSON) -> Host:
        """A worker with these command-line arguments in this process: its lanes on threads of
        this process, its protocol stream over real pipes. No stdout guard, signals or logs of
        its own (they go to this process's logging)."""
        return cls(await InProcessWorker.start(list(args)), framing)  # type: ignore[arg-type]

    # --- sending ----------------------------------------------------------------

    async def send(self, message: dict[str, Any]) -> None:
        await self.send_raw(encode_frame(msgspec.json.encode(message), self.framing))

    async def send_raw(self, data: bytes) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(data)
        await stdin.drain()

    async def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        await self.send(message)

    def start(self, method: str, params: dict[str, Any] | None = None, *, id: Any = None) -> tuple[Any, asyncio.Future]:
        """Send a request without waiting; returns its id and a future of the whole response."""
        msg_id = next(self._ids) if id is None else id
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": msg_id, "method": method}
        if params is not None:
            message["params"] = params
        # encoded here, so that what cannot be sent (a lone surrogate) raises to the caller
        data = encode_frame(msgspec.json.encode(message), self.framing)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = future
        asyncio.ensure_future(self.send_raw(data))
        return msg_id, future

    async def call(self, method: str, params: dict[str, Any] | None = None, *, timeout: float = 60.0) -> Any:
        """Send a request and return its result; raises WorkerError for an error response."""
        _, future = self.start(method, params)
        response = await asyncio.wait_for(future, timeout)
        if "error" in response:
            raise WorkerError(response["error"])
        return response["result"]

    # --- receiving --------------------------------------------------------------

    async def wait_until(self, condition: Callable[[], bool], *, timeout: float = 30.0) -> None:
        """Wait until ``condition()`` holds, checking after every message (or stderr output) received."""

        async def wait() -> None:
            async with self._arrived:
                while not condition():
                    if self._reader.done():
                        raise EOFError(f"the worker closed stdout; stderr: {self.stderr_tail()}")
                    await self._arrived.wait()

        await asyncio.wait_for(wait(), timeout)

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool], *, timeout: float = 30.0) -> dict[str, Any]:
        """The first message received (before or after this call) that satisfies ``predicate``."""
        scanned = 0
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            nonlocal scanned
            while not found and scanned < len(self.messages):
                if predicate(self.messages[scanned]):
                    found.append(self.messages[scanned])
                scanned += 1
            return bool(found)

        await self.wait_until(seen, timeout=timeout)
        return found[0]

    async def _read_stdout(self) -> None:
        stdout = self.process.stdout
        assert stdout is not None
        decoder = FrameDecoder()
        try:
            while data := await stdout.read(1 << 16):
                self._deliver(decoder.feed(data))
            self._deliver(decoder.feed_eof())
        finally:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(EOFError(f"the worker exited; stderr: {self.stderr_tail()}"))
            async with self._arrived:
                self._arrived.notify_all()

    def _deliver(self, events: Sequence[Any]) -> None:
        for event in events:
            if not isinstance(event, Frame):
                self.malformed.append(event.message)
                continue
            try:
                message = msgspec.json.decode(event.body)
            except msgspec.DecodeError as exc:
                self.malformed.append(f"{exc}: {event.body[:200]!r}")
                continue
            self.messages.append(message)
            self.arrival_times.append(time.perf_counter())
            if message.get("method") == "generate/chunk":
                self.chunks[message["params"]["id"]].append(message["params"])
            elif "id" in message and message["id"] in self._pending:
                future = self._pending.pop(message["id"])
                if not future.done():
                    future.set_result(message)
        asyncio.ensure_future(self._notify_arrived())

    async def _notify_arrived(self) -> None:
        async with self._arrived:
            self._arrived.notify_all()

    async def _read_stderr(self) -> None:
        stderr = self.process.stderr
        assert stderr is not None
        while data := await stderr.read(1 << 16):
            self.stderr += data
            del self.stderr[: max(0, len(self.stderr) - (1 << 20))]
            await self._notify_arrived()

    def stderr_tail(self, size: int = 2000) -> str:
        return self.stderr[-size:].decode("utf-8", "replace")

    # --- ending -----------------------------------------------------------------

    async def close_stdin(self) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        if not stdin.is_closing():
            stdin.close()
            await stdin.wait_closed()

    async def wait(self, timeout: float = 10.0) -> int:
        code = await asyncio.wait_for(self.process.wait(), timeout)
        await asyncio.gather(self._reader, self._stderr_reader, return_exceptions=True)
        return code

    async def close(self, timeout: float = 10.0) -> int:
        """Close stdin (the worker exits at end of input) and wait; kill if it hangs."""
        if self.process.returncode is None:
            try:
                await self.close_stdin()
            except (BrokenPipeError, ConnectionResetError):
                pass
            try:
                return await self.wait(timeout)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
                raise
        return await self.wait(timeout)

    async def __aenter__(self) -> Host:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.process.returncode is None:
            await self.close()


class InProcessWorker:
    """What Host uses of a worker process (stdin, stdout, stderr, pid, returncode, wait, kill),
    for a worker running on threads of this process: ``worker.cli.Worker`` serving one pipe and
    writing to another through the same transport (framing, parsing, writer) as ``python -m
    worker`` serves stdin and writes to stdout."""

    def __init__(self, worker: Any, stdin: asyncio.StreamWriter, stdout: asyncio.StreamReader, done: asyncio.Future):
        self.pid = os.getpid()
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = asyncio.StreamReader()
        self.stderr.feed_eof()
        self._worker = worker
        self._done = done

    @classmethod
    async def start(cls, args: list[str]) -> InProcessWorker:
        from worker import __version__
        from worker.cli import Worker, build_parser
        from worker.transcript import Recorder

        parsed = build_parser().parse_args(args)
        recorder = Recorder(parsed.record, worker_version=__version__, args=args) if parsed.record else None
        worker = Worker(parsed, (out := os.pipe())[1], recorder=recorder)
        in_read, in_write = os.pipe()
        loop = asyncio.get_running_loop()
        stdout = asyncio.StreamReader(limit=1 << 26)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdout), os.fdopen(out[0], "rb", 0))
        unused = asyncio.StreamReader()
        protocol = asyncio.StreamReaderProtocol(unused)  # a write pipe's protocol with flow control and close
        transport, _ = await loop.connect_write_pipe(lambda: protocol, os.fdopen(in_write, "wb", 0))
        stdin = asyncio.StreamWriter(transport, protocol, unused, loop)
        done: asyncio.Future[int] = loop.create_future()
        self = cls(worker, stdin, stdout, done)

        def run() -> None:
            reader = threading.Thread(target=worker.serve, args=(in_read,), name="lm-worker-reader")
            reader.daemon = True
            reader.start()
            worker.dispatcher.ended.wait()
            worker.stop()
            os.close(out[1])  # the host reads the end of the stream, as when a process exits
            reader.join(5)
            code = worker.dispatcher.exit_code
            try:
                loop.call_soon_threadsafe(lambda: done.done() or done.set_result(code))
            except RuntimeError:  # the host's loop has closed: nobody waits for the end any more
                pass

        threading.Thread(target=run, name="lm-worker-main", daemon=True).start()
        return self

    @property
    def returncode(self) -> int | None:
        """The exit code once the worker has ended (as a process's, None while it runs)."""
        return self._done.result() if self._done.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._done)

    def kill(self) -> None:
        """Not a kill: the worker is told to stop at once, cancelling what runs, and its input
        is closed (its reader sees the end)."""
        self._worker.dispatcher.end("killed by the host", cancel=True)
        self.stdin.close()
