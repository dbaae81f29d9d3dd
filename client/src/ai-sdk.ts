/**
 * An AI SDK provider (`import { createLmWorker } from "lm-worker/ai-sdk"`): `generateText`,
 * `streamText`, tools and structured output of the `ai` package, run by an lm-worker.
 *
 * It implements the AI SDK's LanguageModelV4 specification, whose types and error classes
 * come from `@ai-sdk/provider` (a dependency, so that they resolve wherever the package is
 * installed): the worker's errors reach the AI SDK as its own (NoSuchModelError,
 * LoadSettingError, APICallError), so its retries and `isInstance` checks work.
 */

import {
  APICallError,
  InvalidArgumentError,
  LoadSettingError,
  NoSuchModelError,
  UnsupportedFunctionalityError,
} from "@ai-sdk/provider";
import type {
  JSONObject,
  LanguageModelV4,
  LanguageModelV4CallOptions,
  LanguageModelV4Content,
  LanguageModelV4FinishReason,
  LanguageModelV4GenerateResult,
  LanguageModelV4Message,
  LanguageModelV4Prompt,
  LanguageModelV4StreamPart,
  LanguageModelV4StreamResult,
  LanguageModelV4ToolResultOutput,
  LanguageModelV4Usage,
  ProviderV4,
  SharedV4ProviderMetadata,
  SharedV4Warning,
} from "@ai-sdk/provider";

import { z } from "zod";

import { LmWorker, type GenerateStream, type WorkerOptions } from "./client.js";
import { RpcError } from "./errors.js";
import type {
  ChatMessage,
  ErrorKind,
  GenerateParams,
  GenerateResult,
  LoadParams,
  LoadProgress,
  MessageToolCall,
  Tool,
  ToolCall,
} from "./protocol-types.js";

/** The provider's name, as its models report it. */
const PROVIDER = "lm-worker";
/** The key of `providerOptions` and `providerMetadata` for this provider (camelCase, as the AI SDK's). */
const KEY = "lmWorker";
/** The key `providerOptions` had before; still read, with a deprecation warning. */
const OLD_KEY = "lm-worker";

export interface LmWorkerProviderSettings {
  /** A running worker to use; the provider neither starts nor closes it. */
  worker?: LmWorker;
  /**
   * How to start the provider's own worker (on first use) when `worker` is not given. It is
   * restarted when it exits unasked (`restart: true` unless these options say otherwise): a
   * long-running server keeps its provider through a crashed worker.
   */
  workerOptions?: WorkerOptions;
  /** The rest of `load`'s params (`backend`, `dtype`, `quantization`, …); the model id is `model`. */
  load?: Omit<LoadParams, "model">;
  /** Sees the stages of a long load of a model (the first load of "default" converts it), as `LmWorker.load`'s `onProgress`. */
  onLoadProgress?: (progress: LoadProgress) => void;
}

/** `providerOptions.lmWorker` of a call. */
export interface LmWorkerCallOptions {
  /** `"auto"` (find the longest stored prefix, store this turn) or a cache ref (PROTOCOL §18). */
  cache?: string;
  /** With a cache ref: use at most this many of its tokens. */
  cacheTrimTokens?: number;
  minP?: number;
  repetitionPenalty?: number;
  /** With `toolChoice` "required" or a named tool: false allows exactly one call (default true). */
  parallelToolCalls?: boolean;
  /** Speculative decoding, the same output sooner where it repeats the prompt: `{ method: "prompt_lookup" }` (PROTOCOL §21). */
  draft?: GenerateParams["draft"];
}

