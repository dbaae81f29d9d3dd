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


def documented_names(reference: str) -> set[str]:
    """The names a table row documents (backticked in its first cell, the field column, or in
    an object's shape ``{a, b}`` in its second, the type column) and those a "Result:" line
    lists; a name mentioned elsewhere in a row documents nothing."""
    spans: list[str] = []
    for line in reference.split("\n"):
        if line.startswith("|"):
            cells = line.split("|")
            spans += re.findall(r"`([^`]+)`", cells[1])
            spans += [span for span in re.findall(r"`([^`]+)`", cells[2] if len(cells) > 2 else "") if span.startswith("{")]
        elif line.startswith("Result:"):
            spans += re.findall(r"`([^`]+)`", line)
    return {word for span in spans for word in re.findall(r"[a-z_]+", span)}


def test_a_name_counts_only_in_the_first_cell_of_a_row():
    reference = "| `alpha`, `beta.gamma` | `{eta, theta}` or `iota` | mentions `delta` |\nResult: `epsilon`\nprose `zeta`"
    assert documented_names(reference) == {"alpha", "beta", "gamma", "eta", "theta", "epsilon"}


def test_every_field_of_every_message_is_in_a_table_of_the_reference():
    documented = documented_names((REPO_ROOT / "docs" / "PROTOCOL.md").read_text())
    missing = sorted(
        f"{kind.__name__}.{field}" for kind in message_types() for field in kind.__struct_fields__ if field not in documented
    )
    assert missing == [], f"fields with no table row or Result line in docs/PROTOCOL.md: {missing}"
