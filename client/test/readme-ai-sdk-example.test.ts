// The README's AI SDK example, run as written (on the tiny model) through the package's own
// name, as a Node project that installed it with `ai` and `zod` would.

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { promisify } from "node:util";

import { python, repoRoot, tinyModel, workerEnv } from "./support.js";

async function readmeExample(): Promise<string> {
  const readme = await readFile(join(repoRoot, "README.md"), "utf8");
  const match = /\n## Using it from the AI SDK\n[\s\S]*?```js\n([\s\S]*?)```/.exec(readme);
  assert.ok(match, 'the README\'s "Using it from the AI SDK" section has a ```js example');
  return match[1]!;
}

test("the README's AI SDK example runs as written: a stream, a cached turn, a tool call, an object", async () => {
  const dataDir = await mkdtemp(join(tmpdir(), "lm-worker-ai-sdk-readme-"));
  // Inside the package, so that `import ... from "lm-worker/ai-sdk"` resolves to this package by its name.
  const script = join(repoRoot, "client", "dist", "test", "readme-ai-sdk-example.mjs");
  try {
    await writeFile(script, await readmeExample());
    const env = {
      ...workerEnv(),
      LM_WORKER_PYTHON: python(),
      LM_WORKER_MODEL: await tinyModel(),
      LM_WORKER_DATA_DIR: dataDir,
    };
    const { stdout } = await promisify(execFile)(process.execPath, [script], { env, timeout: 180_000 });
    assert.match(stdout, /^\[(stop|length), \d+ tokens\]$/m);
    const reused = /^\[(\d+) of (\d+) input tokens from the cache\]$/m.exec(stdout);
    assert.ok(reused && Number(reused[1]) > 0, stdout);
    assert.match(stdout, /^weather\(\{"city":".*"\}\) returned \{"city":".*","forecast":"sunny, 24 °C"\}$/m);
    assert.match(stdout, /born: \d{4},\s+movement: '(renaissance|baroque|impressionism|cubism|other)'/);
  } finally {
    await rm(script, { force: true });
    await rm(dataDir, { recursive: true, force: true });
  }
});