export interface LmWorkerProvider extends ProviderV4 {
  /**
   * The language model that `load` names `modelId`: "default", a model directory, a .gguf file, or
   * a model another tool keeps ("ollama:qwen2.5-coder:0.5b", "hf:Qwen/Qwen2.5-0.5B-Instruct", a
   * gguf's name in node-llama-cpp's folder: PROTOCOL §24; `LmWorker.listModels` names them).
   */
  (modelId?: string): LanguageModelV4;
  languageModel(modelId?: string): LanguageModelV4;
  /** The worker, started if the provider starts its own. */
  worker(): Promise<LmWorker>;
  /** Close the worker the provider started (a `worker` passed in is left running). */
  close(): Promise<void>;
  /** `await using lm = createLmWorker(…)`: `close()` as the scope ends. */
  [Symbol.asyncDispose](): Promise<void>;
}

export function createLmWorker(settings: LmWorkerProviderSettings = {}): LmWorkerProvider {
  let started: Promise<LmWorker> | undefined;
  const worker = (): Promise<LmWorker> => {
    if (settings.worker) {
      return Promise.resolve(settings.worker);
    }
    if (started === undefined) {
      const starting = LmWorker.start({ restart: true, ...settings.workerOptions });
      started = starting;
      starting.catch(() => {
        if (started === starting) started = undefined; // a failed start is tried again on the next call
      });
    }
    return started;
  };
  const languageModel = (modelId = "default"): LanguageModelV4 =>
    new LmWorkerLanguageModel(modelId, { model: modelId, ...settings.load }, worker, settings.onLoadProgress);
  const provider = Object.assign(languageModel, {
    specificationVersion: "v4" as const,
    languageModel,
    worker,
    async close(): Promise<void> {
      const running = started;
      started = undefined;
      await (await running?.catch(() => undefined))?.close();
    },
    [Symbol.asyncDispose](): Promise<void> {
      return provider.close();
    },
    embeddingModel(modelId: string): never {
      throw new NoSuchModelError({ modelId, modelType: "embeddingModel", message: `lm-worker has language models only: ${modelId}` });
    },
    imageModel(modelId: string): never {
      throw new NoSuchModelError({ modelId, modelType: "imageModel", message: `lm-worker has language models only: ${modelId}` });
    },
  });
  return provider;
}

/**
 * A ready provider, as other providers ship one: `lmWorker("default")`. Its worker (the
 * default options, restarted if it crashes) starts on the first call; `lmWorker.close()`
 * stops it.
 */
export const lmWorker: LmWorkerProvider = createLmWorker();

// --- the model -----------------------------------------------------------------------------

class LmWorkerLanguageModel implements LanguageModelV4 {
  readonly specificationVersion = "v4";
  readonly provider = PROVIDER;
  readonly supportedUrls = {};

  constructor(
    readonly modelId: string,
    private readonly load: LoadParams,
    private readonly worker: () => Promise<LmWorker>,
    private readonly onLoadProgress?: (progress: LoadProgress) => void,
  ) {}

  async doGenerate(options: LanguageModelV4CallOptions): Promise<LanguageModelV4GenerateResult> {
    const { params, warnings } = toGenerateParams(options);
    const signal = options.abortSignal;
    const { stream, timestamp } = await this.start({ ...params, stream: false }, signal);
    // Reject at the abort itself, as fetch does; the worker's cancelled answer comes later.
    const result = await untilAborted(stream.result, signal).catch((error: unknown) => {
      throw callError(error, "generate", params);
    });
    return {
      content: toContent(result),
      finishReason: toFinishReason(result.finish_reason),
      usage: toUsage(result),
      providerMetadata: toProviderMetadata(result),
      request: { body: params },
      response: { id: responseId(stream), modelId: this.modelId, timestamp, body: result },
      warnings,
    };
  }

  async doStream(options: LanguageModelV4CallOptions): Promise<LanguageModelV4StreamResult> {
    const { params, warnings } = toGenerateParams(options);
    // Our own controller too: a consumer that cancels the stream cancels the generation.
    const cancel = new AbortController();
    const signal = options.abortSignal ? AbortSignal.any([options.abortSignal, cancel.signal]) : cancel.signal;
    const { stream, timestamp } = await this.start(params, signal);
    const parts = streamParts(stream, params, signal, options.includeRawChunks === true);
    const head: LanguageModelV4StreamPart[] = [
      { type: "stream-start", warnings },
      { type: "response-metadata", id: responseId(stream), modelId: this.modelId, timestamp },
    ];
    return {
      stream: new ReadableStream<LanguageModelV4StreamPart>({
        async pull(controller) {
          const next = head.shift() ?? (await parts.next()).value;
          if (next === undefined) {
            controller.close();
          } else {
            controller.enqueue(next);
          }
        },
        cancel(reason) {
          cancel.abort(reason);
        },
      }),
      request: { body: params },
    };
  }

