// LmWorker against the real worker process: the echo backend (fast, deterministic) and the
// tiny transformers model. No mocks: every test spawns `python -m worker`.

import assert from "node:assert/strict";
import { execFileSync, spawnSync } from "node:child_process";
import { getEventListeners } from "node:events";
import { after, before, describe, test } from "node:test";
import { cpSync, mkdirSync, rmSync, writeFileSync } from "node:fs";
import { mkdtemp } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { setTimeout as sleep } from "node:timers/promises";

import {
  LmWorker,
  RpcError,
  WorkerExitedError,
  WorkerStartError,
  type GenerateChunk,
  type LoadProgress,
  type WorkerRestart,
} from "../src/index.js";
import { python, tinyModel, workerEnv } from "./support.js";

const start = (options: Parameters<typeof LmWorker.start>[0] = {}) =>
  LmWorker.start({ python: python(), env: workerEnv(), ...options });

function isGone(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return false;
  } catch {
    return true;
  }
}

async function collect(stream: AsyncIterable<GenerateChunk>): Promise<GenerateChunk[]> {
  const chunks: GenerateChunk[] = [];
  for await (const chunk of stream) {
    chunks.push(chunk);
  }
  return chunks;
}

describe("with the echo backend", () => {
  let worker: LmWorker;
  before(async () => {
    worker = await start();
    await worker.load({ backend: "echo" });
  });
  after(async () => {
    await worker.close();
  });

  test("start waits for capabilities and exposes them", () => {
    assert.equal(worker.capabilities.pid, worker.pid);
    assert.ok(worker.capabilities.methods.includes("generate"));
  });

  test("generate streams chunks in order whose text is the result's text, multi-byte text intact", async () => {
    const prompt = "héllo wörld, 日本 and 🙂 ".repeat(20);
    const stream = worker.generate({ prompt, max_tokens: 10_000 });
    const chunks = await collect(stream);
    const result = await stream.result;
    assert.deepEqual(
      chunks.map((c) => c.index),
      chunks.map((_, i) => i),
    );
    assert.equal(chunks.map((c) => c.text).join(""), result.text);
    assert.equal(result.text, prompt);
    assert.equal(result.finish_reason, "stop");
  });

  test("tokenize is answered while a generate is still running", async () => {
    await worker.load({ backend: "echo", token_delay_ms: 5 });
    const stream = worker.generate({ prompt: "x".repeat(200), max_tokens: 1000 });
    let generateDone = false;
    void stream.result.then(() => (generateDone = true));
    const tokens = await worker.tokenize({ text: "héllo", add_special_tokens: false });
    assert.equal(tokens.count, 6);
    assert.equal(generateDone, false);
    await stream.result;
    await worker.load({ backend: "echo" });
  });

  test("aborting a generate cancels it and resolves with the partial result", async () => {
    await worker.load({ backend: "echo", token_delay_ms: 5 });
    const controller = new AbortController();
    const stream = worker.generate({ prompt: "y".repeat(2000), max_tokens: 5000 }, { signal: controller.signal });
    const seen: GenerateChunk[] = [];
    for await (const chunk of stream) {
      seen.push(chunk);
      if (seen.length === 3) {
        controller.abort();
      }
    }
    const result = await stream.result;
    assert.equal(result.finish_reason, "cancelled");
    assert.ok(result.tokens.length < 2000, `${result.tokens.length} tokens after the cancel`);
    assert.equal(seen.map((c) => c.text).join(""), result.text);
    await worker.load({ backend: "echo" });
  });

  test("breaking out of a for-await loop over a generate cancels it", async () => {
    await worker.load({ backend: "echo", token_delay_ms: 5 });
    const stream = worker.generate({ prompt: "b".repeat(2000), max_tokens: 2001 });
    const seen: GenerateChunk[] = [];
    for await (const chunk of stream) {
      seen.push(chunk);
      if (seen.length === 3) break;
    }
    const started = Date.now();
    const result = await stream.result;
    assert.equal(result.finish_reason, "cancelled");
    assert.ok(result.tokens.length < 500, `${result.tokens.length} tokens generated after the loop was left`);
    assert.ok(Date.now() - started < 2000, "the generation stopped soon after the break");
    await worker.load({ backend: "echo" });
  });

  test("stream.cancel() cancels a generate and gives its partial result", async () => {
    await worker.load({ backend: "echo", token_delay_ms: 5 });
    const stream = worker.generate({ prompt: "s".repeat(2000), max_tokens: 2001 });
    const chunks = stream[Symbol.asyncIterator]();
    const first = await chunks.next();
    const result = await stream.cancel();
    assert.equal(result.finish_reason, "cancelled");
    assert.ok(result.tokens.length < 500, `${result.tokens.length} tokens`);
    assert.ok(!first.done && result.text.startsWith(first.value.text));
    assert.equal(await stream.cancel(), result, "a second cancel sends nothing and gives the same result");
    await worker.load({ backend: "echo" });
  });

  test("aborting a call other than generate rejects at once with the signal's reason", async () => {
    await worker.load({ backend: "echo", token_delay_ms: 5 });
    // A load waits for the generate sent before it: it is still queued when aborted.
    const running = worker.generate({ prompt: "q".repeat(400), max_tokens: 401 });
    const controller = new AbortController();
    const load = worker.load({ backend: "echo" }, { signal: controller.signal });
    controller.abort();
    await assert.rejects(load, (error: unknown) => error instanceof DOMException && error.name === "AbortError");
    let finished = false;
    void running.result.then(() => (finished = true));
    await assert.rejects(
      worker.render({ messages: [{ role: "user", content: "x" }] }, { signal: AbortSignal.abort(new Error("my reason")) }),
      /my reason/,
    );
    await assert.rejects(worker.load({ backend: "echo" }, { signal: AbortSignal.timeout(50) }), { name: "TimeoutError" });
    assert.equal(finished, false, "the rejections came before the generate ended, not with the worker's answers");
    assert.equal((await running.result).finish_reason, "stop");
    assert.equal((await worker.tokenize({ text: "ok" }, { signal: new AbortController().signal })).count, 3);
    await worker.load({ backend: "echo" });
  });

  test("errors carry the JSON-RPC code, kind and field", async () => {
    await assert.rejects(worker.tokenize({ text: 7 as unknown as string }), (error: unknown) => {
      assert.ok(error instanceof RpcError);
      assert.equal(error.code, -32602);
      assert.equal(error.kind, "invalid_params");
      assert.equal(error.data?.field, "params.text");
      return true;
    });
    const unknown = worker.call("nope" as "capabilities");
    await assert.rejects(unknown, (error: unknown) => error instanceof RpcError && error.code === -32601);
  });

  test("many sequential requests leave nothing pending and no abort listeners behind", async () => {
    const controller = new AbortController();
    for (let i = 0; i < 300; i++) {
      const result = await worker.call("tokenize", { text: `request ${i}` }, { signal: controller.signal });
      assert.equal(result.count, `request ${i}`.length + 1);
    }
    assert.equal(worker.pendingRequests, 0);
    assert.equal(getEventListeners(controller.signal, "abort").length, 0);
  });

  test("a consumer that awaits another call inside its for-await loop gets its answers", async () => {
    const stream = worker.generate({ prompt: "y".repeat(3_000), max_tokens: 3_001 }, { highWaterMark: 4 });
    let chunks = 0;
    for await (const chunk of stream) {
      chunks += 1;
      if (chunks % 500 === 1) {
        assert.equal((await worker.tokenize({ text: chunk.text })).count, chunk.text.length + 1);
      }
    }
    assert.equal((await stream.result).tokens.length, 3_001);
  });

  test("a slow consumer gets merged chunks and holds back neither its generation nor another stream", async () => {
    const slow = worker.generate({ prompt: "z".repeat(20_000), max_tokens: 20_001 }, { highWaterMark: 16 });
    const other = worker.generate({ prompt: "o".repeat(2_000), max_tokens: 2_001 });
    let consumed = 0;
    let mostBuffered = 0;
    let text = "";
    const reading = (async () => {
      for await (const chunk of slow) {
        consumed += 1;
        text += chunk.text;
        mostBuffered = Math.max(mostBuffered, slow.buffered);
        if (consumed <= 20) {
          await sleep(20);
        }
      }
    })();
    // The other stream, read at full speed, ends while the slow consumer is still behind.
    assert.equal((await collect(other)).map((c) => c.text).join(""), "o".repeat(2_000));
    assert.ok(consumed <= 20, `the slow consumer had already taken ${consumed} chunks`);
    await reading;
    const result = await slow.result;
    assert.equal(result.tokens.length, 20_001);
    assert.equal(text, result.text);
    assert.ok(mostBuffered <= 17, `${mostBuffered} chunks waited for the consumer (window 16)`);
    assert.ok(consumed < 20_001, "the chunks held for the slow consumer came merged");
  });
});

