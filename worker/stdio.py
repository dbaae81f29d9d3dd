"""Keep the protocol stream on a private descriptor that nothing else can write to."""

from __future__ import annotations

import os
import sys


def claim_stdout() -> int:
    """Move the real stdout to a private descriptor and point fd 1 at stderr.

    After this, a stray ``print`` or a C library writing to fd 1 lands on
    stderr; only the writer, holding the returned descriptor, reaches the host.
    The descriptor is not inherited by child processes.
    """
    sys.stdout.flush()
    private = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return private
