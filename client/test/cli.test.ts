// The lm-worker command: `python` says which Python the client would run, usage is printed
// for no or an unknown command. (`setup` installs torch: it is run by hand, see the README.)

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { join } from "node:path";
import { test } from "node:test";

import { repoRoot } from "./support.js";

const cli = join(repoRoot, "client", "dist", "src", "cli.js");

function run(args: string[], env: NodeJS.ProcessEnv = {}) {
  return spawnSync(process.execPath, [cli, ...args], { env: { ...process.env, ...env }, encoding: "utf8" });
}

test("lm-worker python prints $LM_WORKER_PYTHON when it is set", () => {
  const done = run(["python"], { LM_WORKER_PYTHON: "/opt/some/python3" });
  assert.equal(done.status, 0);
  assert.equal(done.stdout.trim(), "/opt/some/python3");
});

test("lm-worker python finds this checkout's .venv otherwise", () => {
  const done = run(["python"], { LM_WORKER_PYTHON: "" });
  assert.equal(done.status, 0);
  assert.equal(done.stdout.trim(), join(repoRoot, ".venv", "bin", "python"));
});

test("lm-worker without a known command prints its usage and fails for an unknown one", () => {
  const help = run([]);
  assert.equal(help.status, 0);
  assert.match(help.stdout, /usage: lm-worker setup/);
  const unknown = run(["frobnicate"]);
  assert.equal(unknown.status, 2);
  assert.match(unknown.stdout, /usage: lm-worker setup/);
  const badOption = run(["setup", "--frob"]);
  assert.equal(badOption.status, 1);
  assert.match(badOption.stderr, /unknown argument "--frob"/);
});