describe("lifecycle", () => {
  test("killing the worker mid-stream rejects the generate with the signal", async () => {
    const worker = await start();
    await worker.load({ backend: "echo", token_delay_ms: 5 });
    const stream = worker.generate({ prompt: "k".repeat(5000), max_tokens: 5001 });
    const chunks: GenerateChunk[] = [];
    const iterated = (async () => {
      for await (const chunk of stream) {
        chunks.push(chunk);
        if (chunks.length === 2) {
          process.kill(worker.pid!, "SIGKILL");
        }
      }
    })();
    await assert.rejects(stream.result, (error: unknown) => {
      assert.ok(error instanceof WorkerExitedError);
      assert.equal(error.signal, "SIGKILL");
      return true;
    });
    await assert.rejects(iterated, WorkerExitedError);
    await assert.rejects(worker.tokenize({ text: "after" }), WorkerExitedError);
    assert.deepEqual(await worker.exited, { exitCode: null, signal: "SIGKILL" });
  });

  test("a worker dying under a generate nobody awaits leaves no unhandled rejection", async () => {
    const unhandled: unknown[] = [];
    const record = (reason: unknown) => unhandled.push(reason);
    process.on("unhandledRejection", record);
    try {
      const worker = await start();
      await worker.load({ backend: "echo", token_delay_ms: 5 });
      worker.generate({ prompt: "u".repeat(1000), max_tokens: 1001 }); // neither iterated nor awaited
      process.kill(worker.pid!, "SIGKILL");
      await worker.exited;
      await sleep(50); // unhandled rejections are reported after the microtask queue drains
    } finally {
      process.off("unhandledRejection", record);
    }
    assert.deepEqual(unhandled, []);
  });

  test("close during a stream ends the stream and leaves no process behind", async () => {
    const worker = await start();
    await worker.load({ backend: "echo", token_delay_ms: 5 });
    const stream = worker.generate({ prompt: "c".repeat(5000), max_tokens: 5001 });
    await stream[Symbol.asyncIterator]().next(); // one chunk read, the loop not left: the request goes on
    const exit = await worker.close();
    assert.deepEqual(exit, { exitCode: 0, signal: null });
    assert.equal((await stream.result).finish_reason, "cancelled");
    assert.ok(isGone(worker.pid!));
  });

  test("an aborted start rejects with the signal's reason and leaves no process behind", async () => {
    const controller = new AbortController();
    const starting = start({ signal: controller.signal });
    controller.abort(); // the process is spawned; it has not answered capabilities yet
    await assert.rejects(starting, { name: "AbortError" });
    const children = execFileSync("ps", ["-o", "args=", "--ppid", String(process.pid)], { encoding: "utf8" });
    assert.doesNotMatch(children, /-m worker/);
  });

  test("await using closes the worker as its scope ends", async () => {
    let pid: number;
    let exited: Promise<unknown>;
    {
      await using worker = await start();
      await worker.load({ backend: "echo" });
      assert.equal((await worker.tokenize({ text: "scope" })).count, 6);
      pid = worker.pid!;
      exited = worker.exited;
    }
    assert.deepEqual(await exited, { exitCode: 0, signal: null }); // shutdown and exit, not a kill
    assert.ok(isGone(pid));
  });

  test("with unref, a program that forgets close() exits once nothing is in flight, and so does its worker", async () => {
    // A generate in flight holds the program until its answer: the line printed shows it.
    const program = `
      import { LmWorker } from ${JSON.stringify(new URL("../src/index.js", import.meta.url).href)};
      const worker = await LmWorker.start({ python: process.argv[1], unref: true });
      await worker.load({ backend: "echo", token_delay_ms: 50 });
      worker.generate({ prompt: "late", max_tokens: 4 }).result.then((result) => {
        console.log(JSON.stringify({ pid: worker.pid, text: result.text }));
      });
    `;
    const started = Date.now();
    const ran = spawnSync(process.execPath, ["--input-type=module", "-e", program, python()], {
      env: workerEnv(), encoding: "utf8", timeout: 60_000,
    });
    assert.equal(ran.status, 0, ran.stderr);
    assert.ok(Date.now() - started < 30_000);
    const { pid, text } = JSON.parse(ran.stdout);
    assert.equal(text, "late");
    for (let waited = 0; !isGone(pid); waited += 50) {
      assert.ok(waited < 10_000, "the worker outlived its program");
      await sleep(50);
    }
  });

  test("a worker that cannot start is a start error with its stderr", async () => {
    await assert.rejects(start({ args: ["--no-such-flag"] }), (error: unknown) => {
      assert.ok(error instanceof WorkerStartError);
      assert.match(error.message, /exit code 2/);
      assert.match(error.message, /--no-such-flag/);
      return true;
    });
  });

  test("a worker/ or protocol/ in the host's working directory does not shadow the worker", async () => {
    const cwd = await mkdtemp(join(tmpdir(), "lm-worker-cwd-"));
    for (const name of ["worker", "protocol"]) {
      mkdirSync(join(cwd, name));
      writeFileSync(join(cwd, name, "__init__.py"), "raise SystemExit('the host directory was imported')\n");
      writeFileSync(join(cwd, name, "__main__.py"), "raise SystemExit('the host directory was run')\n");
    }
    const shadowed = await start({ cwd });
    try {
      assert.equal((await shadowed.tokenize({ text: "x" }).catch((e: RpcError) => e.kind)), "model_not_loaded");
    } finally {
      await shadowed.close();
      rmSync(cwd, { recursive: true, force: true });
    }
  });

  test("Content-Length framing carries large messages and multi-byte text", async () => {
    const worker = await start({ framing: "lsp" });
    try {
      await worker.load({ backend: "echo" });
      const text = "日本語のテキスト🙂".repeat(40_000); // about 1.6 MB of UTF-8
      const { count } = await worker.tokenize({ text, add_special_tokens: false });
      assert.equal(count, Buffer.byteLength(text));
      const { text: back } = await worker.detokenize({ tokens: [...Buffer.from("é🙂")] });
      assert.equal(back, "é🙂");
    } finally {
      await worker.close();
    }
  });
});

