// The lm-worker command: `python` says which Python the client would run, usage is printed
// for no or an unknown command. (`setup` installs torch: it is run by hand, see the README.)

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
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

test("lm-worker setup refuses a Python older than 3.11, saying which it needs", () => {
  const dir = mkdtempSync(join(tmpdir(), "lm-worker-old-python-"));
  const old = join(dir, "python3.10");
  writeFileSync(old, "#!/bin/sh\necho 3 10\n", { mode: 0o755 });
  try {
    const done = run(["setup", "--python", old, "--venv", join(dir, "venv")]);
    assert.equal(done.status, 1);
    assert.match(done.stderr, /needs Python 3\.11 or newer; found .*python3\.10 \(3\.10\)/);
    assert.equal(existsSync(join(dir, "venv")), false);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
