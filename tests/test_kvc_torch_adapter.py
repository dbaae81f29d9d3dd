"""A DynamicCache written to KVC1 and mapped back continues exactly where it left off."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from worker.kvcache.container import Identity, load, write

PROMPT = "the cat sat on the mat and the dog runs quickly to the river"


def identity(model) -> Identity:
    config = model.config
    return Identity(
        model_id="tiny", weights_fingerprint="test", tokenizer_sha256="test",
        rope_theta=float(getattr(config, "rope_theta", 0.0) or 0.0), layers=config.num_hidden_layers,
        kv_heads=config.num_key_value_heads, head_dim=config.hidden_size // config.num_attention_heads,
        dtype="float32", cache_class="DynamicCache", attention_type="full",
    )


def greedy_from(model, cache, last_token: int, steps: int) -> list[int]:
    import torch

    from worker.backends import hf_compat

    tokens, step = [], torch.tensor([[last_token]])
    with torch.inference_mode():
        for _ in range(steps):
            token = int(hf_compat.forward(model, step, cache).argmax(-1))
            tokens.append(token)
            step = torch.tensor([[token]])
    return tokens


@pytest.mark.parametrize("keep", [None, 6], ids=["whole-prefix", "trimmed-to-6"])
def test_a_cache_restored_from_a_file_continues_greedy_decoding_exactly(tiny_hf, tmp_path: Path, keep):
    import torch

    from worker.backends import hf_compat
    from worker.kvcache.torch_adapter import from_loaded, to_tensors

    model, tokenizer = tiny_hf
    ids = tokenizer(PROMPT).input_ids
    prefix = ids[:keep] if keep else ids[:-1]
    with torch.inference_mode():
        reference = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12)[0, len(ids):].tolist()
        cache = hf_compat.new_cache(model.config)
        hf_compat.forward(model, torch.tensor([ids[:-1]]), cache)
    path = tmp_path / "prefix.kvc"
    write(path, identity=identity(model), tokens=prefix, tensors=to_tensors(cache, keep_tokens=len(prefix)))
    restored = from_loaded(load(path, identity(model)), model.config, "cpu")
    assert restored.get_seq_length() == len(prefix)
    with torch.inference_mode():
        if len(prefix) < len(ids) - 1:  # extend the trimmed cache up to the last prompt token
            hf_compat.forward(model, torch.tensor([ids[len(prefix) : -1]]), restored)
    assert greedy_from(model, restored, ids[-1], 12) == reference


def test_a_cache_with_sliding_window_layers_is_refused_not_stored_wrongly(tiny_hf):
    from transformers import DynamicCache, MistralConfig

    from worker.kvcache.torch_adapter import UnsupportedCache, to_tensors

    config = MistralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, vocab_size=100, sliding_window=16)
    cache = DynamicCache(config=config)
    assert any(type(layer).__name__ != "DynamicLayer" for layer in cache.layers)
    with pytest.raises(UnsupportedCache, match="sliding-window"):
        to_tensors(cache)


def resident_from(path: Path) -> int | None:
    """Bytes of ``path`` resident in this process's mappings; None when it is not mapped."""
    total, inside = None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.endswith(f" {path}")
            if inside:
                total = total or 0
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads resident pages from /proc (Linux)")
def test_a_restored_layer_leaves_memory_as_soon_as_its_tensors_are_replaced(tiny_hf, tmp_path: Path):
    import mmap

    import torch

    from worker.backends import hf_compat
    from worker.kvcache.torch_adapter import from_loaded, to_tensors

    model, _ = tiny_hf
    config = model.config
    shape = (1, config.num_key_value_heads, 512, config.hidden_size // config.num_attention_heads)
    computed = hf_compat.new_cache(config)
    for index in range(config.num_hidden_layers):
        computed.update(torch.randn(shape), torch.randn(shape), index)
    path = tmp_path / "long.kvc"
    write(path, identity=identity(model), tokens=list(range(512)), tensors=to_tensors(computed))
    layer_bytes = 2 * computed.layers[0].keys.nbytes
    layers = config.num_hidden_layers

    restored = from_loaded(load(path, identity(model)), config, "cpu")
    assert resident_from(path) >= layers * layer_bytes  # every byte was read to check it
    step = torch.randn(shape[:2] + (1,) + shape[3:])
    restored.update(step, step, 0)  # as a decode step does: layer 0 becomes a copy, one position longer
    # Layer 0's pages are gone but for the two a tensor may share with its neighbours; the rest stay.
    assert (layers - 1) * layer_bytes <= resident_from(path) <= (layers - 1) * layer_bytes + 4 * mmap.PAGESIZE
    for index in range(1, layers):
        restored.update(step, step, index)
    assert resident_from(path) is None  # nothing uses the mapping any more: unmapped
    assert torch.equal(restored.layers[1].keys[..., :512, :], computed.layers[1].keys)


def test_extending_a_cache_on_the_cpu_reads_grouped_heads_in_place_with_the_same_logits(tiny_hf, monkeypatch):
    import torch
    from transformers.integrations import sdpa_attention

    from worker.backends import hf_compat

    model, tokenizer = tiny_hf
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped heads
    ids = torch.tensor([tokenizer(PROMPT).input_ids])
    copies = []
    repeat_kv = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *args: copies.append(args) or repeat_kv(*args))

    def extend(use_gqa_in_sdpa) -> tuple[torch.Tensor, int]:
        monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", use_gqa_in_sdpa)
        cache = hf_compat.new_cache(model.config)
        with torch.inference_mode():
            hf_compat.forward(model, ids[:, :6], cache)
            copies.clear()
            logits = hf_compat.forward(model, ids[:, 6:], cache)  # several tokens over a cache
        return logits, len(copies)

    in_place, in_place_copies = extend(hf_compat._use_gqa_in_sdpa)
    stock, stock_copies = extend(hf_compat._stock_use_gqa_in_sdpa)
    assert (in_place_copies, stock_copies) == (0, 2 * model.config.num_hidden_layers)
    assert torch.equal(in_place, stock)
