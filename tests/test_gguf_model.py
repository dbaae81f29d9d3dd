"""A gguf file loaded from its own blocks, mapped (worker/gguf/reader.py, gguf_model.py): the
header read with bounds and checked against the file, the model built with no float copy of its
matrices, the same numbers as the file's blocks dequantized, and hostile files refused at once
with a load error naming what is wrong."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from tests.test_transformers_backend import generate
from worker.gguf import reader
from worker.gguf.reader import GgufError
from worker.host import Host, WorkerError

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")


def write(path: Path, arch: str = "llama", metadata=(), tensors=()) -> Path:
    """A gguf file of the given metadata ((key, writer method, value)) and float32 tensors."""
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    for key, method, value in metadata:
        getattr(writer, method)(key, value)
    for name, shape in tensors:
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_reader_finds_the_tensors_and_metadata_gguf_s_own_reader_finds(tiny_gguf: Path):
    mine = reader.read(tiny_gguf)
    theirs = gguf.GGUFReader(tiny_gguf)
    assert {t.name: (t.data_offset, t.n_bytes, tuple(int(x) for x in t.shape)) for t in theirs.tensors} == {
        t.name: (t.offset, t.size, t.shape) for t in mine.tensors.values()
    }
    assert mine.get("llama.block_count", int) == 2
    assert mine.strings("tokenizer.ggml.tokens") == [str(bytes(theirs.fields["tokenizer.ggml.tokens"].parts[i]), "utf-8")
                                                     for i in theirs.fields["tokenizer.ggml.tokens"].data]
    with pytest.raises(GgufError, match="llama.block_count is int"):
        mine.get("llama.block_count", str)


def header(count_field: bytes, *, version: int = 3, tensors: int = 0, keys: int = 1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, keys) + count_field


def key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"GGML" + bytes(20), "not a gguf file"),
        (header(b"", version=1), "gguf version 1"),
        (header(b"", keys=1 << 40), "metadata entries, more than"),
        (header(b"", tensors=1 << 40), "tensors, more than"),
        (header(key("a") + struct.pack("<IIQ", 9, 4, 10_000_000)), "more than the file holds"),  # 10 M uint32s in 50 bytes
        (header(key("a") + struct.pack("<IIQ", 9, 8, 5_000_000)), "5000000 strings, more than 4194304"),
        (header(struct.pack("<Q", 1 << 62)), "a metadata key is 4611686018427387904 bytes long"),
        (header(key("a") + struct.pack("<I", 77)), "value type 77"),
        (header(key("a") + struct.pack("<IQ", 8, 10)), "more than the file holds"),
        (header(key("a") + struct.pack("<I", 4)), "truncated"),
        (header(key("a") + struct.pack("<IIQ", 9, 8, 3) + struct.pack("<Q", 1) + b"x" + bytes(4)),
         "the file ends inside a string of the array a: truncated"),
        (header(key("a") + struct.pack("<IIQ", 9, 8, 2) + struct.pack("<Q", 1) + b"x" + struct.pack("<Q", 5) + b"ab"),
         "a string of the array a is 5 bytes long, more than the file holds"),
        (header(key("a") + struct.pack("<IIQ", 9, 8, 1) + struct.pack("<Q", 1 << 40)),
         "a string of the array a is 1099511627776 bytes long, more than 67108864"),
    ],
    ids=["magic", "version", "keys", "tensors", "array-past-the-end", "array-count", "key-length", "value-type",
         "string-past-the-end", "truncated", "strings-truncated", "strings-past-the-end", "strings-too-long"],
)
def test_a_hostile_header_is_refused_at_once_naming_what_is_wrong(tmp_path: Path, content: bytes, says: str):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(content)
    started = time.monotonic()
    with pytest.raises(GgufError, match=says):
        reader.read(path)
    assert time.monotonic() - started < 1


def test_an_array_of_millions_of_strings_is_walked_within_bounds_not_held(tmp_path: Path):
    path = tmp_path / "many.gguf"
    count = 4_000_000
    path.write_bytes(header(key("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, count) + bytes(8 * count)))
    read = reader.read(path)
    assert read.metadata["tokenizer.ggml.tokens"] == reader.Strings(count, 24 + 8 + 21 + 4 + 12)


def test_tensors_past_the_end_overlapping_or_of_no_type_are_refused(tmp_path: Path):
    good = write(tmp_path / "good.gguf", tensors=[("a", (4, 32)), ("b", (4, 32))])
    data = good.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[:-100])
    with pytest.raises(GgufError, match="tensor b's data .* past the end of the file: truncated"):
        reader.read(truncated)
    info = reader.read(good).tensors
    table = data.index(b"\x01\x00\x00\x00\x00\x00\x00\x00b")  # tensor b's name in the table
    overlapping = bytearray(data)
    offset_at = table + 9 + 4 + 16 + 4
    struct.pack_into("<Q", overlapping, offset_at, info["a"].offset - info["b"].offset + struct.unpack_from("<Q", data, offset_at)[0] + 32)
    (tmp_path / "overlap.gguf").write_bytes(overlapping)
    with pytest.raises(GgufError, match="overlap"):
        reader.read(tmp_path / "overlap.gguf")
    typeless = bytearray(data)
    struct.pack_into("<I", typeless, table + 9 + 4 + 16, 200)
    (tmp_path / "typeless.gguf").write_bytes(typeless)
    with pytest.raises(GgufError, match="ggml type 200"):
        reader.read(tmp_path / "typeless.gguf")


def test_a_fifo_is_refused_not_waited_on(tmp_path: Path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        reader.read(fifo)


def load(path: Path, data_dir: Path, **params):
    from protocol.methods import LoadParams
    from worker.backends.transformers.backend import TransformersBackend

    return TransformersBackend().load(LoadParams(model=str(path), **params), data_dir=data_dir)


def load_with_torch(path: Path, data_dir: Path, **params):
    """The model PyTorch computes, where ``load`` takes the file without it (native_model)."""
    from protocol.methods import LoadParams
    from worker.backends.transformers.backend import TransformersBackend

    return TransformersBackend().load_with_torch(LoadParams(model=str(path), **params), data_dir=data_dir)


def test_a_mapped_gguf_holds_no_float_copy_of_a_matrix(tiny_gguf: Path, tmp_path: Path):
    """Every linear multiplies the file's blocks, the embedding widens the rows it looks up, and
    the only float parameters are the norms' vectors."""
    from worker.backends.transformers import gguf_model
    from worker.backends.transformers.gguf_weights import GgufLinear

    mapped = load_with_torch(tiny_gguf, tmp_path)
    assert mapped.info.quantization == "gguf"
    model = mapped._open_model
    assert isinstance(model.model.embed_tokens, gguf_model.GgufEmbedding)
    assert all(not isinstance(m, torch.nn.Linear) for m in model.modules())
    assert len([m for m in model.modules() if isinstance(m, GgufLinear)]) == 2 * 7 + 1
    floats = sum(p.numel() for p in model.parameters())
    assert floats == sum(p.numel() for n, p in model.named_parameters() if "norm" in n)


