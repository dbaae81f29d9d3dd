"""``python -m worker`` / ``lm-worker``: wire stdin, stdout, signals and threads together.

Threads: ``main`` runs on the process's main thread: it starts the reader thread
(``lm-worker-reader``, the transport serving stdin), handles signals, and waits for the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from protocol.framing import DEFAULT_MAX_MESSAGE_BYTES, Framing
from worker import __version__
from worker.backends import Registry
from worker.data_dir import default_data_dir
from worker.dispatcher import Dispatcher
from worker.handlers import Handlers, WireInfo
from worker.scheduler import DEFAULT_MAX_BATCH
from worker.stdio import STDERR_GRACE_S, claim_stdout
from worker.transcript import Recorder
from worker.transport import StdioTransport
from worker.writer import DEFAULT_OUTBOX_MESSAGES, Writer

DEFAULT_MEMORY_CACHE_MAX_BYTES = 2 << 30
DEFAULT_RESTORE_RESERVE_MAX_BYTES = 1 << 30

EXAMPLE = '{"jsonrpc":"2.0","id":1,"method":"capabilities"}'
HELP_EPILOG = f"""\
The worker reads JSON-RPC 2.0 requests on stdin and answers on stdout; logs go
to stderr. Type one request per line, for example:

  {EXAMPLE}
  {{"jsonrpc":"2.0","id":2,"method":"load","params":{{"backend":"echo"}}}}
  {{"jsonrpc":"2.0","id":3,"method":"generate","params":{{"prompt":"héllo","max_tokens":8}}}}

