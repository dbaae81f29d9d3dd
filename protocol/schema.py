"""Generate ``schemas/`` (JSON Schema of every message body) from protocol.methods.

    python -m protocol.schema schemas          # write
    python -m protocol.schema schemas --check  # exit 1 if the files are stale

One file per method's params and result and per notification's params, each
self-contained, plus ``index.json`` that maps the wire names to the files and
every error kind to its code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import msgspec

from protocol.errors import CODES, ErrorKind
from protocol.methods import HOST_NOTIFICATIONS, METHODS, PROTOCOL_VERSION, WORKER_NOTIFICATIONS


def _file_stem(name: str) -> str:
    return name.replace("$/", "").replace("/", ".")


def _schema(tp: Any, title: str) -> dict[str, Any]:
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": title, **msgspec.json.schema(tp)}


def build() -> dict[str, dict[str, Any]]:
    """File name → schema document."""
    files: dict[str, dict[str, Any]] = {}
    index: dict[str, Any] = {"protocol_version": PROTOCOL_VERSION, "methods": {}, "notifications": {}}
    for name, spec in METHODS.items():
        stem = _file_stem(name)
        files[f"{stem}.params.json"] = _schema(spec.params, f"{name} params")
        files[f"{stem}.result.json"] = _schema(spec.result, f"{name} result")
        index["methods"][name] = {
            "summary": spec.summary,
            "params": f"{stem}.params.json",
            "result": f"{stem}.result.json",
        }
    for direction, table in (("host_to_worker", HOST_NOTIFICATIONS), ("worker_to_host", WORKER_NOTIFICATIONS)):
        for name, params in table.items():
            stem = _file_stem(name)
            files[f"{stem}.notification.json"] = _schema(params, f"{name} notification params")
            index["notifications"][name] = {"direction": direction, "params": f"{stem}.notification.json"}
    # Every error kind (`error.data.kind`) with its code, so that hosts can type and branch on them.
    index["errors"] = {kind.value: CODES[kind] for kind in ErrorKind}
    files["index.json"] = index
    return files


def render(files: dict[str, dict[str, Any]]) -> dict[str, bytes]:
    return {name: msgspec.json.format(msgspec.json.encode(doc), indent=2) + b"\n" for name, doc in files.items()}


def stale(directory: Path) -> list[str]:
    """Names of files that are missing, different or extra in ``directory``."""
    wanted = render(build())
    present: set[str] = {p.name for p in directory.glob("*.json")} if directory.is_dir() else set()
    problems = [name for name, data in wanted.items() if not (directory / name).is_file() or (directory / name).read_bytes() != data]
    problems += sorted(present - wanted.keys())
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protocol.schema", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--check", action="store_true", help="report stale files instead of writing")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale(args.directory)
        for name in problems:
            print(f"stale: {args.directory / name}", file=sys.stderr)
        if problems:
            print(f"run: python -m protocol.schema {args.directory}", file=sys.stderr)
        return 1 if problems else 0
    args.directory.mkdir(parents=True, exist_ok=True)
    for path in args.directory.glob("*.json"):
        path.unlink()
    for name, data in render(build()).items():
        (args.directory / name).write_bytes(data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
