// lm-worker beside llama.cpp (node-llama-cpp), driven from one Node process, on the same
// model (SmolLM2-135M-Instruct: llama.cpp on the shipped Q4_1 gguf, the worker on its
// conversion of it, with int8 weights (the default on the CPU) and dense; with --model
// gemma3-270m, Gemma 3 270M and its Q4_K_M gguf; with --model PATH.gguf, any gguf: llama.cpp
// loads the file and the worker loads {model: PATH}), the same prompt tokens, greedy,
// interleaved round by round.
//
//   node bench/llama_cpp_bench.mjs [--quick] [--rounds N] [--json FILE] [--workers int8,gguf,none,int4] [--decode-only]
//                                  [--decode-row] [--tokens N]
//                                  [--model default|gemma3-270m|qwen2.5-coder-0.5b|PATH.gguf]
//
// bench/README.md says what each figure is. Needs `make setup` and `npm run build`;
// node-llama-cpp is installed on first use into bench/llama-cpp (exact pins, lock file).
import { execFileSync, spawn } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { availableParallelism, loadavg, tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { parseArgs } from "node:util";

import { cpuLlama, lmWorkerClient, python, root, shippedGguf, THREADS } from "./llama_cpp_setup.mjs";

const { values: options } = parseArgs({
  options: {
    quick: { type: "boolean", default: false },
    rounds: { type: "string" },
    json: { type: "string" },
    // one worker per quantization (load param), all dense float32 otherwise
    workers: { type: "string" },
    // the decode rows alone: decode, a busy core, batches (a crowded machine makes the 2,048-token rows take minutes)
    "decode-only": { type: "boolean", default: false },
    // the first row alone (one stream decoding): what a model of billions of weights has time for
    "decode-row": { type: "boolean", default: false },
    // new tokens per decode (128 unless told)
    tokens: { type: "string" },
    model: { type: "string", default: "default" },
  },
});
const rounds = Number(options.rounds ?? (options.quick ? 1 : 3));
const NEW_TOKENS = Number(options.tokens ?? 128);
const LONG_PROMPT_TOKENS = 2048;

// --- the two contestants -------------------------------------------------------------

const scratch = mkdtempSync(join(tmpdir(), "lm-bench-"));
// A .gguf path is loaded as it is by both; a name is a shipped model, the worker loads the name.
const isPath = options.model.endsWith(".gguf");
const gguf = isPath ? resolve(options.model) : shippedGguf(options.model, scratch);
const workerModel = isPath ? gguf : options.model;
const LmWorker = await lmWorkerClient();
const llama = await cpuLlama();
const llamaModel = await llama.loadModel({ modelPath: gguf });
let llamaContext = await llamaModel.createContext({ contextSize: 4096, threads: THREADS, sequences: 1 });

async function startWorker(loadParams) {
  const worker = await LmWorker.start({ python, cwd: root, args: ["--log-level", "warning"] });
  const info = await worker.load({ model: workerModel, ...loadParams });
  return { worker, info };
}

// --- prompts: token ids, the same for both --------------------------------------------

const tokenizer = await startWorker({});
const tokenize = async (text) => (await tokenizer.worker.tokenize({ text })).tokens;
// A counting prompt: greedy decoding continues it well past 128 tokens without an end.
const decodePrompt = await tokenize("1, 2, 3, 4, 5, 6, 7, 8, 9, 10,");
const shortPrompt = await tokenize("The capital of France is");
// One counting prompt for each stream of the batched rows, each from its own number.
const BATCHES = [4, 8];
const batchPrompts = [];
for (let i = 0; i < Math.max(...BATCHES); i++) {
  const start = 1 + 20 * i;
  batchPrompts.push(await tokenize(Array.from({ length: 10 }, (_, k) => start + k).join(", ") + ","));
}
const sentences = [
  "The river runs past the old mill, where the miller keeps his accounts in a leather book.",
  "In spring the orchards bloom, and the bees come down from the hills to the valley.",
  "Merchants cross the bridge at dawn with carts of grain, salt, wool and copper pots.",
  "A clerk in the town hall writes the names of every ship that anchors in the bay.",
];
let text = "";
for (let i = 0; (await tokenize(text)).length < LONG_PROMPT_TOKENS + 8; i++) text += sentences[i % 4] + ` (${i}) `;
const longPrompt = (await tokenize(text)).slice(0, LONG_PROMPT_TOKENS);
const question = await tokenize(" Question: what does the clerk write? Answer:");
const restartPrompt = [...longPrompt, ...question.slice(question[0] === longPrompt[0] ? 1 : 0)];
await tokenizer.worker.close();

// --- one measurement each -----------------------------------------------------------

/** Time to first token and decode rate of one greedy generation of at most `max` tokens. */
async function timeTokens(tokenStream, max) {
  const started = performance.now();
  let first = 0;
  let last = 0;
  let count = 0;
  const tokens = [];
  for await (const token of tokenStream) {
    last = performance.now();
    if (count === 0) first = last;
    count += 1;
    tokens.push(token);
    if (count >= max) break;
  }
  return { firstMs: first - started, tokensPerSecond: count > 1 ? (count - 1) / ((last - first) / 1000) : 0, tokens };
}

async function* llamaTokens(tokens, sequence) {
  for await (const token of sequence.evaluate(tokens, { temperature: 0 })) yield token;
}

async function llamaRun(tokens, max) {
  const sequence = llamaContext.getSequence();
  try {
    return await timeTokens(llamaTokens(tokens, sequence), max);
  } finally {
    sequence.dispose();
  }
}

async function* workerTokens(worker, params) {
  const stream = worker.generate({ temperature: 0, ...params });
  for await (const chunk of stream) yield* chunk.tokens;
  await stream.result;
}

const workerRun = (worker, tokens, max, extra = {}) =>
  timeTokens(workerTokens(worker, { tokens, max_tokens: max, ...extra }), max);

/** llama.cpp: evaluate the prefix, save the sequence state, then in a new context (the
 *  model stays loaded, as in a restarted host that loaded it) load it and answer. */
async function llamaRestart(directory) {
  const file = join(directory, "llama-state.bin");
  const sequence = llamaContext.getSequence();
  await sequence.evaluateWithoutGeneratingNewTokens(longPrompt);
  await sequence.saveStateToFile(file);
  sequence.dispose();
  await llamaContext.dispose();
  llamaContext = await llamaModel.createContext({ contextSize: 4096, threads: THREADS, sequences: 1 });
  const restored = llamaContext.getSequence();
  try {
    const started = performance.now();
    await restored.loadStateFromFile(file, { acceptRisk: true });
    const loadedMs = performance.now() - started;
    const run = await timeTokens(llamaTokens(restartPrompt.slice(longPrompt.length), restored), 1);
    return { ...run, firstMs: loadedMs + run.firstMs };
  } finally {
    restored.dispose();
  }
}

/** The worker: prefill the prefix into a cache file, restart the worker (and load), then
 *  answer from the cache: first token from the request written. */
async function workerRestart(state, loadParams, ref) {
  await state.worker.prefill({ tokens: longPrompt, cache: ref });
  await state.worker.close();
  Object.assign(state, await startWorker(loadParams));
  return workerRun(state.worker, restartPrompt, 1, { cache: ref });
}

/** `count` greedy generations at once, each of at most NEW_TOKENS after its own counting
 *  prompt: all tokens over the time from the start to the last token. llama.cpp: one context of
 *  `count` sequences, evaluated together (node-llama-cpp batches their steps); the worker:
 *  `count` generate requests sent together. */
async function llamaBatch(prompts) {
  const context = await llamaModel.createContext({ contextSize: 4096, threads: THREADS, sequences: prompts.length });
  try {
    const started = performance.now();
    const runs = await Promise.all(prompts.map((tokens) => timeTokens(llamaTokens(tokens, context.getSequence()), NEW_TOKENS)));
    return { tokensPerSecond: total(runs) / ((performance.now() - started) / 1000), runs };
  } finally {
    await context.dispose();
  }
}

async function workerBatch(worker, prompts) {
  const started = performance.now();
  const runs = await Promise.all(prompts.map((tokens) => workerRun(worker, tokens, NEW_TOKENS)));
  return { tokensPerSecond: total(runs) / ((performance.now() - started) / 1000), runs };
}

const total = (runs) => runs.reduce((sum, run) => sum + run.tokens.length, 0);

/** The first ONE_BY_ONE batch prompts one after another with `run` (one stream): all tokens
 *  over the time from each request to its last token, as the batches count theirs, so that a
 *  batch's ratio to it is a batch against the same requests sent one by one. */
const ONE_BY_ONE = 4;
async function oneByOne(run) {
  let tokens = 0;
  let ms = 0;
  for (const prompt of batchPrompts.slice(0, ONE_BY_ONE)) {
    const started = performance.now();
    tokens += (await run(prompt)).tokens.length;
    ms += performance.now() - started;
  }
  return { tokensPerSecond: tokens / (ms / 1000) };
}

/** `run` with one core kept busy by another process (a plain busy loop), as a host or a build
 *  on the same machine keeps it. */
async function withBusyCore(run) {
  const busy = spawn(process.execPath, ["-e", "for (;;) {}"], { stdio: "ignore" });
  await new Promise((resolve) => setTimeout(resolve, 300));
  try {
    return await run();
  } finally {
    busy.kill();
    await new Promise((resolve) => busy.once("exit", resolve));
  }
}

// --- the run -----------------------------------------------------------------------------

const quantizations = (options.workers ?? (options.quick ? "int8" : "int8,none")).split(",");
const contestants = quantizations.map((quantization) => ({
  name: `lm-worker ${quantization === "int8" ? "int8 (the default)" : quantization === "none" ? "dense" : quantization}`,
  load: { dtype: "float32", quantization },
}));
for (const contestant of contestants) contestant.state = await startWorker(contestant.load);
const KEYS = ["decode", "busy", "single", ...BATCHES.map((n) => `batch${n}`), "short", "long", "restart"];
const emptyFigures = () => Object.fromEntries(KEYS.map((key) => [key, []]));
const figures = { llama: emptyFigures() };
// The 1-minute load average as each decode run ends: on a shared machine the figures are only
// comparable within a round, and this says how crowded it was.
const loads = [];
const cpus = availableParallelism();
for (const c of contestants) figures[c.name] = emptyFigures();
const agreement = [];
let memory; // bench/read_bandwidth.py's report

try {
  for (let round = 0; round < rounds; round++) {
    console.error(`round ${round + 1}/${rounds}`);
    const llamaDecode = await llamaRun(decodePrompt, NEW_TOKENS);
    figures.llama.decode.push(llamaDecode.tokensPerSecond);
    loads.push({ round, run: "llama.cpp", load: loadavg()[0] });
    for (const c of contestants) {
      const run = await workerRun(c.state.worker, decodePrompt, NEW_TOKENS);
      figures[c.name].decode.push(run.tokensPerSecond);
      loads.push({ round, run: c.name, load: loadavg()[0] });
      const same = run.tokens.findIndex((t, i) => t !== llamaDecode.tokens[i]);
      agreement.push({ contestant: c.name, firstDifference: same });
    }
    if (options["decode-row"]) continue;
    figures.llama.busy.push((await withBusyCore(() => llamaRun(decodePrompt, NEW_TOKENS))).tokensPerSecond);
    for (const c of contestants) {
      figures[c.name].busy.push((await withBusyCore(() => workerRun(c.state.worker, decodePrompt, NEW_TOKENS))).tokensPerSecond);
    }
    figures.llama.single.push((await oneByOne((prompt) => llamaRun(prompt, NEW_TOKENS))).tokensPerSecond);
    for (const c of contestants) {
      figures[c.name].single.push((await oneByOne((prompt) => workerRun(c.state.worker, prompt, NEW_TOKENS))).tokensPerSecond);
    }
    for (const n of BATCHES) {
      const prompts = batchPrompts.slice(0, n);
      figures.llama[`batch${n}`].push((await llamaBatch(prompts)).tokensPerSecond);
      for (const c of contestants) figures[c.name][`batch${n}`].push((await workerBatch(c.state.worker, prompts)).tokensPerSecond);
    }
    if (options["decode-only"]) continue;
    figures.llama.short.push((await llamaRun(shortPrompt, 1)).firstMs);
    for (const c of contestants) figures[c.name].short.push((await workerRun(c.state.worker, shortPrompt, 1)).firstMs);
    figures.llama.long.push((await llamaRun(longPrompt, 1)).firstMs);
    for (const c of contestants) figures[c.name].long.push((await workerRun(c.state.worker, longPrompt, 1)).firstMs);
    figures.llama.restart.push((await llamaRestart(scratch)).firstMs);
    for (const c of contestants) {
      figures[c.name].restart.push((await workerRestart(c.state, c.load, `bench-restart-${round}`)).firstMs);
      await c.state.worker.cacheDelete({ cache: `bench-restart-${round}` });
    }
  }
  // This machine's read speed and the bytes a step reads (bench/read_bandwidth.py), with nothing else running.
  const probeFile = join(scratch, "read.json");
  execFileSync(python, [join(root, "bench", "read_bandwidth.py"), "--model", gguf, "--json", probeFile], { cwd: root });
  memory = JSON.parse(readFileSync(probeFile, "utf8"));
} finally {
  for (const c of contestants) await c.state.worker.close();
  await llamaContext.dispose();
  await llamaModel.dispose();
  rmSync(scratch, { recursive: true, force: true });
}

// --- the report --------------------------------------------------------------------------

const median = (values) => {
  const sorted = [...values].sort((a, b) => a - b);
  const middle = Math.floor(sorted.length / 2);
  return sorted.length % 2 ? sorted[middle] : (sorted[middle - 1] + sorted[middle]) / 2;
};
const rows = [
  [`decode tokens/s (${NEW_TOKENS} new)`, "decode", "higher", (w, l) => w / l, 1],
  ["decode tokens/s, one core kept busy by another process", "busy", "higher", (w, l) => w / l, 1],
  [`${ONE_BY_ONE} of the batches' requests one by one, tokens/s (from each request to its last token)`, "single", "higher", (w, l) => w / l, 1],
  ...BATCHES.map((n) => [`${n} streams at once, aggregate tokens/s`, `batch${n}`, "higher", (w, l) => w / l, 1]),
  ["first token, short prompt (ms)", "short", "lower", (w, l) => w / l, 0],
  [`first token, ${LONG_PROMPT_TOKENS}-token prompt (ms)`, "long", "lower", (w, l) => w / l, 0],
  [`first token after a restart, ${LONG_PROMPT_TOKENS} tokens cached (ms)`, "restart", "lower", (w, l) => w / l, 0],
];
const report = { model: options.model, rounds, threads: THREADS, prompts: { decode: decodePrompt.length, short: shortPrompt.length, long: longPrompt.length, restart: restartPrompt.length }, rows: [] };
console.log(`\n${options.model}: medians of ${rounds} round(s), ${THREADS} threads each, greedy; ratio = lm-worker / llama.cpp\n`);
const header = ["figure", "llama.cpp", ...contestants.flatMap((c) => [c.name, "ratio"])];
console.log(`| ${header.join(" | ")} |\n|${header.map(() => " --- ").join("|")}|`);
for (const [label, key, better, ratio, digits] of rows) {
  if (!figures.llama[key].length) continue;
  const base = median(figures.llama[key]);
  const cells = [label, base.toFixed(digits)];
  const row = { figure: key, better, llama_cpp: base };
  for (const c of contestants) {
    const value = median(figures[c.name][key]);
    cells.push(value.toFixed(digits), `${ratio(value, base).toFixed(2)}×`);
    row[c.name] = { value, ratio: ratio(value, base) };
  }
  report.rows.push(row);
  console.log(`| ${cells.join(" | ")} |`);
}
const diverged = agreement.filter((a) => a.firstDifference >= 0);
console.log(
  `\ngreedy tokens, lm-worker against llama.cpp (different arithmetic, so they may part): ` +
    (diverged.length ? diverged.map((a) => `${a.contestant} from token ${a.firstDifference}`).join("; ") : `equal for all ${NEW_TOKENS}`),
);
report.agreement = agreement;
report.loads = loads;
console.log(`\n1-minute load average after each decode run (${cpus} CPUs): ${loads.map((l) => l.load.toFixed(1)).join(", ")}`);
if (rounds > 1) {
  const perRound = (name) => figures[name].decode.map((v, i) => v / figures.llama.decode[i]);
  for (const c of contestants) console.log(`decode ratio per round, ${c.name}: ${perRound(c.name).map((r) => r.toFixed(2) + "×").join(", ")}`);
}
// What each keeps of its quiet decode with a core busy, round by round (the two runs back to back).
const kept = (name) => figures[name].busy.map((v, i) => `${((100 * v) / figures[name].decode[i]).toFixed(0)}%`).join(", ");
console.log(`quiet decode speed kept with one core busy, per round: llama.cpp ${kept("llama")}`);
for (const c of contestants) console.log(`  ${c.name} ${kept(c.name)}`);
// Each decode figure on the file's blocks as a fraction of what this machine's memory allows.
const read = memory.models[gguf];
const speed = memory.read_gb_per_s[String(Math.max(...Object.keys(memory.read_gb_per_s).map(Number)))];
const readers = [["llama.cpp", "llama"], ...contestants.filter((c) => c.state.info.quantization === "gguf").map((c) => [c.name, c.name])];
console.log(
  `a decode step reads ${(read.bytes_per_token / 1e6).toFixed(1)} MB of the gguf; ${memory.processor} reads ${speed.toFixed(1)} GB/s ` +
    `(bench/read_bandwidth.py), so at most ${read.tokens_per_s_at_read_speed.toFixed(1)} tokens/s; decode as a fraction of it: ` +
    readers.map(([label, key]) => `${label} ${((100 * median(figures[key].decode)) / read.tokens_per_s_at_read_speed).toFixed(0)}%`).join(", "),
);
report.memory = memory;
// Each contestant's batches against its own requests one by one, round by round (both timed from
// the requests sent to their last tokens, prompts included).
for (const name of ["llama", ...contestants.map((c) => c.name)]) {
  const over = (n) => figures[name][`batch${n}`].map((v, i) => `${(v / figures[name].single[i]).toFixed(2)}×`).join(", ");
  console.log(`${name === "llama" ? "llama.cpp" : name}: ${BATCHES.map((n) => `${n} streams ÷ one ${over(n)}`).join("; ")}`);
}
// Workers against the first one named (say gguf against int8), round by round: the pair ran back to back.
for (const c of contestants.slice(1)) {
  const first = contestants[0].name;
  const ratios = figures[c.name].decode.map((v, i) => v / figures[first].decode[i]);
  console.log(`decode, ${c.name} / ${first} per round: ${ratios.map((r) => r.toFixed(2) + "×").join(", ")}`);
}
if (options.json) writeFileSync(options.json, JSON.stringify({ ...report, samples: figures }, null, 2));