def test_the_tokenizer_is_built_once_and_kept_in_the_data_directory(tiny_gguf: Path, tmp_path: Path, monkeypatch):
    from worker.backends.transformers import hf_compat

    first = load(tiny_gguf, tmp_path)
    kept = list((tmp_path / "gguf").iterdir())
    assert len(kept) == 1 and (kept[0] / "tokenizer.json").is_file()

    def not_again(file):
        raise AssertionError("the tokenizer was built again")

    monkeypatch.setattr(hf_compat, "gguf_tokenizer", not_again)
    second = load(tiny_gguf, tmp_path)
    text = "a red sun over <|im_end|> the sea"
    assert second.tokenize(text, add_special_tokens=True) == first.tokenize(text, add_special_tokens=True)
    assert second.info.has_chat_template and second.info.special_tokens == first.info.special_tokens


def chat_template_of_a_number(kept: Path) -> None:
    import json

    config = json.loads((kept / "tokenizer_config.json").read_text())
    config["chat_template"] = 5
    (kept / "tokenizer_config.json").write_text(json.dumps(config))
    for template in kept.glob("chat_template.*"):
        template.unlink()


@pytest.mark.parametrize("damage", ["garbled", "no-config", "a-file", "template-a-number"])
def test_a_damaged_kept_tokenizer_is_built_again_in_its_place_and_the_next_load_reads_that(
    tiny_gguf: Path, tmp_path: Path, monkeypatch, damage: str
):
    import shutil

    from worker.backends.transformers import hf_compat

    first = load(tiny_gguf, tmp_path)
    kept = next((tmp_path / "gguf").iterdir())
    if damage == "garbled":
        (kept / "tokenizer.json").write_text("{not json")
    elif damage == "no-config":
        (kept / "tokenizer_config.json").unlink()
    elif damage == "template-a-number":
        chat_template_of_a_number(kept)
    else:
        shutil.rmtree(kept)
        kept.write_text("in the way")
    rebuilt = load(tiny_gguf, tmp_path)
    assert kept.is_dir() and (kept / "tokenizer_config.json").is_file()
    assert rebuilt.info.has_chat_template
    assert [p.name for p in kept.parent.iterdir() if p.name.startswith(".")] == []  # nothing left aside

    def not_again(file):
        raise AssertionError("the tokenizer was built again")

    monkeypatch.setattr(hf_compat, "gguf_tokenizer", not_again)
    third = load(tiny_gguf, tmp_path)
    text = "a red sun over <|im_end|> the sea"
    expected = first.tokenize(text, add_special_tokens=True)
    assert rebuilt.tokenize(text, add_special_tokens=True) == expected == third.tokenize(text, add_special_tokens=True)


