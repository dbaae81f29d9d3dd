"""docs/PROTOCOL.md names every field of every message, in a table row or a method's "Result:"
line: a field added to protocol/methods.py without its line in the reference fails here."""

from __future__ import annotations

import re
import typing

import msgspec

from protocol.methods import HOST_NOTIFICATIONS, METHODS, WORKER_NOTIFICATIONS
from worker.host import REPO_ROOT


def message_types() -> set[type[msgspec.Struct]]:
    """Every Struct a message is made of: params, results, notifications and what they hold."""
    found: set[type[msgspec.Struct]] = set()
    todo: list = [spec.params for spec in METHODS.values()] + [spec.result for spec in METHODS.values()]
    todo += [*HOST_NOTIFICATIONS.values(), *WORKER_NOTIFICATIONS.values()]
    while todo:
        kind = todo.pop()
        if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            if kind not in found:
                found.add(kind)
                todo.extend(typing.get_type_hints(kind, include_extras=True).values())
        else:
            todo.extend(typing.get_args(kind))
    return found


def test_every_field_of_every_message_is_in_a_table_of_the_reference():
    lines = (REPO_ROOT / "docs" / "PROTOCOL.md").read_text().split("\n")
    rows = "\n".join(line for line in lines if line.startswith(("|", "Result:")))
    documented = {word for span in re.findall(r"`([^`]+)`", rows) for word in re.findall(r"[a-z_]+", span)}
    missing = sorted(
        f"{kind.__name__}.{field}" for kind in message_types() for field in kind.__struct_fields__ if field not in documented
    )
    assert missing == [], f"fields with no table row or Result line in docs/PROTOCOL.md: {missing}"
