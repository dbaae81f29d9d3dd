// The example of docs/NODE.md, run as written (on the tiny model) through the package's own
// name, as a Node project that installed it would.

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { promisify } from "node:util";

import { python, repoRoot, tinyModel, workerEnv } from "./support.js";

async function nodeExample(): Promise<string> {
  const guide = await readFile(join(repoRoot, "docs", "NODE.md"), "utf8");
  const match = /```js\n([\s\S]*?)```/.exec(guide);
  assert.ok(match, "docs/NODE.md has a ```js example");
  return match[1]!;
}

test("the Node guide's example runs as written and its second turn starts from the first", async () => {
  const dataDir = await mkdtemp(join(tmpdir(), "lm-worker-readme-"));
  // Inside the package, so that `import ... from "lm-worker"` resolves to this package by its name.
  const script = join(repoRoot, "client", "dist", "test", "node-guide-example.mjs");
  try {
    await writeFile(script, await nodeExample());
    const env = {
      ...workerEnv(),
      LM_WORKER_PYTHON: python(),
      LM_WORKER_MODEL: await tinyModel(),
      LM_WORKER_DATA_DIR: dataDir,
    };
    const { stdout } = await promisify(execFile)(process.execPath, [script], { env, timeout: 180_000 });
    assert.match(stdout, /^loaded .*: transformers, context 2048 tokens$/m);
    assert.match(stdout, /stored as auto-[0-9a-f]{24}$/m);
    const reused = /\[(\d+) of (\d+) prompt tokens from the cache\]/.exec(stdout);
    assert.ok(reused && Number(reused[1]) > 0, stdout);
    assert.match(stdout, /^refused: invalid_params \(-32602\) on params\.text$/m);
  } finally {
    await rm(script, { force: true });
    await rm(dataDir, { recursive: true, force: true });
  }
});
