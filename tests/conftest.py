"""Shared fixtures: workers spawned as real subprocesses over real pipes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from worker.host import Host

SpawnWorker = Callable[..., Awaitable[Host]]


@pytest.fixture
async def spawn_worker() -> AsyncIterator[SpawnWorker]:
    """Spawn ``python -m worker`` with the given arguments; every worker is reaped after the test."""
    hosts: list[Host] = []

    async def spawn(*args: str, **kwargs) -> Host:
        host = await Host.spawn(*args, **kwargs)
        hosts.append(host)
        return host

    yield spawn
    for host in hosts:
        if host.process.returncode is None:
            host.process.kill()
        await host.process.wait()
        assert not host.malformed, f"the worker wrote malformed output: {host.malformed}"


@pytest.fixture
async def echo_worker(spawn_worker: SpawnWorker) -> Host:
    """A worker with the echo backend loaded."""
    host = await spawn_worker()
    await host.call("load", {"backend": "echo"})
    return host
