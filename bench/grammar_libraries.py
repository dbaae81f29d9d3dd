"""The grammar libraries lm-worker could constrain output with, side by side on one vocabulary.

    .venv/bin/python bench/grammar_libraries.py

llguidance (what the worker uses), xgrammar and outlines-core, each on SmolLM2-135M's 49,152-token
vocabulary and three JSON Schemas: the time to make the vocabulary (once per model), to compile
a schema (once per request), the time per token to compute the mask of allowed tokens and take
a token (replayed over a valid output), and whether it refuses a schema keyword it cannot
enforce (``not``, an unknown ``format``) or silently ignores it (then the output may not
validate). xgrammar and outlines-core are installed on first use into bench/out/grammar-libs
(without their dependencies: xgrammar asks for triton, which the worker has no use for).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBS = ROOT / "bench" / "out" / "grammar-libs"
sys.path.insert(0, str(ROOT))

from tests.json_schemas import SCHEMAS  # noqa: E402
from worker.backends.transformers.shipped import converted_path  # noqa: E402
from worker.data_dir import default_data_dir  # noqa: E402

CASES = {
    "nested_object": (SCHEMAS["nested_object"], {"user": {"id": 123, "address": {"city": "New York", "zip": "10011"}}}),
    "definitions_ref": (SCHEMAS["definitions_ref"], {"start": {"x": 1, "y": 2}, "end": {"x": 3, "y": 4}}),
    "list_of_24": (
        {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 24, "maxItems": 24},
        ["an apple, sweet and red"] * 24,
    ),
}
UNENFORCEABLE = [{"not": {"type": "string"}}, {"type": "string", "format": "stardate"}]


def install() -> None:
    if not LIBS.exists():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(LIBS)]
        subprocess.run([*pip, "xgrammar==0.2.9", "outlines-core==0.2.14", "apache-tvm-ffi"], check=True)
    sys.path.insert(0, str(LIBS))


def timed(step) -> tuple[float, object]:
    started = time.perf_counter()
    value = step()
    return time.perf_counter() - started, value


def per_token(ids: list[int], mask, take) -> float:
    started = time.perf_counter()
    for token in ids:
        mask()
        if take(token) is False:
            raise AssertionError("a valid output's token was refused")
    return (time.perf_counter() - started) / len(ids)


def llguidance_rows(tokenizer) -> tuple[float, list, list]:
    import llguidance.hf
    from llguidance import LLMatcher

    made, vocabulary = timed(lambda: llguidance.hf.from_tokenizer(tokenizer))
    compact = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    rows = []
    for name, (schema, ids) in token_cases(tokenizer).items():
        compiled, matcher = timed(lambda: LLMatcher(vocabulary, LLMatcher.grammar_from_json_schema(schema, overrides=compact)))
        rows.append((name, compiled, per_token(ids, matcher.compute_bitmask, matcher.consume_token)))
    refused = [bool(LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(s), vocabulary)) for s in UNENFORCEABLE]
    return made, rows, refused


def xgrammar_rows(tokenizer) -> tuple[float, list, list]:
    import xgrammar

    made, info = timed(lambda: xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer)))
    compiler = xgrammar.GrammarCompiler(info)
    rows = []
    for name, (schema, ids) in token_cases(tokenizer).items():
        def compile_schema(schema=schema):
            grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
            return xgrammar.GrammarMatcher(grammar)

        compiled, matcher = timed(compile_schema)
        bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
        rows.append((name, compiled, per_token(ids, lambda: matcher.fill_next_token_bitmask(bitmask), matcher.accept_token)))
    refused = []
    for schema in UNENFORCEABLE:
        try:
            compiler.compile_json_schema(json.dumps(schema))
            refused.append(False)
        except Exception:
            refused.append(True)
    return made, rows, refused


def outlines_rows(tokenizer) -> tuple[float, list, list]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    def vocabulary() -> Vocabulary:  # byte-level BPE pieces back to their text
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        others = [b for b in range(256) if b not in printable]
        byte_of = {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}
        pieces: dict[str, list[int]] = {}
        for piece, token in tokenizer.get_vocab().items():
            if token in tokenizer.all_special_ids:
                continue
            try:
                pieces.setdefault(bytes(byte_of[c] for c in piece).decode("utf-8"), []).append(token)
            except (KeyError, UnicodeDecodeError):
                continue
        return Vocabulary(tokenizer.eos_token_id, pieces)

    made, vocab = timed(vocabulary)
    rows = []
    for name, (schema, ids) in token_cases(tokenizer).items():
        compiled, guide = timed(lambda schema=schema: Guide(Index(build_regex_from_schema(json.dumps(schema), ""), vocab)))
        rows.append((name, compiled, per_token(ids, guide.get_tokens, guide.advance)))
    refused = []
    for schema in UNENFORCEABLE:
        try:
            build_regex_from_schema(json.dumps(schema), "")
            refused.append(False)
        except Exception:
            refused.append(True)
    return made, rows, refused


def token_cases(tokenizer) -> dict[str, tuple[dict, list[int]]]:
    return {
        name: (schema, tokenizer(json.dumps(value, separators=(",", ":")), add_special_tokens=False).input_ids)
        for name, (schema, value) in CASES.items()
    }


def main() -> int:
    from transformers import AutoTokenizer

    install()
    tokenizer = AutoTokenizer.from_pretrained(converted_path(default_data_dir()))
    print(f"{'library':14s} {'schema':16s} {'compile':>10s} {'per token':>10s}")
    for library, rows_of in [("llguidance", llguidance_rows), ("xgrammar", xgrammar_rows), ("outlines-core", outlines_rows)]:
        made, rows, refused = rows_of(tokenizer)
        for name, compiled, token_s in rows:
            print(f"{library:14s} {name:16s} {compiled * 1e3:8.1f}ms {token_s * 1e3:8.3f}ms")
        said = ", ".join(f"{json.dumps(s)}: {'refused' if r else 'IGNORED'}" for s, r in zip(UNENFORCEABLE, refused))
        print(f"{library:14s} vocabulary {made * 1e3:.0f} ms; {said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
