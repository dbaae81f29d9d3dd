#!/usr/bin/env node
// Generate client/src/protocol-types.ts from the protocol's JSON Schemas in schemas/.
//
//   node client/scripts/schema-types.mjs            write the file (npm run types)
//   node client/scripts/schema-types.mjs --check    exit 1 if the file is stale
//   options: --schemas DIR (default schemas/), --out FILE (default client/src/protocol-types.ts)
//
// Reads schemas/index.json and every file it names (written by `python -m protocol.schema
// schemas`, from msgspec), and emits one TypeScript declaration per struct in the files'
// $defs (deduplicated by title: a title defined twice must have the same schema), then
// the Methods / WorkerNotifications / HostNotifications maps, PROTOCOL_VERSION and the
// ErrorKind union (index.json's errors: kind → code).
// Only the part of JSON Schema that msgspec emits is understood; anything else fails
// loudly rather than being typed wrongly. No dependencies; output is deterministic.

import { readFileSync, renameSync, writeFileSync } from "node:fs";
import { dirname, isAbsolute, join, relative, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..");
const DEFAULT_SCHEMAS = join(ROOT, "schemas");
const DEFAULT_OUT = join(ROOT, "client", "src", "protocol-types.ts");

/** Names the generator itself exports; a struct may not take one. */
const RESERVED = new Set(["Methods", "MethodName", "WorkerNotifications", "HostNotifications", "PROTOCOL_VERSION", "ErrorKind"]);

/** Keywords understood when turning a schema into a type (annotations and constraints included). */
const KNOWN = new Set([
  "$schema", "$ref", "$defs", "title", "description", "default", "examples", "deprecated",
  "readOnly", "writeOnly", "type", "enum", "const", "anyOf", "oneOf", "allOf", "discriminator",
  "properties", "required", "additionalProperties", "items", "prefixItems",
  "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
  "minLength", "maxLength", "pattern", "format", "contentEncoding", "contentMediaType",
  "minItems", "maxItems", "uniqueItems", "minProperties", "maxProperties",
]);

/** Constraints shown in property docs, in this order. */
const CONSTRAINTS = [
  "minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "multipleOf",
  "minLength", "maxLength", "pattern", "format", "minItems", "maxItems", "uniqueItems",
];

class SchemaError extends Error {}

function fail(message) {
  throw new SchemaError(message);
}

// ---------------------------------------------------------------- command line

function parseArgs(argv) {
  const options = { check: false, schemas: DEFAULT_SCHEMAS, out: DEFAULT_OUT, custom: false };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === "--check") {
      options.check = true;
    } else if (arg === "--schemas" || arg === "--out") {
      const value = argv[++i];
      if (value === undefined || value.startsWith("--")) fail(`${arg} needs a value`);
      options[arg.slice(2)] = resolve(value);
      options.custom = true;
    } else if (arg === "--help" || arg === "-h") {
      options.help = true;
    } else {
      fail(`unknown argument ${JSON.stringify(arg)} (try --help)`);
    }
  }
  return options;
}

const HELP = `usage: node client/scripts/schema-types.mjs [--check] [--schemas DIR] [--out FILE]

Generate TypeScript types for the protocol from its JSON Schemas.
  --check         write nothing; exit 1 if FILE differs from what would be generated
  --schemas DIR   the schemas folder, with index.json (default: schemas/)
  --out FILE      the file to write or check (default: client/src/protocol-types.ts)
Exit status: 0 ok, 1 stale (--check), 2 bad arguments or schemas.`;

// ---------------------------------------------------------------- reading

function readJson(path) {
  let text;
  try {
    text = readFileSync(path, "utf8");
  } catch (err) {
    fail(`cannot read ${path}: ${err.message}`);
  }
  try {
    return JSON.parse(text);
  } catch (err) {
    fail(`${path} is not JSON: ${err.message}`);
  }
}

function isObject(value) {
  return value !== null && typeof value === "object" && !Array.isArray(value);
}

