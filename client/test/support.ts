// Shared helpers for the client tests. Other test files import these names:
// keep them stable.
//
//   repoRoot     the repository root (this file runs as client/dist/test/support.js)
//   python()     the Python that runs the worker: $LM_WORKER_PYTHON, else .venv/bin/python
//   workerEnv()  process.env, with thread counts pinned and Hugging Face kept offline
//   tinyModel()  the offline tiny transformers model, built once per process; its directory
//   runDocExample(file, heading?)  the first ```js block of a doc (under a heading), run as written

import { execFile } from "node:child_process";
import { existsSync, rmSync } from "node:fs";
import { mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

/** The repository root: client/dist/test/support.js → ../../.. */
export const repoRoot: string = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..", "..");

/** The Python interpreter that runs the worker: $LM_WORKER_PYTHON, else the project venv's. */
export function python(): string {
  const fromEnv = process.env.LM_WORKER_PYTHON;
  const exe = fromEnv !== undefined && fromEnv !== "" ? fromEnv : join(repoRoot, ".venv", "bin", "python");
  if (!existsSync(exe)) {
    const source = fromEnv ? "LM_WORKER_PYTHON" : "the default (no LM_WORKER_PYTHON set)";
    throw new Error(
      `No Python found at ${exe} (from ${source}). Create the project venv ` +
        `(python3 -m venv .venv && .venv/bin/pip install -e .) in ${repoRoot}, ` +
        `or set LM_WORKER_PYTHON to a Python that can run "python -m worker".`,
    );
  }
  return exe;
}

/** The environment for a worker (or any Python the tests start): lean and offline. */
export function workerEnv(): NodeJS.ProcessEnv {
  return {
    ...process.env,
    OMP_NUM_THREADS: "1",
    MKL_NUM_THREADS: "1",
    TOKENIZERS_PARALLELISM: "false",
    HF_HUB_OFFLINE: "1",
  };
}

let tinyModelPromise: Promise<string> | undefined;

/**
 * Build the tiny offline test model (`python -m worker.backends.transformers.tiny_model DIR`) into a
 * fresh temporary directory, once per process, and return that directory. It is
 * removed when the process exits. A failed build is not cached: the next call
 * tries again.
 */
export function tinyModel(): Promise<string> {
  if (tinyModelPromise === undefined) {
    const promise = buildTinyModel();
    tinyModelPromise = promise;
    promise.catch(() => {
      if (tinyModelPromise === promise) tinyModelPromise = undefined;
    });
  }
  return tinyModelPromise;
}

async function buildTinyModel(): Promise<string> {
  const exe = python();
  const dir = await mkdtemp(join(tmpdir(), "lm-worker-tiny-"));
  process.once("exit", () => rmSync(dir, { recursive: true, force: true }));
  await new Promise<void>((done, fail) => {
    execFile(
      exe,
      ["-m", "worker.backends.transformers.tiny_model", dir],
      { cwd: repoRoot, env: workerEnv(), timeout: 300_000, maxBuffer: 16 * 1024 * 1024 },
      (error, _stdout, stderr) => {
        if (error) {
          fail(new Error(`building the tiny model failed (${exe} -m worker.backends.transformers.tiny_model ${dir}): ${error.message}\n${stderr}`));
        } else {
          done();
        }
      },
    );
  });
  if (!existsSync(join(dir, "config.json"))) {
    throw new Error(`python -m worker.backends.transformers.tiny_model ${dir} exited 0 but wrote no config.json`);
  }
  return dir;
}

/**
 * The first ```js block of `file` (a path from the repository root), after the line `heading`
 * if given, run as written on the tiny model with a fresh data directory; its stdout. The
 * script is written inside the package, so that `import ... from "lm-worker"` (and
 * "lm-worker/ai-sdk") resolve to this package by its name, as in a project that installed it.
 */
export async function runDocExample(file: string, heading?: string): Promise<string> {
  const doc = await readFile(join(repoRoot, file), "utf8");
  const from = heading === undefined ? 0 : doc.indexOf(`\n${heading}\n`);
  const match = from < 0 ? null : /```js\n([\s\S]*?)```/.exec(doc.slice(from));
  if (match === null) throw new Error(`${file} has no \`\`\`js example${heading ? ` under "${heading}"` : ""}`);
  const dataDir = await mkdtemp(join(tmpdir(), "lm-worker-example-"));
  const script = join(repoRoot, "client", "dist", "test", `example-${process.pid}.mjs`);
  try {
    await writeFile(script, match[1]!);
    const env = { ...workerEnv(), LM_WORKER_PYTHON: python(), LM_WORKER_MODEL: await tinyModel(), LM_WORKER_DATA_DIR: dataDir };
    const { stdout } = await promisify(execFile)(process.execPath, [script], { env, timeout: 180_000 });
    return stdout;
  } finally {
    await rm(script, { force: true });
    await rm(dataDir, { recursive: true, force: true });
  }
}