  /** Send the generate once the worker runs this model. */
  private async start(
    params: GenerateParams,
    signal: AbortSignal | undefined,
  ): Promise<{ stream: GenerateStream; timestamp: Date }> {
    const worker = await untilAborted(this.worker(), signal);
    const stream = await ModelSlot.of(worker)
      .send(this.load, signal, () => worker.generate(params, { signal }), this.onLoadProgress)
      .catch((error: unknown) => {
        throw loadError(error, this.modelId, this.load);
      });
    return { stream, timestamp: new Date() };
  }
}

/**
 * Which model a worker runs, as far as the providers using it know. One worker holds one
 * model; a call for another one loads it (so two models on one worker take turns, reloading).
 * The worker runs requests in arrival order, and a load waits for the generates sent before
 * it: a generate sent while the last load sent is this model's, and answered, runs on it.
 * The providers assume that they alone load models on the worker.
 */
class ModelSlot {
  private static readonly slots = new WeakMap<LmWorker, ModelSlot>();
  /** The model loaded, or being loaded by `loading`; undefined: none, or unknown. */
  private key: string | undefined;
  private loading: Promise<unknown> = Promise.resolve();
  /** Settles once the worker has said which model it runs. */
  private readonly asked: Promise<void>;

  private constructor(private readonly worker: LmWorker) {
    // A worker passed in may run a model loaded since it started (its `capabilities` then): ask.
    this.asked = worker.call("capabilities").then(
      ({ model }) => {
        if (model) this.key = slotKey({ model: model.model, backend: model.backend });
      },
      () => {}, // the load that follows reports what is wrong with the worker
    );
  }

  static of(worker: LmWorker): ModelSlot {
    let slot = ModelSlot.slots.get(worker);
    if (slot === undefined) {
      slot = new ModelSlot(worker);
      ModelSlot.slots.set(worker, slot);
    }
    return slot;
  }

  /** Call `send` once `load`'s model is the worker's, loading it unless it is, or is being, loaded. */
  async send<T>(
    load: LoadParams,
    signal: AbortSignal | undefined,
    send: () => T,
    onProgress?: (progress: LoadProgress) => void,
  ): Promise<T> {
    const key = slotKey(load);
    await untilAborted(this.asked, signal);
    for (;;) {
      if (this.key !== key) this.switchTo(load, key, onProgress);
      await untilAborted(this.loading, signal);
      // Another call may have switched models meanwhile: send only while the model is still this one.
      if (this.key === key) return send();
    }
  }

  private switchTo(load: LoadParams, key: string, onProgress?: (progress: LoadProgress) => void): void {
    this.key = key;
    const loading = this.loading.catch(() => {}).then(() => this.worker.load(load, { onProgress }));
    loading.catch(() => {
      if (this.key === key) this.key = undefined; // the next call tries the load again
    });
    this.loading = loading;
  }
}

/** Load params as a key: a model found loaded is known by its name and backend only. */
function slotKey(load: LoadParams): string {
  const params: Record<string, unknown> = { backend: "transformers", ...load };
  return JSON.stringify(Object.keys(params).sort().map((name) => [name, params[name]]));
}

// --- the request ---------------------------------------------------------------------------