/** JSON text with object keys sorted, to compare two schemas by content. */
function canonical(value) {
  if (Array.isArray(value)) return `[${value.map(canonical).join(",")}]`;
  if (isObject(value)) {
    const keys = Object.keys(value).sort();
    return `{${keys.map((k) => `${JSON.stringify(k)}:${canonical(value[k])}`).join(",")}}`;
  }
  return JSON.stringify(value);
}

function isIdentifier(name) {
  return /^[A-Za-z_$][A-Za-z0-9_$]*$/.test(name);
}

function propertyKey(name) {
  return isIdentifier(name) ? name : JSON.stringify(name);
}

// ---------------------------------------------------------------- schema → type

/**
 * One schema file: its $defs by key, and a function mapping `#/$defs/KEY` to the
 * exported name (the definition's title).
 */
class SchemaFile {
  constructor(name, doc) {
    this.name = name;
    this.doc = doc;
    this.defs = isObject(doc.$defs) ? doc.$defs : {};
    if (doc.$defs !== undefined && !isObject(doc.$defs)) fail(`${name}: $defs is not an object`);
  }

  typeName(key) {
    const def = this.defs[key];
    if (!isObject(def)) fail(`${this.name}: $ref to missing definition ${JSON.stringify(key)}`);
    const title = typeof def.title === "string" ? def.title : key;
    if (!isIdentifier(title)) fail(`${this.name}: definition title ${JSON.stringify(title)} is not a TypeScript identifier`);
    if (RESERVED.has(title)) fail(`${this.name}: definition title ${title} clashes with a generated name`);
    return title;
  }

  refName(ref, where) {
    const match = typeof ref === "string" ? /^#\/\$defs\/(.+)$/.exec(ref) : null;
    if (!match) fail(`${this.name}: ${where}: unsupported $ref ${JSON.stringify(ref)} (only #/$defs/NAME)`);
    return this.typeName(decodeURIComponent(match[1]).replace(/~1/g, "/").replace(/~0/g, "~"));
  }
}

function literal(value, file, where) {
  if (value === null || ["string", "number", "boolean"].includes(typeof value)) return JSON.stringify(value);
  fail(`${file.name}: ${where}: enum/const value ${JSON.stringify(value)} is not a primitive`);
}

/** Join union members, without duplicates, `null` last. */
function union(members) {
  const unique = [...new Set(members)];
  if (unique.includes("unknown")) return "unknown";
  if (unique.length > 1 && unique.includes("never")) return union(unique.filter((m) => m !== "never"));
  const ordered = [...unique.filter((m) => m !== "null"), ...unique.filter((m) => m === "null")];
  return ordered.length === 0 ? "never" : ordered.join(" | ");
}

/** `T[]`, with `T` in parentheses where it is a union. */
function arrayOf(type) {
  let depth = 0;
  for (const char of type) {
    if ("<([{".includes(char)) depth++;
    else if (">)]}".includes(char)) depth--;
    else if (char === "|" && depth === 0) return `(${type})[]`;
  }
  return `${type}[]`;
}

function checkKeywords(schema, file, where) {
  for (const key of Object.keys(schema)) {
    if (!KNOWN.has(key)) fail(`${file.name}: ${where}: unsupported JSON Schema keyword ${JSON.stringify(key)}`);
  }
}

