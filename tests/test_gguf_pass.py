"""A mapped gguf's passes without torch (gguf_pass): the torch path's numbers bit for bit on each
architecture and block type (NativeForward over gguf_model's model of the same file), however
the prompt is cut and whatever rides in the batch; its caches cut back; a fresh process that
builds it and steps imports neither torch nor transformers; and a hostile file refused with the
torch path's message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from tests.test_gguf_model import TEXT, gguf_of, rewritten  # noqa: F401 (gguf_of: the fixture)
from tests.test_hostile_files import T, with_metadata

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

FAMILIES = ["llama", "qwen2", "qwen3", "gemma3-gguf"]


@pytest.fixture(autouse=True, scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The data directory the kernels are built into (once), or these tests skipped where they
    cannot be (no C compiler)."""
    from worker.backends.transformers import exact_attention, fast_weights, gguf_weights, native_pass
    from worker.c_build import KernelUnavailable

    data = tmp_path_factory.mktemp("data")
    try:
        native_pass.load_kernel(data)
        native_pass.kernel_addresses(data)
        # the torch path's, for gguf_model's model made here
        exact_attention.kernel(data)
        fast_weights.load_int8_kernel(data)
        gguf_weights.load_kernel(data)
    except KernelUnavailable as exc:
        pytest.skip(f"the native pass cannot be built here: {exc}")
    return data


def both(path: Path, data_dir: Path):
    """The torch path (NativeForward over the model a worker's load of ``path`` builds, and the
    load for its caches and tokenizer) and the torch-free pass of the same file, one thread each."""
    from tests.test_gguf_model import load_with_torch
    from worker.backends.transformers.gguf_pass import GgufPass
    from worker.backends.transformers.native_forward import NativeForward
    from worker.gguf.reader import read

    torch.set_num_threads(1)
    loaded = load_with_torch(path, data_dir)
    ours = GgufPass(read(path), data_dir)
    ours.threads = 1
    return loaded, NativeForward(loaded._model, "gguf"), ours


def assert_same(theirs, ours) -> None:
    (logits, best), (our_logits, our_best) = theirs, ours
    assert isinstance(our_logits, np.ndarray) and our_logits.dtype == np.float32
    assert np.array_equal(logits.numpy(), our_logits) and best == our_best


def assert_chunks_then_steps_agree(loaded, native, ours):
    """A prompt in chunks, then greedy steps, through the torch path's pass (``native``, on
    ``loaded``'s caches) and a torch-free one (``ours``): the same logits and highest, and the same
    keys and values at every position, windows too. Returns (ids, our cache, their cache)."""
    ids = loaded.tokenize(TEXT, add_special_tokens=True)
    assert len(ids) > 40  # past the tiny Gemma 3's window of 16
    theirs_cache, our_cache = loaded.new_cache(), ours.new_cache()
    with torch.inference_mode():
        for start, end in ((0, 1), (1, 8), (8, 29), (29, len(ids))):
            chunk = ids[start:end]
            assert_same(native.forward_highest([chunk], [theirs_cache], [len(chunk)]),
                        ours.forward_highest([chunk], [our_cache], [len(chunk)]))
        token = 7
        for _ in range(6):
            theirs = native.forward_highest([[token]], [theirs_cache])
            assert_same(theirs, ours.forward_highest([[token]], [our_cache]))
            token = theirs[1][0]
    for mine, theirs in zip(our_cache.layers, theirs_cache.kv.layers, strict=True):  # every position kept, windows too
        keys, values = cast(Any, theirs).keys, cast(Any, theirs).values  # the torch cache's full or sliding layer
        assert np.array_equal(mine.keys, keys[0].numpy()) and np.array_equal(mine.values, values[0].numpy())
    return ids, our_cache, theirs_cache


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", [0, 8], ids=["F32", "Q8_0"])
def test_a_prompt_in_chunks_then_steps_give_the_torch_path_s_logits_bit_for_bit(
    gguf_of, kernels: Path, family: str, kind: int
):
    ids, our_cache, theirs_cache = assert_chunks_then_steps_agree(*both(gguf_of(family, kind), kernels))
    assert our_cache.length == theirs_cache.length == len(ids) + 6


