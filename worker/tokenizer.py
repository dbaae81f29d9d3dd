"""A model's tokenizer read from its directory (tokenizer.json and the files beside it) on the
tokenizers library alone, with the answers transformers' AutoTokenizer gives for the same
directory: without torch and transformers, whose imports cost a spawned worker about a second
and the memory of both.

It answers for the directories AutoTokenizer reads as a plain TokenizersBackend (the class the
worker keeps a gguf's tokenizer as, gguf_model.tokenizer_of): tokenizer.json as written, changed
only as transformers changes it at a load (the added tokens and special tokens of
tokenizer_config.json or special_tokens_map.json added, truncation and padding off, a missing
post-processor made), and the special tokens, maximum length and chat templates of those files.
Every other directory raises TokenizerUnsupported, naming the file and the setting, and the
caller reads it with transformers instead: no tokenizer.json or tokenizer_config.json, a tokenizer
class of transformers' own (whose Python applies settings such as legacy or add_prefix_space, or
rebuilds the tokenizer), a class chosen by code or by config.json's model type, a slow
tokenizer's added_tokens.json.

Its surface is what lm-worker uses of a transformers tokenizer: calling it for ``input_ids``,
``decode`` (never cleaning up spaces), ``len()``, the special tokens' texts and ids,
``special_tokens_map``, ``model_max_length``, ``convert_ids_to_tokens``, ``chat_template`` and
``get_chat_template``; ``serialized()`` is the backend's tokenizer.json for llguidance."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from worker.files import open_regular

if TYPE_CHECKING:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
ADDED_TOKENS_FILE = "added_tokens.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

# The classes a tokenizer_config.json may name that AutoTokenizer reads as a plain TokenizersBackend.
PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# The model types of a config.json beside the tokenizer for which AutoTokenizer keeps the class
# tokenizer_config.json names (for others, qwen2 and phi3 among them, it may load its own class).
KEEPS_DECLARED_CLASS = frozenset({"llama", "qwen3", "gemma3", "gemma3_text"})
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' model_max_length where none is given: no limit.
UNLIMITED = int(1e30)


class TokenizerUnsupported(Exception):
    """A tokenizer directory this module cannot answer for as transformers would; the message
    says which file and setting."""


class Encoded(NamedTuple):
    input_ids: list[int]


class Tokenizer:
    """A tokenizer directory's tokenizer, as transformers' TokenizersBackend would load it."""

    def __init__(self, backend: Backend, special: dict[str, str], model_max_length: int | float,
                 chat_template: str | dict[str, str] | None) -> None:
        self._backend = backend
        self._special = special
        self.model_max_length = model_max_length
        self.chat_template = chat_template

    @classmethod
    def read(cls, directory: str | Path) -> Tokenizer:
        """Raises TokenizerUnsupported for a directory transformers would read otherwise, and what
        reading a file raises (OSError, ValueError for a damaged one)."""
        return _read(Path(directory))

    def __call__(self, text: str, *, add_special_tokens: bool = True) -> Encoded:
        return Encoded(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        """The text of ``ids``; transformers' clean-up of spaces is not done (it is not asked for)."""
        if clean_up_tokenization_spaces:
            raise ValueError("this tokenizer does not clean up tokenization spaces")
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._special)

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._id_of("unk_token")

    def _id_of(self, role: str) -> int | None:
        text = self._special.get(role)
        return None if text is None else self._backend.token_to_id(text)

    def get_chat_template(self, chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        """The template transformers' apply_chat_template renders: of named templates, "tool_use"
        where tools are given and the tokenizer has it, else "default"."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None and chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" in templates:
                    return templates["default"]
                raise ValueError(f"This model has multiple chat templates with no default specified; their names are "
                                 f"{sorted(templates)}.")
            return chat_template
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError("This tokenizer has no chat template.")
        return templates

    def serialized(self) -> str:
        """The tokenizer as tokenizer.json would hold it, with what the load added (for llguidance)."""
        return self._backend.to_str()


def settings_problem(tokenizer: Any) -> str | None:
    """What is wrong with the settings the worker reads beside a tokenizer's own (a chat template
    that is text or named texts, a model_max_length that is a number), None where nothing is."""
    template = getattr(tokenizer, "chat_template", None)
    if not (template is None or isinstance(template, str) or (
            isinstance(template, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in template.items()))):
        return f"a chat_template that is not a text or named texts: {str(template)[:80]}"
    length = getattr(tokenizer, "model_max_length", None)
    if isinstance(length, bool) or not isinstance(length, (int, float)) or length != length:
        return f"model_max_length as {str(length)[:80]!r}, not a number of tokens"
    return None


def _read(directory: Path) -> Tokenizer:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    tokenizer_file = directory / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        raise TokenizerUnsupported(f"{directory} has no {TOKENIZER_FILE}")
    settings = _settings(directory, AddedToken)
    backend = Backend.from_file(str(tokenizer_file))
    return _made(backend, settings, AddedToken)


def _settings(directory: Path, added_token: type[AddedToken]) -> dict[str, Any]:
    """What transformers' from_pretrained hands a TokenizersBackend's __init__ from the files."""
    config = _json(directory / CONFIG_FILE)
    if config is None:
        raise TokenizerUnsupported(f"{directory} has no {CONFIG_FILE} (transformers picks a tokenizer class for it)")
    declared = config.pop("tokenizer_class", None)
    if declared not in PLAIN_CLASSES:
        raise TokenizerUnsupported(f"{CONFIG_FILE} names the tokenizer class {declared!r}, not one of {PLAIN_CLASSES}")
    for name in ("auto_map", "fast_tokenizer_files"):
        if config.get(name):
            raise TokenizerUnsupported(f"{CONFIG_FILE} gives {name}")
    config.pop("init_inputs", None)
    _check_model_type(directory)
    # A tokenizer.json's post-processor decides on BOS and EOS; transformers drops these then.
    config.pop("add_bos_token", None)
    config.pop("add_eos_token", None)
    templates = _chat_template_files(directory)
    if len(templates) == 1 and "default" in templates:
        config["chat_template"] = templates["default"]
    elif templates:
        config["chat_template"] = templates
    if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    own = {key: config.pop(key) for key in list(config)
           if key not in NAMED_SPECIAL_TOKENS and key.endswith("_token") and isinstance(config[key], str)}
    if isinstance(config.get("extra_special_tokens"), dict):
        own.update(config.pop("extra_special_tokens"))
    if own:
        config["model_specific_special_tokens"] = own

    if "added_tokens_decoder" in config:
        added: dict[int, AddedToken] = {}
        for index, token in config["added_tokens_decoder"].items():
            if not isinstance(token, dict):
                raise TokenizerUnsupported(f"{CONFIG_FILE}'s added_tokens_decoder holds {str(token)[:80]!r}")
            added[int(index)] = added_token(**token)
        config["added_tokens_decoder"] = added
    else:
        _merge_special_tokens_map(directory, config, added_token)
        if (directory / ADDED_TOKENS_FILE).exists():
            raise TokenizerUnsupported(f"{directory} has {ADDED_TOKENS_FILE} (a slow tokenizer's added tokens)")
    return _added_tokens_in(config, added_token)


def _check_model_type(directory: Path) -> None:
    """A config.json beside the tokenizer can make AutoTokenizer load a class of its own for the
    model type; only the types known to keep the declared class are read here."""
    path = directory / "config.json"
    if not path.exists():
        return
    model_type = (_json(path) or {}).get("model_type")
    if model_type not in KEEPS_DECLARED_CLASS:
        raise TokenizerUnsupported(f"config.json gives the model type {model_type!r}, for which transformers may load "
                                   "a tokenizer class of its own")


def _chat_template_files(directory: Path) -> dict[str, str]:
    templates: dict[str, str] = {}
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (directory / CHAT_TEMPLATE_DIR).is_dir():
        for path in (directory / CHAT_TEMPLATE_DIR).glob("*.jinja"):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    return templates


def _merge_special_tokens_map(directory: Path, config: dict[str, Any], added_token: type[AddedToken]) -> None:
    """special_tokens_map.json's tokens over tokenizer_config.json's, as transformers reads a
    directory whose config has no added_tokens_decoder."""
    special = _json(directory / SPECIAL_TOKENS_MAP_FILE)
    if special is None:
        return
    for key, value in special.items():
        if isinstance(value, dict) and key != "extra_special_tokens":
            value = added_token(**{k: v for k, v in value.items() if k != "special"}, special=True)
        elif key == "extra_special_tokens" and isinstance(value, list):
            merged = list(config.get("extra_special_tokens") or [])
            for token in value:
                token = added_token(**token, special=True) if isinstance(token, dict) else token
                if token not in merged:
                    merged.append(token)
            value = merged
        config[key] = value
    if isinstance(config.get("extra_special_tokens"), dict):
        config.setdefault("model_specific_special_tokens", {}).update(config.pop("extra_special_tokens"))


def _added_tokens_in(value: Any, added_token: type[AddedToken]) -> Any:
    """transformers' convert_added_tokens: every {"__type": "AddedToken", ...} made an AddedToken."""
    if isinstance(value, dict) and value.get("__type") == "AddedToken":
        return added_token(**{k: v for k, v in value.items() if k != "__type"})
    if isinstance(value, (list, tuple)):
        return [_added_tokens_in(item, added_token) for item in value]
    if isinstance(value, dict):
        return {key: _added_tokens_in(item, added_token) for key, item in value.items()}
    return value


