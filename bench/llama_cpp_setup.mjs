// What the llama.cpp benches share: the checkout's root, its Python, the shipped models' gguf files,
// the built Node client, and llama.cpp (node-llama-cpp 3.21.1, installed on first use into
// bench/llama-cpp with exact pins and a lock file; not a dependency of lm-worker).
import { execFileSync } from "node:child_process";
import { existsSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

export const root = dirname(dirname(fileURLToPath(import.meta.url)));
export const python = join(root, ".venv", "bin", "python");
export const THREADS = 2; // llama.cpp's and the worker's, on this 2-core machine

/** The gguf of a shipped model: SmolLM2's ("default") as its package holds it; Gemma 3 270M's
 *  ("gemma3-270m") joined from its part packages into `directory`; Qwen2.5-Coder-0.5B's
 *  ("qwen2.5-coder-0.5b") as the worker joined it into its data directory. */
export function shippedGguf(model = "default", directory = undefined) {
  const code = {
    default: "from worker.backends.transformers.shipped import gguf_path; print(gguf_path())",
    "gemma3-270m":
      "import sys; from pathlib import Path; from worker.backends.transformers.shipped import assembled_gemma; " +
      "print(assembled_gemma(Path(sys.argv[1])))",
    "qwen2.5-coder-0.5b":
      "from worker.backends.transformers.shipped import assembled_qwen_coder; " +
      "from worker.data_dir import default_data_dir; print(assembled_qwen_coder(default_data_dir()))",
  }[model];
  if (code === undefined) throw new Error(`no shipped model ${model}`);
  return execFileSync(python, ["-c", code, ...(directory ? [directory] : [])], { cwd: root, encoding: "utf8" }).trim();
}

/** The Node client as `npm run build` left it. */
export async function lmWorkerClient() {
  return (await import(pathToFileURL(join(root, "client", "dist", "src", "index.js")).href)).LmWorker;
}

/** llama.cpp on the CPU, as node-llama-cpp's `getLlama` gives it. */
export async function cpuLlama() {
  const folder = join(root, "bench", "llama-cpp");
  if (!existsSync(join(folder, "node_modules", "node-llama-cpp"))) {
    console.error("installing node-llama-cpp 3.21.1 into bench/llama-cpp ...");
    execFileSync("npm", ["ci", "--omit=optional", "--ignore-scripts", "--no-audit", "--no-fund"], {
      cwd: folder,
      stdio: "inherit",
    });
  }
  const { getLlama } = await import(pathToFileURL(join(folder, "node_modules", "node-llama-cpp", "dist", "index.js")).href);
  return getLlama({ gpu: false, build: "never", logLevel: "error" });
}
