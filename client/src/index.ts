export {
  LmWorker,
  GenerateStream,
  type WorkerOptions,
  type CallOptions,
  type WorkerExit,
  type WorkerRestart,
  type WorkerEvents,
} from "./client.js";
export { RpcError, WorkerExitedError, WorkerStartError, type RpcErrorData } from "./errors.js";
export { encode, FrameDecoder, type Framing, type Decoded, type FramingProblem } from "./framing.js";
export { findPython, dataDir, setupVenv, packageRoot } from "./python.js";
export * from "./protocol-types.js";
