/**
 * LmWorker: spawn `python -m worker`, call its methods with types, stream `generate`.
 *
 * One process at a time per LmWorker. Requests are written as they are made; the worker
 * answers model requests one at a time, in order, and the rest at once (docs/PROTOCOL.md §5).
 * If the process exits, every pending call rejects with a WorkerExitedError carrying
 * the exit code or signal and the tail of the worker's stderr; with the `restart` option,
 * the next call starts a new process in its place.
 */
import { spawn } from "node:child_process";
import { RpcError, WorkerExitedError, WorkerStartError } from "./errors.js";
import { encode, FrameDecoder } from "./framing.js";
import { findPython } from "./python.js";
const STDERR_TAIL_BYTES = 8192;
export class LmWorker {
    /** What the worker answered to `capabilities` when it (or, after a restart, its replacement) started. */
    capabilities;
    options;
    framing;
    unrefWhenIdle;
    restartLimit;
    pending = new Map();
    streams = new Map();
    // onProgress of a load or a prefill, by request id: each sees its own method's notifications.
    progress = new Map();
    listeners = new Map();
    nextId = 1;
    // The process now, and what belongs to it alone.
    process;
    decoder;
    exitPromise;
    stderrTail = "";
    exit = null;
    exitError = null;
    // Restarts: what to load again, when the last ones were, whether the host ended the worker.
    model = null;
    restartTimes = [];
    restarting = null;
    gaveUp = null;
    ended = false;
    /** Requests cancelled before they could be sent (they wait for a restart): cancelled once sent. */
    cancelledUnsent = new Set();
    constructor(options) {
        this.options = options;
        this.framing = options.framing ?? "ndjson";
        this.unrefWhenIdle = options.unref ?? false;
        const restart = options.restart === true ? {} : options.restart || null;
        this.restartLimit = restart && { maxRestarts: restart.maxRestarts ?? 3, withinMs: restart.withinMs ?? 60_000 };
        this.spawn();
    }
    /** Spawn a worker and wait until it answers `capabilities`; aborting `signal` kills it. */
    static async start(options = {}) {
        const worker = new LmWorker(options);
        try {
            await worker.handshake(options.signal);
            return worker;
        }
        catch (error) {
            await worker.kill();
            throw error;
        }
    }
    get pid() {
        return this.process.pid;
    }
    /** Settles when the current process has exited and its pipes are closed; never rejects. */
    get exited() {
        return this.exitPromise;
    }
    /** Requests sent and not answered yet. */
    get pendingRequests() {
        return this.pending.size;
    }
    /** Call a method by name; params and result are typed from the protocol's schemas. */
    call(method, ...args) {
        const [params, options] = args;
        return this.request(method, params, options?.signal).promise;
    }
    /**
     * Load a model, replacing any loaded one. `onProgress` (which sets the load's `progress`)
     * sees the stages of a long load (the attention kernel built, a gguf's tensors dequantized,
     * the weights hashed and quantized), each from `done: 0` up to its `total`, a few times a
     * second at most.
     */
    load(params, options = {}) {
        const asked = options.onProgress ? { ...params, progress: true } : params;
        const { id, promise } = this.request("load", asked, options.signal);
        this.watchProgress(id, promise, options.onProgress);
        return promise;
    }
    unload(options) {
        return this.call("unload", undefined, options);
    }
    tokenize(params, options) {
        return this.call("tokenize", params, options);
    }
    detokenize(params, options) {
        return this.call("detokenize", params, options);
    }
    render(params, options) {
        return this.call("render", params, options);
    }
    /**
     * The models on this machine that `load` can name, each with its reference (the `model` that
     * loads it: `ollama:NAME:TAG`, `hf:ORG/NAME`, a gguf's name), described from its headers:
     * Ollama's, the Hugging Face cache's, node-llama-cpp's folder's and each `--models-dir`'s
     * (PROTOCOL §6.14, §24).
     */
    listModels(options) {
        return this.call("models/list", undefined, options);
    }
    cacheList(options) {
        return this.call("cache/list", undefined, options);
    }
    cacheInfo(params, options) {
        return this.call("cache/info", params, options);
    }
    cacheDelete(params, options) {
        return this.call("cache/delete", params, options);
    }
    /** Compute and store a prompt's KV cache; `onProgress` sees each chunk of a long one. */
    prefill(params, options = {}) {
        const { id, promise } = this.request("prefill", params, options.signal);
        this.watchProgress(id, promise, options.onProgress);
        return promise;
    }
    watchProgress(id, answered, onProgress) {
        if (onProgress) {
            this.progress.set(id, onProgress);
            const forget = () => this.progress.delete(id);
            answered.then(forget, forget);
        }
    }
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
    generate(params, options = {}) {
        const window = params.stream_window ?? options.highWaterMark ?? 64;
        const { id, promise } = this.request("generate", { ...params, stream_window: window }, options.signal);
        const stream = new GenerateStream(id, promise, window, (index) => this.notify("generate/ack", { id, index }), () => this.cancelRequest(id));
        this.streams.set(id, stream);
        const forget = () => this.streams.delete(id);
        promise.then(forget, forget);
        return stream;
    }
    /**
     * Listen to a notification from the worker, or to the client's own `restart`; returns a
     * function that stops listening.
     */
    on(method, listener) {
        const set = this.listeners.get(method) ?? new Set();
        this.listeners.set(method, set);
        const untyped = listener;
        set.add(untyped);
        return () => set.delete(untyped);
    }
    /**
     * Ask the worker to finish: `shutdown` (it answers after every earlier request), then `exit`.
     * If it has not exited after `timeoutMs`, SIGTERM; after as long again, SIGKILL.
     */
    async close(timeoutMs = 5000) {
        this.ended = true;
        await this.restarting?.catch(() => { });
        if (this.exit === null) {
            this.call("shutdown")
                .then(() => this.notify("exit"))
                .catch(() => { }); // it is exiting anyway; the exit status tells how
            if (!(await this.exitsWithin(timeoutMs))) {
                this.process.kill("SIGTERM");
                if (!(await this.exitsWithin(timeoutMs))) {
                    this.process.kill("SIGKILL");
                }
            }
        }
        return this.exited;
    }
    /** `await using worker = await LmWorker.start()`: the worker is closed as the scope ends. */
    async [Symbol.asyncDispose]() {
        await this.close();
    }
    /** Stop the worker at once (SIGKILL) and wait for it; it is not restarted. */
    async kill() {
        this.ended = true;
        await this.restarting?.catch(() => { });
        if (this.exit === null) {
            this.process.kill("SIGKILL");
        }
        return this.exited;
    }
    // --- the process and its replacement ------------------------------------------------------
    spawn() {
        const options = this.options;
        // -P: the host's working directory is not on sys.path, so a worker.py or protocol/ of the
        // host's own cannot stand in for the installed package.
        const args = ["-P", "-m", "worker", "--framing", this.framing, ...(options.args ?? [])];
        const child = spawn(findPython(options.python), args, {
            cwd: options.cwd,
            env: { ...process.env, ...options.env },
            stdio: ["pipe", "pipe", "pipe"],
        });
        this.process = child;
        this.decoder = new FrameDecoder(this.framing);
        this.exit = null;
        this.exitError = null;
        this.stderrTail = "";
        child.stdout.on("data", (data) => this.receive(data));
        child.stderr.on("data", (data) => {
            const text = data.toString("utf8");
            this.stderrTail = (this.stderrTail + text).slice(-STDERR_TAIL_BYTES);
            options.onStderr?.(text);
        });
        child.stdin.on("error", () => { }); // a dead worker's stdin: the exit handler reports it
        this.exitPromise = new Promise((resolve) => {
            child.on("error", (error) => {
                this.stderrTail += `\n${error.message}`;
            });
            // "close" comes after "exit" and after the pipes are drained: no answer is lost.
            child.on("close", (exitCode, signal) => {
                this.exit = { exitCode, signal };
                this.exitError = new WorkerExitedError(exitCode, signal, this.stderrTail.trim());
                this.failAll(this.exitError);
                resolve(this.exit);
            });
        });
        this.holdNodeWhileBusy();
    }
    /** Wait for the new process's `capabilities`, within `startTimeoutMs`. */
    async handshake(signal) {
        const timeoutMs = this.options.startTimeoutMs ?? 60_000;
        let timer;
        const timeout = new Promise((_, reject) => {
            timer = setTimeout(() => reject(new WorkerStartError(`the worker did not answer capabilities within ${timeoutMs} ms`)), timeoutMs);
        });
        try {
            this.capabilities = (await Promise.race([this.sendRequest("capabilities", undefined, signal).promise, timeout]));
        }
        catch (error) {
            if (error instanceof WorkerExitedError) {
                throw new WorkerStartError(`the worker could not start: ${error.message}`, { cause: error });
            }
            throw error;
        }
        finally {
            clearTimeout(timer);
        }
    }
    /** The process has exited: may a new one take its place (else: the error that says why not)? */
    replaceable() {
        const exit = this.exit;
        const gone = (context) => new WorkerExitedError(exit.exitCode, exit.signal, this.stderrTail.trim(), context);
        if (this.restartLimit === null || this.ended) {
            return gone("the worker has exited");
        }
        const { maxRestarts, withinMs } = this.restartLimit;
        const now = Date.now();
        this.restartTimes = this.restartTimes.filter((time) => now - time < withinMs);
        if (this.gaveUp === null && this.restartTimes.length >= maxRestarts) {
            this.gaveUp = gone(`the worker exited again after ${maxRestarts} restarts within ${withinMs / 1000} s, so it is not restarted any more`);
        }
        return this.gaveUp;
    }
    /** Start a new process in place of the exited one, load its model again, and say so. */
    replace() {
        this.restarting ??= (async () => {
            const previous = this.exit;
            const error = this.exitError;
            this.restartTimes.push(Date.now());
            this.spawn();
            try {
                await this.handshake();
                if (this.model !== null)
                    await this.sendRequest("load", this.model).promise;
            }
            catch (failure) {
                if (this.exit === null)
                    this.process.kill("SIGKILL");
                await this.exited;
                throw failure;
            }
            const event = { pid: this.process.pid, previous, error, model: this.model, restarts: this.restartTimes.length };
            for (const listener of this.listeners.get("restart") ?? []) {
                listener(event);
            }
        })().finally(() => {
            this.restarting = null;
        });
        return this.restarting;
    }
    // --- the wire ----------------------------------------------------------------------------
    /** A request, sent now, or once a restart has replaced an exited process. */
    request(method, params, signal) {
        if (this.exit === null && this.restarting === null) {
            return this.sendRequest(method, params, signal);
        }
        const id = this.nextId++;
        const whyNot = this.exit !== null && this.restarting === null ? this.replaceable() : null;
        if (whyNot !== null) {
            return { id, promise: Promise.reject(whyNot) };
        }
        const promise = this.replace().then(() => this.sendRequest(method, params, signal, id).promise, (error) => {
            this.cancelledUnsent.delete(id); // never sent: nothing to cancel
            throw error;
        });
        return { id, promise };
    }
    sendRequest(method, params, signal, id = this.nextId++) {
        // A generate ends with the worker's answer to a cancel (its partial result); any other
        // call ends at the abort itself, with the signal's reason, as fetch does. The worker's
        // later answer to it finds the promise settled (it still counts in pendingRequests until then).
        const endsAtAbort = method !== "generate";
        let rejectAtAbort = () => { };
        const promise = new Promise((resolve, reject) => {
            if (this.exit !== null) {
                reject(new WorkerExitedError(this.exit.exitCode, this.exit.signal, this.stderrTail.trim(), "the worker has exited"));
                return;
            }
            if (endsAtAbort && signal?.aborted) {
                reject(signal.reason); // nothing sent
                return;
            }
            if (method === "shutdown") {
                this.ended = true; // the host ends the worker: its exit is no crash
            }
            rejectAtAbort = reject;
            this.pending.set(id, { method, params, resolve, reject });
            this.holdNodeWhileBusy();
            this.send({ jsonrpc: "2.0", id, method, ...(params === undefined ? {} : { params }) });
            if (this.cancelledUnsent.delete(id)) {
                this.notify("$/cancelRequest", { id });
            }
        });
        promise.catch(() => this.cancelledUnsent.delete(id));
        if (signal) {
            const abort = () => {
                this.cancelRequest(id);
                if (endsAtAbort)
                    rejectAtAbort(signal.reason);
            };
            if (signal.aborted) {
                if (!endsAtAbort)
                    abort();
            }
            else {
                signal.addEventListener("abort", abort, { once: true });
                const forget = () => signal.removeEventListener("abort", abort);
                promise.then(forget, forget);
            }
        }
        return { id, promise };
    }
    /** `$/cancelRequest`, at once if the request was sent, else as soon as it is. */
    cancelRequest(id) {
        if (this.pending.has(id)) {
            this.notify("$/cancelRequest", { id });
        }
        else {
            this.cancelledUnsent.add(id);
        }
    }
    notify(method, params) {
        if (this.exit === null) {
            this.send({ jsonrpc: "2.0", method, ...(params === undefined ? {} : { params }) });
        }
    }
    send(message) {
        this.process.stdin.write(encode(message, this.framing));
    }
    receive(data) {
        for (const item of this.decoder.push(data)) {
            if ("problem" in item) {
                // The worker writes only whole JSON-RPC messages to stdout; anything else is a bug to report.
                this.stderrTail = `${this.stderrTail}\n[lm-worker client] unreadable output: ${item.problem}: ${item.excerpt}`.slice(-STDERR_TAIL_BYTES);
                continue;
            }
            this.dispatch(item.message);
        }
    }
    dispatch(message) {
        if (message.method !== undefined) {
            this.onNotification(message.method, message.params);
            return;
        }
        const pending = typeof message.id === "number" ? this.pending.get(message.id) : undefined;
        if (pending === undefined) {
            return; // an answer to nothing we sent (an error about an unreadable message has id null)
        }
        this.pending.delete(message.id);
        this.holdNodeWhileBusy();
        if (message.error !== undefined) {
            const { code, message: text, data } = message.error;
            pending.reject(new RpcError(code, text, data));
            return;
        }
        // The model a replacement process loads again: the last one loaded, unless unloaded since.
        if (pending.method === "load")
            this.model = pending.params;
        if (pending.method === "unload")
            this.model = null;
        pending.resolve(message.result);
    }
    onNotification(method, params) {
        if (method === "generate/chunk") {
            const chunk = params;
            this.streams.get(chunk.id)?.push(chunk);
        }
        else if (method === "prefill/progress" || method === "load/progress") {
            const progress = params;
            this.progress.get(progress.id)?.(progress);
        }
        for (const listener of this.listeners.get(method) ?? []) {
            listener(params);
        }
    }
    failAll(error) {
        for (const pending of this.pending.values()) {
            pending.reject(error);
        }
        this.pending.clear();
    }
    /** With `unref`: the process and its pipes keep Node's event loop alive only while a request is pending. */
    holdNodeWhileBusy() {
        if (!this.unrefWhenIdle)
            return;
        const busy = this.pending.size > 0;
        const { stdin, stdout, stderr } = this.process;
        for (const handle of [this.process, ...[stdin, stdout, stderr].map((pipe) => pipe)]) {
            if (busy)
                handle.ref();
            else
                handle.unref();
        }
    }
    async exitsWithin(ms) {
        let timer;
        const timedOut = new Promise((resolve) => {
            timer = setTimeout(() => resolve(false), ms);
        });
        const exited = await Promise.race([this.exited.then(() => true), timedOut]);
        clearTimeout(timer);
        return exited;
    }
}
/**
 * The chunks of one `generate`, in order, as an async iterable, and its final `result`.
 * The worker sends at most `window` chunks past the last one the consumer has taken (the
 * request's `stream_window`; the stream acknowledges taken chunks with `generate/ack`), so
 * at most that many wait here; a consumer that falls behind gets the rest of the text
 * merged into fewer chunks. Chunks not iterated are kept until the end. Leaving a loop over
 * the stream before its end cancels the generation, as the consumer wants no more of it.
 */
