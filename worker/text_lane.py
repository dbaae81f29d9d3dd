"""The text lane: ``tokenize``, ``detokenize`` and ``render`` run here in order, so that a huge
one delays neither the reading of a ``cancel`` nor a generation.

Threads: one, ``lm-worker-text``: it waits on the session for its next job and runs it to its
answer, until the session is ending and its queue is empty.
"""

from __future__ import annotations

import threading

from worker.locked_session import LockedSession
from worker.responder import Responder


class TextLane:
    def __init__(self, session: LockedSession, responder: Responder) -> None:
        self._session = session
        self._responder = responder
        self.thread = threading.Thread(target=self._run, name="lm-worker-text", daemon=True)

    def _run(self) -> None:
        while (job := self._session.next_text_job()) is not None:
            self._responder.run(job)