describe("restarts", () => {
  /** Read `stream` until `count` chunks have come, then kill its worker with SIGKILL. */
  async function killAfter(worker: LmWorker, stream: AsyncIterable<GenerateChunk>, count: number): Promise<void> {
    let seen = 0;
    for await (const chunk of stream) {
      void chunk;
      if (++seen === count) process.kill(worker.pid!, "SIGKILL");
    }
  }

  test("with restart, a worker killed mid-stream is replaced on the next call, with its model loaded again", async () => {
    const worker = await start({ restart: true });
    const restarts: WorkerRestart[] = [];
    worker.on("restart", (event) => restarts.push(event));
    try {
      await worker.load({ backend: "echo", token_delay_ms: 5 });
      const first = worker.pid!;
      const stream = worker.generate({ prompt: "m".repeat(2000), max_tokens: 2001 });
      await assert.rejects(killAfter(worker, stream, 2), WorkerExitedError);
      await assert.rejects(stream.result, (error: unknown) => error instanceof WorkerExitedError && error.signal === "SIGKILL");

      // The echo backend tokenizes only with a model loaded: the new process has it again.
      assert.equal((await worker.tokenize({ text: "again" })).count, 6);
      assert.notEqual(worker.pid, first);
      assert.equal(worker.capabilities.pid, worker.pid);
      assert.equal(restarts.length, 1);
      const [event] = restarts;
      assert.equal(event!.pid, worker.pid);
      assert.deepEqual(event!.previous, { exitCode: null, signal: "SIGKILL" });
      assert.ok(event!.error instanceof WorkerExitedError);
      assert.deepEqual(event!.model, { backend: "echo", token_delay_ms: 5 });
      assert.equal((await worker.generate({ prompt: "on", max_tokens: 3 }).result).text, "on");
    } finally {
      await worker.close();
    }
    // A worker the host closed is not restarted.
    await assert.rejects(worker.tokenize({ text: "closed" }), /the worker has exited/);
    assert.equal(restarts.length, 1);
  });

  test("kills between calls and mid-stream are each restarted, until too many come too soon", async () => {
    const worker = await start({ restart: { maxRestarts: 2, withinMs: 60_000 } });
    try {
      await worker.load({ backend: "echo", token_delay_ms: 5 });
      process.kill(worker.pid!, "SIGKILL"); // idle, between calls
      await worker.exited;
      assert.equal((await worker.generate({ prompt: "one", max_tokens: 4 }).result).text, "one");

      const stream = worker.generate({ prompt: "m".repeat(2000), max_tokens: 2001 });
      await assert.rejects(killAfter(worker, stream, 2), WorkerExitedError);
      assert.equal((await worker.tokenize({ text: "two" })).count, 4);

      process.kill(worker.pid!, "SIGKILL"); // the third exit within a minute: final
      await worker.exited;
      for (let i = 0; i < 2; i++) {
        await assert.rejects(worker.tokenize({ text: "three" }), (error: unknown) => {
          assert.ok(error instanceof WorkerExitedError);
          assert.match(error.message, /exited again after 2 restarts within 60 s, so it is not restarted any more/);
          return true;
        });
      }
    } finally {
      await worker.close();
    }
  });

});