@pytest.mark.parametrize("family", FAMILIES)
def test_two_sequences_in_one_batch_step_and_take_a_chunk_as_the_torch_path_does(gguf_of, kernels: Path, family: str):
    """Steps of two sequences together (one exact attention call), then a step beside another's
    prompt chunk and a draft of three: each row the torch path's, and each sequence's logits
    those it gets alone."""
    loaded, native, ours = both(gguf_of(family, 8), kernels)
    ids = loaded.tokenize(TEXT, add_special_tokens=True)
    firsts, seconds = ids[:23], ids[5:19]
    theirs_caches, our_caches = [loaded.new_cache(), loaded.new_cache()], [ours.new_cache(), ours.new_cache()]
    alone = ours.new_cache()
    with torch.inference_mode():
        assert_same(native.forward_highest([firsts, seconds], theirs_caches), ours.forward_highest([firsts, seconds], our_caches))
        ours.forward_highest([firsts], [alone])
        for token in (3, 9, 27):
            batched = ours.forward_highest([[token], [token + 1]], our_caches)
            assert_same(native.forward_highest([[token], [token + 1]], theirs_caches), batched)
            assert np.array_equal(batched[0][0], ours.forward([[token]], [alone])[0])
        assert_same(native.forward_highest([[5], ids[19:30]], theirs_caches, [1, 11]),
                    ours.forward_highest([[5], ids[19:30]], our_caches, [1, 11]))
        assert_same(native.forward_highest([ids[30:33], [6]], theirs_caches, [3, 1]),
                    ours.forward_highest([ids[30:33], [6]], our_caches, [3, 1]))


@pytest.mark.parametrize("family", ["llama", "gemma3-gguf"])
def test_a_cache_cut_back_continues_as_one_pass_over_its_tokens(gguf_of, kernels: Path, family: str):
    """Steps keep the keys transposed; cut back (a draft refused) and fed other tokens, the cache
    gives the logits of one pass over the tokens it now holds, at every cut within a tile."""
    _, _, ours = both(gguf_of(family, 8), kernels)
    prompt = list(range(3, 30))
    cache = ours.new_cache()
    ours.forward([prompt], [cache])
    for token in (40, 41, 42, 43, 44, 45):
        ours.forward([[token]], [cache])
    for keep in (len(prompt) + 5, len(prompt) + 2, len(prompt)):
        cache.crop(keep)
        fed = prompt + [40, 41, 42, 43, 44, 45][: keep - len(prompt)]
        assert np.array_equal(ours.forward([[50]], [cache]), ours.forward([fed + [50]], [ours.new_cache()]))
        cache.crop(keep)
    with pytest.raises(ValueError, match="cannot be cut back"):
        cache.crop(cache.length + 1)


def test_gemma3_s_full_and_sliding_layers_rotate_each_by_its_own_base_as_the_torch_path_does(
    gguf_of, kernels: Path, tmp_path: Path
):
    """Six layers: the sixth attends every position with RoPE base 10^6, the others a window with
    10^4 (the pattern a Gemma 3 gguf implies)."""
    source = gguf.GGUFReader(gguf_of("gemma3-gguf", 8))
    path = copied(source, tmp_path / "six.gguf", layers=6)
    loaded, native, ours = both(path, kernels)
    assert ours.config.layer_kinds[5] == "full_attention" and len(set(ours.config.layer_kinds)) == 2
    ids = loaded.tokenize(TEXT, add_special_tokens=True)
    with torch.inference_mode():
        theirs_cache, our_cache = loaded.new_cache(), ours.new_cache()
        for chunk in (ids[:20], ids[20:], [4], [8]):
            assert_same(native.forward_highest([chunk], [theirs_cache], [len(chunk)]),
                        ours.forward_highest([chunk], [our_cache], [len(chunk)]))


def test_a_gguf_s_rope_factors_divide_its_frequencies(gguf_of, kernels: Path, tmp_path: Path):
    """Llama 3.1's rope_freqs: the pass's logits are the torch path's (which divides the rotary
    embedding's frequencies by them, and so keeps PyTorch's tables) to rounding, and not those of
    the file without them."""
    source = gguf.GGUFReader(gguf_of("llama", 0))  # float32 blocks: no 8-bit rounding of activations to tip
    factors = np.linspace(1.0, 8.0, 8, dtype=np.float32)  # the tiny Llama's heads of 16
    path = copied(source, tmp_path / "factors.gguf", extra={"rope_freqs.weight": factors})
    loaded, native, ours = both(path, kernels)
    _, _, plain = both(gguf_of("llama", 0), kernels)
    ids = loaded.tokenize(TEXT, add_special_tokens=True)
    with torch.inference_mode():
        theirs = native.forward([ids], [loaded.new_cache()], [len(ids)]).numpy()
    mine = ours.forward([ids], [ours.new_cache()], [len(ids)])
    np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-4)
    assert np.abs(mine - plain.forward([ids], [plain.new_cache()], [len(ids)])).max() > 1e-2


