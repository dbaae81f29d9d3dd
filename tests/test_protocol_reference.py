"""docs/PROTOCOL.md names every field of every message where that message is described: a
method's params and result fields in the method's own section (6.N), a notification's in its
own (7), and the fields of a type a message holds either there or in the type's own table
(ChatMessage, ToolCall, CacheUse...). A field added to protocol/methods.py without its line,
or documented only under another message, fails here."""

from __future__ import annotations

import re
import typing

import msgspec

from protocol.methods import HOST_NOTIFICATIONS, METHODS, WORKER_NOTIFICATIONS
from worker.host import REPO_ROOT

Struct = type[msgspec.Struct]


def documented_names(reference: str) -> set[str]:
    """The names a table row documents (backticked in its first cell, the field column, or in
    an object's shape ``{a, b}`` in its second, the type column) and those a "Result:" line
    lists; a name mentioned elsewhere in a row documents nothing."""
    spans: list[str] = []
    for line in reference.split("\n"):
        if line.startswith("|"):
            cells = re.split(r"(?<!\\)\|", line)  # "\|" is a pipe inside a cell
            spans += re.findall(r"`([^`]+)`", cells[1])
            spans += [span for span in re.findall(r"`([^`]+)`", cells[2] if len(cells) > 2 else "") if span.startswith("{")]
        elif line.startswith("Result:"):
            spans += re.findall(r"`([^`]+)`", line)
    return {word for span in spans for word in re.findall(r"[a-z_]+", span)}


def prose_lines(reference: str) -> list[str]:
    """The reference's lines with those of fenced code blocks blanked (a ``#`` in a block of
    TOML or shell is no heading)."""
    lines, fenced = [], False
    for line in reference.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return lines


def sections(reference: str) -> dict[str, str]:
    """The text under each heading that is a name alone, up to the next heading: "### 6.9
    cache/list" is ``cache/list``'s, "### generate/chunk (worker → host)" is
    ``generate/chunk``'s; "## 8. generate in detail" is no message's."""
    found: dict[str, list[str]] = {}
    current: list[str] = []
    for line in prose_lines(reference):
        if line.startswith("#"):
            heading = re.fullmatch(r"#+\s+(?:[\d.]+\s+)?(\S+)(?:\s+\(.*\))?\s*", line)
            current = found.setdefault(heading.group(1), []) if heading else []
        else:
            current.append(line)
    return {name: "\n".join(lines) for name, lines in found.items()}


def type_tables(reference: str) -> dict[str, str]:
    """Tables that describe one type, by the type's name: those whose label (the line above
    the table) starts with the name, or names it in bold: "ChatMessage (unknown fields
    refused):", "Result (**CacheInfo**):", "**ToolCall** (in the result's ...):"."""
    tables: dict[str, str] = {}
    lines = prose_lines(reference)
    for index, line in enumerate(lines):
        if not line.startswith("|") or (index > 0 and lines[index - 1].startswith("|")):
            continue
        label = next((above for above in reversed(lines[:index]) if above.strip()), "")
        name = re.search(r"\*\*([A-Z]\w*)\*\*", label) or re.match(r"([A-Z][a-z]+[A-Z]\w*|[A-Z][a-z]+)\b[^|]*:$", label)
        if name:
            end = next((i for i, row in enumerate(lines[index:]) if not row.startswith("|")), len(lines) - index)
            rows = lines[index : index + end]
            tables[name.group(1)] = tables.get(name.group(1), "") + "\n".join(rows) + "\n"
    return tables


def structs_in(hint: typing.Any) -> list[Struct]:
    """The Structs a field's type holds: ``list[ChatMessage] | None`` holds ChatMessage."""
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
        return [hint]
    return [kind for arg in typing.get_args(hint) for kind in structs_in(arg)]


def messages() -> dict[str, list[Struct]]:
    """Every method and notification, with the Structs it sends: params and result (a result of
    null, None or NoneType, has no fields)."""
    found: dict[str, list[Struct]] = {
        name: [kind for kind in (spec.params, spec.result) if structs_in(kind) == [kind]] for name, spec in METHODS.items()
    }
    found.update({name: [kind] for name, kind in {**HOST_NOTIFICATIONS, **WORKER_NOTIFICATIONS}.items()})
    return found