/** The TypeScript type of `schema`; `indent` is the indentation of the line it starts on. */
function toType(schema, file, where, indent) {
  if (schema === true) return "unknown";
  if (schema === false) return "never";
  if (!isObject(schema)) fail(`${file.name}: ${where}: schema is not an object`);
  checkKeywords(schema, file, where);

  if (schema.$ref !== undefined) return file.refName(schema.$ref, where);
  if (schema.const !== undefined) return literal(schema.const, file, where);
  if (schema.enum !== undefined) {
    if (!Array.isArray(schema.enum)) fail(`${file.name}: ${where}: enum is not an array`);
    return union(schema.enum.map((v) => literal(v, file, where)));
  }
  for (const key of ["anyOf", "oneOf"]) {
    if (schema[key] !== undefined) {
      if (!Array.isArray(schema[key])) fail(`${file.name}: ${where}: ${key} is not an array`);
      return union(schema[key].map((s, i) => toType(s, file, `${where}.${key}[${i}]`, indent)));
    }
  }
  if (schema.allOf !== undefined) {
    if (!Array.isArray(schema.allOf) || schema.allOf.length !== 1) {
      fail(`${file.name}: ${where}: allOf with more than one schema is not supported`);
    }
    return toType(schema.allOf[0], file, `${where}.allOf[0]`, indent);
  }

  const types = Array.isArray(schema.type) ? schema.type : schema.type === undefined ? [] : [schema.type];
  if (types.length === 0) {
    if (schema.properties !== undefined || schema.additionalProperties !== undefined) return objectType(schema, file, where, indent);
    return "unknown";
  }
  return union(types.map((type) => {
    switch (type) {
      case "string": return "string";
      case "integer":
      case "number": return "number";
      case "boolean": return "boolean";
      case "null": return "null";
      case "array": return arrayType(schema, file, where, indent);
      case "object": return objectType(schema, file, where, indent);
      default: fail(`${file.name}: ${where}: unsupported type ${JSON.stringify(type)}`);
    }
  }));
}

function arrayType(schema, file, where, indent) {
  if (schema.prefixItems !== undefined) {
    if (!Array.isArray(schema.prefixItems)) fail(`${file.name}: ${where}: prefixItems is not an array`);
    const fixed = schema.prefixItems.map((s, i) => toType(s, file, `${where}.prefixItems[${i}]`, indent));
    if (schema.items === false) return `[${fixed.join(", ")}]`;
    const rest = schema.items === undefined ? "unknown" : toType(schema.items, file, `${where}.items`, indent);
    return `[${[...fixed, `...${arrayOf(rest)}`].join(", ")}]`;
  }
  const items = schema.items === undefined ? "unknown" : toType(schema.items, file, `${where}.items`, indent);
  return arrayOf(items);
}

/** An object schema written in place (a struct in $defs is referred to by name instead). */
function objectType(schema, file, where, indent) {
  const props = schema.properties ?? {};
  if (!isObject(props)) fail(`${file.name}: ${where}: properties is not an object`);
  const extra = schema.additionalProperties;
  const valueType = extra === undefined || extra === true ? "unknown" : extra === false ? null : toType(extra, file, `${where}.additionalProperties`, indent);
  if (Object.keys(props).length === 0) {
    return valueType === null ? "Record<string, never>" : `Record<string, ${valueType}>`;
  }
  const lines = members(schema, file, where, `${indent}  `);
  if (valueType !== null && schema.additionalProperties !== undefined) lines.push(`${indent}  [key: string]: unknown;`);
  return `{\n${lines.join("\n")}\n${indent}}`;
}

/** The member lines (with docs) of an object schema. */
function members(schema, file, where, indent) {
  const props = schema.properties ?? {};
  const required = schema.required ?? [];
  if (!Array.isArray(required)) fail(`${file.name}: ${where}: required is not an array`);
  for (const name of required) {
    if (!Object.hasOwn(props, name)) fail(`${file.name}: ${where}: required property ${JSON.stringify(name)} is not in properties`);
  }
  const lines = [];
  for (const [name, prop] of Object.entries(props)) {
    const at = `${where}.${name}`;
    lines.push(...docLines(propertyDoc(prop), indent));
    const optional = required.includes(name) ? "" : "?";
    lines.push(`${indent}${propertyKey(name)}${optional}: ${toType(prop, file, at, indent)};`);
  }
  return lines;
}

// ---------------------------------------------------------------- docs

