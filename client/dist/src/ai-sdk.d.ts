/**
 * An AI SDK provider (`import { createLmWorker } from "lm-worker/ai-sdk"`): `generateText`,
 * `streamText`, tools and structured output of the `ai` package, run by an lm-worker.
 *
 * It implements the AI SDK's LanguageModelV4 specification, whose types and error classes
 * come from `@ai-sdk/provider` (a dependency, so that they resolve wherever the package is
 * installed): the worker's errors reach the AI SDK as its own (NoSuchModelError,
 * LoadSettingError, APICallError), so its retries and `isInstance` checks work.
 */
import type { LanguageModelV4, ProviderV4 } from "@ai-sdk/provider";
import { LmWorker, type WorkerOptions } from "./client.js";
import type { GenerateParams, LoadParams, LoadProgress } from "./protocol-types.js";
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
export declare function createLmWorker(settings?: LmWorkerProviderSettings): LmWorkerProvider;
/**
 * A ready provider, as other providers ship one: `lmWorker("default")`. Its worker (the
 * default options, restarted if it crashes) starts on the first call; `lmWorker.close()`
 * stops it.
 */
export declare const lmWorker: LmWorkerProvider;