export class GenerateStream {
    id;
    result;
    window;
    ack;
    stop;
    queue = [];
    waiting = null;
    done = false;
    failure = null;
    acked = -1;
    cancelled = false;
    constructor(
    /** The request id: what `generate/chunk` notifications and `cancel` refer to. */
    id, 
    /** The final result; rejects with RpcError or WorkerExitedError. */
    result, window, ack, stop) {
        this.id = id;
        this.result = result;
        this.window = window;
        this.ack = ack;
        this.stop = stop;
        result.then(() => this.end(null), (error) => this.end(error));
    }
    /** Chunks received and not yet taken by the consumer. */
    get buffered() {
        return this.queue.length;
    }
    /** Called by the client for each chunk of this request. */
    push(chunk) {
        this.queue.push(chunk);
        this.wake();
    }
    /**
     * Cancel the generation (`$/cancelRequest`), unless it has ended; its `result`, the
     * partial one (`finish_reason: "cancelled"`), is what this returns.
     */
    cancel() {
        if (!this.done && !this.cancelled) {
            this.cancelled = true;
            this.stop();
        }
        return this.result;
    }
    async *[Symbol.asyncIterator]() {
        try {
            for (;;) {
                const chunk = this.queue.shift();
                if (chunk !== undefined) {
                    // Acknowledge every half window: the worker never has to hold a consumer that keeps up.
                    if (!this.done && chunk.index - this.acked >= Math.max(1, Math.floor(this.window / 2))) {
                        this.acked = chunk.index;
                        this.ack(chunk.index);
                    }
                    yield chunk;
                    continue;
                }
                if (this.failure !== null) {
                    throw this.failure;
                }
                if (this.done) {
                    return;
                }
                await new Promise((resolve) => {
                    this.waiting = resolve;
                });
            }
        }
        finally {
            // Here before the end: the loop over the stream was left (its return()), so nobody reads on.
            if (!this.done)
                void this.cancel();
        }
    }
    end(error) {
        this.done = true;
        this.failure = error;
        this.wake();
    }
    wake() {
        const waiting = this.waiting;
        this.waiting = null;
        waiting?.();
    }
}
//# sourceMappingURL=client.js.map