def _made(backend: Backend, config: dict[str, Any], added_token: type[AddedToken]) -> Tokenizer:
    """transformers' TokenizersBackend.__init__ on a tokenizer.json: the same changes to the
    backend, in the same order."""
    from tokenizers import processors

    added: dict[int, AddedToken] | None = config.pop("added_tokens_decoder", None)
    if added is None:  # no added_tokens_decoder in tokenizer_config.json: tokenizer.json's own
        added = backend.get_added_tokens_decoder()
    padding = backend.padding
    if padding is not None:
        config.setdefault("pad_token", padding["pad_token"])
    backend.no_truncation()  # transformers turns them off at each call that asks for neither
    backend.no_padding()

    if "additional_special_tokens" in config and "extra_special_tokens" not in config:
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    explicit = config.pop("model_specific_special_tokens", None) or {}
    special: dict[str, Any] = dict.fromkeys(NAMED_SPECIAL_TOKENS)
    extra: list[Any] = []
    found: dict[str, Any] = {}
    for key in list(config):
        if key in NAMED_SPECIAL_TOKENS:
            special[key] = config.pop(key)
        elif key == "extra_special_tokens":
            value = config.pop(key)
            if isinstance(value, dict):
                special.update(value)
            elif isinstance(value, (list, tuple)):
                extra = list(value)
            elif value is not None:
                raise TokenizerUnsupported(f"extra_special_tokens is {str(value)[:80]!r}, not a list or a mapping")
        elif key.endswith("_token") and isinstance(config[key], (str, added_token)):
            found[key] = config.pop(key)
    special.update({**found, **explicit})
    for key, value in [*special.items(), *(("an extra special token", token) for token in extra)]:
        if value is not None and not isinstance(value, (str, added_token)):
            raise TokenizerUnsupported(f"{key} is {str(value)[:80]!r}, neither a text nor an added token")
    special = {key: value for key, value in special.items() if value is not None}

    length = config.pop("model_max_length", config.pop("max_len", None))
    template = config.pop("chat_template", None)
    if isinstance(template, (list, tuple)):
        template = {entry["name"]: entry["template"] for entry in template}
    backend.encode_special_tokens = bool(config.pop("split_special_tokens", False))

    # Every token of added_tokens_decoder is added again, then each special token not among them.
    to_add: list[Any] = [token for _, token in sorted(added.items(), key=lambda item: item[0])]
    present = [str(token) for token in backend.get_added_tokens_decoder().values()] + [str(t) for t in to_add]
    for value in [*special.values(), *extra]:
        if str(value) not in present and value not in to_add:
            to_add.append(value)
    if to_add:
        names = [str(value) for value in special.values() if value]
        tokens = []
        for token in to_add:
            if isinstance(token, str):
                token = added_token(token, special=True)
            elif not token.special and str(token) in names:
                token.special = True
            tokens.append(token)
        backend.add_tokens(tokens)
    if backend.post_processor is None:
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    return Tokenizer(backend, {key: str(value) for key, value in special.items()},
                     UNLIMITED if length is None else length, template)


def _json(path: Path) -> dict[str, Any] | None:
    """The file's JSON object, None where there is no such file (NotRegularFile for a FIFO or the
    like, which a plain open would wait on forever)."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, encoding="utf-8") as file:
        text = file.read()
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds no JSON object")
    return value
