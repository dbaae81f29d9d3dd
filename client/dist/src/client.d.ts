/**
 * LmWorker: spawn `python -m worker`, call its methods with types, stream `generate`.
 *
 * One process at a time per LmWorker. Requests are written as they are made; the worker
 * answers model requests one at a time, in order, and the rest at once (docs/PROTOCOL.md §5).
 * If the process exits, every pending call rejects with a WorkerExitedError carrying
 * the exit code or signal and the tail of the worker's stderr; with the `restart` option,
 * the next call starts a new process in its place.
 */
import { WorkerExitedError } from "./errors.js";
import { type Framing } from "./framing.js";
import type { CapabilitiesResult, GenerateChunk, GenerateParams, GenerateResult, LoadParams, MethodName, Methods, PrefillParams, LoadProgress, PrefillProgress, PrefillResult, WorkerNotifications } from "./protocol-types.js";
export interface WorkerOptions {
    /** The Python to run; else $LM_WORKER_PYTHON, this package's .venv, or the one `lm-worker setup` made. */
    python?: string;
    /** More worker arguments, e.g. `["--cache-dir", dir]` (see `python -m worker --help`). */
    args?: string[];
    /** Added to this process's environment for the worker. */
    env?: NodeJS.ProcessEnv;
    cwd?: string;
    /** `ndjson` (default) or `lsp` (Content-Length headers). */
    framing?: Framing;
    /** How long the worker may take to answer its first `capabilities` (default 60 s). */
    startTimeoutMs?: number;
    /** Each piece of the worker's stderr (its log) as it arrives; it is also kept for error messages. */
    onStderr?: (text: string) => void;
    /**
     * true: the worker keeps the Node process alive only while a request is in flight, so a
     * program that is done exits without `close()` (the worker then sees its input end and
     * exits too). Default false: a running worker keeps Node alive until it is closed.
     */
    unref?: boolean;
    /**
     * Replace a worker that exits without being asked to (killed, crashed): the next call
     * starts a new process, loads the model the last `load` loaded (unless unloaded since),
     * emits `restart`, then runs. The calls in flight at the exit still reject with its
     * `WorkerExitedError`. After `maxRestarts` restarts (default 3) within `withinMs`
     * (default 60 s), the next exit is final: calls reject with a `WorkerExitedError` that
     * says so. Default false: an exited worker stays exited.
     */
    restart?: boolean | {
        maxRestarts?: number;
        withinMs?: number;
    };
}
/** The `restart` event: a new worker process took the place of one that exited. */
export interface WorkerRestart {
    /** The new process. */
    pid: number;
    /** How the previous one exited, and the error its calls in flight rejected with. */
    previous: WorkerExit;
    error: WorkerExitedError;
    /** The model loaded again in the new process; null when none was loaded. */
    model: LoadParams | null;
    /** Restarts within the `withinMs` window, this one included. */
    restarts: number;
}
/** What `on` listens to: the worker's notifications and the client's own `restart`. */
export interface WorkerEvents extends WorkerNotifications {
    restart: WorkerRestart;
}
export interface CallOptions {
    /**
     * Aborting sends `$/cancelRequest` (docs §9). A `generate` then ends as the worker answers,
     * with its partial result; any other call rejects at once with the signal's reason (an
     * `AbortError`, or a `TimeoutError` for `AbortSignal.timeout`), as `fetch` does.
     */
    signal?: AbortSignal;
}
export interface WorkerExit {
    exitCode: number | null;
    signal: NodeJS.Signals | null;
}
type Params<M extends MethodName> = Methods[M]["params"];
type Result<M extends MethodName> = Methods[M]["result"];
export declare class LmWorker {
    /** What the worker answered to `capabilities` when it (or, after a restart, its replacement) started. */
    capabilities: CapabilitiesResult;
    private readonly options;
    private readonly framing;
    private readonly unrefWhenIdle;
    private readonly restartLimit;
    private readonly pending;
    private readonly streams;
    private readonly progress;
    private readonly listeners;
    private nextId;
    private process;
    private decoder;
    private exitPromise;
    private stderrTail;
    private exit;
    private exitError;
    private model;
    private restartTimes;
    private restarting;
    private gaveUp;
    private ended;
    /** Requests cancelled before they could be sent (they wait for a restart): cancelled once sent. */
    private readonly cancelledUnsent;
    private constructor();
    /** Spawn a worker and wait until it answers `capabilities`; aborting `signal` kills it. */
    static start(options?: WorkerOptions & CallOptions): Promise<LmWorker>;
    get pid(): number | undefined;
    /** Settles when the current process has exited and its pipes are closed; never rejects. */
    get exited(): Promise<WorkerExit>;
    /** Requests sent and not answered yet. */
    get pendingRequests(): number;
    /** Call a method by name; params and result are typed from the protocol's schemas. */
    call<M extends MethodName>(method: M, ...args: OptionalParams<M>): Promise<Result<M>>;
    /**
     * Load a model, replacing any loaded one. `onProgress` (which sets the load's `progress`)
     * sees the stages of a long load (the attention kernel built, a gguf's tensors dequantized,
     * the weights hashed and quantized), each from `done: 0` up to its `total`, a few times a
     * second at most.
     */
    load(params: Params<"load">, options?: CallOptions & {
        onProgress?: (progress: LoadProgress) => void;
    }): Promise<Result<"load">>;
    unload(options?: CallOptions): Promise<Result<"unload">>;
    tokenize(params: Params<"tokenize">, options?: CallOptions): Promise<Result<"tokenize">>;
    detokenize(params: Params<"detokenize">, options?: CallOptions): Promise<Result<"detokenize">>;
    render(params: Params<"render">, options?: CallOptions): Promise<Result<"render">>;
    /**
     * The models on this machine that `load` can name, each with its reference (the `model` that
     * loads it: `ollama:NAME:TAG`, `hf:ORG/NAME`, a gguf's name), described from its headers:
     * Ollama's, the Hugging Face cache's, node-llama-cpp's folder's and each `--models-dir`'s
     * (PROTOCOL §6.14, §24).
     */
    listModels(options?: CallOptions): Promise<Result<"models/list">>;
    cacheList(options?: CallOptions): Promise<Result<"cache/list">>;
    cacheInfo(params: Params<"cache/info">, options?: CallOptions): Promise<Result<"cache/info">>;
    cacheDelete(params: Params<"cache/delete">, options?: CallOptions): Promise<Result<"cache/delete">>;
    /** Compute and store a prompt's KV cache; `onProgress` sees each chunk of a long one. */
    prefill(params: PrefillParams, options?: CallOptions & {
        onProgress?: (progress: PrefillProgress) => void;
    }): Promise<PrefillResult>;
    private watchProgress;
    /**
     * Start a generation: iterate the returned stream for chunks, in order, and await its
     * `result` for the final answer. Aborting `signal`, `stream.cancel()` or leaving a
     * `for await` loop over the stream early (`break`, `return`, a throw) cancels it: the
     * result is then the partial one, with `finish_reason: "cancelled"`.
     *
     * At most `highWaterMark` chunks (default 64) wait here for the consumer: the request's
     * `stream_window` is set to it (unless given) and the stream acknowledges the chunks the
     * consumer takes, so a consumer that falls behind gets the rest of the text merged into
     * fewer chunks, while the generation and every other stream go on at full speed.
     */
    generate(params: GenerateParams, options?: CallOptions & {
        highWaterMark?: number;
    }): GenerateStream;
    /**
     * Listen to a notification from the worker, or to the client's own `restart`; returns a
     * function that stops listening.
     */
    on<N extends keyof WorkerEvents>(method: N, listener: (params: WorkerEvents[N]) => void): () => void;
    /**
     * Ask the worker to finish: `shutdown` (it answers after every earlier request), then `exit`.
     * If it has not exited after `timeoutMs`, SIGTERM; after as long again, SIGKILL.
     */
    close(timeoutMs?: number): Promise<WorkerExit>;
    /** `await using worker = await LmWorker.start()`: the worker is closed as the scope ends. */
    [Symbol.asyncDispose](): Promise<void>;
    /** Stop the worker at once (SIGKILL) and wait for it; it is not restarted. */
    kill(): Promise<WorkerExit>;
    private spawn;
    /** Wait for the new process's `capabilities`, within `startTimeoutMs`. */
    private handshake;
    /** The process has exited: may a new one take its place (else: the error that says why not)? */
    private replaceable;
    /** Start a new process in place of the exited one, load its model again, and say so. */
    private replace;
    /** A request, sent now, or once a restart has replaced an exited process. */
    private request;
    private sendRequest;
    /** `$/cancelRequest`, at once if the request was sent, else as soon as it is. */
    private cancelRequest;
    private notify;
    private send;
    private receive;
    private dispatch;
    private onNotification;
    private failAll;
    /** With `unref`: the process and its pipes keep Node's event loop alive only while a request is pending. */
    private holdNodeWhileBusy;
    private exitsWithin;
}
/** `call`'s arguments: params may be left out where the method needs none. */
type OptionalParams<M extends MethodName> = Record<string, never> extends Params<M> ? [params?: Params<M>, options?: CallOptions] : [params: Params<M>, options?: CallOptions];
/**
 * The chunks of one `generate`, in order, as an async iterable, and its final `result`.
 * The worker sends at most `window` chunks past the last one the consumer has taken (the
 * request's `stream_window`; the stream acknowledges taken chunks with `generate/ack`), so
 * at most that many wait here; a consumer that falls behind gets the rest of the text
 * merged into fewer chunks. Chunks not iterated are kept until the end. Leaving a loop over
 * the stream before its end cancels the generation, as the consumer wants no more of it.
 */
export declare class GenerateStream implements AsyncIterable<GenerateChunk> {
    /** The request id: what `generate/chunk` notifications and `cancel` refer to. */
    readonly id: number;
    /** The final result; rejects with RpcError or WorkerExitedError. */
    readonly result: Promise<GenerateResult>;
    private readonly window;
    private readonly ack;
    private readonly stop;
    private readonly queue;
    private waiting;
    private done;
    private failure;
    private acked;
    private cancelled;
    constructor(
    /** The request id: what `generate/chunk` notifications and `cancel` refer to. */
    id: number, 
    /** The final result; rejects with RpcError or WorkerExitedError. */
    result: Promise<GenerateResult>, window: number, ack: (index: number) => void, stop: () => void);
    /** Chunks received and not yet taken by the consumer. */
    get buffered(): number;
    /** Called by the client for each chunk of this request. */
    push(chunk: GenerateChunk): void;
    /**
     * Cancel the generation (`$/cancelRequest`), unless it has ended; its `result`, the
     * partial one (`finish_reason: "cancelled"`), is what this returns.
     */
    cancel(): Promise<GenerateResult>;
    [Symbol.asyncIterator](): AsyncIterator<GenerateChunk>;
    private end;
    private wake;
}
export {};