def test_a_gguf_transformers_would_dequantize_into_more_memory_than_there_is_is_refused_before_it_is_read(
    tiny_gguf: Path, tmp_path: Path, monkeypatch
):
    """quantization int8 (or dense, or another device) sends a gguf through transformers' loader,
    which makes float32 of every tensor: a 7B file took 20 GB before the kernel killed the worker.
    The mapped default needs no such memory and still loads."""
    from protocol.errors import RpcError
    from worker.backends.transformers import backend

    monkeypatch.setattr(backend, "_available_memory", lambda: 1000)
    with pytest.raises(RpcError) as refused:
        load(tiny_gguf, tmp_path, quantization="int8")
    assert refused.value.code == -32002
    assert "more than the 0.0 GB this machine has available" in refused.value.message
    assert "quantization 'auto'" in refused.value.message and str(tiny_gguf) in refused.value.message
    assert load(tiny_gguf, tmp_path).info.quantization == "gguf"


def test_the_kept_tokenizer_s_config_holds_its_added_tokens_and_one_kept_without_them_gets_them(
    tiny_gguf: Path, tmp_path: Path
):
    """Held in tokenizer_config.json, transformers reads the added tokens there instead of parsing
    the whole tokenizer.json in Python at every load; a copy kept without them gets them at its
    next load, and loads to the same tokenizer either way."""
    import json

    first = load_with_torch(tiny_gguf, tmp_path)
    config_path = next((tmp_path / "gguf").iterdir()) / "tokenizer_config.json"
    written = json.loads(config_path.read_text())["added_tokens_decoder"]
    assert {int(i): token["content"] for i, token in written.items()} == {
        i: token.content for i, token in first._tokenizer.added_tokens_decoder.items()
    }
    config = json.loads(config_path.read_text())
    del config["added_tokens_decoder"]
    config_path.write_text(json.dumps(config))
    again = load_with_torch(tiny_gguf, tmp_path)
    assert json.loads(config_path.read_text())["added_tokens_decoder"] == written
    text = "a red sun over <|im_end|> the sea"
    assert again.tokenize(text, add_special_tokens=True) == first.tokenize(text, add_special_tokens=True)
    assert again._tokenizer.added_tokens_decoder == first._tokenizer.added_tokens_decoder


