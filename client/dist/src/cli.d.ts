#!/usr/bin/env node
/**
 * `lm-worker setup`: make the Python environment the worker runs in, where the client finds it.
 * `lm-worker python`: print the Python the client would run the worker with.
 */
export {};
