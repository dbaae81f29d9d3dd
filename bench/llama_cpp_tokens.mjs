// llama.cpp's greedy tokens on a shipped model's gguf, for the slow tier's quality gates
// (tests/test_gguf_weights.py on SmolLM2, tests/test_qwen_coder_real.py on Qwen2.5-Coder-0.5B):
// run once, the output is committed as test data.
//
//   node bench/llama_cpp_tokens.mjs tests/data/llama_cpp_greedy.json
//   node bench/llama_cpp_tokens.mjs tests/data/llama_cpp_greedy_qwen_coder.json qwen2.5-coder-0.5b
//
// Each prompt's token ids come from the worker's tokenizer and are given to llama.cpp as
// they are (node-llama-cpp 3.21.1, 2 threads, temperature 0, 128 new tokens, a new
// sequence per prompt). Needs `npm run build`; node-llama-cpp is installed on first use
// into bench/llama-cpp, as for bench/llama_cpp_bench.mjs.
import { writeFileSync } from "node:fs";

import { cpuLlama, lmWorkerClient, python, root, shippedGguf, THREADS } from "./llama_cpp_setup.mjs";

const [output, modelName = "default"] = process.argv.slice(2);
if (!output) throw new Error("usage: node bench/llama_cpp_tokens.mjs OUTPUT.json [default|qwen2.5-coder-0.5b]");
const NEW_TOKENS = 128;
const PROMPTS = {
  default: [
    "The capital of France is",
    "The history of the city of Rome begins",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
    "Once upon a time, in a small village by the sea,",
  ],
  "qwen2.5-coder-0.5b": [
    "def quicksort(arr):",
    "# Return True when n is a prime number.\ndef is_prime(n):",
    "class Stack:\n    def __init__(self):",
  ],
}[modelName];
const DESCRIBED = { default: "SmolLM2-135M-Instruct Q4_1", "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B-Instruct" }[modelName];

const gguf = shippedGguf(modelName);
const LmWorker = await lmWorkerClient();

const worker = await LmWorker.start({ python, cwd: root, args: ["--log-level", "warning"] });
await worker.load({ model: modelName });
const prompts = [];
for (const text of PROMPTS) prompts.push({ text, tokens: (await worker.tokenize({ text })).tokens });
await worker.close();

const llama = await cpuLlama();
const model = await llama.loadModel({ modelPath: gguf });
const context = await model.createContext({ contextSize: 1024, threads: THREADS, sequences: 1 });
const eos = model.tokens.eos;
for (const prompt of prompts) {
  const sequence = context.getSequence();
  const tokens = [];
  for await (const token of sequence.evaluate(prompt.tokens, { temperature: 0 })) {
    tokens.push(token);
    if (token === eos || tokens.length >= NEW_TOKENS) break;
  }
  sequence.dispose();
  prompt.llama_cpp_tokens = tokens;
  console.error(JSON.stringify(prompt.text), tokens.length, "tokens");
}

const release = llama.llamaCppRelease;
writeFileSync(
  output,
  JSON.stringify(
    {
      note:
        `llama.cpp's greedy output on the shipped ${DESCRIBED} gguf, made once with ` +
        "`node bench/llama_cpp_tokens.mjs " + process.argv.slice(2).join(" ") + "`: node-llama-cpp 3.21.1 (" + llama.buildType + " build, llama.cpp " +
        `${release.repo} ${release.release}), ${THREADS} threads, temperature 0, ${NEW_TOKENS} new tokens or up to the end-of-sequence token ` +
        `(id ${eos}), a new sequence per prompt; the prompts' token ids are the worker's tokenizer's.`,
      system: llama.systemInfo,
      new_tokens: NEW_TOKENS,
      eos,
      prompts,
    },
    null,
    1,
  ) + "\n",
);
await context.dispose();
await model.dispose();
await llama.dispose();