def rewritten(source: Path, out: Path, *, drop: str = "", add: str = "", block_count: int | None = None,
              reshape: str = "", kind: dict[str, int] | None = None) -> Path:
    """``source`` written again with a tensor dropped, one added, one of another shape or type, or
    another block count in its metadata."""
    import numpy as np

    original = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(out), "llama")
    for field in original.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.name == "llama.block_count" and block_count is not None:
            value = block_count
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for tensor in original.tensors:
        if tensor.name == drop:
            continue
        data = np.asarray(tensor.data)
        raw = gguf.GGMLQuantizationType(tensor.tensor_type)
        if tensor.name == reshape:
            data, raw = np.zeros((int(tensor.shape[1]) + 32, int(tensor.shape[0])), np.float32), gguf.GGMLQuantizationType.F32
        elif kind and tensor.name in kind:  # random blocks of that type: refused before they are read
            raw = gguf.GGMLQuantizationType(kind[tensor.name])
            weights, size = gguf.GGML_QUANT_SIZES[raw]
            rows, inputs = int(tensor.shape[1]), int(tensor.shape[0])
            data = np.random.default_rng(0).integers(0, 256, (rows, inputs // weights * size), dtype=np.uint8)
        writer.add_tensor(tensor.name, data, raw_dtype=raw if raw != gguf.GGMLQuantizationType.F32 else None)
    if add:
        writer.add_tensor(add, np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"drop": "blk.0.attn_q.weight"}, "the tensor blk.0.attn_q.weight is missing"),
        ({"add": "blk.0.attn_extra.weight"}, "does not use: blk.0.attn_extra.weight"),
        ({"reshape": "blk.1.ffn_up.weight"}, "blk.1.ffn_up.weight has the shape"),
        ({"block_count": 1000}, "block_count says 1000 layers"),
        ({"block_count": 1}, "block_count says 1 layers, and the file's tensors go past them"),
        ({"kind": {"blk.0.ffn_down.weight": 20}}, "blk.0.ffn_down.weight is IQ4_NL, which lm-worker does not multiply; it takes F32, F16, Q4_0"),
    ],
    ids=["missing", "extra", "misshapen", "block-count-high", "block-count-low", "type"],
)
async def test_a_gguf_whose_tensors_do_not_make_its_model_is_a_load_error_naming_the_tensor(
    tiny_gguf: Path, tmp_path: Path, change: dict, says: str
):
    """Never a weight made up at random (two workers would compute two models under one
    identity), never a loop over a thousand layers' names: -32002 within seconds."""
    path = rewritten(tiny_gguf, tmp_path / "changed.gguf", **change)
    host = await Host.start_in_process("--data-dir", str(tmp_path / "data"))
    try:
        started = time.monotonic()
        with pytest.raises(WorkerError) as refused:
            await host.call("load", {"model": str(path)}, timeout=120)
        error = refused.value
        assert error.code == -32002 and says in error.message and str(path) in error.message, error.message
        assert time.monotonic() - started < 30
        assert await host.call("capabilities")
    finally:
        await host.close()


async def test_greedy_from_a_cache_of_a_mapped_gguf_equals_greedy_without_one(tiny_gguf: Path, tmp_path: Path):
    host = await Host.start_in_process("--data-dir", str(tmp_path / "data"), "--cache-dir", str(tmp_path / "caches"))
    try:
        loaded = await host.call("load", {"model": str(tiny_gguf)}, timeout=120)
        assert loaded["quantization"] == "gguf"
        prompt = " ".join(["the history of the city begins with a small settlement by the river."] * 3)
        await host.call("prefill", {"prompt": prompt, "cache": "ctx"}, timeout=60)
        cached, _ = await generate(host, {"prompt": prompt + " And so", "max_tokens": 12, "temperature": 0, "cache": "ctx"})
        plain, _ = await generate(host, {"prompt": prompt + " And so", "max_tokens": 12, "temperature": 0})
        assert cached["tokens"] == plain["tokens"]
        assert cached["usage"]["cache_read_tokens"] > 0
    finally:
        await host.close()


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_a_mapped_gguf_of_each_block_type_computes_its_dequantized_model_to_the_kernels_rounding(
    tiny_model_dir: Path, tmp_path: Path, kind: str
):
    """Against the same file dequantized by transformers and computed in float32 (`none`): the
    float types differ by the order of their sums alone, the quantized types by the rounding of
    their activations to 8-bit blocks too (the kernel's arithmetic itself is held bit for bit in
    test_gguf_kernel.py), which on the tiny model's random weights reaches 8% of the largest
    logit; a row in the wrong place or a misread block is of its size."""
    from worker.backends.transformers.tiny_model import write_gguf

    path = write_gguf(tiny_model_dir, tmp_path / f"tiny-{kind}.gguf", matrices=int(gguf.GGMLQuantizationType[kind]))
    mapped = load(path, tmp_path / "data")
    dense = load(path, tmp_path / "data", quantization="none")
    assert mapped.info.quantization == "gguf" and dense.info.quantization == "none"
    ids = mapped.tokenize("the quick brown fox jumps over the lazy dog", add_special_tokens=True)
    with torch.inference_mode():
        ours = torch.from_numpy(mapped.forward_chunk(mapped.new_cache(), ids))
        theirs = torch.from_numpy(dense.forward_chunk(dense.new_cache(), ids))
    bound = 1e-5 if kind in ("F32", "F16", "BF16") else 0.15
    assert (ours - theirs).abs().max() <= bound * theirs.abs().max(), (ours - theirs).abs().max()


ARCHITECTURES = ["llama", "qwen2", "qwen3", "gemma3-gguf", "phi3"]


