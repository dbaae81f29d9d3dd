/** The errors a caller of the client can meet, each with what a program needs to act on it. */
import type { ErrorKind } from "./protocol-types.js";
/** The worker answered a request with a JSON-RPC error. */
export declare class RpcError extends Error {
    /** The JSON-RPC error code: -32602 invalid params, -32001 model not loaded, … (docs/PROTOCOL.md §12). */
    readonly code: number;
    /** The worker's `data`: `kind` (a stable name for the code), `field`, `method`, `limit` when they apply. */
    readonly data: RpcErrorData | undefined;
    readonly name = "RpcError";
    constructor(
    /** The JSON-RPC error code: -32602 invalid params, -32001 model not loaded, … (docs/PROTOCOL.md §12). */
    code: number, message: string, 
    /** The worker's `data`: `kind` (a stable name for the code), `field`, `method`, `limit` when they apply. */
    data: RpcErrorData | undefined);
    /** A stable name for the error (`invalid_params`, `cache_not_found`, …), when the worker gave one. */
    get kind(): ErrorKind | undefined;
}
export interface RpcErrorData {
    kind?: ErrorKind;
    field?: string | null;
    method?: string | null;
    limit?: number | null;
    [key: string]: unknown;
}
/** The worker process is gone: every pending call rejects with this. */
export declare class WorkerExitedError extends Error {
    readonly exitCode: number | null;
    readonly signal: NodeJS.Signals | null;
    /** The last lines the worker wrote to stderr (its log), for the reason. */
    readonly stderrTail: string;
    readonly name = "WorkerExitedError";
    constructor(exitCode: number | null, signal: NodeJS.Signals | null, 
    /** The last lines the worker wrote to stderr (its log), for the reason. */
    stderrTail: string, context?: string);
}
/** The worker could not be started, or did not answer `capabilities` in time. */
export declare class WorkerStartError extends Error {
    readonly name = "WorkerStartError";
}
