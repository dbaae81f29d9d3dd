// Models other tools keep, from Node: a gguf pulled into an Ollama models directory (laid out
// as `ollama pull` leaves it) is listed by `listModels()`, loads by its reference, and is a
// model id of the AI SDK provider.

import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { createHash } from "node:crypto";
import { copyFileSync, mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { mkdtemp } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";

import { generateText, NoSuchModelError } from "ai";

import { createLmWorker } from "../src/ai-sdk.js";
import { LmWorker } from "../src/index.js";
import { python, tinyModel, workerEnv } from "./support.js";

globalThis.AI_SDK_LOG_WARNINGS = false;

/** What `ollama pull NAME:TAG` leaves: the gguf as a sha256-named blob, and the manifest naming it. */
function ollamaPull(root: string, name: string, tag: string, gguf: string): string {
  const blob = (data: Buffer) => {
    const digest = createHash("sha256").update(data).digest("hex");
    mkdirSync(join(root, "blobs"), { recursive: true });
    writeFileSync(join(root, "blobs", `sha256-${digest}`), data);
    return { digest: `sha256:${digest}`, size: data.length };
  };
  const model = blob(readFileSync(gguf));
  const manifest = {
    schemaVersion: 2,
    mediaType: "application/vnd.docker.distribution.manifest.v2+json",
    config: { mediaType: "application/vnd.docker.container.image.v1+json", ...blob(Buffer.from('{"model_format":"gguf"}')) },
    layers: [
      { mediaType: "application/vnd.ollama.image.model", ...model },
      { mediaType: "application/vnd.ollama.image.template", ...blob(Buffer.from("{{ .Prompt }}")) },
    ],
  };
  const folder = join(root, "manifests", "registry.ollama.ai", "library", name);
  mkdirSync(folder, { recursive: true });
  writeFileSync(join(folder, tag), JSON.stringify(manifest));
  return join(root, "blobs", model.digest.replace(":", "-"));
}

describe("a model pulled with Ollama", () => {
  let dir: string;
  let blob: string;
  let env: NodeJS.ProcessEnv;

  before(async () => {
    dir = await mkdtemp(join(tmpdir(), "lm-worker-refs-"));
    const gguf = join(dir, "tiny.gguf");
    execFileSync(
      python(),
      ["-c", "import sys; from worker.backends.transformers.tiny_model import write_gguf; write_gguf(sys.argv[1], sys.argv[2])", await tinyModel(), gguf],
      { env: workerEnv(), timeout: 120_000 },
    );
    blob = ollamaPull(join(dir, "ollama"), "tiny", "latest", gguf);
    copyFileSync(gguf, join(dir, "unused.gguf"));
    // The places a worker looks in, all under the test's directory; a data directory of its own.
    env = {
      ...workerEnv(),
      OLLAMA_MODELS: join(dir, "ollama"),
      HF_HUB_CACHE: join(dir, "hub"),
      HOME: join(dir, "home"),
      LM_WORKER_DATA_DIR: join(dir, "data"),
    };
  });

  after(() => rmSync(dir, { recursive: true, force: true }));

  test("listModels() names it by its reference, and load takes that reference", async () => {
    const worker = await LmWorker.start({ python: python(), env });
    try {
      const { models, searched } = await worker.listModels();
      assert.deepEqual(models.map((m) => [m.reference, m.source, m.path, m.format, m.architecture, m.loadable]), [
        ["ollama:tiny:latest", "ollama", blob, "gguf", "llama", true],
      ]);
      assert.deepEqual(searched.map((p) => p.source), ["ollama", "huggingface", "node-llama-cpp"]);
      const loaded = await worker.load({ model: models[0]!.reference });
      assert.equal(loaded.model, "ollama:tiny:latest");
      assert.equal(loaded.path, blob);
      assert.equal(loaded.quantization, "gguf");
      const result = await worker.generate({ prompt: "a red sun", max_tokens: 3, temperature: 0 }).result;
      assert.equal(result.usage.completion_tokens, 3);
    } finally {
      await worker.close();
    }
  });

  test("the AI SDK provider takes the reference as its model id, and one to nothing is NoSuchModelError", async () => {
    await using lm = createLmWorker({ workerOptions: { python: python(), env } });
    const { usage } = await generateText({ model: lm("ollama:tiny"), prompt: "a red sun", maxOutputTokens: 3, temperature: 0 });
    assert.equal(usage.outputTokens, 3);
    await assert.rejects(
      generateText({ model: lm("ollama:nothing-here"), prompt: "hi", maxOutputTokens: 1 }),
      (error: unknown) => NoSuchModelError.isInstance(error) && /ollama:nothing-here/.test(String((error as Error).message)),
    );
  });
});
