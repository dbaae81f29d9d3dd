/** Where the Python that runs the worker is: an option, $LM_WORKER_PYTHON, a checkout's .venv, or the setup's. */
import { existsSync } from "node:fs";
import { homedir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
/** The package's root (where package.json and the Python sources are), from client/dist/src/. */
export const packageRoot = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..", "..");
/** The worker's data directory, as the worker itself picks it: $LM_WORKER_DATA_DIR, else under XDG_DATA_HOME. */
export function dataDir(env = process.env) {
    if (env.LM_WORKER_DATA_DIR) {
        return env.LM_WORKER_DATA_DIR;
    }
    return join(env.XDG_DATA_HOME || join(homedir(), ".local", "share"), "lm-worker");
}
/** The virtual environment `lm-worker setup` makes (unless told another place). */
export function setupVenv(env = process.env) {
    return join(dataDir(env), "venv");
}
export function venvPython(venv) {
    return process.platform === "win32" ? join(venv, "Scripts", "python.exe") : join(venv, "bin", "python");
}
/** The Python to run the worker with, in order: `explicit`, $LM_WORKER_PYTHON, the package's own
 *  .venv (a development checkout, made by `make setup`), the venv `lm-worker setup` made. */
export function findPython(explicit, env = process.env) {
    if (explicit) {
        return explicit;
    }
    if (env.LM_WORKER_PYTHON) {
        return env.LM_WORKER_PYTHON;
    }
    const candidates = [venvPython(join(packageRoot, ".venv")), venvPython(setupVenv(env))];
    const found = candidates.find((path) => existsSync(path));
    if (found === undefined) {
        throw new Error(`No Python environment for lm-worker: looked for ${candidates.join(" and ")}. ` +
            "Run `npx lm-worker setup` to make one, or set LM_WORKER_PYTHON (or the `python` option).");
    }
    return found;
}
//# sourceMappingURL=python.js.map