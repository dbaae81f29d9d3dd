export { LmWorker, GenerateStream, } from "./client.js";
export { RpcError, WorkerExitedError, WorkerStartError } from "./errors.js";
export { encode, FrameDecoder } from "./framing.js";
export { findPython, dataDir, setupVenv, packageRoot } from "./python.js";
export * from "./protocol-types.js";
//# sourceMappingURL=index.js.map