/** Where the Python that runs the worker is: an option, $LM_WORKER_PYTHON, a checkout's .venv, or the setup's. */
/** The package's root (where package.json and the Python sources are), from client/dist/src/. */
export declare const packageRoot: string;
/** The worker's data directory, as the worker itself picks it: $LM_WORKER_DATA_DIR, else under XDG_DATA_HOME. */
export declare function dataDir(env?: NodeJS.ProcessEnv): string;
/** The virtual environment `lm-worker setup` makes (unless told another place). */
export declare function setupVenv(env?: NodeJS.ProcessEnv): string;
export declare function venvPython(venv: string): string;
/** The Python to run the worker with, in order: `explicit`, $LM_WORKER_PYTHON, the package's own
 *  .venv (a development checkout, made by `make setup`), the venv `lm-worker setup` made. */
export declare function findPython(explicit?: string, env?: NodeJS.ProcessEnv): string;