Messages framed with a Content-Length header (as LSP and vscode-jsonrpc send
them) work too; replies use the framing of the first message. At end of input
the worker cancels what is still running and exits (--drain finishes it first).
docs/PROTOCOL.md describes every method.
"""

# How long a cancelled model request may take to stop before the worker exits anyway.
STOP_GRACE_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lm-worker",
        description="Run language models for a host process over JSON-RPC 2.0 on stdio.",
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # options are spelled out, so a transcript's arguments read unambiguously
    )
    parser.add_argument("--version", action="version", version=f"lm-worker {__version__}")
    parser.add_argument(
        "--framing",
        choices=["auto", *(f.value for f in Framing)],
        default="auto",
        help="framing of replies: 'auto' (default) uses the framing of the first message received",
    )
    parser.add_argument(
        "--max-message-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        metavar="N",
        help=f"refuse incoming messages larger than N bytes (default {DEFAULT_MAX_MESSAGE_BYTES})",
    )
    parser.add_argument(
        "--outbox",
        type=_positive_int,
        default=DEFAULT_OUTBOX_MESSAGES,
        metavar="N",
        help=f"messages buffered for stdout before generation waits for the host (default {DEFAULT_OUTBOX_MESSAGES})",
    )
    parser.add_argument(
        "--max-batch",
        type=_positive_int,
        default=DEFAULT_MAX_BATCH,
        metavar="N",
        help="run at most N generate and prefill requests side by side, decoding them in one batch; "
        f"later ones wait in the queue (default {DEFAULT_MAX_BATCH})",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"where converted models are kept (default: $LM_WORKER_DATA_DIR, else {default_data_dir()})",
    )
    parser.add_argument(
        "--models-dir",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of gguf files (and model directories) that load finds by name and models/list "
        "lists, after node-llama-cpp's (~/.node-llama-cpp/models); repeatable",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where named KV caches are stored as NAME.kvc (default: DATA_DIR/caches)",
    )
    parser.add_argument(
        "--cache-max-bytes",
        type=_positive_int,
        default=None,
        metavar="N",
        help="keep the cache directory under N bytes, deleting least recently used caches (default: no bound)",
    )
    parser.add_argument(
        "--memory-cache-max-bytes",
        type=_positive_int,
        default=DEFAULT_MEMORY_CACHE_MAX_BYTES,
        metavar="N",
        help="hold memory:// caches of at most N bytes together, letting go of least recently used ones "
        f"(default {DEFAULT_MEMORY_CACHE_MAX_BYTES}, 2 GiB)",
    )
    parser.add_argument(
        "--restore-reserve-max-bytes",
        type=_non_negative_int,
        default=DEFAULT_RESTORE_RESERVE_MAX_BYTES,
        metavar="N",
        help="at load, fill at most N bytes of memory for restoring the model's largest stored cache "
        f"(default {DEFAULT_RESTORE_RESERVE_MAX_BYTES}, 1 GiB; 0: none)",
    )
    parser.add_argument("--record", metavar="FILE", help="write every message in and out to FILE as a transcript")
    parser.add_argument(
        "--drain",
        action="store_true",
        help="at end of input, finish the requests already received instead of cancelling them "
        "(for piping a file of requests)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="stderr log level"
    )
    return parser


def _without_record(argv: list[str]) -> list[str]:
    """The arguments a replay starts its worker with: all but --record's, in both its forms
    (a replay that recorded too would overwrite the transcript it replays)."""
    kept, skip_next = [], False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg == "--record":
            skip_next = True
        elif not arg.startswith("--record="):
            kept.append(arg)
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    recorder = None
    if args.record:
        replay_args = _without_record(argv if argv is not None else sys.argv[1:])
        try:
            recorder = Recorder(args.record, worker_version=__version__, args=replay_args)
        except OSError as exc:  # a bad command line: usage and one line of reason, exit 2
            parser.error(f"--record {args.record}: cannot write it: {exc.strerror or exc}")
    logging.basicConfig(
        stream=sys.stderr, level=args.log_level.upper(), format="lm-worker %(levelname)s %(name)s: %(message)s"
    )
    out_fd, stderr_pump = claim_stdout()
    worker = Worker(args, out_fd, recorder=recorder)
    _on_signals(lambda: worker.dispatcher.end("signal", cancel=True))
    threading.Thread(target=worker.serve, args=(0,), name="lm-worker-reader", daemon=True).start()
    if sys.stdin.isatty():
        print(f"lm-worker {__version__} ready: type one JSON-RPC request per line, e.g. {EXAMPLE}", file=sys.stderr)
    while not worker.dispatcher.ended.wait(0.5):
        pass  # a timed wait keeps signal handlers running promptly
    if not worker.stop():
        # The model thread is inside native code; interpreter shutdown around it would abort.
        logging.getLogger(__name__).warning("a model request did not stop within %.0f s; exiting", STOP_GRACE_S)
        stderr_pump.close(STDERR_GRACE_S)
        os._exit(worker.dispatcher.exit_code)
    stderr_pump.close(STDERR_GRACE_S)
    return worker.dispatcher.exit_code


class Worker:
    """The pieces of a worker wired together (writer, transport, handlers, dispatcher), writing
    its protocol stream to ``out_fd``; whoever makes it calls ``serve`` on a reader thread with
    the descriptor to read and, at the end, ``stop``. ``python -m worker`` makes one over stdio;
    tests make one in their own process over a pair of pipes (worker.host.Host.start_in_process)."""

    def __init__(self, args: argparse.Namespace, out_fd: int, *, recorder: Recorder | None) -> None:
        self.recorder = recorder
        self.writer = Writer(
            out_fd,
            capacity=args.outbox,
            framing=None if args.framing == "auto" else Framing(args.framing),
            recorder=self.recorder,
            on_broken=lambda: self.dispatcher.end("stdout closed: the host stopped reading", cancel=True),
        )
        writer = self.writer
        self.handlers = Handlers(
            Registry(),
            WireInfo(
                methods=Dispatcher.method_names(),
                notifications=Dispatcher.notification_names(),
                framing=lambda: writer.framing,
                max_message_bytes=args.max_message_bytes,
                outbox_messages=args.outbox,
                max_batch=args.max_batch,
            ),
            data_dir=args.data_dir or default_data_dir(),
            cache_dir=args.cache_dir,
            cache_max_bytes=args.cache_max_bytes,
            memory_cache_max_bytes=args.memory_cache_max_bytes,
            restore_reserve_max_bytes=args.restore_reserve_max_bytes,
            models_dirs=args.models_dir,
        )
        self.transport = StdioTransport(self.writer, max_message_bytes=args.max_message_bytes, recorder=self.recorder)
        self.dispatcher = Dispatcher(self.handlers, self.transport, drain_on_eof=args.drain, max_batch=args.max_batch)

    def serve(self, fd: int) -> None:
        """The reader thread: feed the dispatcher what arrives on ``fd`` until the end of input
        (or until it stops reading)."""
        self.transport.serve(fd, self.dispatcher)

    def stop(self) -> bool:
        """After the dispatcher has ended: let the lanes finish, write what is queued, let go of
        the model. False if a model request did not stop in time (the model is kept then)."""
        stopped = self.dispatcher.wait_stopped(STOP_GRACE_S)
        if stopped:
            self.handlers.close()
        self.writer.close(STOP_GRACE_S)
        if self.recorder is not None:
            self.recorder.close()
        return stopped


def _on_signals(stop) -> None:
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop())


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
