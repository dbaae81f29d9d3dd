"""Keep the protocol stream on a private descriptor that nothing else can write to, and keep
log output from ever making the worker wait.

Threads: ``claim_stdout`` runs on the main thread at start; the stderr pump's two threads
(``lm-worker-stderr-drain`` empties the pipe, ``lm-worker-stderr`` writes to the real stderr)
run until the worker exits.
"""

from __future__ import annotations

import os
import sys
import threading

# Log output buffered while the host does not read stderr; beyond it, output is dropped.
STDERR_BUFFER_BYTES = 1 << 20
# How long an exiting worker waits for the host to take the log output still buffered.
STDERR_GRACE_S = 1.0


def claim_stdout() -> tuple[int, StderrPump]:
    """Move the real stdout to a private descriptor; fd 1 and fd 2 become a pipe that
    ``StderrPump`` drains to the real stderr.

    After this, a stray ``print`` or a C library writing to fd 1 lands on stderr; only the
    writer, holding the returned descriptor, reaches the host. The descriptor is not
    inherited by child processes.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    private = os.dup(1)
    pump = StderrPump(os.dup(2))
    sys.stdout = sys.stderr
    report = sys.excepthook

    def report_then_flush(*args) -> None:  # a crash's traceback reaches the host before the exit
        report(*args)
        pump.close(STDERR_GRACE_S)

    sys.excepthook = report_then_flush
    _report_fatal_signals(pump.real_stderr)
    return private, pump


def _report_fatal_signals(real_stderr: int) -> None:
    """Python's report of a fatal signal (SIGBUS: a mapped model file cut short or rewritten in
    place under the worker; SIGSEGV) and where each thread was, written straight to the real
    stderr: once such a signal arrives the pump's threads never run again. Through an open
    file description of its own, which never blocks (a dying worker must not wait for a host
    that does not read stderr) and appends (a log file is not written over)."""
    import faulthandler

    try:
        fd = os.open(f"/proc/self/fd/{real_stderr}", os.O_WRONLY | os.O_NONBLOCK | os.O_APPEND | os.O_CLOEXEC)
    except OSError:  # no /proc, or a socket (which cannot be opened again): no report
        return
    faulthandler.enable(file=fd, all_threads=True)


class StderrPump:
    """Whatever the process writes to fd 1 or fd 2 (logs, warnings, C libraries) goes into a
    pipe that one thread always drains into a bounded buffer, and another thread writes that
    buffer to the real stderr. A host that never reads stderr fills the buffer, not the
    pipe: what does not fit is dropped and counted (said once the host reads again), and
    nothing that logs ever waits for the host."""

    def __init__(self, real_stderr: int, capacity: int = STDERR_BUFFER_BYTES) -> None:
        self.real_stderr = real_stderr
        self._capacity = capacity
        self._buffer = bytearray()
        self._dropped = 0  # bytes
        self._ended = False  # the pipe's write ends are all closed
        self._closed = False
        self._lock = threading.Condition()
        read_end, write_end = os.pipe()
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        self._read_end = read_end
        self._written = threading.Event()  # everything was written out after the end
        threading.Thread(target=self._drain, name="lm-worker-stderr-drain", daemon=True).start()
        threading.Thread(target=self._write, name="lm-worker-stderr", daemon=True).start()

    def close(self, timeout: float) -> None:
        """Write out what is buffered, waiting at most ``timeout``; later output goes straight to
        the real stderr if the host took everything, else nowhere (so that exiting never waits)."""
        if self._closed:
            return
        self._closed = True
        sys.stdout.flush()
        sys.stderr.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)  # the last write ends: the drain sees the end of the pipe
        os.dup2(null, 2)
        os.close(null)
        if self._written.wait(timeout):
            os.dup2(self.real_stderr, 1)
            os.dup2(self.real_stderr, 2)

    def _drain(self) -> None:
        while data := os.read(self._read_end, 1 << 16):
            with self._lock:
                # Once dropping, drop until the buffer was written out: the gap stays one gap.
                if self._dropped or len(self._buffer) + len(data) > self._capacity:
                    self._dropped += len(data)
                else:
                    self._buffer += data
                    self._lock.notify()
        os.close(self._read_end)
        with self._lock:
            self._ended = True
            self._lock.notify()

    def _write(self) -> None:
        while True:
            with self._lock:
                while not self._buffer and not self._ended:
                    self._lock.wait()
                data, self._buffer = bytes(self._buffer), bytearray()
                dropped, self._dropped = self._dropped, 0
                ended = self._ended
            if dropped:
                data += b"lm-worker WARNING worker.stdio: %d bytes of log output were dropped: " \
                        b"the host did not read stderr\n" % dropped
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.real_stderr, view) :]
            except OSError:  # stderr closed: keep draining, into nothing
                pass
            if ended:
                self._written.set()
                return