test("a restart whose model cannot be loaded again fails the call waiting for it; the next call tries again", async () => {
  const model = join(await mkdtemp(join(tmpdir(), "lm-worker-moved-")), "model");
  cpSync(await tinyModel(), model, { recursive: true });
  const worker = await start({ restart: true });
  try {
    await worker.load({ model });
    process.kill(worker.pid!, "SIGKILL");
    await worker.exited;
    rmSync(model, { recursive: true });
    const cancelled = new AbortController();
    const waiting = worker.generate({ prompt: "x", max_tokens: 2 }, { signal: cancelled.signal });
    cancelled.abort(); // while it waits for the restart: nothing is left to cancel once it fails
    await assert.rejects(waiting.result, (error: unknown) => error instanceof RpcError && error.kind === "model_not_found");
    await worker.exited; // the new process that could not load it is stopped
    cpSync(await tinyModel(), model, { recursive: true });
    assert.equal((await worker.tokenize({ text: "back", add_special_tokens: false })).tokens.length > 0, true);
  } finally {
    await worker.close();
    rmSync(dirname(model), { recursive: true, force: true });
  }
});

describe("with the tiny transformers model", () => {
  let worker: LmWorker;
  let model: string;
  before(async () => {
    model = await tinyModel();
    worker = await start({ args: ["--cache-dir", `${model}-caches`] });
    await worker.load({ model }, );
  });
  after(async () => {
    await worker.close();
  });

  test("a long prefill reports progress and a generate from its cache gives the uncached tokens", async () => {
    const tokens = Array.from({ length: 600 }, (_, i) => ((i * 7) % 500) + 3);
    const progress: number[] = [];
    const made = await worker.prefill(
      { tokens, cache: "node-test" },
      { onProgress: (p) => progress.push(p.processed_tokens) },
    );
    assert.equal(made.token_count, 600);
    assert.deepEqual(progress, [256, 512, 600]);
    const prompt = [...tokens, 9, 10, 11];
    const plain = await worker.generate({ tokens: prompt, max_tokens: 8 }).result;
    const cached = await worker.generate({ tokens: prompt, max_tokens: 8, cache: "node-test" }).result;
    assert.deepEqual(cached.tokens, plain.tokens);
    assert.equal(cached.usage.cache_read_tokens, 600);
  });
});

