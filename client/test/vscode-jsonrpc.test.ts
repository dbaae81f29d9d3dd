// The worker driven by vscode-jsonrpc, an off-the-shelf JSON-RPC client that
// writes LSP `Content-Length` framing and reads only that: every test here
// passes only if the worker detects the framing and answers in it
// (docs/PROTOCOL.md §3), speaks JSON-RPC 2.0 as vscode-jsonrpc expects (§4:
// vscode-jsonrpc numbers its requests from 0), streams `generate/chunk` (§7, §8)
// and honours `$/cancelRequest` (§9).

import { test } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import {
  CancellationTokenSource,
  createMessageConnection,
  ResponseError,
  StreamMessageReader,
  StreamMessageWriter,
  type Logger,
  type MessageConnection,
} from "vscode-jsonrpc/node";
import type { CapabilitiesResult, GenerateChunk, GenerateResult, ModelInfo } from "../src/protocol-types.js";
import { python, repoRoot, tinyModel, workerEnv } from "./support.js";

// The protocol's own types: this test uses vscode-jsonrpc for the wire, not the client.
type Chunk = GenerateChunk;
type Capabilities = CapabilitiesResult;

/** Rejects with a message naming `what` when `promise` takes longer than `ms`. */
async function within<T>(promise: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms waiting for ${what}`)), ms);
  });
  try {
    return await Promise.race([promise, timeout]);
  } finally {
    clearTimeout(timer);
  }
}

interface Worker {
  connection: MessageConnection;
  /** What vscode-jsonrpc logged as errors or warnings, and errors it reported on the streams. */
  complaints: string[];
  /** The worker's stderr so far (its tail). */
  stderr(): string;
  /** `shutdown`, then `exit`; asserts the worker exits 0 and vscode-jsonrpc had nothing to complain about. */
  shutdown(): Promise<void>;
  /** Kill the worker if it still runs, and dispose the connection. Safe to call twice. */
  dispose(): Promise<void>;
}

function startWorker(flags: string[] = []): Worker {
  const proc = spawn(python(), ["-m", "worker", ...flags], { cwd: repoRoot, env: workerEnv(), stdio: ["pipe", "pipe", "pipe"] });
  let stderr = "";
  proc.stderr.setEncoding("utf8");
  proc.stderr.on("data", (data: string) => {
    stderr = (stderr + data).slice(-20_000);
  });
  const complaints: string[] = [];
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) => {
    proc.once("exit", (code, signal) => resolve({ code, signal }));
    proc.once("error", (error) => {
      complaints.push(`spawn: ${error.message}`);
      resolve({ code: null, signal: null });
    });
  });
  const logger: Logger = {
    error: (message) => complaints.push(`error: ${message}`),
    warn: (message) => complaints.push(`warn: ${message}`),
    info: () => {},
    log: () => {},
  };
  const connection = createMessageConnection(
    new StreamMessageReader(proc.stdout),
    new StreamMessageWriter(proc.stdin),
    logger,
  );
  connection.onError(([error]) => complaints.push(`stream error: ${error.message}`));
  connection.onUnhandledNotification((message) => complaints.push(`unhandled notification: ${JSON.stringify(message)}`));
  connection.listen();

  let disposed = false;
  return {
    connection,
    complaints,
    stderr: () => stderr,
    async shutdown() {
      const result = await within(connection.sendRequest<null>("shutdown"), 15_000, "the shutdown response");
      assert.equal(result, null);
      await connection.sendNotification("exit");
      const { code, signal } = await within(exited, 15_000, "the worker to exit after shutdown + exit");
      assert.deepEqual({ code, signal }, { code: 0, signal: null }, `worker exit; stderr:\n${stderr}`);
      assert.deepEqual(complaints, [], `vscode-jsonrpc complained; worker stderr:\n${stderr}`);
    },
    async dispose() {
      if (disposed) return;
      disposed = true;
      if (proc.exitCode === null && proc.signalCode === null && proc.pid !== undefined) {
        proc.kill("SIGKILL");
      }
      await exited;
      connection.dispose();
    },
  };
}

/** Runs `body` against a fresh worker, then shuts it down (or kills it if `body` failed). */
async function withWorker(body: (worker: Worker) => Promise<void>, flags: string[] = []): Promise<void> {
  const worker = startWorker(flags);
  try {
    await body(worker);
    await worker.shutdown();
  } catch (error) {
    if (error instanceof Error) error.message += `\n--- worker stderr (tail) ---\n${worker.stderr().slice(-4000)}`;
    throw error;
  } finally {
    await worker.dispose();
  }
}

/**
 * Collects the `generate/chunk` notifications, and where each response fell
 * among them: `events` reads like the stream, `chunk:<index>` and `response`.
 */
function recordChunks(connection: MessageConnection, onChunk?: (chunk: Chunk) => void) {
  const chunks: Chunk[] = [];
  const events: string[] = [];
  connection.onNotification("generate/chunk", (chunk: Chunk) => {
    chunks.push(chunk);
    events.push(`chunk:${chunk.index}`);
    onChunk?.(chunk);
  });
  return { chunks, events };
}

/** The checks every streamed generate must pass: chunks in order, adding up to the result. */
function assertChunksMakeResult(chunks: Chunk[], result: GenerateResult): void {
  assert.ok(chunks.length > 0, "no generate/chunk arrived");
  const id = chunks[0]!.id;
  let generated = 0;
  chunks.forEach((chunk, i) => {
    assert.equal(chunk.id, id, `chunk ${i} belongs to another request`);
    assert.equal(chunk.index, i, "chunks arrive in index order, from 0, without gaps");
    generated += chunk.tokens.length;
    assert.equal(chunk.generated_tokens, generated, `generated_tokens of chunk ${i} is cumulative`);
    assert.equal(chunk.prompt_tokens, result.usage.prompt_tokens);
    assert.ok(!chunk.text.includes("\uFFFD"), `chunk ${i} split a character: ${JSON.stringify(chunk.text)}`);
  });
  assert.equal(chunks.map((c) => c.text).join(""), result.text, "chunk texts concatenate to the result's text");
  assert.deepEqual(chunks.flatMap((c) => c.tokens), result.tokens, "chunk tokens concatenate to the result's tokens");
  assert.equal(result.usage.completion_tokens, result.tokens.length);
}

async function loadEcho(connection: MessageConnection, tokenDelayMs: number): Promise<ModelInfo> {
  return within(
    connection.sendRequest<ModelInfo>("load", { backend: "echo", token_delay_ms: tokenDelayMs }),
    15_000,
    "the echo load",
  );
}

test("requests over Content-Length framing get results: capabilities, then load of the echo backend", { timeout: 60_000 }, async () => {
  await withWorker(async ({ connection }) => {
    // vscode-jsonrpc's first request has id 0.
    const caps = await within(connection.sendRequest<Capabilities>("capabilities"), 15_000, "capabilities");
    assert.equal(caps.protocol_version, "1.0");
    assert.equal(caps.framing.replies, "lsp", "the worker replies in the framing vscode-jsonrpc wrote");
    assert.ok(caps.methods.includes("generate"));
    assert.ok(caps.notifications.includes("$/cancelRequest"));
    assert.ok(caps.backends.some((b) => b.name === "echo" && b.available));
    assert.equal(caps.model, null);

    const model = await loadEcho(connection, 0);
    assert.equal(model.backend, "echo");
    assert.equal(model.vocab_size, 258);
    assert.deepEqual(
      model.special_tokens.map((t) => [t.role, t.id]),
      [["bos", 256], ["eos", 257]],
    );

    const after = await within(connection.sendRequest<Capabilities>("capabilities"), 15_000, "capabilities");
    assert.equal(after.model?.backend, "echo");
  });
});

test("generate streams generate/chunk notifications, in index order, that add up to the result, all before the response", { timeout: 60_000 }, async () => {
  await withWorker(async ({ connection }) => {
    const { chunks, events } = recordChunks(connection);
    await loadEcho(connection, 0);
    // Multi-byte characters span several echo tokens, so some chunks carry "" (§8.3).
    const prompt = "héllo, wörld 🙂 日本";
    const result = await within(
      connection.sendRequest<GenerateResult>("generate", { prompt }).then((r) => {
        events.push("response");
        return r;
      }),
      15_000,
      "the generate response",
    );
    // One more round trip, so that a chunk sent after the response would have been read.
    await within(connection.sendRequest("capabilities"), 15_000, "capabilities");

    assert.equal(result.text, prompt, "the echo backend echoes the prompt");
    assert.equal(result.finish_reason, "stop");
    assert.deepEqual(result.stop_reason, { kind: "eos", token: 257, stop: null });
    assert.equal(result.tokens.at(-1), 257);
    assert.equal(result.tokens.length, Buffer.byteLength(prompt, "utf8") + 1);
    assertChunksMakeResult(chunks, result);
    assert.ok(chunks.some((c) => c.text === "" && c.tokens.length === 1 && c.tokens[0]! < 256), "a character split over tokens gives an empty chunk");
    assert.equal(events.at(-1), "response", `the response comes after every chunk: ${events.join(" ")}`);
    assert.equal(events.filter((e) => e === "response").length, 1);
  });
});

test("cancelling a running generate through a CancellationToken ($/cancelRequest) resolves it early with the partial result, finish_reason cancelled", { timeout: 90_000 }, async () => {
  await withWorker(async ({ connection }) => {
    const source = new CancellationTokenSource();
    let responded = false;
    let chunksAfterResponse = 0;
    const { chunks } = recordChunks(connection, (chunk) => {
      if (responded) chunksAfterResponse += 1;
      if (chunk.index === 0) source.cancel(); // vscode-jsonrpc sends $/cancelRequest
    });
    // 4000 tokens at 5 ms each: 20 s uncancelled. The cancel follows the first chunk.
    const prompt = "abcdefghij".repeat(400);
    await loadEcho(connection, 5);
    let result: GenerateResult;
    try {
      result = await within(
        connection.sendRequest<GenerateResult>("generate", { prompt, add_special_tokens: false }, source.token),
        60_000,
        "the cancelled generate's response",
      );
    } catch (error) {
      // vscode-jsonrpc rejects with a ResponseError (say -32800) only if the worker answered
      // an error; §9 says a running generate answers a result instead.
      if (error instanceof ResponseError) {
        throw new Error(`the cancelled generate was answered with error ${error.code} (${error.message}), not a partial result`);
      }
      throw error;
    }
    responded = true;
    await within(connection.sendRequest("capabilities"), 15_000, "capabilities");

    assert.equal(result.finish_reason, "cancelled");
    assert.deepEqual(result.stop_reason, { kind: "cancelled", token: null, stop: null });
    assert.equal(result.usage.prompt_tokens, prompt.length);
    assert.ok(result.tokens.length >= 1, "the token of the first chunk is in the result");
    assert.ok(
      result.tokens.length < prompt.length / 4,
      `cancel took effect well before the end: ${result.tokens.length} of ${prompt.length} tokens`,
    );
    assert.equal(result.text, prompt.slice(0, result.text.length), "the partial text is the prompt's start");
    assertChunksMakeResult(chunks, result);
    assert.equal(chunksAfterResponse, 0, "no chunk after the response");

    // The request is over: the worker no longer knows its id, and the model lane is free.
    const id = chunks[0]!.id;
    const cancelAgain = await within(connection.sendRequest("cancel", { id }), 15_000, "cancel");
    assert.deepEqual(cancelAgain, { cancelled: false, state: "unknown" });
  });
});

// With --max-batch 1 a second generate waits in the queue while the first runs.
test("cancelling a queued generate through its CancellationToken resolves it empty, without running it", { timeout: 60_000 }, async () => {
  await withWorker(async ({ connection }) => {
    const running = new CancellationTokenSource();
    const queued = new CancellationTokenSource();
    const { chunks } = recordChunks(connection, (chunk) => {
      if (chunk.index === 0) {
        queued.cancel(); // the second generate waits behind the first on the model lane
        running.cancel();
      }
    });
    await loadEcho(connection, 5);
    const first = connection.sendRequest<GenerateResult>("generate", { prompt: "x".repeat(2000) }, running.token);
    const second = connection.sendRequest<GenerateResult>("generate", { prompt: "never runs" }, queued.token);
    const [a, b] = await within(Promise.all([first, second]), 60_000, "both generate responses");

    assert.equal(a.finish_reason, "cancelled");
    assert.ok(a.tokens.length < 500, `${a.tokens.length} tokens`);
    assert.equal(b.finish_reason, "cancelled");
    assert.equal(b.text, "");
    assert.deepEqual(b.tokens, []);
    assert.deepEqual(b.usage, { prompt_tokens: 0, completion_tokens: 0, cache_read_tokens: 0, cache_write_tokens: 0, reasoning_tokens: 0 });
    assert.equal(b.cache, null);
    assert.ok(chunks.every((c) => c.id === chunks[0]!.id), "the queued generate sent no chunk");
  }, ["--max-batch", "1"]);
});

test("the tiny transformers model streams real tokens through vscode-jsonrpc, matching the same generate unstreamed", { timeout: 300_000 }, async () => {
  const dir = await tinyModel();
  await withWorker(async ({ connection }) => {
    const { chunks } = recordChunks(connection);
    const model = await within(connection.sendRequest<ModelInfo>("load", { model: dir }), 180_000, "loading the tiny model");
    assert.equal(model.backend, "transformers");
    assert.equal(model.vocab_size, 512);

    const params = { prompt: "a red sun", max_tokens: 8, temperature: 0 };
    const streamed = await within(connection.sendRequest<GenerateResult>("generate", params), 60_000, "generate");
    assert.ok(["length", "stop"].includes(streamed.finish_reason), streamed.finish_reason);
    assert.ok(streamed.tokens.length >= 1 && streamed.tokens.length <= 8);
    assert.ok(streamed.tokens.every((t) => Number.isInteger(t) && t >= 0 && t < model.vocab_size));
    assert.equal(streamed.usage.prompt_tokens, 5, "BOS and 4 tokens (§13)");
    // The chunks' texts may legitimately carry U+FFFD here (random weights can emit
    // invalid UTF-8), so compare without the split-character check.
    assert.equal(chunks.map((c) => c.text).join(""), streamed.text);
    assert.deepEqual(chunks.flatMap((c) => c.tokens), streamed.tokens);
    assert.deepEqual(chunks.map((c) => c.index), chunks.map((_, i) => i));

    const count = chunks.length;
    const plain = await within(
      connection.sendRequest<GenerateResult>("generate", { ...params, stream: false }),
      60_000,
      "generate without streaming",
    );
    assert.equal(chunks.length, count, "stream: false sends no chunk");
    assert.equal(plain.text, streamed.text, "greedy decoding is deterministic");
    assert.deepEqual(plain.tokens, streamed.tokens);
  });
});