function toGenerateParams(options: LanguageModelV4CallOptions): { params: GenerateParams; warnings: SharedV4Warning[] } {
  const warnings: SharedV4Warning[] = [];
  for (const feature of ["presencePenalty", "frequencyPenalty"] as const) {
    if (options[feature] !== undefined) warnings.push({ type: "unsupported", feature });
  }
  if (options.reasoning !== undefined && options.reasoning !== "provider-default") {
    warnings.push({ type: "unsupported", feature: "reasoning", details: "lm-worker does not control reasoning" });
  }
  const params: GenerateParams = {
    messages: toMessages(options.prompt),
    max_tokens: options.maxOutputTokens,
    temperature: options.temperature,
    top_p: options.topP,
    top_k: options.topK,
    seed: options.seed,
    stop: options.stopSequences,
    ...toTools(options, warnings),
    response_format: toResponseFormat(options.responseFormat),
    ...toWorkerOptions(options.providerOptions, warnings),
  };
  // Leave out what the call did not set: the worker's defaults apply, and the request stays readable.
  const defined = Object.entries(params).filter(([, value]) => value !== undefined);
  return { params: Object.fromEntries(defined) as GenerateParams, warnings };
}

function toTools(
  options: LanguageModelV4CallOptions,
  warnings: SharedV4Warning[],
): Pick<GenerateParams, "tools" | "tool_choice"> {
  const tools: Tool[] = [];
  for (const tool of options.tools ?? []) {
    if (tool.type === "function") {
      tools.push({
        type: "function",
        function: { name: tool.name, description: tool.description, parameters: tool.inputSchema as Record<string, unknown> },
      });
    } else {
      warnings.push({ type: "unsupported", feature: `provider tool ${tool.id}` });
    }
  }
  if (tools.length === 0) {
    return {};
  }
  return { tools, tool_choice: toToolChoice(options.toolChoice) };
}

function toToolChoice(choice: LanguageModelV4CallOptions["toolChoice"]): GenerateParams["tool_choice"] {
  if (choice === undefined) return "auto";
  return choice.type === "tool" ? { type: "function", function: { name: choice.toolName } } : choice.type;
}

function toResponseFormat(format: LanguageModelV4CallOptions["responseFormat"]): GenerateParams["response_format"] {
  if (format?.type !== "json") {
    return undefined;
  }
  if (format.schema === undefined) {
    return { type: "json_object" };
  }
  return {
    type: "json_schema",
    json_schema: {
      schema: format.schema as Record<string, unknown>,
      ...(format.name !== undefined && { name: format.name }),
      ...(format.description !== undefined && { description: format.description }),
    },
  };
}

/**
 * `providerOptions.lmWorker`, checked before anything is sent: the protocol's types and
 * bounds (schemas/generate.params.json), so a wrong value fails at once, naming its option.
 * Options it does not know are left out, with a warning.
 */
const callOptionsSchema = z.object({
  cache: z.string().optional(),
  cacheTrimTokens: z.number().int().min(0).optional(),
  minP: z.number().min(0).max(1).optional(),
  repetitionPenalty: z.number().positive().optional(),
  parallelToolCalls: z.boolean().optional(),
  draft: z
    .object({
      method: z.literal("prompt_lookup"),
      draft_tokens: z.number().int().min(1).max(64).optional(),
      ngram_max: z.number().int().min(1).max(16).optional(),
      ngram_min: z.number().int().min(1).max(16).optional(),
    })
    .strict()
    .nullable()
    .optional(),
}) satisfies z.ZodType<LmWorkerCallOptions>;

