/** The errors a caller of the client can meet, each with what a program needs to act on it. */

import type { ErrorKind } from "./protocol-types.js";

/** The worker answered a request with a JSON-RPC error. */
export class RpcError extends Error {
  override readonly name = "RpcError";
  constructor(
    /** The JSON-RPC error code: -32602 invalid params, -32001 model not loaded, … (docs/PROTOCOL.md §12). */
    readonly code: number,
    message: string,
    /** The worker's `data`: `kind` (a stable name for the code), `field`, `method`, `limit` when they apply. */
    readonly data: RpcErrorData | undefined,
  ) {
    super(message);
  }

  /** A stable name for the error (`invalid_params`, `cache_not_found`, …), when the worker gave one. */
  get kind(): ErrorKind | undefined {
    return this.data?.kind;
  }
}

export interface RpcErrorData {
  kind?: ErrorKind;
  field?: string | null;
  method?: string | null;
  limit?: number | null;
  [key: string]: unknown;
}

/** The worker process is gone: every pending call rejects with this. */
export class WorkerExitedError extends Error {
  override readonly name = "WorkerExitedError";
  constructor(
    readonly exitCode: number | null,
    readonly signal: NodeJS.Signals | null,
    /** The last lines the worker wrote to stderr (its log), for the reason. */
    readonly stderrTail: string,
    context = "the worker exited",
  ) {
    super(`${context} (${signal ? `signal ${signal}` : `exit code ${exitCode}`})${stderrTail ? `; its stderr ends with:\n${stderrTail}` : ""}`);
  }
}

/** The worker could not be started, or did not answer `capabilities` in time. */
export class WorkerStartError extends Error {
  override readonly name = "WorkerStartError";
}