def copied(source, out: Path, layers: int | None = None, extra: dict | None = None) -> Path:
    """``source`` (a GGUFReader) written again with ``layers`` layers (layer i a copy of the
    file's layer i modulo its count) and ``extra`` float32 tensors."""
    arch = source.fields["general.architecture"].contents()
    have = int(source.fields[f"{arch}.block_count"].contents())
    writer = gguf.GGUFWriter(str(out), arch)
    for field in source.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = layers if field.name == f"{arch}.block_count" and layers else field.contents()
        kind = field.types[0]
        writer.add_key_value(field.name, value, kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    tensors = {tensor.name: tensor for tensor in source.tensors}
    names = [name for name in tensors if not name.startswith("blk.")]
    for layer in range(layers or have):
        names += [(f"blk.{layer}." + name.split(".", 2)[2], name) for name in tensors if name.startswith(f"blk.{layer % have}.")]
    for entry in names:
        name, origin = entry if isinstance(entry, tuple) else (entry, entry)
        tensor = tensors[origin]
        raw = gguf.GGMLQuantizationType(tensor.tensor_type)
        writer.add_tensor(name, np.asarray(tensor.data), raw_dtype=raw if raw != gguf.GGMLQuantizationType.F32 else None)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_fresh_process_builds_the_pass_and_steps_without_importing_torch_or_transformers(gguf_of, kernels: Path):
    program = f"""
import sys
from pathlib import Path
from worker.backends.transformers.gguf_pass import GgufPass
from worker.gguf.reader import read
ours = GgufPass(read({str(gguf_of("qwen2", 8))!r}), Path({str(kernels)!r}))
cache = ours.new_cache()
ours.forward_highest([[1, 2, 3, 4]], [cache])
logits, best = ours.forward_highest([[5]], [cache])
assert logits.shape == (1, ours.config.vocab) and cache.length == 5, (logits.shape, cache.length)
print(sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "transformers")))
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent.parent)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr


def test_a_model_the_pass_does_not_compute_is_not_taken(gguf_of, kernels: Path):
    from worker.backends.transformers.gguf_config import NotTaken
    from worker.backends.transformers.gguf_pass import GgufPass
    from worker.gguf.reader import read

    with pytest.raises(NotTaken, match="a phi3 model"):
        GgufPass(read(gguf_of("phi3", 8)), kernels)


@pytest.mark.parametrize("family", FAMILIES + ["gemma3"])
def test_the_configuration_is_the_torch_path_s(gguf_of, tiny_models, tmp_path: Path, family: str):
    """Read from the same keys as transformers reads (hf_compat.gguf_config_keys), with its defaults
    for what the file leaves out: the numbers gguf_model's configuration resolves to."""
    from worker.backends.transformers import gguf_config, gguf_model, hf_compat, shell_model
    from worker.backends.transformers.tiny_model import write_gguf
    from worker.gguf.reader import read

    path = gguf_of(family, 8) if family != "gemma3" else write_gguf(tiny_models("gemma3"), tmp_path / "g.gguf")
    file = read(path)
    ours, theirs = gguf_config.config_of(file), gguf_model.config_of(file)
    assert gguf_config.KEYS[file.architecture] == hf_compat.gguf_config_keys(file.architecture)
    rope = theirs.rope_parameters
    kinds = list(getattr(theirs, "layer_types", None) or []) if file.architecture == "gemma3" else [None] * ours.layers
    assert ours.layer_kinds == kinds
    assert ours.rope_bases == ({kind: rope[kind]["rope_theta"] for kind in sorted(set(kinds))} if kinds[0] else {None: rope["rope_theta"]})
    shell = shell_model.Attention(theirs, 0)
    assert (ours.heads, ours.kv_heads, ours.dim, ours.hidden, ours.intermediate, ours.epsilon, ours.scaling) == (
        theirs.num_attention_heads, theirs.num_key_value_heads, shell_model.head_dim(theirs), theirs.hidden_size,
        theirs.intermediate_size, theirs.rms_norm_eps, shell.scaling,
    )
    assert ours.window == (getattr(shell_model.Attention(theirs, 0), "sliding_window", None) or 0)


def hostile(tiny_gguf: Path, tmp_path: Path, change: dict) -> Path:
    if "metadata" in change:
        key, value, kind = change["metadata"]
        return with_metadata(tiny_gguf, tmp_path / "hostile.gguf", {key: (value, getattr(T, kind), None)})
    return rewritten(tiny_gguf, tmp_path / "hostile.gguf", **change)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"drop": "blk.0.attn_q.weight"}, "the tensor blk.0.attn_q.weight is missing"),
        ({"add": "blk.0.attn_extra.weight"}, "does not use: blk.0.attn_extra.weight"),
        ({"reshape": "blk.1.ffn_up.weight"}, "blk.1.ffn_up.weight has the shape"),
        ({"block_count": 1000}, "block_count says 1000 layers"),
        ({"block_count": 1}, "block_count says 1 layers, and the file's tensors go past them"),
        ({"kind": {"blk.0.ffn_down.weight": 20}}, "blk.0.ffn_down.weight is IQ4_NL, which lm-worker does not multiply; it takes F32, F16, Q4_0"),
        ({"kind": {"token_embd.weight": 20}}, "the embedding token_embd.weight is IQ4_NL, which lm-worker does not multiply"),
        ({"metadata": ("llama.context_length", float("nan"), "FLOAT32")}, "llama.context_length is nan, not an integer"),
        ({"metadata": ("llama.attention.head_count", 6, "UINT32")}, "not a multiple of the number of attention heads"),
        ({"metadata": ("llama.attention.head_count", 1 << 63, "UINT64")}, "llama.attention.head_count is 9223372036854775808, not a size"),
        ({"metadata": ("llama.attention.head_count_kv", 2.5, "FLOAT32")}, "llama.attention.head_count_kv is 2.5, not an integer"),
        ({"metadata": ("llama.attention.head_count_kv", 3, "UINT32")}, "head_count_kv is 3, which does not divide"),
        ({"metadata": ("llama.rope.freq_base", 0.0, "FLOAT32")}, "llama.rope.freq_base is 0.0, not a finite number above 0"),
        ({"metadata": ("llama.attention.layer_norm_rms_epsilon", float("nan"), "FLOAT32")}, "layer_norm_rms_epsilon is nan, not a finite number from 0 to 1"),
        ({"metadata": ("llama.rope.dimension_count", 1 << 40, "UINT64")}, "llama.rope.dimension_count is 1099511627776, not a size"),
        ({"metadata": ("llama.rope.dimension_count", 7, "UINT32")}, "RoPE requires an even rotary dimension"),
        ({"metadata": ("llama.block_count", "two", "STRING")}, "metadata llama.block_count is str 'two', not int or float"),
    ],
    ids=["missing", "extra", "misshapen", "block-count-high", "block-count-low", "type", "embedding-type", "ctx-nan",
         "heads-6", "heads-2^63", "kv-float", "kv-not-dividing", "rope-zero", "eps-nan", "head-dim-2^40", "head-dim-odd",
         "block-count-string"],
)
def test_a_hostile_gguf_is_refused_with_the_torch_path_s_message(
    tiny_gguf: Path, kernels: Path, tmp_path: Path, change: dict, says: str
):
    from worker.backends.transformers import gguf_model, hf_compat
    from worker.backends.transformers.gguf_pass import GgufPass
    from worker.gguf.reader import GgufError, read

    path = hostile(tiny_gguf, tmp_path, change)
    with pytest.raises(GgufError) as ours:
        GgufPass(read(path), kernels)
    with pytest.raises(GgufError) as theirs:
        file = read(path)
        gguf_model.build(file, gguf_model.config_of(file), hf_compat.EXACT_ATTENTION)
    said, they_said = str(ours.value), str(theirs.value)
    assert says in said and says in they_said, (said, they_said)
    assert (str(path) in said) == (str(path) in they_said)
