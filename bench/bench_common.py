"""Small helpers the benchmarks share."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def cpu_pressure_us() -> int | None:
    """Linux PSI: total microseconds some runnable task waited for a CPU (None elsewhere).
    Over a run it shows how much the run was crowded, by its own threads or anyone else's."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


def cpu_pressure_since(start: int | None) -> float | None:
    """Seconds some task waited for a CPU since ``start`` (a cpu_pressure_us reading)."""
    now = cpu_pressure_us()
    return None if start is None or now is None else (now - start) / 1e6


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def write_report(path: str, report: dict[str, Any]) -> None:
    """The figures as JSON (``--json``), for comparing runs."""
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