function toWorkerOptions(
  providerOptions: LanguageModelV4CallOptions["providerOptions"],
  warnings: SharedV4Warning[],
): Partial<GenerateParams> {
  let key: string = KEY;
  if (providerOptions?.[OLD_KEY] !== undefined) {
    const ignored = providerOptions[KEY] !== undefined;
    warnings.push({
      type: "deprecated",
      setting: `providerOptions["${OLD_KEY}"]`,
      message: `use providerOptions.${KEY}${ignored ? ` (given too: providerOptions["${OLD_KEY}"] is ignored)` : ""}`,
    });
    if (!ignored) key = OLD_KEY;
  }
  const given = providerOptions?.[key] ?? {};
  const parsed = callOptionsSchema.safeParse(given);
  if (!parsed.success) {
    throw new InvalidArgumentError({
      argument: `providerOptions.${key}`,
      message: `invalid lm-worker provider options:\n${z.prettifyError(parsed.error)}`,
      cause: parsed.error,
    });
  }
  for (const name of Object.keys(given).filter((name) => !(name in callOptionsSchema.shape))) {
    warnings.push({ type: "unsupported", feature: `providerOptions.${key}.${name}` });
  }
  const { cache, cacheTrimTokens, minP, repetitionPenalty, parallelToolCalls, draft } = parsed.data;
  return {
    cache,
    cache_trim_tokens: cacheTrimTokens,
    min_p: minP,
    repetition_penalty: repetitionPenalty,
    parallel_tool_calls: parallelToolCalls,
    draft,
  };
}

// --- the prompt ----------------------------------------------------------------------------

function toMessages(prompt: LanguageModelV4Prompt): ChatMessage[] {
  return prompt.flatMap(toChatMessages);
}

function toChatMessages(message: LanguageModelV4Message): ChatMessage[] {
  switch (message.role) {
    case "system":
      return [{ role: "system", content: message.content }];
    case "user":
      return [{ role: "user", content: message.content.map((part) => (part.type === "text" ? part.text : unsupportedFile())).join("") }];
    case "assistant":
      return toAssistantMessages(message.content);
    case "tool":
      // Approval responses concern provider-executed tools, which lm-worker has none of.
      return message.content.flatMap((part) => (part.type === "tool-result" ? [toToolMessage(part)] : []));
  }
}

type AssistantPart = Extract<LanguageModelV4Message, { role: "assistant" }>["content"][number];

function toAssistantMessages(parts: AssistantPart[]): ChatMessage[] {
  let content = "";
  const calls: MessageToolCall[] = [];
  const results: ChatMessage[] = [];
  for (const part of parts) {
    if (part.type === "text") {
      content += part.text;
    } else if (part.type === "tool-call") {
      calls.push({ id: part.toolCallId, type: "function", function: { name: part.toolName, arguments: toArguments(part.input) } });
    } else if (part.type === "tool-result") {
      results.push(toToolMessage(part));
    } else if (part.type === "file") {
      unsupportedFile();
    }
    // Reasoning is the model's own scratch work: templates drop it from earlier turns too.
  }
  return [{ role: "assistant", content, ...(calls.length > 0 && { tool_calls: calls }) }, ...results];
}

/** A call's input as the chat template takes it: an object, or text that is not one (an invalid call's). */
function toArguments(input: unknown): Record<string, unknown> | string {
  if (typeof input === "string") return input;
  if (typeof input === "object" && input !== null && !Array.isArray(input)) return input as Record<string, unknown>;
  return JSON.stringify(input);
}

function toToolMessage(part: { toolCallId: string; toolName: string; output: LanguageModelV4ToolResultOutput }): ChatMessage {
  return { role: "tool", tool_call_id: part.toolCallId, name: part.toolName, content: outputText(part.output) };
}

function outputText(output: LanguageModelV4ToolResultOutput): string {
  switch (output.type) {
    case "text":
    case "error-text":
      return output.value;
    case "json":
    case "error-json":
      return JSON.stringify(output.value);
    case "execution-denied":
      return `The tool was not run: ${output.reason ?? "the user denied it"}.`;
    case "content":
      return output.value.map((part) => (part.type === "text" ? part.text : unsupportedFile())).join("\n");
  }
}

function unsupportedFile(): never {
  throw new UnsupportedFunctionalityError({ functionality: "file parts", message: "lm-worker runs text models: send text, not files." });
}

// --- the answer ----------------------------------------------------------------------------

