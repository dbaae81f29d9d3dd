"""Every example exchange in docs/PROTOCOL.md, run against a real worker: the reference cannot
drift from the code.

An example is a fenced block with lines `→ {request}` (sent to the worker) and `← {message}`
(what the worker writes, in order). The line just before the block says how to run it:

    <!-- example: [worker flags] [load=echo|load=echo:DELAY_MS] [model=tinydoc|tinythink] [cache-dir=kvdoc]
                  [data-dir=NAME] [plugin=slow] [gap=SECONDS] [per-request] [stdout-next] [slow] -->

- a `→` line is sent once every `←` line above it has arrived (so the block shows what a host
  saw before it sent each line); `gap` waits that long before a `→` line that follows another;
- `→ (end of input: stdin closed)` closes stdin, `(worker exited with code N)` waits for the exit,
  `(a new worker, started with the same command line)` starts another worker;
- `load=echo` loads the echo backend first (its answer is not part of the example);
  `model=tinydoc` builds the tiny model in a directory named tinydoc and stands it in for
  `/tmp/tinydoc` (`model=tinythink`: the same with a reasoning model's chat template, for
  `/tmp/tinythink`), `cache-dir=kvdoc` gives a cache directory that stands in for `/tmp/kvdoc`
  (kept for the examples after it), `data-dir=NAME` gives the worker a data directory of the
  example's own, empty, `plugin=slow` installs a backend that sleeps 1 s in `load`;
- `stdout-next`: the expected output is the next fenced block (a worker's stdout, or one message
  pretty-printed as JSON); `slow`: the example needs the default model (the slow tier);
- `per-request`: each request's messages are compared in order, not how the requests' messages
  interleave (which step a request that arrives beside a running one joins depends on timing);
- in expected lines, `…` stands for anything.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import pytest

from tests.conftest import TORCH_ENV, install_plugin
from tests.test_e2e_protocol import SLOW_LOADING_BACKEND
from worker.host import REPO_ROOT, Host

DOC = REPO_ROOT / "docs" / "PROTOCOL.md"
ANNOTATION = re.compile(r"<!-- example:(.*)-->")
REQUEST_ID = re.compile(r'"id":(-?\d+|"[^"]*")')
EXITED = re.compile(r"\(worker exited with code (\d+)\)")
END_OF_INPUT = "(end of input: stdin closed)"
NEW_WORKER = "(a new worker, started with the same command line)"


class Example(NamedTuple):
    line: int  # of the opening fence, from 1
    body: list[str]
    annotation: str | None
    next_block: list[str]
    next_language: str


def read_examples() -> list[Example]:
    lines = DOC.read_text().split("\n")
    fences = [i for i, line in enumerate(lines) if line.startswith("```")]
    blocks = list(zip(fences[::2], fences[1::2]))
    examples = []
    for index, (start, end) in enumerate(blocks):
        body = lines[start + 1 : end]
        if not any(line.startswith(("→ ", "← ")) for line in body):
            continue
        before = next((lines[i] for i in range(start - 1, -1, -1) if lines[i].strip()), "")
        found = ANNOTATION.fullmatch(before.strip())
        following = blocks[index + 1] if index + 1 < len(blocks) else (end, end)
        examples.append(
            Example(
                line=start + 1,
                body=body,
                annotation=found.group(1).strip() if found else None,
                next_block=lines[following[0] + 1 : following[1]],
                next_language=lines[following[0]][3:].strip(),
            )
        )
    return examples


EXAMPLES = read_examples()


def options(example: Example) -> tuple[list[str], dict[str, str]]:
    """The worker flags and the other options of an example's annotation."""
    flags, named = [], {}
    for token in shlex.split(example.annotation or ""):
        key, sep, value = token.partition("=")
        if sep and not key.startswith("--"):
            named[key] = value
        elif token in ("stdout-next", "slow", "per-request"):
            named[token] = "yes"
        else:
            flags.append(token)
    return flags, named


def by_request(lines: list[str]) -> list[str]:
    """The messages grouped by the request they belong to, each group in its order."""

    def request(line: str) -> str:  # a reply's own id or a notification's params.id comes first
        found = REQUEST_ID.search(line)
        return found.group(1) if found else ""

    return sorted(lines, key=request)  # sorted() is stable: order within a request is kept


def matches(expected: str, actual: str) -> bool:
    pattern = ".*?".join(re.escape(part) for part in expected.split("…"))
    return re.fullmatch(pattern, actual, re.DOTALL) is not None


