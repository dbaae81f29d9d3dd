"""The README's AI SDK example on the default model (SmolLM2), run as written with the pinned `ai`
package: a real model answers, reuses its cache on the second turn, calls the weather tool for
Paris, and fills the schema's object. (client/test runs the same example on the tiny model.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import TORCH_ENV
from worker.host import REPO_ROOT

pytestmark = pytest.mark.slow


def readme_example() -> str:
    readme = (REPO_ROOT / "README.md").read_text()
    found = re.search(r"\n## Using it from the AI SDK\n.*?```js\n(.*?)```", readme, re.S)
    assert found, 'the README\'s "Using it from the AI SDK" section has a ```js example'
    return found.group(1)


def test_the_readme_ai_sdk_example_on_smollm2_calls_the_tool_and_fills_the_object():
    node = shutil.which("node")
    assert node, "Node is needed for the AI SDK (make test installs the npm packages)"
    # Inside the package, so that `lm-worker/ai-sdk` resolves to this package by its name.
    script = REPO_ROOT / "client" / "dist" / "readme-ai-sdk-smollm2.mjs"
    script.write_text(readme_example())
    env = {
        **os.environ,
        **TORCH_ENV,
        "LM_WORKER_PYTHON": sys.executable,
        "LM_WORKER_MODEL": "default",
    }
    try:
        run = subprocess.run([node, str(script)], env=env, capture_output=True, text=True, timeout=900)
    finally:
        script.unlink()
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert re.search(r"Paris", out), out
    reused = re.search(r"^\[(\d+) of (\d+) input tokens from the cache\]$", out, re.M)
    assert reused and int(reused.group(1)) > 0, out
    assert re.search(r'^weather\(\{"city":"Paris"\}\) returned ', out, re.M), out
    assert re.search(r"born: \d{4},\s+movement: '(renaissance|baroque|impressionism|cubism|other)'", out), out
