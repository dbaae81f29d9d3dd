/** The errors a caller of the client can meet, each with what a program needs to act on it. */
/** The worker answered a request with a JSON-RPC error. */
export class RpcError extends Error {
    code;
    data;
    name = "RpcError";
    constructor(
    /** The JSON-RPC error code: -32602 invalid params, -32001 model not loaded, … (docs/PROTOCOL.md §12). */
    code, message, 
    /** The worker's `data`: `kind` (a stable name for the code), `field`, `method`, `limit` when they apply. */
    data) {
        super(message);
        this.code = code;
        this.data = data;
    }
    /** A stable name for the error (`invalid_params`, `cache_not_found`, …), when the worker gave one. */
    get kind() {
        return this.data?.kind;
    }
}
/** The worker process is gone: every pending call rejects with this. */
export class WorkerExitedError extends Error {
    exitCode;
    signal;
    stderrTail;
    name = "WorkerExitedError";
    constructor(exitCode, signal, 
    /** The last lines the worker wrote to stderr (its log), for the reason. */
    stderrTail, context = "the worker exited") {
        super(`${context} (${signal ? `signal ${signal}` : `exit code ${exitCode}`})${stderrTail ? `; its stderr ends with:\n${stderrTail}` : ""}`);
        this.exitCode = exitCode;
        this.signal = signal;
        this.stderrTail = stderrTail;
    }
}
/** The worker could not be started, or did not answer `capabilities` in time. */
export class WorkerStartError extends Error {
    name = "WorkerStartError";
}
//# sourceMappingURL=errors.js.map