def matches_json(expected: Any, actual: Any) -> bool:
    if expected == "…":
        return True
    if isinstance(expected, dict):
        return isinstance(actual, dict) and list(expected) == list(actual) and all(
            matches_json(value, actual[key]) for key, value in expected.items()
        )
    if isinstance(expected, list):
        return isinstance(actual, list) and len(expected) == len(actual) and all(
            matches_json(e, a) for e, a in zip(expected, actual)
        )
    return expected == actual


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory, tiny_models, tiny_thinking_model) -> dict[str, Path]:
    """Where the examples' /tmp/tinydoc, /tmp/tinythink and /tmp/kvdoc are, shared by the examples in order."""
    import shutil

    root = tmp_path_factory.mktemp("protocol-examples")
    shutil.copytree(tiny_models("llama"), root / "tinydoc")
    shutil.copytree(tiny_thinking_model, root / "tinythink")
    return {
        "/tmp/tinydoc": root / "tinydoc", "/tmp/tinythink": root / "tinythink", "/tmp/kvdoc": root / "kvdoc",
        "plugins": root / "plugins",
    }


def test_every_example_says_how_it_is_run():
    unannotated = [example.line for example in EXAMPLES if example.annotation is None]
    assert unannotated == [], f"examples of docs/PROTOCOL.md without an '<!-- example: ... -->' line: {unannotated}"


@pytest.mark.parametrize(
    "example",
    [pytest.param(e, marks=[pytest.mark.slow] if "slow" in options(e)[1] else []) for e in EXAMPLES],
    ids=[f"line-{e.line}" for e in EXAMPLES],
)
async def test_the_example_is_what_the_worker_answers(example: Example, places: dict[str, Path], tmp_path: Path):
    flags, named = options(example)

    def local(text: str) -> str:
        for doc_path in ("/tmp/tinydoc", "/tmp/tinythink", "/tmp/kvdoc"):
            text = text.replace(doc_path, str(places[doc_path]))
        return text

    if "cache-dir" in named:
        flags += ["--cache-dir", str(places["/tmp/kvdoc"])]
    if "data-dir" in named:
        flags += ["--data-dir", str(tmp_path / named["data-dir"])]
    env = dict(TORCH_ENV)
    if named.get("plugin") == "slow":
        places["plugins"].mkdir(exist_ok=True)
        env.update(install_plugin(places["plugins"], "slow_backend", SLOW_LOADING_BACKEND, {"slow": "slow_backend:Slow"}))
    gap = float(named.get("gap", "0"))

    received: list[dict[str, Any]] = []
    host: Host | None = None

    async def start() -> Host:
        worker = await Host.spawn(*flags, env=env)
        if named.get("load", "").startswith("echo"):
            delay = named["load"].partition(":")[2]
            params = {"backend": "echo", **({"token_delay_ms": float(delay)} if delay else {})}
            await worker.call("load", params)
            worker.messages.clear()
            worker.arrival_times.clear()
        return worker

    async def finish(worker: Host) -> None:
        received.extend(worker.messages)
        if worker.process.returncode is None:
            await worker.close()

    expected = [local(line[2:]) for line in example.body if line.startswith("← ")]
    seen = 0  # expected lines above the current one
    host = await start()
    try:
        previous_was_sent = False
        for line in example.body:
            if line.startswith("← "):
                seen += 1
                previous_was_sent = False
                continue
            if line.startswith("→ "):
                await host.wait_until(lambda: len(received) + len(host.messages) >= seen, timeout=60)
                if previous_was_sent and gap:
                    import asyncio

                    await asyncio.sleep(gap)
                text = line[2:]
                if text == END_OF_INPUT:
                    await host.close_stdin()
                else:
                    await host.send_raw(local(text).encode() + b"\n")
                previous_was_sent = True
            elif exited := EXITED.fullmatch(line):
                assert await host.wait(30) == int(exited.group(1)), host.stderr_tail()
            elif line == NEW_WORKER:
                await finish(host)
                host = await start()
        if "stdout-next" in named:
            await host.close_stdin()
            await host.wait(60)
        else:
            await host.wait_until(lambda: len(received) + len(host.messages) >= len(expected), timeout=60)
    finally:
        await finish(host)
    if "stdout-next" in named and example.next_language == "json":
        document = "\n".join(example.next_block).replace(": …", ': "…"')
        assert len(received) == 1 and matches_json(json.loads(local(document)), received[0]), received
        return
    if "stdout-next" in named:
        expected = [local(line) for line in example.next_block]
    actual = [msgspec.json.encode(message).decode() for message in received[: len(expected)]]
    assert len(actual) == len(expected), f"{len(actual)} messages, the example shows {len(expected)}: {actual}"
    if "per-request" in named:
        expected, actual = by_request(expected), by_request(actual)
    for number, (want, got) in enumerate(zip(expected, actual), 1):
        assert matches(want, got), f"message {number} of the example at line {example.line}:\n{want}\n{got}"
