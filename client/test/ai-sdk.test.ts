// The AI SDK provider (lm-worker/ai-sdk) driven by the real `ai` package against real workers:
// the echo backend (its output is the rendered prompt, so the prompt's mapping shows in it) and
// the tiny transformers model (random weights: gibberish, but constrained output still parses).

import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtemp, rm } from "node:fs/promises";
import { createServer } from "node:http";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import { after, before, describe, test } from "node:test";

import { APICallError, InvalidArgumentError, LoadSettingError, type JSONValue } from "@ai-sdk/provider";
import {
  generateObject,
  generateText,
  isStepCount,
  NoSuchModelError,
  Output,
  streamObject,
  streamText,
  tool,
  type ModelMessage,
} from "ai";
import { z } from "zod";

import { createLmWorker, lmWorker, type LmWorkerProvider } from "../src/ai-sdk.js";
import {
  LmWorker,
  RpcError,
  WorkerExitedError,
  type ChatMessage,
  type LoadProgress,
  type WorkerRestart,
} from "../src/index.js";
import { python, tinyModel, workerEnv } from "./support.js";

// The tests check warnings themselves; the AI SDK would also print them.
globalThis.AI_SDK_LOG_WARNINGS = false;

const workerOptions = (args: string[] = []) => ({ python: python(), env: workerEnv(), args });

/** What the echo backend answers to these messages: their rendered prompt. */
async function render(lm: LmWorkerProvider, messages: ChatMessage[]) {
  return (await lm.worker()).render({ messages });
}

/** Wait until the worker has answered every request (a cancelled generate answers at once). */
async function drained(worker: LmWorker, withinMs = 5000): Promise<void> {
  const deadline = Date.now() + withinMs;
  while (worker.pendingRequests > 0) {
    assert.ok(Date.now() < deadline, `${worker.pendingRequests} requests still pending after ${withinMs} ms`);
    await sleep(10);
  }
}

// A tool whose input the random model can always complete: a short string, nothing else.
const cityInput = z.object({ city: z.string().max(8) });
const weather = tool({ description: "The weather in a city", inputSchema: cityInput });

