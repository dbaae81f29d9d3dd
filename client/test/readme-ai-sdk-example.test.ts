// The README's AI SDK example, run as written (on the tiny model) through the package's own
// name, as a Node project that installed it with `ai` and `zod` would.

import assert from "node:assert/strict";
import { test } from "node:test";

import { runDocExample } from "./support.js";

test("the README's AI SDK example runs as written: a stream, a cached turn, a tool call, an object", async () => {
  const stdout = await runDocExample("README.md", "## Using it from the AI SDK");
  assert.match(stdout, /^\[(stop|length), \d+ tokens\]$/m);
  const reused = /^\[(\d+) of (\d+) input tokens from the cache\]$/m.exec(stdout);
  assert.ok(reused && Number(reused[1]) > 0, stdout);
  assert.match(stdout, /^weather\(\{"city":".*"\}\) returned \{"city":".*","forecast":"sunny, 24 °C"\}$/m);
  assert.match(stdout, /born: \d{4},\s+movement: '(renaissance|baroque|impressionism|cubism|other)'/);
});
