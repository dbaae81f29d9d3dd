// The example of docs/NODE.md, run as written (on the tiny model) through the package's own
// name, as a Node project that installed it would.

import assert from "node:assert/strict";
import { test } from "node:test";

import { runDocExample } from "./support.js";

test("the Node guide's example runs as written: its load reports progress, its second turn starts from the first, a break cancels", async () => {
  const stdout = await runDocExample("docs/NODE.md");
  assert.match(stdout, /^quantizing: 0 of 15 tensors\nquantizing: 15 of 15 tensors\n(.*\n)*loaded .*: transformers, context 2048 tokens$/m);
  assert.match(stdout, /stored as auto-[0-9a-f]{24}$/m);
  const reused = /\[(\d+) of (\d+) prompt tokens from the cache\]/.exec(stdout);
  assert.ok(reused && Number(reused[1]) > 0, stdout);
  assert.match(stdout, /^\[stopped after 3 chunks: cancelled\]$/m);
  assert.match(stdout, /^refused: invalid_params \(-32602\) on params\.text$/m);
});