describe("the AI SDK provider with the echo backend", () => {
  let lm: LmWorkerProvider;
  before(() => {
    lm = createLmWorker({ workerOptions: workerOptions(), load: { backend: "echo" } });
  });
  after(async () => {
    await lm.close();
  });

  test("streamText streams the echoed prompt in order, with usage and finish reason", async () => {
    const result = streamText({
      model: lm("default"),
      instructions: "Be brief.",
      prompt: "héllo wörld 🙂",
      presencePenalty: 0.5,
    });
    const deltas: string[] = [];
    for await (const delta of result.textStream) {
      deltas.push(delta);
    }
    const rendered = await render(lm, [
      { role: "system", content: "Be brief." },
      { role: "user", content: "héllo wörld 🙂" },
    ]);
    assert.ok(deltas.length > 10, `only ${deltas.length} deltas`);
    assert.equal(deltas.join(""), rendered.text);
    assert.equal(await result.finishReason, "stop");
    const usage = await result.usage;
    assert.equal(usage.inputTokens, rendered.count);
    assert.equal(usage.outputTokens, Buffer.byteLength(rendered.text) + 1); // and EOS
    assert.deepEqual(await result.warnings, [{ type: "unsupported", feature: "presencePenalty" }]);
  });

  test("a conversation with a tool call and its result reaches the chat template as messages", async () => {
    const messages: ModelMessage[] = [
      { role: "user", content: "Weather in Paris?" },
      {
        role: "assistant",
        content: [
          { type: "text", text: "Let me look." },
          { type: "tool-call", toolCallId: "call_1", toolName: "weather", input: { city: "Paris" } },
        ],
      },
      {
        role: "tool",
        content: [{ type: "tool-result", toolCallId: "call_1", toolName: "weather", output: { type: "json", value: { sky: "clear" } } }],
      },
    ];
    const { text } = await generateText({ model: lm("default"), messages, maxOutputTokens: 10_000 });
    const expected = await render(lm, [
      { role: "user", content: "Weather in Paris?" },
      {
        role: "assistant",
        content: "Let me look.",
        tool_calls: [{ id: "call_1", type: "function", function: { name: "weather", arguments: { city: "Paris" } } }],
      },
      { role: "tool", tool_call_id: "call_1", name: "weather", content: '{"sky":"clear"}' },
    ]);
    assert.equal(text, expected.text);
    assert.match(text, /\{"sky":"clear"\}/);
  });

  test("a file part is refused before anything is sent", async () => {
    await assert.rejects(
      generateText({
        model: lm("default"),
        messages: [{ role: "user", content: [{ type: "file", data: new Uint8Array([1]), mediaType: "image/png" }] }],
      }),
      /lm-worker runs text models/,
    );
  });

  test("an aborted streamText and generateText cancel their requests and the worker goes on", async () => {
    const worker = await lm.worker();
    // Another provider on the same worker, with a slow model: each token takes 20 ms.
    const slow = createLmWorker({ worker, load: { backend: "echo", token_delay_ms: 20 } })("default");
    const controller = new AbortController();
    const streamed = streamText({ model: slow, prompt: "z".repeat(2000), abortSignal: controller.signal });
    let received = "";
    for await (const delta of streamed.textStream) {
      received += delta;
      if (received.length >= 3) controller.abort();
    }
    assert.ok(received.length >= 3 && received.length < 100, `received ${received.length} characters`);
    await assert.rejects(Promise.resolve(streamed.text), { name: "AbortError" });
    await drained(worker);

    const started = Date.now();
    await assert.rejects(
      generateText({ model: slow, prompt: "y".repeat(2000), abortSignal: AbortSignal.timeout(300) }),
      { name: "TimeoutError" },
    );
    assert.ok(Date.now() - started < 5000, "the abort ended the call");
    await drained(worker);

    const { text } = await generateText({ model: lm("default"), prompt: "still here" });
    assert.equal(text, (await render(lm, [{ role: "user", content: "still here" }])).text);
  });
});

describe("the AI SDK provider and the model a worker runs", () => {
  let worker: LmWorker;
  const loads: unknown[] = [];
  before(async () => {
    worker = await LmWorker.start(workerOptions());
    // Count the loads the providers send (the worker is real; only the call is recorded).
    const load = worker.load.bind(worker);
    worker.load = (params) => (loads.push(params), load(params));
  });
  after(async () => {
    await worker.close();
  });

  test("a model the worker runs is used as it is; concurrent calls for another one load it once", async () => {
    await worker.load({ backend: "echo" }); // as a program sharing its worker with a provider would
    loads.length = 0;
    const plain = createLmWorker({ worker, load: { backend: "echo" } });
    await generateText({ model: plain("default"), prompt: "a" });
    assert.deepEqual(loads, []);

    const slow = createLmWorker({ worker, load: { backend: "echo", token_delay_ms: 1 } });
    const texts = await Promise.all(["b", "c", "d"].map((prompt) => generateText({ model: slow("default"), prompt })));
    assert.deepEqual(texts.map((result) => result.finishReason), ["stop", "stop", "stop"]);
    assert.deepEqual(loads, [{ model: "default", backend: "echo", token_delay_ms: 1 }]);

    await generateText({ model: plain("default"), prompt: "e" });
    assert.equal(loads.length, 2);
    await plain.close(); // a worker passed in is left running
    assert.equal((await worker.tokenize({ text: "f" })).count, 2);
  });

  test("await using a provider closes the worker it started as the scope ends", async () => {
    let exited: Promise<unknown>;
    {
      await using lm = createLmWorker({ workerOptions: workerOptions(), load: { backend: "echo" } });
      assert.equal((await generateText({ model: lm("default"), prompt: "scoped" })).finishReason, "stop");
      exited = (await lm.worker()).exited;
    }
    assert.deepEqual(await exited, { exitCode: 0, signal: null });
  });

  test("the provider's own worker, killed mid-stream, is replaced on the next call with the model loaded again", async () => {
    await using lm = createLmWorker({ workerOptions: workerOptions(), load: { backend: "echo", token_delay_ms: 5 } });
    const worker = await lm.worker();
    const restarts: WorkerRestart[] = [];
    worker.on("restart", (event) => restarts.push(event));
    // onError: the error part is checked here; the AI SDK would also print it.
    const streamed = streamText({ model: lm("default"), prompt: "k".repeat(2000), onError: () => {} });
    const errors: unknown[] = [];
    let killed = false;
    for await (const part of streamed.fullStream) {
      if (part.type === "text-delta" && !killed) {
        killed = true;
        process.kill(worker.pid!, "SIGKILL");
      }
      if (part.type === "error") errors.push(part.error);
    }
    assert.equal(errors.length, 1);
    assert.ok(errors[0] instanceof WorkerExitedError && errors[0].signal === "SIGKILL", String(errors[0]));

    const { text: after } = await generateText({ model: lm("default"), prompt: "back" });
    assert.equal(after, (await render(lm, [{ role: "user", content: "back" }])).text);
    assert.equal(await lm.worker(), worker, "the same LmWorker, with a new process");
    assert.deepEqual(restarts.map((event) => [event.previous.signal, event.model]), [
      ["SIGKILL", { model: "default", backend: "echo", token_delay_ms: 5 }],
    ]);
  });

  test("the provider has language models only", () => {
    const lm = createLmWorker({ worker });
    assert.throws(() => lm.embeddingModel("default"), (error: unknown) => NoSuchModelError.isInstance(error));
  });
});

