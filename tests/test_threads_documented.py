"""docs/ARCHITECTURE.md's table of threads, checked on the sources: it names every thread the
worker starts, and each module it puts on a thread says so in its docstring."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Threads the sources name that are no thread of a worker, each with the reason.
NOT_THE_WORKERS = {
    "lm-worker-main": "worker/host.py: stands in for the main thread of a worker run in the host's process",
}


def thread_rows() -> list[tuple[set[str], list[str]]]:
    """Each row of the table: the thread names in its first column, the modules in its second."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("\n## The threads\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = line.strip().strip("|").split("|")
        if line.startswith("|") and len(cells) == 3:
            names = set(re.findall(r"`(lm-worker-[\w-]+)`", cells[0]))
            if names:
                rows.append((names, re.findall(r"`([\w/]+\.py)`", cells[1])))
    return rows


def test_the_table_names_every_thread_the_worker_starts():
    started = set()
    for path in (ROOT / "worker").rglob("*.py"):
        started |= set(re.findall(r'(?:name|thread_name_prefix)="(lm-worker-[\w-]+)"', path.read_text()))
    documented = set().union(*(names for names, _ in thread_rows()))
    assert started - NOT_THE_WORKERS.keys() == documented


def test_each_module_the_table_puts_on_a_thread_names_that_thread_in_its_docstring():
    rows = thread_rows()
    assert all(modules for _, modules in rows), "every thread's row names the code it runs"
    for names, modules in rows:
        for module in modules:
            docstring = ast.get_docstring(ast.parse((ROOT / "worker" / module).read_text())) or ""
            assert any(f"``{name}``" in docstring for name in names), f"worker/{module} does not say it runs on {names}"
