// The client's framing codec on its own: the same messages whatever the pieces the bytes come in.

import assert from "node:assert/strict";
import { test } from "node:test";

import { encode, FrameDecoder, type Decoded, type Framing } from "../src/framing.js";

const MESSAGES = [
  { jsonrpc: "2.0", id: 1, result: { text: "héllo 日本 🙂" } },
  { jsonrpc: "2.0", method: "generate/chunk", params: { id: 1, index: 0, text: "€".repeat(5000) } },
  { jsonrpc: "2.0", id: 2, result: null },
];

function decodeIn(framing: Framing, bytes: Buffer, sizes: () => number): Decoded[] {
  const decoder = new FrameDecoder(framing);
  const out: Decoded[] = [];
  for (let at = 0; at < bytes.length; ) {
    const size = Math.max(1, sizes());
    out.push(...decoder.push(bytes.subarray(at, at + size)));
    at += size;
  }
  assert.equal(decoder.buffered, 0);
  return out;
}

for (const framing of ["ndjson", "lsp"] as const) {
  test(`${framing}: whole, byte by byte and random pieces decode to the same messages`, () => {
    const bytes = Buffer.concat(MESSAGES.map((m) => encode(m, framing)));
    const expected = MESSAGES.map((message) => ({ message }));
    assert.deepEqual(decodeIn(framing, bytes, () => bytes.length), expected);
    assert.deepEqual(decodeIn(framing, bytes, () => 1), expected);
    let seed = 7;
    const random = () => ((seed = (seed * 1103515245 + 12345) % 2 ** 31) % 97) + 1;
    assert.deepEqual(decodeIn(framing, bytes, random), expected);
  });
}

test("ndjson: a CR before the newline and blank lines are ignored", () => {
  const decoder = new FrameDecoder("ndjson");
  assert.deepEqual(decoder.push(Buffer.from('{"a":1}\r\n\n{"b":2}\n')), [{ message: { a: 1 } }, { message: { b: 2 } }]);
});

test("a line that is not JSON is reported and the next message is still decoded", () => {
  const decoder = new FrameDecoder("ndjson");
  const [bad, good] = decoder.push(Buffer.from('not json\n{"id":3}\n'));
  assert.ok(bad !== undefined && "problem" in bad && bad.problem.startsWith("invalid JSON"));
  assert.equal(bad.excerpt, "not json");
  assert.deepEqual(good, { message: { id: 3 } });
});

test("lsp: header names are case-insensitive and the length counts bytes", () => {
  const body = Buffer.from('{"text":"日本"}');
  const frame = Buffer.concat([Buffer.from(`content-length: ${body.length}\r\n\r\n`), body]);
  assert.deepEqual(new FrameDecoder("lsp").push(frame), [{ message: { text: "日本" } }]);
});
