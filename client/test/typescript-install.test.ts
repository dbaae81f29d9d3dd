// The package as a TypeScript project gets it: a fresh npm project installs a fresh copy of
// this checkout as a folder (a symbolic link, the documented way) with the pinned `ai` and
// `zod` from the registry, type-checks a file with `strict` and without `skipLibCheck`
// (its `@ts-expect-error` lines fail as unused if a type the package gives is `any`), then
// runs it on the tiny model.

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { existsSync, lstatSync, readFileSync } from "node:fs";
import { cp, mkdir, mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { promisify } from "node:util";

import { python, repoRoot, tinyModel, workerEnv } from "./support.js";

const run = promisify(execFile);

/** The version of a package installed in this checkout (what its tests type-check against). */
function installed(name: string): string {
  return JSON.parse(readFileSync(join(repoRoot, "node_modules", name, "package.json"), "utf8")).version;
}

// What the project's file does with the package, typed: each @ts-expect-error needs a real type.
const source = `
import { generateText, Output, streamText, type LanguageModel } from "ai";
import { z } from "zod";
import { LmWorker, RpcError, type GenerateParams } from "lm-worker";
import { createLmWorker, lmWorker, type LmWorkerCallOptions } from "lm-worker/ai-sdk";
import packageJson from "lm-worker/package.json" with { type: "json" };

const lm = createLmWorker({ workerOptions: { args: ["--log-level", "warning"] } });
const model: LanguageModel = lm(process.env.LM_WORKER_MODEL!);

// Never called: each line is an error only where the type it uses is real.
export function misuses(worker: LmWorker, error: RpcError): unknown[] {
  // @ts-expect-error the provider's model is the AI SDK's LanguageModelV4, not a string
  const notAString: string = lm("default");
  // @ts-expect-error and so is the ready provider's
  const notANumber: number = lmWorker("default");
  // @ts-expect-error and it has no such method
  lm("default").noSuchMethod();
  // @ts-expect-error the provider's options are typed: cache is a string
  const badOptions: LmWorkerCallOptions = { cache: 3 };
  // @ts-expect-error the protocol's params are typed: max_tokens is a number
  const badParams: GenerateParams = { prompt: "x", max_tokens: "3" };
  // @ts-expect-error a worker's capabilities are typed
  const pid: string = worker.capabilities.pid;
  // @ts-expect-error an RpcError's code is a number
  const code: string = error.code;
  // @ts-expect-error its kind is one of the protocol's ErrorKind union
  const unknownKind = error.kind === "no_such_kind";
  return [notAString, notANumber, badOptions, badParams, pid, code, unknownKind];
}

try {
  const streamed = streamText({ model, prompt: "Hello", maxOutputTokens: 4 });
  let text = "";
  for await (const delta of streamed.textStream) text += delta;
  const { output } = await generateText({
    model,
    prompt: "Describe someone.",
    output: Output.object({ schema: z.object({ mood: z.enum(["happy", "sad"]) }) }),
    maxOutputTokens: 20,
  });
  console.log(JSON.stringify({ version: packageJson.version, streamed: text.length, finish: await streamed.finishReason, mood: output.mood }));
} finally {
  await lm.close();
}
`;

test("a TypeScript project that installs the checkout as a folder gets real types, checked strictly, and runs", async () => {
  const scratch = await mkdtemp(join(tmpdir(), "lm-worker-ts-install-"));
  const model = tinyModel(); // built meanwhile
  try {
    // A fresh clone of what would be committed: the files git tracks or would, as they are in
    // the working tree; no node_modules.
    const checkout = join(scratch, "lm-worker");
    const listed = await run("git", ["ls-files", "-z", "--cached", "--others", "--exclude-standard"], {
      cwd: repoRoot, maxBuffer: 16 * 1024 * 1024,
    });
    for (const name of listed.stdout.split("\0").filter((name) => name && existsSync(join(repoRoot, name)))) {
      await mkdir(dirname(join(checkout, name)), { recursive: true });
      await cp(join(repoRoot, name), join(checkout, name));
    }
    const host = join(scratch, "host");
    await mkdir(host);
    await writeFile(join(host, "package.json"), JSON.stringify({ name: "host", private: true, type: "module" }));
    await writeFile(
      join(host, "tsconfig.json"),
      JSON.stringify({
        compilerOptions: {
          target: "ES2022", module: "NodeNext", moduleResolution: "NodeNext", strict: true,
          skipLibCheck: false, resolveJsonModule: true, types: ["node"], outDir: "out",
        },
        files: ["main.ts"],
      }),
    );
    await writeFile(join(host, "main.ts"), source);

    // @types/json-schema: the AI SDK's own types need it (@ai-sdk/provider has it as a devDependency only).
    const { devDependencies } = JSON.parse(readFileSync(join(repoRoot, "package.json"), "utf8"));
    const packages = [
      `ai@${devDependencies.ai}`, `zod@${installed("zod")}`,
      `@types/node@${installed("@types/node")}`, `@types/json-schema@${installed("@types/json-schema")}`,
    ];
    await run("npm", ["install", "--prefer-offline", "--no-audit", "--no-fund", ...packages, checkout], {
      cwd: host, timeout: 180_000, maxBuffer: 16 * 1024 * 1024,
    });
    assert.ok(lstatSync(join(host, "node_modules", "lm-worker")).isSymbolicLink(), "npm installed the folder as a link");

    const tsc = join(repoRoot, "node_modules", "typescript", "bin", "tsc");
    const checked = await run(process.execPath, [tsc, "-p", host], { cwd: host, timeout: 180_000 }).catch((error) => error);
    assert.equal(checked.code ?? 0, 0, `tsc failed:\n${checked.stdout}${checked.stderr}`);

    const env = { ...workerEnv(), LM_WORKER_PYTHON: python(), LM_WORKER_MODEL: await model, LM_WORKER_DATA_DIR: join(scratch, "data") };
    const { stdout } = await run(process.execPath, [join(host, "out", "main.js")], { cwd: host, env, timeout: 180_000 });
    const printed = JSON.parse(stdout);
    assert.equal(printed.version, JSON.parse(readFileSync(join(repoRoot, "package.json"), "utf8")).version);
    assert.ok(printed.streamed > 0, stdout);
    assert.match(printed.finish, /^(stop|length)$/);
    assert.match(printed.mood, /^(happy|sad)$/);
  } finally {
    await rm(scratch, { recursive: true, force: true });
  }
});
