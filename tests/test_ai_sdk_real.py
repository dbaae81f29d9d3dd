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


STREAM_WITH_A_TOOL = """
import { streamText, tool } from "ai";
import { z } from "zod";
import { createLmWorker } from "lm-worker/ai-sdk";

// The same provider, a model on vLLM: only the load params differ.
const lm = createLmWorker({
  workerOptions: { args: ["--log-level", "warning"] },
  load: { backend: "openai", base_url: process.env.VLLM_URL, api_key_env: process.env.VLLM_KEY_ENV },
});
const model = lm("smollm2");
try {
  const weather = tool({
    description: "The weather forecast for a city",
    inputSchema: z.object({ city: z.string().max(20) }),
    execute: async ({ city }) => ({ city, forecast: "sunny" }),
  });
  const result = streamText({
    model, prompt: "What is the weather in Paris?", tools: { weather }, toolChoice: "required", maxOutputTokens: 60,
  });
  for await (const part of result.fullStream) {
    if (part.type === "tool-call") console.log(`call ${part.toolName} ${JSON.stringify(part.input)}`);
    if (part.type === "tool-result") console.log(`result ${JSON.stringify(part.output)}`);
  }
  console.log(`finish ${await result.finishReason}`);
} finally {
  await lm.close();
}
"""


def test_stream_text_with_a_tool_through_the_provider_on_vllm(vllm_url: str):
    from tests import engine_server

    node = shutil.which("node")
    assert node, "Node is needed for the AI SDK (make test installs the npm packages)"
    script = REPO_ROOT / "client" / "dist" / "ai-sdk-vllm-tool.mjs"
    script.write_text(STREAM_WITH_A_TOOL)
    env = {**os.environ, "LM_WORKER_PYTHON": sys.executable, "VLLM_URL": vllm_url,
           "VLLM_KEY_ENV": engine_server.API_KEY_ENV}
    try:
        run = subprocess.run([node, str(script)], env=env, capture_output=True, text=True, timeout=600)
    finally:
        script.unlink()
    assert run.returncode == 0, run.stderr[-3000:]
    call = re.search(r'^call weather \{"city":"([^"]*)"\}$', run.stdout, re.M)
    assert call, run.stdout
    assert f'result {{"city":"{call.group(1)}","forecast":"sunny"}}' in run.stdout
    assert "finish tool-calls" in run.stdout, run.stdout
