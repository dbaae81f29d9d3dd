"""A model's cache (TorchCache) written to KVC2 and mapped back continues exactly where it left
off, on every family of cache layers, and is cut back only where that is exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cache_samples import IDENTITY
from worker.kvcache import container
from worker.kvcache.container import Contents, Identity, load, write

PROMPT = "the cat sat on the mat and the dog runs quickly to the river " * 2


def identity(model) -> Identity:
    return Identity(**{**{f: getattr(IDENTITY, f) for f in IDENTITY.__struct_fields__},
                       "layers": model.config.num_hidden_layers})


def save(path: Path, model, cache, tokens: list[int]) -> None:
    layers, states, tensors = cache.to_file()
    write(path, Contents(identity=identity(model), tokens=tokens, layers=layers, states=states), tensors)


def feed(model, cache, tokens: list[int]) -> None:
    import torch

    with torch.inference_mode():
        cache.feed(model, torch.tensor([tokens]))


def greedy_from(model, cache, fed: list[int], steps: int) -> list[int]:
    """Feed ``fed`` (the prompt past what ``cache`` covers), then decode greedily."""
    import torch

    tokens, step = [], torch.tensor([fed])
    with torch.inference_mode():
        for _ in range(steps):
            token = int(cache.feed(model, step).argmax(-1))
            tokens.append(token)
            step = torch.tensor([[token]])
    return tokens


@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen3_5"])
def family_hf(request, tiny_models):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    directory = tiny_models(request.param)
    return AutoModelForCausalLM.from_pretrained(directory).eval(), AutoTokenizer.from_pretrained(directory)


def room_of(model, max_positions: int = 10**6):
    """The room to grow that the worker reads a file of this model's cache with, for a request
    whose cache will hold at most ``max_positions`` positions."""
    from worker.backends.transformers.torch_adapter import TorchCache, room_to_grow

    kinds = TorchCache(model.config).kinds
    return lambda entry: room_to_grow(kinds, "cpu", entry, max_positions)


@pytest.mark.parametrize("room", [False, True], ids=["as-stored", "with-room"])
@pytest.mark.parametrize("keep", [None, 6], ids=["whole-prefix", "cut-back-to-6"])
def test_a_cache_restored_from_a_file_continues_greedy_decoding_exactly(family_hf, tmp_path: Path, keep, room):
    """The prefix is longer than the tiny gemma3 model's sliding window; a model with linear
    state is cut back to a position where the prefill kept it (a checkpoint)."""
    from worker.backends.transformers.torch_adapter import TorchCache

    model, tokenizer = family_hf
    ids = tokenizer(PROMPT).input_ids
    reference = greedy_from(model, TorchCache(model.config), ids, 12)
    prefix = ids[:-1]
    cache = TorchCache(model.config)
    feed(model, cache, ids[:6])
    cache.checkpoint()  # at 6
    feed(model, cache, prefix[6:])
    path = tmp_path / "prefix.kvc"
    save(path, model, cache, prefix)
    loaded = load(path, identity(model), room=room_of(model) if room else None)
    restored = TorchCache.from_file(loaded, model.config, "cpu")
    assert restored.length == len(prefix)
    if keep is not None:
        assert restored.reusable(keep) == keep
        restored.crop(keep)
    assert greedy_from(model, restored, ids[restored.length :], 12) == reference
    assert len(set(reference)) >= 4, reference


def test_a_sliding_window_cache_is_cut_back_past_its_window_exactly(tiny_models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.backends.transformers.torch_adapter import TorchCache
    from worker.backends.transformers.tiny_model import SLIDING_WINDOW

    directory = tiny_models("gemma3")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(directory).eval(), AutoTokenizer.from_pretrained(directory)
    ids = tokenizer(PROMPT).input_ids
    assert len(ids) > 3 * SLIDING_WINDOW
    cache = TorchCache(model.config)
    greedy_from(model, cache, ids, 4)
    assert cache.resume_points() is None and cache.reusable(10) == 10
    assert all(layer.keys.shape[-2] == cache.length for layer in cache.kv.layers)  # every position kept
    cache.crop(10)
    assert greedy_from(model, cache, ids[10:], 8) == greedy_from(model, TorchCache(model.config), ids, 8)


def test_a_linear_attention_cache_is_cut_back_only_to_its_checkpoints(tiny_models):
    from transformers import AutoModelForCausalLM

    from worker.backends.transformers.torch_adapter import TorchCache

    model = AutoModelForCausalLM.from_pretrained(tiny_models("qwen3_5")).eval()
    cache = TorchCache(model.config)
    feed(model, cache, list(range(3, 13)))
    cache.checkpoint()
    feed(model, cache, list(range(13, 20)))
    assert cache.resume_points() == [0, 10, 17]
    assert [cache.reusable(n) for n in (5, 10, 16, 17, 40)] == [0, 10, 10, 17, 17]
    with pytest.raises(ValueError, match="cannot be cut back to 12"):
        cache.crop(12)


def resident(buffer) -> int:
    """Bytes of ``buffer`` (an mmap) resident in memory, page by page (mincore)."""
    import ctypes
    import ctypes.util
    import mmap

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    pages = -(-len(buffer) // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(len(buffer)), vector) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vector) * mmap.PAGESIZE


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="Linux: mincore and madvise")
def test_a_restored_layer_leaves_memory_as_soon_as_its_tensors_are_replaced(tiny_hf, tmp_path: Path):
    import mmap

    import torch

    from worker.backends.transformers.torch_adapter import TorchCache

    model, _ = tiny_hf
    config = model.config
    shape = (1, config.num_key_value_heads, 512, config.hidden_size // config.num_attention_heads)
    computed = TorchCache(config)
    for index in range(config.num_hidden_layers):
        computed.kv.update(torch.randn(shape), torch.randn(shape), index)
    computed.length = 512
    path = tmp_path / "long.kvc"
    save(path, model, computed, list(range(512)))
    computed = computed.kv
    layer_bytes = 2 * computed.layers[0].keys.nbytes
    layers = config.num_hidden_layers

    container.reserve(0)  # memory read into from a reserve stays with it by design
    loaded = load(path, identity(model))
    buffer = loaded._mapping
    restored = TorchCache.from_file(loaded, config, "cpu").kv
    del loaded
    assert resident(buffer) >= layers * layer_bytes  # every byte was read to check it
    step = torch.randn(shape[:2] + (1,) + shape[3:])
    restored.update(step, step, 0)  # as a decode step does: layer 0 becomes a copy, one position longer
    # Layer 0's pages are gone but for the two a tensor may share with its neighbours; the rest stay.
    assert (layers - 1) * layer_bytes <= resident(buffer) <= (layers - 1) * layer_bytes + 4 * mmap.PAGESIZE + 8192
    for index in range(1, layers):
        restored.update(step, step, index)
    assert resident(buffer) <= 4 * mmap.PAGESIZE + 8192  # only the header's pages and those tensors shared
    assert torch.equal(restored.layers[1].keys[..., :512, :], computed.layers[1].keys)


def test_a_cache_read_with_room_grows_into_it_without_moving_its_positions(tiny_hf, tmp_path: Path):
    """Feeding a restored cache appends to the memory the file was read into: the restored
    positions are not copied into larger buffers (all of them, at every first forward).
    The room is what the request can use; past it the cache moves, exactly."""
    import torch

    from worker.backends.transformers.torch_adapter import TorchCache

    model, tokenizer = tiny_hf
    ids = tokenizer(PROMPT).input_ids
    computed = TorchCache(model.config)
    feed(model, computed, ids[:-4])
    path = tmp_path / "prefix.kvc"
    save(path, model, computed, ids[:-4])
    loaded = load(path, identity(model), room=room_of(model, max_positions=len(ids) - 1))
    restored = TorchCache.from_file(loaded, model.config, "cpu")
    places = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in restored.kv.layers]
    assert all(layer.capacity == len(ids) - 1 for layer in restored.kv.layers)
    for fed in (ids[-4:-1], ids[-1:]):
        with torch.inference_mode():
            logits = restored.feed(model, torch.tensor([fed]))
            expected = computed.feed(model, torch.tensor([fed]))
        assert torch.equal(logits, expected)
        for ours, theirs in zip(restored.kv.layers, computed.kv.layers):
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        now = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in restored.kv.layers]
        assert (now == places) == (restored.length < len(ids))  # in place while the room lasts


def test_the_room_read_is_what_the_request_holds_up_to_a_growth_step_on_growing_layers_on_the_cpu():
    from worker.kvcache.container import TensorEntry
    from worker.backends.transformers.torch_adapter import room_to_grow

    def entry(layer: int, positions: int = 1000) -> TensorEntry:
        return TensorEntry(name="k", kind="key", layer=layer, shape=[1, 2, positions, 4], strides=[], offset=0,
                           nbytes=0, dtype="float32", crc32=0)

    kinds = ["full", "sliding", "full+linear"]
    assert room_to_grow(kinds, "cpu", entry(0), 1010) == 10
    assert room_to_grow(kinds, "cpu", entry(0), 10**6) == 500  # a growth step: half as much again
    assert room_to_grow(kinds, "cpu", entry(0), 900) == 0  # cut back: the request holds fewer positions than the file
    assert room_to_grow(kinds, "cpu", entry(1), 1010) == 10  # a sliding window's layer keeps every position
    assert room_to_grow(kinds, "cpu", entry(2), 1010) == 0
    assert room_to_grow(kinds, "cuda", entry(0), 1010) == 0


def test_extending_a_cache_on_the_cpu_reads_grouped_heads_in_place_with_the_same_logits(tiny_hf, monkeypatch):
    import torch
    from transformers.integrations import sdpa_attention

    from worker.backends.transformers import cache_layers, hf_compat

    hf_compat.register_attention()  # where the stock rule is kept (a load of transformers' classes does it too)
    model, tokenizer = tiny_hf
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped heads
    ids = torch.tensor([tokenizer(PROMPT).input_ids])
    copies = []
    repeat_kv = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *args: copies.append(args) or repeat_kv(*args))

    def extend(use_gqa_in_sdpa) -> tuple[torch.Tensor, int]:
        monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", use_gqa_in_sdpa)
        cache = cache_layers.new_cache(model.config)
        with torch.inference_mode():
            hf_compat.forward(model, ids[:, :6], cache)
            copies.clear()
            logits = hf_compat.forward(model, ids[:, 6:], cache)  # several tokens over a cache
        return logits, len(copies)

    in_place, in_place_copies = extend(hf_compat._use_gqa_in_sdpa)
    stock, stock_copies = extend(hf_compat._stock_use_gqa_in_sdpa)
    assert (in_place_copies, stock_copies) == (0, 2 * model.config.num_hidden_layers)
    assert torch.equal(in_place, stock)


def test_a_hybrid_layers_cache_cut_back_to_a_checkpoint_continues_as_it_did():
    """A layer with both full attention and linear-attention states (Falcon-H1's, transformers'
    "hybrid" layer type) is one of lm-worker's own layers: its keys, values and states cut back
    to a checkpoint and continue with the same logits, and a copy holds the same."""
    import torch
    from transformers import FalconH1Config, FalconH1ForCausalLM

    from worker.backends.transformers.cache_layers import FullAndLinearLayer
    from worker.backends.transformers.torch_adapter import TorchCache

    torch.manual_seed(0)
    config = FalconH1Config(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
        mamba_chunk_size=8, vocab_size=100,
    )
    model = FalconH1ForCausalLM(config).eval()
    ids = torch.randint(0, 100, (1, 20))
    cache = TorchCache(config)
    assert cache.kinds == ["full+linear"] * 2 and all(isinstance(layer, FullAndLinearLayer) for layer in cache.kv.layers)
    with torch.inference_mode():
        cache.feed(model, ids[:, :10])
        cache.checkpoint()
        first = cache.feed(model, ids[:, 10:])
        twin = cache.copy()
        assert cache.resume_points() == [0, 10, 20]
        cache.crop(10)
        assert all(layer.state[0].shape[-2] == 10 for layer in cache.kv.layers)
        again = cache.feed(model, ids[:, 10:])
    assert torch.equal(first, again)
    assert twin.nbytes == cache.nbytes


def test_a_cache_restored_or_cut_back_tells_transformers_the_positions_it_holds(tiny_models, tmp_path: Path):
    """transformers reads the positions of new tokens from the cache's first layer, which in
    Qwen3.5 is a linear-attention layer; from transformers 5.25 such a layer counts positions
    itself, so a restored or cut-back one must count what it holds (else every later position
    is wrong: greedy output from a cache parted from output without one)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.backends.transformers.torch_adapter import TorchCache

    directory = tiny_models("qwen3_5")
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = AutoTokenizer.from_pretrained(directory)(PROMPT).input_ids
    cache = TorchCache(model.config)
    feed(model, cache, ids[:12])
    cache.checkpoint()
    feed(model, cache, ids[12:20])
    cache.checkpoint()
    path = tmp_path / "cache.kvc"
    save(path, model, cache, ids[:20])
    restored = TorchCache.from_file(load(path, identity(model)), model.config, "cpu")
    assert restored.kv.get_seq_length() == restored.length == 20
    restored.crop(12)
    assert restored.kv.get_seq_length() == 12
    fresh = TorchCache(model.config)
    feed(model, fresh, ids[:12])
    with torch.inference_mode():  # the next positions are where they are without a cache
        assert torch.equal(restored.feed(model, torch.tensor([ids[12:20]])), fresh.feed(model, torch.tensor([ids[12:20]])))