test("a load of a gguf reports its stages through onProgress, each up to its total, before it answers", async () => {
  const dir = await mkdtemp(join(tmpdir(), "lm-worker-gguf-"));
  const gguf = join(dir, "tiny.gguf");
  execFileSync(
    python(),
    ["-c", "import sys; from worker.backends.transformers.tiny_model import write_gguf; write_gguf(sys.argv[1], sys.argv[2])", await tinyModel(), gguf],
    { env: workerEnv(), timeout: 120_000 },
  );
  // A data directory of its own: the kernels are built and the file hashed here.
  const worker = await start({ env: { ...workerEnv(), LM_WORKER_DATA_DIR: join(dir, "data") } });
  try {
    const seen: LoadProgress[] = [];
    const loaded = await worker.load({ model: gguf }, { onProgress: (progress) => seen.push(progress) });
    // A .gguf path loads mapped on its own blocks: nothing dequantized or quantized.
    assert.equal(loaded.quantization, "gguf");
    const stages = [...new Set(seen.map((p) => p.stage))];
    assert.deepEqual(stages, ["building_kernel", "hashing"]);
    // Each kernel built (the native pass, exact attention, gguf products: a load without torch needs no int8
    // products) is a building_kernel stage of its own.
    assert.equal(seen.filter((p) => p.stage === "building_kernel" && p.done === 0).length, 3);
    for (const stage of stages) {
      const reports = seen.filter((p) => p.stage === stage);
      assert.equal(reports[0].done, 0);
      assert.equal(reports.at(-1)!.done, reports.at(-1)!.total);
      // done grows within a stage, and starts again from 0 only where the stage comes again
      assert.ok(reports.every((p, i) => i === 0 || p.done >= reports[i - 1].done || (p.done === 0 && reports[i - 1].done === reports[i - 1].total)));
    }
  } finally {
    await worker.close();
    rmSync(dir, { recursive: true, force: true });
  }
});