def undocumented(reference: str, sent: dict[str, list[Struct]]) -> list[str]:
    """``message: Type.field`` for each field the reference does not document where it should:
    in the message's own section, or, for a type with a table of its own, in that table (the
    types it holds then in that table too)."""
    by_name, tables = sections(reference), type_tables(reference)
    missing: list[str] = []
    checked: set[tuple[Struct, str]] = set()

    def check(message: str, kind: Struct, context: str) -> None:
        if kind.__name__ in tables:
            context = tables[kind.__name__]
        if (kind, context) in checked:
            return
        checked.add((kind, context))
        names = documented_names(context)
        hints = typing.get_type_hints(kind, include_extras=True)
        for field in kind.__struct_fields__:
            if field not in names:
                missing.append(f"{message}: {kind.__name__}.{field}")
            for inner in structs_in(hints[field]):
                check(message, inner, context)

    for message, kinds in sent.items():
        if message not in by_name:
            missing.append(f"{message}: no section")
            continue
        for kind in kinds:
            check(message, kind, by_name[message])
    return missing


def test_a_name_counts_only_in_the_first_cell_of_a_row():
    reference = (
        "| `alpha`, `beta.gamma` | `{eta, theta}` or `iota` \\| `{kappa}` | mentions `delta` |\n"
        "Result: `epsilon`\nprose `zeta`"
    )
    assert documented_names(reference) == {"alpha", "beta", "gamma", "eta", "theta", "kappa", "epsilon"}


class Inner(msgspec.Struct):
    depth: int


class Ping(msgspec.Struct):
    alpha: int


class Pong(msgspec.Struct):
    beta: int
    inner: Inner


_DOCTORED = """## 6. Methods

### 6.1 ping

| param | type | default | meaning |
| --- | --- | --- | --- |
| `alpha` | integer | — | |

Inner:

| field | type | meaning |
| --- | --- | --- |
| `depth` | integer | |

### 6.2 pong

Result: `beta`, `inner`.
"""


def test_the_checker_wants_each_field_in_its_own_message_s_section():
    assert undocumented(_DOCTORED, {"ping": [Ping], "pong": [Pong]}) == []
    # alpha is documented, but under ping: pong's own section must name it.
    assert undocumented(_DOCTORED, {"ping": [Ping], "pong": [Pong, Ping]}) == ["pong: Ping.alpha"]
    # Inner's own table counts wherever Inner is held; the same rows without the label are ping's.
    without_table = _DOCTORED.replace("Inner:", "What it holds:")
    assert undocumented(without_table, {"pong": [Pong]}) == ["pong: Inner.depth"]
    assert undocumented(_DOCTORED, {"ping": [Ping], "missing": [Ping]}) == ["missing: no section"]


def test_the_checker_reads_the_reference_s_sections_and_type_tables():
    reference = (REPO_ROOT / "docs" / "PROTOCOL.md").read_text()
    assert set(messages()) <= set(sections(reference)) and len(messages()) > 15
    assert {"ChatMessage", "Tool", "ToolCall", "CacheUse", "CacheInfo", "ModelInfo", "ModelEntry"} <= set(type_tables(reference))
    assert "pyproject.toml" not in sections(reference), "a heading inside a code block"
    assert sections("### 6.7 generate\nparams\n## 8. generate in detail\nmore\n") == {"generate": "params"}


def test_a_field_of_the_reference_documented_only_under_another_message_fails():
    """tokenize's ``count`` taken out of its Result line: render's still names a ``count``."""
    reference = (REPO_ROOT / "docs" / "PROTOCOL.md").read_text()
    line = "Result: `tokens` (array of integers), `count` (its length)."
    assert reference.count(line) == 1
    doctored = reference.replace(line, "Result: `tokens` (array of integers), and its length.")
    assert "count" in documented_names(doctored)
    assert undocumented(doctored, messages()) == ["tokenize: TokenizeResult.count"]


def test_every_field_of_every_message_is_in_its_own_section_of_the_reference():
    missing = undocumented((REPO_ROOT / "docs" / "PROTOCOL.md").read_text(), messages())
    assert missing == [], f"fields docs/PROTOCOL.md does not document where their message is: {missing}"
