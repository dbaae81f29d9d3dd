#!/usr/bin/env node
// The package's `prepare` script: install this package's own dependencies into its folder
// when a project installed it as a folder.
//
// `npm install /path/to/lm-worker` makes a symbolic link, runs `prepare` in the folder, and
// installs none of the folder's dependencies. Node and TypeScript resolve the package's
// imports from its real path, where the project's node_modules is out of reach: without
// this, `lm-worker/ai-sdk` could not load and its types would be unresolved (`any` under
// skipLibCheck). A registry or tarball install, a git install and a checkout after `npm ci`
// have them already: then this does nothing.

import { spawnSync } from "node:child_process";
import { existsSync, readFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..");
const { dependencies = {} } = JSON.parse(readFileSync(join(root, "package.json"), "utf8"));
const missing = Object.keys(dependencies).filter((name) => !existsSync(join(root, "node_modules", name, "package.json")));
if (missing.length > 0) {
  // The versions of package-lock.json; no scripts (the dependencies have none to run), nothing saved.
  // The npm that runs this script, where npm runs it.
  const npm = /npm-cli\.js$/.test(process.env.npm_execpath ?? "") ? process.env.npm_execpath : undefined;
  const [command, args] = npm ? [process.execPath, [npm]] : ["npm", []];
  const done = spawnSync(
    command,
    [...args, "install", "--omit=dev", "--omit=peer", "--no-save", "--ignore-scripts", "--no-audit", "--no-fund"],
    { cwd: root, stdio: "inherit", shell: process.platform === "win32" && !npm },
  );
  process.exit(done.status ?? 1);
}
