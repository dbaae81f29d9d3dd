"""The backend registry: built-in backends by import path, third-party ones by entry point.

A package adds a backend by declaring an entry point in the group
``lm_worker.backends`` whose object is a class implementing
:class:`worker.backends.base.Backend`. Nothing is imported until a backend is
described or used, so ``capabilities`` stays fast.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

from protocol.errors import ErrorKind, RpcError
from protocol.methods import BackendInfo
from worker.backends.base import Backend

ENTRY_POINT_GROUP = "lm_worker.backends"
BUILTIN: dict[str, str] = {
    "echo": "worker.backends.echo:EchoBackend",
    "openai": "worker.backends.openai.backend:OpenAIBackend",
    "transformers": "worker.backends.transformers.backend:TransformersBackend",
}

log = logging.getLogger(__name__)


class Registry:
    def __init__(self, builtin: dict[str, str] | None = None, *, entry_points: bool = True) -> None:
        self._targets = dict(BUILTIN if builtin is None else builtin)
        self._scan_entry_points = entry_points
        self._instances: dict[str, Backend] = {}
        self._failures: dict[str, str] = {}

    def names(self) -> list[str]:
        self._scan()
        return sorted(self._targets)

    def describe(self) -> list[BackendInfo]:
        infos = []
        for name in self.names():
            try:
                backend = self._instance(name)
            except RpcError as exc:
                infos.append(BackendInfo(name=name, description="", available=False, reason=exc.message))
                continue
            reason = backend.unavailable_reason()
            infos.append(
                BackendInfo(name=name, description=backend.description, available=reason is None, reason=reason)
            )
        return infos

    def get(self, name: str) -> Backend:
        if name not in self.names():
            raise RpcError(
                ErrorKind.BACKEND_NOT_FOUND,
                f"Unknown backend {name!r}; load with one of: {', '.join(self.names())}.",
                field="params.backend",
            )
        backend = self._instance(name)
        reason = backend.unavailable_reason()
        if reason is not None:
            raise RpcError(ErrorKind.BACKEND_UNAVAILABLE, f"Backend {name!r} is not available: {reason}")
        return backend

    def _scan(self) -> None:
        if not self._scan_entry_points:
            return
        self._scan_entry_points = False
        for name, target in _plugin_entry_points():
            if name in self._targets:
                log.warning("entry point backend %r ignored: the name is taken", name)
                continue
            self._targets[name] = target

    def _instance(self, name: str) -> Backend:
        if name in self._instances:
            return self._instances[name]
        if name in self._failures:
            raise RpcError(ErrorKind.BACKEND_UNAVAILABLE, self._failures[name])
        module_name, _, attr = self._targets[name].partition(":")
        try:
            backend = getattr(importlib.import_module(module_name), attr)()
        except Exception as exc:  # a broken plug-in must not take the worker down
            self._failures[name] = f"Backend {name!r} failed to import from {self._targets[name]}: {exc!r}"
            log.exception("backend %r failed to import", name)
            raise RpcError(ErrorKind.BACKEND_UNAVAILABLE, self._failures[name]) from exc
        self._instances[name] = backend
        return backend


def _plugin_entry_points() -> list[tuple[str, str]]:
    """(name, "module:attr") for each backend that an installed distribution declares.

    importlib.metadata is slow to import, a large share of the start-up time (bench/README.md,
    "Figures behind constants"), so it is used only when some distribution's
    entry_points.txt names the group.
    """
    marker = f"[{ENTRY_POINT_GROUP}]"
    for entry in sys.path:
        try:
            names = [e.name for e in os.scandir(entry or ".") if e.name.endswith((".dist-info", ".egg-info"))]
        except OSError:
            continue
        for name in names:
            try:
                with open(os.path.join(entry or ".", name, "entry_points.txt"), encoding="utf-8") as file:
                    if marker not in file.read():
                        continue
            except OSError:
                continue
            from importlib import metadata

            return [(ep.name, ep.value) for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)]
    return []
