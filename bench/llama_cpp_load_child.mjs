// One llama.cpp start-up, for bench/load_bench.mjs: a fresh Node process loads a gguf with
// node-llama-cpp (2 threads, a 4,096-token context of one sequence), evaluates a prompt that
// llama.cpp itself tokenizes and takes one greedy token. It prints one JSON line per stage on
// stdout ("baseline", "loaded", "first token"); the parent times the lines from its spawn.
//
//   node bench/llama_cpp_load_child.mjs MODEL.gguf "PROMPT"
import { readFileSync } from "node:fs";

import { cpuLlama, THREADS } from "./llama_cpp_setup.mjs";

const [modelPath, prompt] = process.argv.slice(2);
if (!modelPath || prompt === undefined) throw new Error("usage: node bench/llama_cpp_load_child.mjs MODEL.gguf PROMPT");

/** This process's memory now: rss from Node, the rest from /proc/self/status, in bytes. */
function memory() {
  const status = readFileSync("/proc/self/status", "utf8");
  const field = (name) => Number(status.match(new RegExp(`^${name}:\\s+(\\d+) kB`, "m"))?.[1] ?? NaN) * 1024;
  return { rss: process.memoryUsage().rss, vmRSS: field("VmRSS"), vmHWM: field("VmHWM"), rssAnon: field("RssAnon"), rssFile: field("RssFile") };
}
const say = (stage, extra = {}) => process.stdout.write(JSON.stringify({ stage, ...memory(), ...extra }) + "\n");

const llama = await cpuLlama();
// Node and the addon with nothing loaded: what "above its baseline" is taken from.
say("baseline");
const model = await llama.loadModel({ modelPath });
const context = await model.createContext({ contextSize: 4096, threads: THREADS, sequences: 1 });
say("loaded");
const tokens = model.tokenize(prompt);
const sequence = context.getSequence();
let first = null;
for await (const token of sequence.evaluate(tokens, { temperature: 0 })) {
  first = token;
  break;
}
say("first token", { prompt_tokens: tokens, token: first });
sequence.dispose();
await context.dispose();
await model.dispose();
await llama.dispose();
