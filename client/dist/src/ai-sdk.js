/**
 * An AI SDK provider (`import { createLmWorker } from "lm-worker/ai-sdk"`): `generateText`,
 * `streamText`, tools and structured output of the `ai` package, run by an lm-worker.
 *
 * It implements the AI SDK's LanguageModelV4 specification, whose types come from
 * `@ai-sdk/provider` (a dependency, so that they resolve wherever the package is installed);
 * the errors it throws carry the AI SDK's markers, so `NoSuchModelError.isInstance` and the
 * like recognize them.
 */
import { LmWorker } from "./client.js";
/** The key of `providerOptions` (and of `providerMetadata`) for this provider. */
const PROVIDER = "lm-worker";
export function createLmWorker(settings = {}) {
    let started;
    const worker = () => {
        if (settings.worker) {
            return Promise.resolve(settings.worker);
        }
        if (started === undefined) {
            const starting = LmWorker.start({ restart: true, ...settings.workerOptions });
            started = starting;
            starting.catch(() => {
                if (started === starting)
                    started = undefined; // a failed start is tried again on the next call
            });
        }
        return started;
    };
    const languageModel = (modelId = "default") => new LmWorkerLanguageModel(modelId, { model: modelId, ...settings.load }, worker);
    const provider = Object.assign(languageModel, {
        specificationVersion: "v4",
        languageModel,
        worker,
        async close() {
            const running = started;
            started = undefined;
            await (await running?.catch(() => undefined))?.close();
        },
        [Symbol.asyncDispose]() {
            return provider.close();
        },
        embeddingModel(modelId) {
            throw new NoSuchModelError(modelId, "embeddingModel");
        },
        imageModel(modelId) {
            throw new NoSuchModelError(modelId, "imageModel");
        },
    });
    return provider;
}
// --- the model -----------------------------------------------------------------------------
class LmWorkerLanguageModel {
    modelId;
    load;
    worker;
    specificationVersion = "v4";
    provider = PROVIDER;
    supportedUrls = {};
    constructor(modelId, load, worker) {
        this.modelId = modelId;
        this.load = load;
        this.worker = worker;
    }
    async doGenerate(options) {
        const { params, warnings } = toGenerateParams(options);
        const signal = options.abortSignal;
        const { stream, timestamp } = await this.start({ ...params, stream: false }, signal);
        // Reject at the abort itself, as fetch does; the worker's cancelled answer comes later.
        const result = await untilAborted(stream.result, signal);
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
    async doStream(options) {
        const { params, warnings } = toGenerateParams(options);
        // Our own controller too: a consumer that cancels the stream cancels the generation.
        const cancel = new AbortController();
        const signal = options.abortSignal ? AbortSignal.any([options.abortSignal, cancel.signal]) : cancel.signal;
        const { stream, timestamp } = await this.start(params, signal);
        const parts = streamParts(stream, signal, options.includeRawChunks === true);
        const head = [
            { type: "stream-start", warnings },
            { type: "response-metadata", id: responseId(stream), modelId: this.modelId, timestamp },
        ];
        return {
            stream: new ReadableStream({
                async pull(controller) {
                    const next = head.shift() ?? (await parts.next()).value;
                    if (next === undefined) {
                        controller.close();
                    }
                    else {
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
    async start(params, signal) {
        const worker = await untilAborted(this.worker(), signal);
        const stream = await ModelSlot.of(worker).send(this.load, signal, () => worker.generate(params, { signal }));
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
    worker;
    static slots = new WeakMap();
    /** The model loaded, or being loaded by `loading`; undefined: none, or unknown. */
    key;
    loading = Promise.resolve();
    /** Settles once the worker has said which model it runs. */
    asked;
    constructor(worker) {
        this.worker = worker;
        // A worker passed in may run a model loaded since it started (its `capabilities` then): ask.
        this.asked = worker.call("capabilities").then(({ model }) => {
            if (model)
                this.key = slotKey({ model: model.model, backend: model.backend });
        }, () => { });
    }
    static of(worker) {
        let slot = ModelSlot.slots.get(worker);
        if (slot === undefined) {
            slot = new ModelSlot(worker);
            ModelSlot.slots.set(worker, slot);
        }
        return slot;
    }
    /** Call `send` once `load`'s model is the worker's, loading it unless it is, or is being, loaded. */
    async send(load, signal, send) {
        const key = slotKey(load);
        await untilAborted(this.asked, signal);
        for (;;) {
            if (this.key !== key)
                this.switchTo(load, key);
            await untilAborted(this.loading, signal);
            // Another call may have switched models meanwhile: send only while the model is still this one.
            if (this.key === key)
                return send();
        }
    }
    switchTo(load, key) {
        this.key = key;
        const loading = this.loading.catch(() => { }).then(() => this.worker.load(load));
        loading.catch(() => {
            if (this.key === key)
                this.key = undefined; // the next call tries the load again
        });
        this.loading = loading;
    }
}
/** Load params as a key: a model found loaded is known by its name and backend only. */
function slotKey(load) {
    const params = { backend: "transformers", ...load };
    return JSON.stringify(Object.keys(params).sort().map((name) => [name, params[name]]));
}
// --- the request ---------------------------------------------------------------------------
function toGenerateParams(options) {
    const warnings = [];
    for (const feature of ["presencePenalty", "frequencyPenalty"]) {
        if (options[feature] !== undefined)
            warnings.push({ type: "unsupported", feature });
    }
    if (options.reasoning !== undefined && options.reasoning !== "provider-default") {
        warnings.push({ type: "unsupported", feature: "reasoning", details: "lm-worker does not control reasoning" });
    }
    const params = {
        messages: toMessages(options.prompt),
        max_tokens: options.maxOutputTokens,
        temperature: options.temperature,
        top_p: options.topP,
        top_k: options.topK,
        seed: options.seed,
        stop: options.stopSequences,
        ...toTools(options, warnings),
        response_format: toResponseFormat(options.responseFormat),
        ...toWorkerOptions(options.providerOptions?.[PROVIDER], warnings),
    };
    // Leave out what the call did not set: the worker's defaults apply, and the request stays readable.
    const defined = Object.entries(params).filter(([, value]) => value !== undefined);
    return { params: Object.fromEntries(defined), warnings };
}
function toTools(options, warnings) {
    const tools = [];
    for (const tool of options.tools ?? []) {
        if (tool.type === "function") {
            tools.push({
                type: "function",
                function: { name: tool.name, description: tool.description, parameters: tool.inputSchema },
            });
        }
        else {
            warnings.push({ type: "unsupported", feature: `provider tool ${tool.id}` });
        }
    }
    if (tools.length === 0) {
        return {};
    }
    return { tools, tool_choice: toToolChoice(options.toolChoice) };
}
function toToolChoice(choice) {
    if (choice === undefined)
        return "auto";
    return choice.type === "tool" ? { type: "function", function: { name: choice.toolName } } : choice.type;
}
function toResponseFormat(format) {
    if (format?.type !== "json") {
        return undefined;
    }
    if (format.schema === undefined) {
        return { type: "json_object" };
    }
    return {
        type: "json_schema",
        json_schema: {
            schema: format.schema,
            ...(format.name !== undefined && { name: format.name }),
            ...(format.description !== undefined && { description: format.description }),
        },
    };
}
function toWorkerOptions(options, warnings) {
    const { cache, cacheTrimTokens, minP, repetitionPenalty, parallelToolCalls, draft, ...rest } = (options ?? {});
    for (const name of Object.keys(rest)) {
        warnings.push({ type: "unsupported", feature: `providerOptions["${PROVIDER}"].${name}` });
    }
    // The worker checks the values, and its error names the field.
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
function toMessages(prompt) {
    return prompt.flatMap(toChatMessages);
}
function toChatMessages(message) {
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
function toAssistantMessages(parts) {
    let content = "";
    const calls = [];
    const results = [];
    for (const part of parts) {
        if (part.type === "text") {
            content += part.text;
        }
        else if (part.type === "tool-call") {
            calls.push({ id: part.toolCallId, type: "function", function: { name: part.toolName, arguments: toArguments(part.input) } });
        }
        else if (part.type === "tool-result") {
            results.push(toToolMessage(part));
        }
        else if (part.type === "file") {
            unsupportedFile();
        }
        // Reasoning is the model's own scratch work: templates drop it from earlier turns too.
    }
    return [{ role: "assistant", content, ...(calls.length > 0 && { tool_calls: calls }) }, ...results];
}
/** A call's input as the chat template takes it: an object, or text that is not one (an invalid call's). */
function toArguments(input) {
    if (typeof input === "string")
        return input;
    if (typeof input === "object" && input !== null && !Array.isArray(input))
        return input;
    return JSON.stringify(input);
}
function toToolMessage(part) {
    return { role: "tool", tool_call_id: part.toolCallId, name: part.toolName, content: outputText(part.output) };
}
function outputText(output) {
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
function unsupportedFile() {
    throw new UnsupportedFunctionalityError("file parts", "lm-worker runs text models: send text, not files.");
}
// --- the answer ----------------------------------------------------------------------------
function toContent(result) {
    // Whitespace alone (the line breaks between calls) is no text part.
    const content = result.content.trim() ? [{ type: "text", text: result.content }] : [];
    return [...content, ...result.tool_calls.map(toToolCallPart)];
}
/**
 * A malformed call (not JSON, an unknown tool) keeps its raw text as the input, so that the
 * AI SDK reports it as an invalid tool call rather than dropping it.
 */
function toToolCallPart(call) {
    return {
        type: "tool-call",
        toolCallId: call.id,
        toolName: call.name ?? "",
        input: call.error === null ? JSON.stringify(call.arguments ?? {}) : call.raw,
    };
}
function toFinishReason(reason) {
    const unified = { stop: "stop", length: "length", tool_calls: "tool-calls", cancelled: "other" };
    return { unified: reason === undefined ? "error" : unified[reason], raw: reason };
}
function toUsage(result) {
    const usage = result?.usage;
    return {
        inputTokens: {
            total: usage?.prompt_tokens,
            noCache: usage && usage.prompt_tokens - usage.cache_read_tokens,
            cacheRead: usage?.cache_read_tokens,
            cacheWrite: usage?.cache_write_tokens,
        },
        // The worker does not tell reasoning tokens apart: all of them count as text.
        outputTokens: { total: usage?.completion_tokens, text: usage?.completion_tokens, reasoning: undefined },
        ...(usage && { raw: { ...usage } }),
    };
}
function toProviderMetadata(result) {
    // The protocol's types are plain JSON, declared as interfaces (which JSONObject's index signature does not take).
    const metadata = { cache: result.cache, timings: result.timings, stopReason: result.stop_reason };
    return { [PROVIDER]: metadata };
}
function responseId(stream) {
    return `generate-${stream.id}`;
}
/**
 * The stream's parts after its head: text as it comes (outside tool calls), each tool call
 * once complete, then `finish`. A worker error becomes an `error` part and a `finish` with
 * finish reason "error"; an abort ends it with the abort's reason, as a fetch body does.
 */
async function* streamParts(stream, signal, includeRaw) {
    const textId = "text";
    let textOpen = false;
    let blank = ""; // whitespace before any text (the line breaks between calls): no text part unless text follows
    let result;
    try {
        const chunks = stream[Symbol.asyncIterator]();
        for (;;) {
            const next = await untilAborted(chunks.next(), signal);
            if (next.done)
                break;
            const chunk = next.value;
            if (includeRaw)
                yield { type: "raw", rawValue: chunk };
            if (!textOpen && chunk.content.trim() === "") {
                blank += chunk.content;
            }
            else {
                if (!textOpen)
                    yield { type: "text-start", id: textId };
                textOpen = true;
                yield { type: "text-delta", id: textId, delta: blank + chunk.content };
                blank = "";
            }
            for (const call of chunk.tool_calls) {
                yield* toolCallParts(call);
            }
        }
        result = await untilAborted(stream.result, signal);
    }
    catch (error) {
        if (signal.aborted)
            throw error;
        yield { type: "error", error };
    }
    if (textOpen)
        yield { type: "text-end", id: textId };
    yield {
        type: "finish",
        finishReason: toFinishReason(result?.finish_reason),
        usage: toUsage(result),
        ...(result && { providerMetadata: toProviderMetadata(result) }),
    };
    return undefined;
}
function* toolCallParts(call) {
    const part = toToolCallPart(call);
    // The worker reports a call once it is complete: its input arrives as one delta.
    yield { type: "tool-input-start", id: call.id, toolName: part.toolName };
    yield { type: "tool-input-delta", id: call.id, delta: part.input };
    yield { type: "tool-input-end", id: call.id };
    yield part;
}
/** `promise`, or a rejection with the signal's reason as soon as it aborts. */
function untilAborted(promise, signal) {
    if (signal === undefined) {
        return promise;
    }
    promise.catch(() => { }); // given up on after an abort: its later failure is nobody's
    if (signal.aborted) {
        return Promise.reject(signal.reason);
    }
    return new Promise((resolve, reject) => {
        const abort = () => reject(signal.reason);
        signal.addEventListener("abort", abort, { once: true });
        promise.then(resolve, reject).finally(() => signal.removeEventListener("abort", abort));
    });
}
// --- errors the AI SDK recognizes ----------------------------------------------------------
/** Mark an error as the AI SDK's errors are marked, so that its `isInstance` checks accept it. */
function mark(error, name) {
    for (const marker of ["vercel.ai.error", `vercel.ai.error.${name}`]) {
        Object.defineProperty(error, Symbol.for(marker), { value: true });
    }
}
class NoSuchModelError extends Error {
    modelId;
    modelType;
    name = "AI_NoSuchModelError";
    constructor(modelId, modelType) {
        super(`lm-worker has language models only, no ${modelType}: ${modelId}`);
        this.modelId = modelId;
        this.modelType = modelType;
        mark(this, this.name);
    }
}
class UnsupportedFunctionalityError extends Error {
    functionality;
    name = "AI_UnsupportedFunctionalityError";
    constructor(functionality, message) {
        super(message);
        this.functionality = functionality;
        mark(this, this.name);
    }
}
//# sourceMappingURL=ai-sdk.js.map