function toContent(result: GenerateResult): LanguageModelV4Content[] {
  // The model's thinking first (it comes before the answer); whitespace alone (the line
  // breaks between calls) is no text part.
  const reasoning: LanguageModelV4Content[] = result.reasoning ? [{ type: "reasoning", text: result.reasoning }] : [];
  const content: LanguageModelV4Content[] = result.content.trim() ? [{ type: "text", text: result.content }] : [];
  return [...reasoning, ...content, ...result.tool_calls.map(toToolCallPart)];
}

/**
 * A malformed call (not JSON, an unknown tool) keeps its raw text as the input, so that the
 * AI SDK reports it as an invalid tool call rather than dropping it.
 */
function toToolCallPart(call: ToolCall): Extract<LanguageModelV4Content, { type: "tool-call" }> {
  return {
    type: "tool-call",
    toolCallId: call.id,
    toolName: call.name ?? "",
    input: call.error === null ? JSON.stringify(call.arguments ?? {}) : call.raw,
  };
}

function toFinishReason(reason: GenerateResult["finish_reason"] | undefined): LanguageModelV4FinishReason {
  const unified = { stop: "stop", length: "length", tool_calls: "tool-calls", cancelled: "other" } as const;
  return { unified: reason === undefined ? "error" : unified[reason], raw: reason };
}

function toUsage(result: GenerateResult | undefined): LanguageModelV4Usage {
  const usage = result?.usage;
  return {
    inputTokens: {
      total: usage?.prompt_tokens,
      noCache: usage && usage.prompt_tokens - usage.cache_read_tokens,
      cacheRead: usage?.cache_read_tokens,
      cacheWrite: result && inputTokensWritten(result),
    },
    outputTokens: {
      total: usage?.completion_tokens,
      text: usage && usage.completion_tokens - usage.reasoning_tokens,
      reasoning: usage?.reasoning_tokens,
    },
    ...(usage && { raw: { ...usage } }),
  };
}

/**
 * The prompt tokens written to a cache: a ref's prefill wrote prompt tokens alone; `"auto"`
 * stores the generated tokens too, which are no input (PROTOCOL §18.3: its count is the
 * stored tokens after the reused ones, so the input among them is at most the prompt's rest).
 */
function inputTokensWritten({ usage, cache }: GenerateResult): number {
  if (cache?.mode !== "auto") return usage.cache_write_tokens;
  return Math.min(usage.cache_write_tokens, usage.prompt_tokens - usage.cache_read_tokens);
}

function toProviderMetadata(result: GenerateResult): SharedV4ProviderMetadata {
  // The protocol's types are plain JSON, declared as interfaces (which JSONObject's index signature does not take).
  const metadata = {
    cache: result.cache,
    // All the tokens this call wrote to a cache, the generated ones of an "auto" store included.
    cacheWriteTokens: result.usage.cache_write_tokens,
    timings: result.timings,
    stopReason: result.stop_reason,
  };
  return { [KEY]: metadata as unknown as JSONObject };
}

function responseId(stream: GenerateStream): string {
  return `generate-${stream.id}`;
}

/**
 * The stream's parts after its head: the model's thinking and text as they come (outside
 * tool calls; a thinking part ends where text begins), each tool call once complete, then
 * `finish`. A worker error becomes an `error` part and a `finish` with
 * finish reason "error"; an abort ends it with the abort's reason, as a fetch body does.
 */