describe("the AI SDK provider with the tiny model", () => {
  let lm: LmWorkerProvider;
  let modelDir: string;
  let cacheDir: string;
  before(async () => {
    modelDir = await tinyModel();
    cacheDir = await mkdtemp(join(tmpdir(), "lm-worker-ai-sdk-caches-"));
    lm = createLmWorker({ workerOptions: workerOptions(["--cache-dir", cacheDir]) });
  });
  after(async () => {
    await lm.close();
    await rm(cacheDir, { recursive: true, force: true });
  });

  test("generateText with a required tool returns a call whose input matches the schema", async () => {
    const result = await generateText({
      model: lm(modelDir),
      prompt: "What is the weather in Paris?",
      tools: { weather },
      toolChoice: "required",
      maxOutputTokens: 200,
      // One call: a random model would go on writing calls until maxOutputTokens.
      providerOptions: { lmWorker: { parallelToolCalls: false } },
    });
    assert.equal(result.finishReason, "tool-calls");
    assert.ok(result.toolCalls.length >= 1, JSON.stringify(result.content));
    const [call] = result.toolCalls;
    assert.equal(call!.toolName, "weather");
    assert.ok(!call!.invalid, JSON.stringify(call));
    assert.ok(cityInput.safeParse(call!.input).success, JSON.stringify(call!.input));
    assert.match(call!.toolCallId, /^call_[0-9a-f]{24}$/);
  });

  test("streamText with a named tool streams the call's input, then the call", async () => {
    const result = streamText({
      model: lm(modelDir),
      prompt: "What is the weather in Paris?",
      tools: { weather },
      toolChoice: { type: "tool", toolName: "weather" },
      maxOutputTokens: 200,
      providerOptions: { lmWorker: { parallelToolCalls: false } },
    });
    const types: string[] = [];
    for await (const part of result.fullStream) {
      types.push(part.type);
    }
    const calls = await result.toolCalls;
    assert.equal(calls.length, 1, JSON.stringify(await result.content));
    assert.equal(calls[0]!.toolName, "weather");
    const order = ["tool-input-start", "tool-input-delta", "tool-input-end", "tool-call", "finish"];
    assert.deepEqual(types.filter((type) => order.includes(type)), order);
  });

  test("a call cut off by maxOutputTokens reaches the AI SDK as an invalid tool call, with the model's text", async () => {
    const result = await generateText({
      model: lm(modelDir),
      prompt: "What is the weather in Paris?",
      tools: { weather },
      toolChoice: "required",
      maxOutputTokens: 30,
    });
    assert.equal(result.finishReason, "length");
    const [call] = result.toolCalls;
    assert.equal(result.toolCalls.length, 1);
    assert.equal(call!.invalid, true);
    assert.match(call!.input as string, /^\{"name": "weather"/);
    assert.ok(result.content.some((part) => part.type === "tool-error" && part.toolCallId === call!.toolCallId));
  });

  test("a tool loop: the calls are run and their results go back to the model as tool messages", async () => {
    const result = await generateText({
      model: lm(modelDir),
      prompt: "What is the weather in Paris?",
      tools: { weather: tool({ inputSchema: cityInput, execute: async ({ city }) => ({ city, sky: "clear" }) }) },
      toolChoice: "required",
      prepareStep: ({ stepNumber }) => (stepNumber > 0 ? { toolChoice: "none" } : {}),
      stopWhen: isStepCount(2),
      maxOutputTokens: 200,
      include: { requestBody: true },
    });
    const [calling, answering] = result.steps;
    assert.equal(result.steps.length, 2);
    const calls = calling!.toolCalls.map((call) => ({ id: call.toolCallId, input: call.input as { city: string } }));
    assert.ok(calls.length >= 1);
    assert.equal(answering!.toolCalls.length, 0);
    const sent = (answering!.request.body as { messages: ChatMessage[] }).messages;
    assert.deepEqual(
      sent.filter((message) => message.role === "tool"),
      calls.map(({ id, input }) => ({
        role: "tool",
        tool_call_id: id,
        name: "weather",
        content: JSON.stringify({ city: input.city, sky: "clear" }),
      })),
    );
    assert.deepEqual(
      sent.find((message) => message.role === "assistant")?.tool_calls,
      calls.map(({ id, input }) => ({ id, type: "function", function: { name: "weather", arguments: input } })),
    );
  });

  // Bounded strings and numbers: the random model's output always ends within max tokens.
  const person = z.object({
    name: z.string().max(8),
    mood: z.enum(["happy", "sad"]),
    age: z.number().int().min(0).max(120),
  });

  test("generateText with Output.object returns an object that matches a zod schema", async () => {
    const { output, finishReason } = await generateText({
      model: lm(modelDir),
      output: Output.object({ schema: person }),
      prompt: "Describe someone.",
      maxOutputTokens: 200,
    });
    assert.equal(finishReason, "stop");
    assert.deepEqual(person.parse(output), output);
  });

  test("streamText with Output.object streams partial objects, then the whole one", async () => {
    const result = streamText({
      model: lm(modelDir),
      output: Output.object({ schema: person }),
      prompt: "Describe someone else.",
      maxOutputTokens: 200,
    });
    const partials: unknown[] = [];
    for await (const partial of result.partialOutputStream) {
      partials.push(partial);
    }
    const output = await result.output;
    assert.ok(partials.length > 1, `${partials.length} partial objects`);
    assert.deepEqual(partials.at(-1), output);
    assert.deepEqual(person.parse(output), output);
  });

  test("generateObject and streamObject return objects that match a zod schema", async () => {
    const generated = await generateObject({ model: lm(modelDir), schema: person, prompt: "Describe a friend." });
    assert.deepEqual(person.parse(generated.object), generated.object);
    const streamed = streamObject({ model: lm(modelDir), schema: person, prompt: "Describe a neighbour." });
    const partials: unknown[] = [];
    for await (const partial of streamed.partialObjectStream) {
      partials.push(partial);
    }
    const object = await streamed.object;
    assert.deepEqual(person.parse(object), object);
    assert.deepEqual(partials.at(-1), object);
  });

  test("a draft in providerOptions gives the text of plain decoding, and its counts in the metadata", async () => {
    const prompt = "one two three four one two three four one two three four";
    const plain = await generateText({ model: lm(modelDir), prompt, maxOutputTokens: 40 });
    const drafted = await generateText({
      model: lm(modelDir), prompt, maxOutputTokens: 40,
      // Tails of one token: a random model's output soon repeats a token seen before.
      providerOptions: { lmWorker: { draft: { method: "prompt_lookup", ngram_min: 1 } } },
    });
    assert.equal(drafted.text, plain.text);
    const timings = drafted.providerMetadata?.lmWorker?.timings as { draft_tokens: number } | undefined;
    assert.ok(timings !== undefined && timings.draft_tokens > 0, JSON.stringify(drafted.providerMetadata));
  });

  test('a second turn with cache "auto" reads the first turn\'s tokens from the cache; cacheWrite counts input tokens only', async () => {
    const providerOptions = { lmWorker: { cache: "auto" } };
    const messages: ModelMessage[] = [{ role: "user", content: "Tell me a story about a cat." }];
    const first = await generateText({ model: lm(modelDir), messages, maxOutputTokens: 8, providerOptions });
    assert.equal(first.usage.inputTokenDetails.cacheReadTokens, 0);
    // Nothing was read: every input token was written, and the stored generated tokens are no input.
    assert.equal(first.usage.inputTokenDetails.cacheWriteTokens, first.usage.inputTokens);
    const metadata = first.providerMetadata?.lmWorker as { cache: { stored: string; stored_tokens: number }; cacheWriteTokens: number };
    assert.match(metadata.cache.stored, /^auto-[0-9a-f]{24}$/);
    assert.equal(metadata.cacheWriteTokens, metadata.cache.stored_tokens);
    assert.ok(metadata.cacheWriteTokens > first.usage.inputTokens!, JSON.stringify(metadata));

    messages.push(...first.response.messages, { role: "user", content: "And about a dog?" });
    const second = await generateText({ model: lm(modelDir), messages, maxOutputTokens: 8, providerOptions });
    const read = second.usage.inputTokenDetails.cacheReadTokens!;
    assert.ok(read > 0, JSON.stringify(second.usage));
    assert.equal(second.usage.inputTokenDetails.noCacheTokens, second.usage.inputTokens! - read);
    assert.equal(second.usage.inputTokenDetails.cacheWriteTokens, second.usage.inputTokens! - read);
  });

  test("the ready lmWorker provider starts its own worker on first use", async () => {
    const { text, finishReason } = await generateText({ model: lmWorker(modelDir), prompt: "Hi", maxOutputTokens: 3 });
    assert.match(finishReason, /^(stop|length)$/);
    assert.equal(typeof text, "string");
    assert.equal(lmWorker(modelDir).provider, "lm-worker");
    await lmWorker.close();
  });

  test("onLoadProgress sees the stages of the model's load, each up to its total", async () => {
    const seen: LoadProgress[] = [];
    // int4 weights: quantized at every load (a model directory's int8 weights are kept after its first)
    await using own = createLmWorker({
      workerOptions: workerOptions(), load: { quantization: "int4" }, onLoadProgress: (p) => seen.push(p),
    });
    await generateText({ model: own(modelDir), prompt: "Hi", maxOutputTokens: 2 });
    const quantizing = seen.filter((p) => p.stage === "quantizing");
    assert.deepEqual(quantizing.map((p) => p.done), [0, 15], JSON.stringify(seen));
    assert.ok(seen.every((p) => p.total === seen.find((q) => q.stage === p.stage)!.total));
  });

  // Last: these leave the worker without a model; the next call would load it again.
  test("an unknown model is a NoSuchModelError and a model that fails to load a LoadSettingError, the RpcError their cause", async () => {
    await assert.rejects(generateText({ model: lm(join(cacheDir, "no-such-model")), prompt: "x" }), (error: unknown) => {
      assert.ok(NoSuchModelError.isInstance(error), String(error));
      assert.equal(error.modelId, join(cacheDir, "no-such-model"));
      assert.ok(error.cause instanceof RpcError && error.cause.kind === "model_not_found");
      return true;
    });
    await assert.rejects(generateText({ model: lm(cacheDir), prompt: "x" }), (error: unknown) => {
      assert.ok(LoadSettingError.isInstance(error), String(error));
      assert.ok(error.cause instanceof RpcError && error.cause.kind === "model_load_failed");
      assert.match(error.message, /no config\.json/);
      return true;
    });
  });
});

describe("the AI SDK provider with a reasoning model", () => {
  let lm: LmWorkerProvider;
  let modelDir: string;
  before(async () => {
    // The tiny model with a reasoning model's chat template: its generation prompt opens the
    // thinking (<think>), and its random weights never close it.
    modelDir = await mkdtemp(join(tmpdir(), "lm-worker-thinking-"));
    execFileSync(python(), ["-m", "worker.backends.transformers.tiny_model", modelDir, "--thinking"], {
      env: workerEnv(),
      timeout: 300_000,
    });
    lm = createLmWorker({ workerOptions: workerOptions() });
  });
  after(async () => {
    await lm.close();
    await rm(modelDir, { recursive: true, force: true });
  });

  test("streamText streams the thinking as reasoning parts and counts its tokens; generateText returns it as reasoning", async () => {
    const streamed = streamText({ model: lm(modelDir), prompt: "the cat sat on the mat", maxOutputTokens: 6 });
    const parts = [];
    for await (const part of streamed.fullStream) parts.push(part);
    const kinds = parts.map((part) => part.type).filter((type) => /^(reasoning|text)-/.test(type));
    assert.equal(kinds[0], "reasoning-start");
    assert.equal(kinds.at(-1), "reasoning-end");
    assert.ok(!kinds.some((kind) => kind.startsWith("text-")), kinds.join());
    const thought = parts.flatMap((part) => (part.type === "reasoning-delta" ? [part.text] : [])).join("");
    assert.ok(thought.length > 0);
    const step = await streamed.finalStep;
    assert.equal(step.reasoningText, thought);
    assert.equal(step.text, "");
    assert.deepEqual(step.usage.outputTokenDetails, { textTokens: 0, reasoningTokens: 6 });

    const generated = await generateText({ model: lm(modelDir), prompt: "the cat sat on the mat", maxOutputTokens: 6 });
    assert.deepEqual(generated.reasoning.map((part) => part.type), ["reasoning"]);
    assert.equal(generated.reasoningText, thought); // greedy: the same thinking
    assert.equal(generated.text, "");
    assert.equal(generated.usage.outputTokenDetails.reasoningTokens, 6);
  });
});

describe("the AI SDK's conventions", () => {
  let lm: LmWorkerProvider;
  before(() => {
    lm = createLmWorker({ workerOptions: workerOptions(), load: { backend: "echo" } });
  });
  after(async () => {
    await lm.close();
  });

  const requestBody = async (providerOptions: Record<string, Record<string, JSONValue>>) => {
    const result = await generateText({ model: lm("default"), prompt: "p", providerOptions, include: { requestBody: true } });
    return { body: result.request.body as Record<string, unknown>, warnings: result.warnings };
  };

  test("providerOptions.lmWorker reaches the request; the old \"lm-worker\" key too, with a deprecation warning", async () => {
    const current = await requestBody({ lmWorker: { minP: 0.25, repetitionPenalty: 1.1 } });
    assert.equal(current.body.min_p, 0.25);
    assert.equal(current.body.repetition_penalty, 1.1);
    assert.deepEqual(current.warnings, []);

    const old = await requestBody({ "lm-worker": { minP: 0.5 } });
    assert.equal(old.body.min_p, 0.5);
    assert.deepEqual(old.warnings, [{ type: "deprecated", setting: 'providerOptions["lm-worker"]', message: "use providerOptions.lmWorker" }]);

    const both = await requestBody({ lmWorker: { minP: 0.1 }, "lm-worker": { minP: 0.9 } });
    assert.equal(both.body.min_p, 0.1);
    assert.match((both.warnings![0] as { message: string }).message, /is ignored/);

    const noDraft = await requestBody({ lmWorker: { draft: null } }); // as LmWorkerCallOptions types it
    assert.equal(noDraft.body.draft, null);

    const unknown = await requestBody({ lmWorker: { topA: 3 } });
    assert.deepEqual(unknown.warnings, [{ type: "unsupported", feature: "providerOptions.lmWorker.topA" }]);
  });

  test("provider options are checked before anything is sent: a wrong one is an InvalidArgumentError naming it", async () => {
    // A provider whose worker could not even start: the check comes first.
    const unstartable = createLmWorker({ workerOptions: { python: join(tmpdir(), "no-such-python") } });
    for (const [options, named] of [
      [{ minP: "high" }, /minP/],
      [{ cacheTrimTokens: -1 }, /cacheTrimTokens/],
      [{ draft: { method: "prompt_lookup", ngram_min: 99 } }, /draft\.ngram_min/],
    ] as const) {
      await assert.rejects(
        generateText({ model: unstartable("default"), prompt: "x", providerOptions: { lmWorker: options } }),
        (error: unknown) => {
          assert.ok(InvalidArgumentError.isInstance(error), String(error));
          assert.equal(error.argument, "providerOptions.lmWorker");
          assert.match(error.message, named);
          return true;
        },
      );
    }
  });

  test("a worker error of a call is an APICallError, not retryable for a bad request, with the RpcError as its cause", async () => {
    const tooMany = Array.from({ length: 33 }, (_, i) => `stop${i}`);
    await assert.rejects(generateText({ model: lm("default"), prompt: "x", stopSequences: tooMany, maxRetries: 0 }), (error: unknown) => {
      assert.ok(APICallError.isInstance(error), String(error));
      assert.equal(error.isRetryable, false);
      assert.ok(error.cause instanceof RpcError && error.cause.kind === "invalid_params");
      assert.equal(error.url, "lm-worker:generate");
      return true;
    });
  });

  test("a model server's faults: a model it does not serve is a NoSuchModelError, an overloaded server a retryable APICallError", async () => {
    // A real OpenAI-compatible server for the openai backend: it serves one model and is overloaded for the rest.
    let overloaded = false;
    const server = createServer((request, response) => {
      if (request.url === "/v1/models" && !overloaded) {
        response.setHeader("content-type", "application/json");
        response.end(JSON.stringify({ object: "list", data: [{ id: "served", object: "model" }] }));
      } else {
        response.statusCode = 503;
        response.end("busy");
      }
    });
    await new Promise<void>((listening) => server.listen(0, "127.0.0.1", listening));
    const base_url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/v1`;
    const remote = createLmWorker({ worker: await lm.worker(), load: { backend: "openai", base_url } });
    try {
      await assert.rejects(generateText({ model: remote("other"), prompt: "x", maxRetries: 0 }), (error: unknown) => {
        assert.ok(NoSuchModelError.isInstance(error), String(error));
        assert.ok(error.cause instanceof RpcError && error.cause.kind === "model_not_served");
        return true;
      });
      // Loaded, then the server is overloaded: the generate fails, and the AI SDK may retry it.
      await assert.rejects(generateText({ model: remote("served"), prompt: "x", maxRetries: 0 }), (error: unknown) => {
        assert.ok(APICallError.isInstance(error), String(error));
        assert.equal(error.isRetryable, true);
        assert.ok(error.cause instanceof RpcError && error.cause.kind === "engine_overloaded");
        return true;
      });
      // The same at load: overloaded is retryable there too.
      overloaded = true;
      await assert.rejects(generateText({ model: remote("served-again"), prompt: "x", maxRetries: 0 }), (error: unknown) => {
        assert.ok(APICallError.isInstance(error) && error.isRetryable, String(error));
        assert.equal(error.url, "lm-worker:load");
        return true;
      });
    } finally {
      server.close();
    }
  });
});