@pytest.fixture(scope="module")
def gguf_of(tiny_models, tmp_path_factory: pytest.TempPathFactory):
    """A tiny gguf of an architecture with its matrices of a ggml type, each written once."""
    from worker.backends.transformers.tiny_model import write_gguf

    written: dict[tuple[str, int], Path] = {}

    def get(family: str, kind: int) -> Path:
        if (family, kind) not in written:
            written[family, kind] = write_gguf(tiny_models(family), tmp_path_factory.mktemp(family) / f"{kind}.gguf", kind)
        return written[family, kind]

    return get


@pytest.mark.parametrize("family", ARCHITECTURES)
@pytest.mark.parametrize("kind", [0, 8], ids=["F32", "Q8_0"])
def test_each_architecture_loads_mapped_and_computes_the_file_s_model(gguf_of, tmp_path: Path, family: str, kind: int):
    """Against the same file dequantized by transformers' own gguf loader and computed dense: its
    configuration, tokenizer, tensor names, Llama's permuted q and k rows, biases (Qwen2), head
    norms (Qwen3, Gemma 3), Gemma's norm scales and Phi-3's fused projections read right. Float32 matrices differ by the order
    of the sums alone; Q8_0's by the 8-bit rounding of the activations too."""
    path = gguf_of(family, kind)
    mapped = load(path, tmp_path)
    dense = load(path, tmp_path, quantization="none")
    assert mapped.info.quantization == "gguf"
    # the native pass without torch; Phi-3 goes through transformers' forward
    assert (type(mapped).__name__ == "NativeModel") == (family != "phi3")
    text = "the quick brown fox jumps over the lazy dog"
    ids = mapped.tokenize(text, add_special_tokens=True)
    assert ids == dense.tokenize(text, add_special_tokens=True)
    with torch.inference_mode():
        ours = torch.from_numpy(mapped.forward_chunk(mapped.new_cache(), ids))
        theirs = torch.from_numpy(dense.forward_chunk(dense.new_cache(), ids))
    bound = 1e-5 if kind == 0 else 0.1
    assert (ours - theirs).abs().max() <= bound * theirs.abs().max(), (ours - theirs).abs().max()


@pytest.mark.parametrize("family", ARCHITECTURES)
def test_on_each_architecture_a_mapped_gguf_s_streams_in_a_batch_and_prompts_cut_anyhow_get_their_own_numbers(
    gguf_of, tmp_path: Path, family: str
):
    """What makes greedy from a cache equal greedy without one, and a stream in a batch equal it
    alone: a position's logits the same bits whichever pass computed it."""
    from tests.test_fast_decode import assert_a_batch_steps_as_each_alone

    model = load(gguf_of(family, 8), tmp_path)
    prompts = [model.tokenize(text, add_special_tokens=True) for text in ("the cat sat on the mat", TEXT, "a red sun")]
    if model._passes is not None:
        assert_a_batch_steps_as_each_alone(model, prompts)
    prompt = prompts[1]
    with torch.inference_mode():
        whole = model.forward_chunk(model.new_cache(), prompt)
        cut = model.new_cache()
        model.forward_chunk(cut, prompt[:7])
        model.forward_chunk(cut, prompt[7:-1])
        last = model.forward_chunk(cut, prompt[-1:])
    assert np.array_equal(whole, last)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "gemma3-gguf"])
def test_a_mapped_gguf_loads_without_importing_torch_or_transformers_once_its_tokenizer_is_kept(
    gguf_of, tmp_path: Path, arch: str
):
    """In a fresh process, as a worker loads one: the first load of a file builds its tokenizer
    with transformers' converter and keeps it (native_model); every later one imports neither."""
    from tests.conftest import load_in_a_fresh_process

    first = load_in_a_fresh_process(gguf_of(arch, 8), tmp_path, ("torch._dynamo", "transformers.modeling_utils"))
    assert first == "NativeModel []"
    assert load_in_a_fresh_process(gguf_of(arch, 8), tmp_path, ("torch", "transformers")) == "NativeModel []"


TEXT = "the history of the city of rome begins with a small settlement by the river, and so it grew " * 2


def test_protocol_md_states_the_reader_s_bounds_as_the_code_has_them():
    from worker.backends.transformers import gguf_model

    text = " ".join((Path(__file__).parent.parent / "docs" / "PROTOCOL.md").read_text().split())
    stated = (
        f"at most {reader.MAX_KEYS:,} metadata entries and {reader.MAX_TENSORS:,} tensors, a string of at most "
        f"{reader.MAX_STRING >> 20} MiB, an array of at most {reader.MAX_ARRAY:,} numbers or {reader.MAX_STRINGS:,} "
        f"strings, at most {gguf_model.MAX_LAYERS:,} layers"
    )
    assert stated in text, stated