function docText(value) {
  // Keep the comment closed and on its lines.
  return String(value).replace(/\*\//g, "*\\/").replace(/\r?\n/g, " ").trim();
}

/** Constraints of a schema, its non-null anyOf branch, or its items: ["minimum 1", ...]. */
function constraints(schema, prefix = "") {
  if (!isObject(schema)) return [];
  const found = [];
  for (const key of CONSTRAINTS) {
    if (schema[key] === undefined) continue;
    const value = key === "pattern" ? `\`${schema[key]}\`` : JSON.stringify(schema[key]);
    found.push(`${prefix}${key} ${value}`);
  }
  for (const branch of [...(schema.anyOf ?? []), ...(schema.oneOf ?? [])]) found.push(...constraints(branch, prefix));
  if (isObject(schema.items)) found.push(...constraints(schema.items, `${prefix}items: `));
  return found;
}

function propertyDoc(prop) {
  if (!isObject(prop)) return [];
  const parts = [];
  if (typeof prop.description === "string") parts.push(docText(prop.description));
  const limits = constraints(prop);
  if (limits.length > 0) parts.push(`${docText([...new Set(limits)].join("; "))}.`);
  if (prop.default !== undefined) parts.push(`Default \`${docText(JSON.stringify(prop.default))}\`.`);
  return parts;
}

function docLines(parts, indent) {
  if (parts.length === 0) return [];
  const text = parts.join(" ");
  return [`${indent}/** ${text} */`];
}

// ---------------------------------------------------------------- generation

/** Collect the $defs of every file, in order of first appearance; same title → same schema. */
function collectDefinitions(files) {
  const defs = new Map(); // title → { schema, file, canon, schemaFile }
  for (const file of files) {
    for (const key of Object.keys(file.defs)) {
      const title = file.typeName(key);
      const schema = file.defs[key];
      const canon = canonical(schema);
      const seen = defs.get(title);
      if (seen === undefined) {
        defs.set(title, { schema, file, canon });
      } else if (seen.canon !== canon) {
        fail(
          `struct ${title} is defined differently in ${seen.file.name} and ${file.name}; ` +
            `two structs with one name would need one TypeScript type (rename one in protocol/)`,
        );
      }
    }
  }
  return defs;
}

function declaration(title, { schema, file }) {
  const lines = [];
  const doc = typeof schema.description === "string" ? [docText(schema.description)] : [];
  lines.push(...docLines(doc, ""));
  const where = `$defs.${title}`;
  checkKeywords(schema, file, where);
  const isStruct = schema.type === "object" && isObject(schema.properties) && Object.keys(schema.properties).length > 0;
  if (isStruct && (schema.additionalProperties === undefined || schema.additionalProperties === false)) {
    lines.push(`export interface ${title} {`, ...members(schema, file, where, "  "), "}");
  } else {
    // No fields (params of a method that takes none), or not an object: a type alias.
    lines.push(`export type ${title} = ${toType(schema, file, where, "")};`);
  }
  return lines.join("\n");
}

/** The type a whole file describes: its root $ref's name, or an inline type (e.g. `null`). */
function rootType(file) {
  const { $defs, $schema, title, description, ...root } = file.doc;
  return toType(root, file, "root", "  ");
}

export function generate(schemasDir) {
  const indexPath = join(schemasDir, "index.json");
  const index = readJson(indexPath);
  if (!isObject(index)) fail(`${indexPath}: not an object`);
  const version = index.protocol_version;
  if (typeof version !== "string" || version === "") fail(`${indexPath}: protocol_version is not a string`);
  if (!isObject(index.methods)) fail(`${indexPath}: methods is not an object`);
  if (!isObject(index.notifications)) fail(`${indexPath}: notifications is not an object`);
  if (!isObject(index.errors)) fail(`${indexPath}: errors is not an object`);
  for (const [kind, code] of Object.entries(index.errors)) {
    if (!Number.isInteger(code)) fail(`${indexPath}: errors.${kind} is not an integer code`);
  }

  const cache = new Map();
  const load = (name, where) => {
    if (typeof name !== "string" || name === "" || isAbsolute(name) || name.includes("..")) {
      fail(`${indexPath}: ${where}: bad schema file name ${JSON.stringify(name)}`);
    }
    if (!cache.has(name)) {
      const doc = readJson(join(schemasDir, name));
      if (!isObject(doc)) fail(`${name}: not a JSON Schema object`);
      cache.set(name, new SchemaFile(name, doc));
    }
    return cache.get(name);
  };

  const methods = [];
  for (const [name, entry] of Object.entries(index.methods)) {
    if (!isObject(entry)) fail(`${indexPath}: methods.${name} is not an object`);
    methods.push({ name, summary: entry.summary, params: load(entry.params, `${name}.params`), result: load(entry.result, `${name}.result`) });
  }
  const notifications = { worker_to_host: [], host_to_worker: [] };
  for (const [name, entry] of Object.entries(index.notifications)) {
    if (!isObject(entry)) fail(`${indexPath}: notifications.${name} is not an object`);
    const list = notifications[entry.direction];
    if (list === undefined) fail(`${indexPath}: notification ${name} has unknown direction ${JSON.stringify(entry.direction)}`);
    list.push({ name, params: load(entry.params, `${name}.params`) });
  }

  // Files in index order (each once), so declarations come in order of first use.
  const files = [];
  for (const m of methods) files.push(m.params, m.result);
  for (const n of [...notifications.worker_to_host, ...notifications.host_to_worker]) files.push(n.params);
  const defs = collectDefinitions([...new Set(files)]);

  const out = [];
  out.push(
    "// Generated from schemas/ by `npm run types` (client/scripts/schema-types.mjs): do not edit.",
    "// After changing the protocol's structs, run `make schemas` (which also runs this).",
    "",
  );
  for (const [title, def] of defs) out.push(declaration(title, def), "");

  out.push(`/** The protocol version these types describe (schemas/index.json). */`);
  out.push(`export const PROTOCOL_VERSION = ${JSON.stringify(version)};`, "");

  out.push("/** Every method: its params and its result. */", "export interface Methods {");
  for (const m of methods) {
    if (typeof m.summary === "string" && m.summary !== "") out.push(`  /** ${docText(m.summary)} */`);
    out.push(`  ${JSON.stringify(m.name)}: { params: ${rootType(m.params)}; result: ${rootType(m.result)} };`);
  }
  out.push("}", "", "export type MethodName = keyof Methods;", "");

  const notificationMap = (title, doc, list) => {
    out.push(`/** ${doc} */`, `export interface ${title} {`);
    for (const n of list) out.push(`  ${JSON.stringify(n.name)}: ${rootType(n.params)};`);
    out.push("}", "");
  };
  notificationMap("WorkerNotifications", "Notifications the worker sends to the host: method → params.", notifications.worker_to_host);
  notificationMap("HostNotifications", "Notifications the host sends to the worker: method → params.", notifications.host_to_worker);

  out.push(
    "/** An error's `data.kind`: the protocol's stable name for it, here with its JSON-RPC code (docs/PROTOCOL.md §12). */",
    "export type ErrorKind =",
    ...Object.entries(index.errors).map(([kind, code], i, all) => `  | ${JSON.stringify(kind)}${i === all.length - 1 ? ";" : ""} // ${code}`),
    "",
  );

  return `${out.join("\n").trimEnd()}\n`;
}

// ---------------------------------------------------------------- main

function display(path) {
  const rel = relative(process.cwd(), path);
  return rel === "" || rel.startsWith("..") || isAbsolute(rel) ? path : rel;
}

function main(argv) {
  const options = parseArgs(argv);
  if (options.help) {
    console.log(HELP);
    return 0;
  }
  const text = generate(options.schemas);
  let current = null;
  try {
    current = readFileSync(options.out, "utf8");
  } catch (err) {
    if (err.code !== "ENOENT") throw err;
  }
  const shown = options.custom ? display(options.out) : relative(ROOT, options.out);
  if (options.check) {
    if (current === text) return 0;
    const fix = options.custom ? "run node client/scripts/schema-types.mjs with the same --schemas/--out, without --check" : "run npm run types";
    console.error(`${shown} is ${current === null ? "missing" : "stale"}: ${fix}`);
    return 1;
  }
  if (current === text) {
    console.log(`${shown} is up to date`);
    return 0;
  }
  const temp = `${options.out}.${process.pid}.tmp`;
  writeFileSync(temp, text);
  renameSync(temp, options.out);
  console.log(`wrote ${shown}`);
  return 0;
}

if (process.argv[1] !== undefined && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  try {
    process.exitCode = main(process.argv.slice(2));
  } catch (err) {
    if (!(err instanceof SchemaError)) throw err;
    console.error(`schema-types: ${err.message}`);
    process.exitCode = 2;
  }
}
