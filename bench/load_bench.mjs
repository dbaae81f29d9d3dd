// Start-up and memory of lm-worker beside llama.cpp on one gguf: each round spawns a fresh
// llama.cpp process (node-llama-cpp in a child Node, bench/llama_cpp_load_child.mjs) and a fresh
// worker (`python -m worker` through the Node client), each loads the model and takes one greedy
// token after "def quicksort(arr):"; the two take turns going first.
//
//   node bench/load_bench.mjs --model NAME|PATH [--rounds N] [--busy] [--json FILE]
//
// NAME is a shipped model (default, gemma3-270m, qwen2.5-coder-0.5b): llama.cpp loads its gguf
// (shippedGguf), the worker loads the name. PATH is a .gguf file: both load it. --busy keeps one
// core busy with a busy-loop process for each whole round (nothing pinned). bench/README.md
// ("Loading a gguf") says what each row is. Needs `make setup` and `npm run build`;
// node-llama-cpp is installed on first use into bench/llama-cpp.
import { spawn } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { availableParallelism, loadavg, tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { createInterface } from "node:readline";
import { parseArgs } from "node:util";

import { lmWorkerClient, python, root, shippedGguf, THREADS } from "./llama_cpp_setup.mjs";

const { values: options } = parseArgs({
  options: {
    model: { type: "string", default: "default" },
    rounds: { type: "string", default: "5" },
    busy: { type: "boolean", default: false },
    json: { type: "string" },
  },
});
const rounds = Number(options.rounds);
const PROMPT = "def quicksort(arr):";
const CHILD = join(root, "bench", "llama_cpp_load_child.mjs");
const MB = 1024 * 1024;

const scratch = mkdtempSync(join(tmpdir(), "lm-load-bench-"));
const isPath = options.model.endsWith(".gguf");
const gguf = isPath ? resolve(options.model) : shippedGguf(options.model, scratch);
const workerModel = isPath ? gguf : options.model;
const LmWorker = await lmWorkerClient();

function processor() {
  const info = readFileSync("/proc/cpuinfo", "utf8");
  const field = (name) => info.match(new RegExp(`^${name}\\s*:\\s*(.*)$`, "m"))?.[1]?.trim();
  return `${field("model name") ?? "unknown"} (family ${field("cpu family")}, model ${field("model")}), ${availableParallelism()} CPUs`;
}

/** A process's memory from /proc/PID/status, in bytes. */
function memoryOf(pid) {
  const status = readFileSync(`/proc/${pid}/status`, "utf8");
  const field = (name) => Number(status.match(new RegExp(`^${name}:\\s+(\\d+) kB`, "m"))?.[1] ?? NaN) * 1024;
  return { vmRSS: field("VmRSS"), vmHWM: field("VmHWM"), rssAnon: field("RssAnon"), rssFile: field("RssFile") };
}

// --- one start-up each ----------------------------------------------------------------

/** llama.cpp: a fresh Node process; times from its spawn to its "loaded" and "first token" lines. */
function llamaOnce() {
  return new Promise((resolvePromise, reject) => {
    const started = performance.now();
    const child = spawn(process.execPath, [CHILD, gguf, PROMPT], { cwd: root, stdio: ["ignore", "pipe", "pipe"] });
    const stages = {};
    let stderr = "";
    child.stderr.on("data", (data) => (stderr += data));
    createInterface({ input: child.stdout }).on("line", (line) => {
      let message;
      try {
        message = JSON.parse(line);
      } catch {
        console.error(line); // npm's output when node-llama-cpp is installed on first use
        return;
      }
      stages[message.stage] = { ...message, atMs: performance.now() - started };
    });
    child.on("error", reject);
    child.on("close", (code) => {
      if (code !== 0 || !stages["first token"]) return reject(new Error(`llama.cpp child exited with ${code}: ${stderr.trim()}`));
      const { baseline, loaded } = stages;
      const first = stages["first token"];
      resolvePromise({
        loadedS: loaded.atMs / 1000,
        firstS: first.atMs / 1000,
        baseline: baseline.rss,
        rss: loaded.rss,
        peak: loaded.vmHWM,
        peakFirst: first.vmHWM,
        rssAnon: loaded.rssAnon,
        rssFile: loaded.rssFile,
        promptTokens: first.prompt_tokens,
        token: first.token,
      });
    });
  });
}

/** The worker: spawned through the Node client; times from just before the spawn to the load's
 *  answer and to the first chunk; memory of the worker's own process (the client's pid). */
async function workerOnce() {
  const started = performance.now();
  const worker = await LmWorker.start({ python, cwd: root, args: ["--log-level", "warning"] });
  try {
    const readyS = (performance.now() - started) / 1000;
    const before = memoryOf(worker.pid);
    const info = await worker.load({ model: workerModel });
    const loadedS = (performance.now() - started) / 1000;
    const loaded = memoryOf(worker.pid);
    const stream = worker.generate({ prompt: PROMPT, max_tokens: 1, temperature: 0 });
    let firstS = null;
    let token = null;
    for await (const chunk of stream) {
      if (firstS === null && chunk.tokens.length) {
        firstS = (performance.now() - started) / 1000;
        token = chunk.tokens[0];
      }
    }
    const result = await stream.result;
    const afterFirst = memoryOf(worker.pid);
    return {
      readyS,
      loadedS,
      firstS,
      before: before.vmRSS,
      rss: loaded.vmRSS,
      peak: loaded.vmHWM,
      peakFirst: afterFirst.vmHWM,
      rssAnon: loaded.rssAnon,
      rssFile: loaded.rssFile,
      promptTokens: result.usage.prompt_tokens,
      token,
      loadedAs: { model: info.model, path: info.path, backend: info.backend, dtype: info.dtype, quantization: info.quantization },
    };
  } finally {
    await worker.close();
  }
}

/** A busy loop on one core (not pinned) for the length of `run`, started 300 ms before it. */
async function withBusyCore(run) {
  if (!options.busy) return run();
  const busy = spawn(process.execPath, ["-e", "for (;;) {}"], { stdio: "ignore" });
  await new Promise((r) => setTimeout(r, 300));
  try {
    return await run();
  } finally {
    busy.kill();
    await new Promise((r) => busy.once("exit", r));
  }
}

// --- the run ------------------------------------------------------------------------------

const cpu = processor();
const loadAtStart = loadavg();
console.error(`${options.model}: ${gguf}\nwarming the page cache (one untimed load of each) ...`);
await llamaOnce();
await workerOnce();
const samples = [];
try {
  for (let round = 0; round < rounds; round++) {
    const llamaFirst = round % 2 === 0;
    console.error(`round ${round + 1}/${rounds} (${llamaFirst ? "llama.cpp" : "lm-worker"} first)`);
    const sample = await withBusyCore(async () => {
      const load = loadavg()[0];
      let llama;
      let worker;
      if (llamaFirst) {
        llama = await llamaOnce();
        worker = await workerOnce();
      } else {
        worker = await workerOnce();
        llama = await llamaOnce();
      }
      return { round: round + 1, first: llamaFirst ? "llama.cpp" : "lm-worker", load, llama, worker };
    });
    samples.push(sample);
  }
} finally {
  rmSync(scratch, { recursive: true, force: true });
}

// --- the report ---------------------------------------------------------------------------

const median = (values) => {
  const sorted = [...values].sort((a, b) => a - b);
  const middle = Math.floor(sorted.length / 2);
  return sorted.length % 2 ? sorted[middle] : (sorted[middle - 1] + sorted[middle]) / 2;
};
// [label, key, llama.cpp's value of a round, lm-worker's value of a round, digits]
const ROWS = [
  ["spawn → loaded (s)", "loaded", (l) => l.loadedS, (w) => w.loadedS, 2],
  ["spawn → first token (s)", "first", (l) => l.firstS, (w) => w.firstS, 2],
  ["resident after load, llama.cpp above its baseline (MB)", "rss_above", (l) => (l.rss - l.baseline) / MB, (w) => w.rss / MB, 0],
  ["resident after load, whole process (MB)", "rss", (l) => l.rss / MB, (w) => w.rss / MB, 0],
  ["peak to loaded, llama.cpp above its baseline (MB)", "peak_above", (l) => (l.peak - l.baseline) / MB, (w) => w.peak / MB, 0],
  ["peak to loaded, whole process (MB)", "peak", (l) => l.peak / MB, (w) => w.peak / MB, 0],
  ["peak to the first token, whole process (MB)", "peak_first", (l) => l.peakFirst / MB, (w) => w.peakFirst / MB, 0],
  ["before load: llama.cpp's baseline, the worker after its handshake (MB)", "before", (l) => l.baseline / MB, (w) => w.before / MB, 0],
];
const rows = [];
console.log(
  `\n${options.model}${isPath ? "" : ` (${gguf})`}: ${rounds} round(s)${options.busy ? ", one core kept busy by a busy-loop process the whole round (not pinned)" : ", quiet (no busy loop)"}`,
);
console.log(`processor: ${cpu}; load average at start ${loadAtStart.map((v) => v.toFixed(2)).join(", ")} (1, 5, 15 min)`);
const as = samples[0].worker.loadedAs;
console.log(
  `llama.cpp: node-llama-cpp, ${THREADS} threads, context 4096, 1 sequence; ` +
    `lm-worker: load ${JSON.stringify({ model: workerModel })} (${as.backend}, ${as.dtype}, quantization ${as.quantization}, from ${as.path})`,
);
console.log(`medians; ratio = lm-worker ÷ llama.cpp\n`);
console.log("| figure | llama.cpp | lm-worker | ratio |\n| --- | --- | --- | --- |");
for (const [label, key, ofLlama, ofWorker, digits] of ROWS) {
  const llama = median(samples.map((s) => ofLlama(s.llama)));
  const worker = median(samples.map((s) => ofWorker(s.worker)));
  rows.push({ figure: key, label, llama_cpp: llama, lm_worker: worker, ratio: worker / llama });
  console.log(`| ${label} | ${llama.toFixed(digits)} | ${worker.toFixed(digits)} | ${(worker / llama).toFixed(2)}× |`);
}
const split = (side) => {
  const anon = median(samples.map((s) => s[side].rssAnon / MB)).toFixed(0);
  const file = median(samples.map((s) => s[side].rssFile / MB)).toFixed(0);
  return `${anon} anonymous + ${file} file-backed`;
};
console.log(`\nresident after load, medians (MB): llama.cpp ${split("llama")}; lm-worker ${split("worker")}`);
console.log(`lm-worker's handshake (spawn → capabilities answered), median: ${median(samples.map((s) => s.worker.readyS)).toFixed(2)} s`);
const tokens = samples.map((s) => `${s.llama.token}/${s.worker.token}`);
console.log(
  `first greedy token llama.cpp/lm-worker per round: ${tokens.join(", ")}; prompt tokens ${samples[0].llama.promptTokens.length}/${samples[0].worker.promptTokens}`,
);
console.log("\nper round (s; MB):\n");
console.log(
  "| round | first | load avg | loaded llama.cpp | loaded lm-worker | first token llama.cpp | first token lm-worker | " +
    "resident llama.cpp (above baseline / whole) | resident lm-worker | peak llama.cpp (above / whole) | peak lm-worker |",
);
console.log(`|${" --- |".repeat(11)}`);
for (const s of samples) {
  const l = s.llama;
  const w = s.worker;
  const mb = (bytes) => (bytes / MB).toFixed(0);
  console.log(
    `| ${s.round} | ${s.first} | ${s.load.toFixed(2)} | ${l.loadedS.toFixed(2)} | ${w.loadedS.toFixed(2)} | ${l.firstS.toFixed(2)} | ${w.firstS.toFixed(2)} | ` +
      `${mb(l.rss - l.baseline)} / ${mb(l.rss)} | ${mb(w.rss)} | ${mb(l.peak - l.baseline)} / ${mb(l.peak)} | ${mb(w.peak)} |`,
  );
}
console.log(`\n1-minute load average at the end: ${loadavg()[0].toFixed(2)}`);
if (options.json) {
  const report = {
    model: options.model,
    gguf,
    worker_load: { model: workerModel },
    loaded_as: samples[0]?.worker.loadedAs,
    prompt: PROMPT,
    processor: cpu,
    busy: options.busy,
    threads: THREADS,
    rounds,
    load_average_start: loadAtStart,
    load_average_end: loadavg(),
    rows,
    samples,
  };
  writeFileSync(options.json, JSON.stringify(report, null, 2) + "\n");
}