async function* streamParts(
  stream: GenerateStream,
  params: GenerateParams,
  signal: AbortSignal,
  includeRaw: boolean,
): AsyncGenerator<LanguageModelV4StreamPart, undefined> {
  const textId = "text";
  let textOpen = false;
  let thoughts = 0; // reasoning parts begun
  let reasoningOpen = false;
  let blank = ""; // whitespace before any text (the line breaks between calls): no text part unless text follows
  let result: GenerateResult | undefined;
  try {
    const chunks = stream[Symbol.asyncIterator]();
    for (;;) {
      const next = await untilAborted(chunks.next(), signal);
      if (next.done) break;
      const chunk = next.value;
      if (includeRaw) yield { type: "raw", rawValue: chunk };
      if (chunk.reasoning) {
        if (!reasoningOpen) yield { type: "reasoning-start", id: `reasoning-${++thoughts}` };
        reasoningOpen = true;
        yield { type: "reasoning-delta", id: `reasoning-${thoughts}`, delta: chunk.reasoning };
      }
      if (reasoningOpen && chunk.content.trim() !== "") {
        yield { type: "reasoning-end", id: `reasoning-${thoughts}` };
        reasoningOpen = false;
      }
      if (!textOpen && chunk.content.trim() === "") {
        blank += chunk.content;
      } else {
        if (!textOpen) yield { type: "text-start", id: textId };
        textOpen = true;
        yield { type: "text-delta", id: textId, delta: blank + chunk.content };
        blank = "";
      }
      for (const call of chunk.tool_calls) {
        yield* toolCallParts(call);
      }
    }
    result = await untilAborted(stream.result, signal);
  } catch (error) {
    if (signal.aborted) throw error;
    yield { type: "error", error: callError(error, "generate", params) };
  }
  if (reasoningOpen) yield { type: "reasoning-end", id: `reasoning-${thoughts}` };
  if (textOpen) yield { type: "text-end", id: textId };
  yield {
    type: "finish",
    finishReason: toFinishReason(result?.finish_reason),
    usage: toUsage(result),
    ...(result && { providerMetadata: toProviderMetadata(result) }),
  };
  return undefined;
}

function* toolCallParts(call: ToolCall): Generator<LanguageModelV4StreamPart> {
  const part = toToolCallPart(call);
  // The worker reports a call once it is complete: its input arrives as one delta.
  yield { type: "tool-input-start", id: call.id, toolName: part.toolName };
  yield { type: "tool-input-delta", id: call.id, delta: part.input };
  yield { type: "tool-input-end", id: call.id };
  yield part;
}

/** `promise`, or a rejection with the signal's reason as soon as it aborts. */
function untilAborted<T>(promise: Promise<T>, signal: AbortSignal | undefined): Promise<T> {
  if (signal === undefined) {
    return promise;
  }
  promise.catch(() => {}); // given up on after an abort: its later failure is nobody's
  if (signal.aborted) {
    return Promise.reject(signal.reason);
  }
  return new Promise<T>((resolve, reject) => {
    const abort = () => reject(signal.reason);
    signal.addEventListener("abort", abort, { once: true });
    promise.then(resolve, reject).finally(() => signal.removeEventListener("abort", abort));
  });
}

// --- errors ----------------------------------------------------------------------------------

/** Faults of a model server that may well pass: the AI SDK retries a call that failed with one. */
const RETRYABLE = new Set<ErrorKind | undefined>(["engine_unreachable", "engine_overloaded", "engine_stalled", "engine_error"]);

/** The worker's answer to a load as the AI SDK's error (the RpcError its cause); any other error as it is. */
function loadError(error: unknown, modelId: string, load: LoadParams): unknown {
  if (!(error instanceof RpcError)) return error;
  if (error.kind === "model_not_found" || error.kind === "model_not_served") {
    return withCause(new NoSuchModelError({ modelId, modelType: "languageModel", message: error.message }), error);
  }
  if (RETRYABLE.has(error.kind)) return callError(error, "load", load);
  return withCause(new LoadSettingError({ message: error.message }), error);
}

/** The worker's error answer to a call as the AI SDK's APICallError; any other error as it is. */
function callError(error: unknown, method: string, params: unknown): unknown {
  if (!(error instanceof RpcError)) return error;
  return new APICallError({
    message: error.message,
    url: `lm-worker:${method}`, // the worker is no HTTP server: the method stands for the endpoint
    requestBodyValues: params,
    isRetryable: RETRYABLE.has(error.kind),
    data: error.data,
    cause: error,
  });
}

/** NoSuchModelError and LoadSettingError take no cause: set it, so that the RpcError stays reachable. */
function withCause<E extends Error>(error: E, cause: RpcError): E {
  Object.defineProperty(error, "cause", { value: cause, configurable: true, writable: true });
  return error;
}
