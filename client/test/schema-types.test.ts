// client/src/protocol-types.ts is generated from schemas/ by client/scripts/schema-types.mjs.
// These tests keep the committed file in step with the schemas, and check that the
// generator notices a schema change (and a struct defined two ways) instead of ignoring it.

import { spawnSync } from "node:child_process";
import { cpSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { after, test } from "node:test";
import { fileURLToPath } from "node:url";
import assert from "node:assert/strict";

import { PROTOCOL_VERSION, type ErrorKind, type Methods } from "../src/protocol-types.js";

/** The repository root: this file runs as client/dist/test/schema-types.test.js → ../../.. */
const root = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..", "..");
const script = join(root, "client", "scripts", "schema-types.mjs");
const schemas = join(root, "schemas");
const committed = join(root, "client", "src", "protocol-types.ts");

const scratch = mkdtempSync(join(tmpdir(), "schema-types-"));
after(() => rmSync(scratch, { recursive: true, force: true }));

function generator(...args: string[]): { status: number | null; stdout: string; stderr: string } {
  const run = spawnSync(process.execPath, [script, ...args], { cwd: root, encoding: "utf8" });
  if (run.error) throw run.error;
  return { status: run.status, stdout: run.stdout, stderr: run.stderr };
}

/** A copy of schemas/ in a fresh folder, with `edit` applied to one file's parsed JSON. */
function editedSchemas(name: string, file: string, edit: (doc: any) => void): string {
  const dir = join(scratch, name);
  cpSync(schemas, dir, { recursive: true });
  const path = join(dir, file);
  const doc = JSON.parse(readFileSync(path, "utf8"));
  edit(doc);
  writeFileSync(path, JSON.stringify(doc, null, 2) + "\n");
  return dir;
}

test("the committed protocol-types.ts matches schemas/ (else: npm run types)", () => {
  const run = generator("--check");
  assert.equal(run.status, 0, `schema-types.mjs --check failed:\n${run.stderr}`);
});

test("generating from an unchanged copy of schemas/ reproduces the committed file byte for byte", () => {
  const dir = join(scratch, "copy");
  cpSync(schemas, dir, { recursive: true });
  const out = join(scratch, "copy.ts");
  const run = generator("--schemas", dir, "--out", out);
  assert.equal(run.status, 0, run.stderr);
  assert.equal(readFileSync(out, "utf8"), readFileSync(committed, "utf8"));
});

test("a property added to a schema struct appears in the generated types and makes --check fail", () => {
  const dir = editedSchemas("added", "generate.params.json", (doc) => {
    doc.$defs.GenerateParams.properties.schema_types_probe = { type: "integer", minimum: 2, default: 7 };
  });
  const out = join(scratch, "added.ts");
  const run = generator("--schemas", dir, "--out", out);
  assert.equal(run.status, 0, run.stderr);
  const generated = readFileSync(out, "utf8");
  assert.notEqual(generated, readFileSync(committed, "utf8"));
  const body = /export interface GenerateParams \{\n([\s\S]*?)\n\}/.exec(generated);
  assert.ok(body, "GenerateParams is missing from the output");
  assert.match(body[1], /\/\*\* minimum 2\. Default `7`\. \*\/\n {2}schema_types_probe\?: number;/);

  const check = generator("--check", "--schemas", dir, "--out", committed);
  assert.equal(check.status, 1);
  assert.match(check.stderr, /protocol-types\.ts is stale/);
});

test("a struct defined differently in two schema files is an error, not a silent pick", () => {
  const dir = editedSchemas("conflict", "render.params.json", (doc) => {
    doc.$defs.ChatMessage.properties.role = { enum: ["user", "assistant"] };
  });
  const run = generator("--schemas", dir, "--out", join(scratch, "conflict.ts"));
  assert.equal(run.status, 2);
  assert.match(run.stderr, /struct ChatMessage is defined differently in .*render\.params\.json/);
});

test("PROTOCOL_VERSION is the protocol_version of schemas/index.json", () => {
  const index = JSON.parse(readFileSync(join(schemas, "index.json"), "utf8"));
  assert.equal(PROTOCOL_VERSION, index.protocol_version);
});

test("Methods has every method of schemas/index.json, in index order", () => {
  const index = JSON.parse(readFileSync(join(schemas, "index.json"), "utf8"));
  const source = readFileSync(committed, "utf8");
  const block = /export interface Methods \{\n([\s\S]*?)\n\}/.exec(source);
  assert.ok(block, "Methods is missing");
  const names = [...block[1].matchAll(/^ {2}("[^"]+"): \{ params:/gm)].map((m) => JSON.parse(m[1]!));
  assert.deepEqual(names, Object.keys(index.methods));
  // Compile-time: methods without fields or with only defaulted fields take {} (so params can be left out).
  const omitted: [Methods["capabilities"]["params"], Methods["generate"]["params"]] = [{}, {}];
  assert.deepEqual(omitted, [{}, {}]);
});

test("ErrorKind is the union of schemas/index.json's error kinds, in index order", () => {
  const index = JSON.parse(readFileSync(join(schemas, "index.json"), "utf8"));
  const block = /export type ErrorKind =\n([\s\S]*?;[^\n]*)\n/.exec(readFileSync(committed, "utf8"));
  assert.ok(block, "ErrorKind is missing");
  const kinds = [...block[1].matchAll(/^ {2}\| ("[^"]+");? \/\/ (-\d+)$/gm)].map((m) => [JSON.parse(m[1]!), Number(m[2])]);
  assert.deepEqual(kinds, Object.entries(index.errors));
  // Compile-time: a kind is one of the list, and nothing else.
  const known: ErrorKind = "engine_overloaded";
  // @ts-expect-error not an error kind of the protocol
  const unknown: ErrorKind = "no_such_kind";
  assert.notEqual(known, unknown);
});

test("an error kind added to index.json appears in ErrorKind", () => {
  const dir = editedSchemas("kind", "index.json", (doc) => {
    doc.errors.schema_types_probe = -32019;
  });
  const out = join(scratch, "kind.ts");
  const run = generator("--schemas", dir, "--out", out);
  assert.equal(run.status, 0, run.stderr);
  assert.match(readFileSync(out, "utf8"), /\n {2}\| "schema_types_probe"; \/\/ -32019\n/);
});
