"""Quoting a server: the text of its answers as the worker's messages repeat it, shortened, and
without the API key, which never crosses the protocol (PROTOCOL 6.2, 22).

A server may put the request's Authorization header into what it answers (a 401 body that
echoes the request, an error event, a model name): the key then appears as it is, after
``Bearer ``, or base64-encoded (as in a Basic header, or a dump of the headers). Every form is
replaced before the text is shortened, so that no cut leaves a piece of the key behind.
"""

from __future__ import annotations

import base64

SHOWN = "[the API key]"
# An encoded form shorter than this is no evidence of the key (and would replace common text).
MIN_FORM_CHARS = 6


class Quoter:
    """Text from the server as the worker quotes it (``quote(text, limit)``)."""

    def __init__(self, api_key: str | None) -> None:
        self._forms = _forms(api_key) if api_key else []

    def __call__(self, text: str, limit: int = 1000) -> str:
        text = self.redact(text)
        return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"

    def redact(self, text: str) -> str:
        """``text`` with every form of the key replaced, whole."""
        for form in self._forms:
            text = text.replace(form, SHOWN)
        return text


def _forms(key: str) -> list[str]:
    """The key, and the characters of its base64 encoding that depend on the key's bytes alone,
    at each of the three alignments it may have in the encoded text around it (standard and
    URL-safe alphabets): whatever precedes it ("Bearer ", "user:"), the key's part of the
    encoding is one of these."""
    raw = key.encode()
    forms = {key}
    for shift in range(3):
        encoded = base64.b64encode(b"\0" * shift + raw).decode()
        # Characters before the first that holds no bit of the padding, up to the last whole group.
        core = encoded[-(-shift * 4 // 3) : (shift + len(raw)) // 3 * 4]
        forms.update((core, core.replace("+", "-").replace("/", "_")))
    # Longest first: a form inside another is replaced with it.
    return sorted((f for f in forms if f == key or len(f) >= MIN_FORM_CHARS), key=len, reverse=True)
