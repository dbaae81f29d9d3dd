"""The CPU's fast decode path: quantized weights, the decode step, keys and values kept in
growing buffers. Each piece is held to transformers' own numbers on the same weights; the
path as a whole is tested through the worker (greedy equals in-process generate(), the
cache exactness tests of every family run on it as the default). Llama and Gemma 3 models
with int8 weights compute their passes natively (tests/test_native_forward.py); the tests of
decode_step's PyTorch operations take them for it too (the torch_operations fixture), as
where that kernel cannot be built."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from worker.host import Host, WorkerError
from tests.conftest import TORCH_ENV

torch = pytest.importorskip("torch")


def load(model_dir: Path, data_dir: Path, **params):
    from protocol.methods import LoadParams
    from worker.backends.transformers.backend import TransformersBackend

    torch.set_num_threads(1)
    return TransformersBackend().load(LoadParams(model=str(model_dir), **params), data_dir=data_dir)


# Long enough to pass the tiny Gemma 3's sliding window of 16 positions.
TEXT = "the cat sat on the mat and the dog ran to the river and a red sun rose over the hills far away"


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_rope_tables_give_a_position_the_rotary_embeddings_own_numbers_in_any_pass(
    tiny_models, tmp_path: Path, torch_operations, family
):
    """A pass's (cos, sin) come from tables made once (decode_step.Ropes), grown as positions
    come: each position gets what the model's rotary embedding computes for it in a pass of
    one position, of a chunk, of scattered ones, past the tables' first size, and as before."""
    model = load(tiny_models(family), tmp_path)
    ropes = model._passes._ropes
    hidden = torch.zeros(1, 8)
    passes = [[0], [1], [300], list(range(256)), [7, 900, 3], [5000], list(range(4990, 5010)), [2]]
    with torch.inference_mode():
        for positions in passes:
            at = torch.tensor([[p] for p in positions])
            tabled, computed = ropes(hidden, at), ropes._computed(hidden, at)
            for kind in ropes.kinds:
                assert tabled[kind][0].shape == computed[kind][0].shape
                assert torch.equal(tabled[kind][0], computed[kind][0]) and torch.equal(tabled[kind][1], computed[kind][1])
    assert len(ropes._tables[ropes.kinds[0]][0]) >= 5010


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("quantization", ["auto", "none", "int4"])
def test_a_decode_step_gives_transformers_forward_logits_bit_for_bit(
    tiny_models, tmp_path: Path, torch_operations, family, quantization
):
    model = load(tiny_models(family), tmp_path, quantization=quantization)
    assert model._passes is not None
    ids = model.tokenize(TEXT, add_special_tokens=True)
    with torch.inference_mode():
        for cut in (1, 2, 5, 15, 16, len(ids) - 1):
            stepped = model.new_cache()
            model.extend_cache(ids[:cut], stepped)
            forwarded = stepped.copy()
            ours = model._passes([ids[cut]], [stepped])
            theirs = forwarded.feed(model._model, torch.tensor([[ids[cut]]]))
            assert torch.equal(ours, theirs), f"step after {cut} tokens"
            assert stepped.length == forwarded.length == cut + 1
            for mine, other in zip(stepped.kv.layers, forwarded.kv.layers):
                assert torch.equal(mine.keys, other.keys) and torch.equal(mine.values, other.values)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("quantization", ["int8", "int4", "none"])
def test_a_prompt_fed_alone_takes_the_step_only_where_it_gives_transformers_forward_numbers_bit_for_bit(
    tiny_models, tmp_path: Path, monkeypatch, torch_operations, family, quantization
):
    """With quantized weights a prompt's chunks go through the decode step (fewer operations),
    whose numbers equal transformers' forward's bit for bit; dense weights, where the step's
    products of several rows may round otherwise, keep transformers' forward."""
    from worker.backends.transformers.decode_step import DecodeStep

    model = load(tiny_models(family), tmp_path, quantization=quantization)
    passes = []
    forward = DecodeStep.forward
    monkeypatch.setattr(DecodeStep, "forward", lambda self, *args: passes.append(args) or forward(self, *args))
    ids = model.tokenize(TEXT, add_special_tokens=True)
    with torch.inference_mode():
        fed = model.new_cache()
        decoding = model.start(ids, None, fed)
        while decoding.prompt_left:
            decoding.feed(5)
        forwarded = model.new_cache()
        logits = [forwarded.feed(model._model, torch.tensor([ids[start : start + 5]])) for start in range(0, len(ids), 5)]
    assert len(passes) == (0 if quantization == "none" else -(-len(ids) // 5))
    assert torch.equal(torch.from_numpy(decoding.logits), logits[-1])
    for mine, other in zip(fed.kv.layers, forwarded.kv.layers):
        assert torch.equal(mine.keys, other.keys) and torch.equal(mine.values, other.values)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch_operations"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_batch_of_sequences_steps_as_each_would_alone(tiny_models, tmp_path: Path, request, family, native):
    if not native:
        request.getfixturevalue("torch_operations")
    model = load(tiny_models(family), tmp_path, quantization="int8")  # dense float32 products differ by batch size
    prompts = [model.tokenize(text, add_special_tokens=True) for text in ("the cat", "a red sun over the river and", TEXT)]
    assert_a_batch_steps_as_each_alone(model, prompts)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_step_attends_every_sequence_in_one_kernel_call_with_the_numbers_of_each_in_turn(
    tiny_models, tmp_path: Path, monkeypatch, torch_operations, family
):
    """One position per sequence: each layer's attention and appends are one call of the exact
    kernel for all sequences; logits and the caches' keys and values equal those of attention
    computed sequence by sequence, also past the tiny Gemma 3's window and with a cache read
    back from a file (its tensors, not buffers the step grew)."""
    from worker.backends.transformers.decode_step import DecodeStep

    model = load(tiny_models(family), tmp_path, quantization="int8")
    step = model._passes
    assert step._kernel is not None
    calls = []
    at_once = DecodeStep._attend_at_once
    monkeypatch.setattr(DecodeStep, "_attend_at_once", lambda self, *a: calls.append(1) or at_once(self, *a))
    prompts = [model.tokenize(text, add_special_tokens=True) for text in ("the cat", TEXT, "a red sun over the river")]
    with torch.inference_mode():
        caches = []
        for prompt in prompts:
            cache = model.new_cache()
            model.extend_cache(prompt[:-1], cache)
            caches.append(cache)
        caches[1] = loaded_back(model, caches[1], prompts[1][:-1], tmp_path)
        in_turn = [cache.copy() for cache in caches]
        tokens = [prompt[-1] for prompt in prompts]
        for _ in range(20):
            calls.clear()
            ours = step(tokens, caches)
            assert len(calls) == len(step._layers)
            kernel, step._kernel = step._kernel, None
            theirs = step(tokens, in_turn)
            step._kernel = kernel
            assert torch.equal(ours, theirs)
            tokens = ours.argmax(-1).tolist()
    for mine, other in zip(caches, in_turn):
        assert mine.length == other.length
        for a, b in zip(mine.kv.layers, other.kv.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def loaded_back(model, cache, tokens: list[int], tmp_path: Path):
    """``cache`` of ``tokens`` written to a file and read back with room to grow, as a request
    that names it reads it."""
    from tests.test_kvc_torch_adapter import identity, room_of, save
    from worker.kvcache.container import load

    path = tmp_path / "cache.kvc"
    save(path, model._model, cache, tokens)
    room = room_of(model._model, max_positions=len(tokens) + 40)
    return model.load_cache(load(path, identity(model._model), room=room))


def assert_a_batch_steps_as_each_alone(model, prompts: list[list[int]]) -> None:
    """The last token of each prompt stepped in one batch gives each row the logits it gets alone."""
    with torch.inference_mode():
        alone, together = [], []
        for prompt in prompts:
            cache = model.new_cache()
            model.extend_cache(prompt[:-1], cache)
            alone.append(cache)
            together.append(cache.copy())
        expected = [model._numpy(model._passes.forward_highest([[prompt[-1]]], [cache])[0])
                    for prompt, cache in zip(prompts, alone)]
        batched = model._numpy(model._passes.forward_highest([[prompt[-1]] for prompt in prompts], together)[0])
    for row, logits in enumerate(expected):
        assert np.array_equal(batched[row : row + 1], logits)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_prompt_chunk_fed_in_a_step_beside_a_decoding_sequence_matches_transformers_forward(
    tiny_models, tmp_path: Path, family
):
    """The scheduler feeds a joining prompt in the same pass as the running requests' step:
    the chunk's logits and keys match transformers' forward of it (float32 rounding apart:
    other matrix shapes), and the decoding sequence gets what it would get alone."""
    model = load(tiny_models(family), tmp_path)
    running = model.tokenize("the cat sat on the mat", add_special_tokens=True)
    joining = model.tokenize(TEXT, add_special_tokens=True)
    with torch.inference_mode():
        decoding = model.new_cache()
        model.extend_cache(running[:-1], decoding)
        alone = decoding.copy()
        fed, forwarded = model.new_cache(), model.new_cache()
        model.extend_cache(joining[:3], fed)
        model.extend_cache(joining[:3], forwarded)
        # 20 positions joining after 3: past the window of 16
        both = model._passes.forward([running[-1:], joining[3:23]], [decoding, fed])
        theirs = forwarded.feed(model._model, torch.tensor([joining[3:23]]))
        expected = model._passes([running[-1]], [alone])
    assert fed.length == forwarded.length == 23 and decoding.length == alone.length == len(running)
    torch.testing.assert_close(both[1:], theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[:1], expected, rtol=1e-5, atol=1e-5)
    for mine, other in zip(fed.kv.layers, forwarded.kv.layers):
        torch.testing.assert_close(mine.keys, other.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine.values, other.values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_5"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_give_a_position_the_same_logits_however_its_prompt_was_cut(
    tiny_models, tmp_path: Path, family: str, quantization: str
):
    """With quantized weights every position's numbers are independent of the chunk it was
    computed in (its products are row by row, its attention exact_attention's kernel):
    one prompt fed whole, in odd chunks, or its tail one decode step at a time (a cache's
    prefix, then the rest) gives the same logits bit for bit."""
    model = load(tiny_models(family), tmp_path, quantization=quantization)
    text = "the cat sat on the mat and the dog ran to the river, a red sun over the hills " * 6
    ids = model.tokenize(text, add_special_tokens=True)[:160]
    step = model._passes or (lambda tokens, caches: caches[0].feed(model._model, torch.tensor([tokens])))

    def logits(cuts: list[int], steps_from: int) -> torch.Tensor:
        cache, rows, start = model.new_cache(), [], 0
        with torch.inference_mode():
            for cut in [*cuts, steps_from]:
                rows.append(cache.feed(model._model, torch.tensor([ids[start:cut]])))
                start = cut
            rows += [step([token], [cache]) for token in ids[steps_from:]]
        return torch.cat(rows[len(cuts):])

    whole = logits([], 100)
    assert torch.equal(logits([37, 64, 91], 100), whole)
    assert torch.equal(logits([50], 80)[20:], whole)


def test_int4_weights_give_each_row_the_numbers_it_gets_alone():
    from worker.backends.transformers.fast_weights import Int4Linear

    torch.manual_seed(0)
    linear = Int4Linear(torch.nn.Linear(576, 192, bias=False), torch.float32)
    rows = torch.randn(300, 576)
    together = linear(rows)
    for start, count in ((0, 1), (17, 3), (100, 256 - 100), (299, 1)):
        assert torch.equal(linear(rows[start : start + count]), together[start : start + count])


def test_int4_gives_a_linear_it_cannot_take_8_bit_rows_not_dense_weights(tmp_path: Path):
    """Every product of a quantized model gives each row the numbers it gets alone; a dense
    one would not, so a shape the int4 kernel refuses gets 8-bit rows."""
    from worker.backends.transformers.fast_weights import Int4Linear, Int8Linear, load_int8_kernel, quantize

    load_int8_kernel(tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(32, 40, bias=False))
    assert quantize(model, "int4") == 2
    assert [type(layer) for layer in model] == [Int4Linear, Int8Linear]


def test_int4_weights_keep_the_values_of_4_bit_groups_exactly():
    """A weight that already is 4-bit groups (as a Q4_1 gguf's are) is represented without loss."""
    from worker.backends.transformers.fast_weights import GROUP, Int4Linear

    torch.manual_seed(1)
    rows, inputs = 32, 64
    levels = torch.randint(0, 16, (rows, inputs // GROUP, GROUP)).float()
    scale = torch.tensor([0.5, 0.25])[torch.randint(0, 2, (rows, inputs // GROUP, 1))]
    low = torch.randint(-8, 0, (rows, inputs // GROUP, 1)).float() / 4
    levels[..., 0], levels[..., 1] = 0, 15  # each group spans its whole range
    weight = (levels * scale + low).reshape(rows, inputs)
    dense = torch.nn.Linear(inputs, rows, bias=False)
    dense.weight.data = weight
    identity = torch.eye(inputs)
    assert torch.equal(Int4Linear(dense, torch.float32)(identity).t(), weight)


@pytest.mark.parametrize("sizes", [(576, 192, 192), (64, 32, 32), (1536, 1536)])
def test_fused_projections_equal_the_separate_linears_bit_for_bit(sizes):
    from worker.backends.transformers.fast_weights import Int4Linear, fused

    torch.manual_seed(2)
    linears = [Int4Linear(torch.nn.Linear(128, size, bias=False), torch.float32) for size in sizes]
    one = fused(linears)
    if any(size % 64 for size in sizes):
        assert one is None  # rows of a packed int4 weight are interleaved in blocks of 64
        return
    x = torch.randn(5, 128)
    assert torch.equal(one(x), torch.cat([linear(x) for linear in linears], dim=-1))


def test_appended_positions_grow_in_place_and_cut_back_like_transformers_layers(tiny_model_dir: Path):
    from transformers import AutoConfig

    from worker.backends.transformers import cache_layers

    cache = cache_layers.new_cache(AutoConfig.from_pretrained(tiny_model_dir))
    layer = cache.layers[0]
    assert isinstance(layer, cache_layers.FullAttentionLayer)
    reference = []
    for step in range(70):  # past the first buffer's room
        keys = torch.full((1, 2, 1, 4), float(step))
        reference.append(keys)
        all_keys, _ = cache.update(keys, -keys, 0)  # as transformers' forward appends
        assert torch.equal(all_keys, torch.cat(reference, dim=-2))
    held = layer.keys
    layer.keep_first(10)
    layer.update_and_fetch(torch.full((1, 2, 1, 4), 99.0), torch.zeros(1, 2, 1, 4))
    assert layer.keys.shape[-2] == 11 and float(layer.keys[0, 0, 10, 0]) == 99.0
    assert torch.equal(layer.keys[..., :10, :], torch.cat(reference[:10], dim=-2))
    assert held.data_ptr() == layer.keys.data_ptr()  # the same buffer: nothing was copied
    copied = cache_layers.new_cache(AutoConfig.from_pretrained(tiny_model_dir)).layers[0]
    copied.restore(layer.keys.clone(), layer.values.clone(), 11)
    copied.update_and_fetch(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4))  # a tensor from elsewhere moves into a buffer
    assert copied.keys.shape[-2] == 12 and torch.equal(copied.keys[..., :11, :], layer.keys)


def test_the_wide_copy_of_a_layer_equals_its_positions_through_appends_cuts_and_restores(tiny_model_dir: Path):
    """Attention in float64 reads a float64 copy kept beside the cache: whatever happens to the
    positions (appended past the buffers' room, cut back and written anew, set from a file),
    the copy it reads is exactly the positions converted."""
    from transformers import AutoConfig

    from worker.backends.transformers import cache_layers

    layer = cache_layers.new_cache(AutoConfig.from_pretrained(tiny_model_dir)).layers[0]

    def check() -> None:
        keys, values = layer.wide_state(torch.float64)
        assert torch.equal(keys, layer.keys.double()) and torch.equal(values, layer.values.double())

    for step in range(300):  # past the first buffers' room
        layer.update_and_fetch(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
        if step % 7 == 0:
            check()
    check()
    for keep in (290, 17, 0):  # cut back, then new positions where old ones were
        layer.keep_first(keep)
        layer.update_and_fetch(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
        check()
    layer.restore(torch.randn(1, 2, 40, 4), torch.randn(1, 2, 40, 4), 40)
    check()
    layer.update_and_fetch(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))
    check()
    layer.compact()
    check()


def test_a_copied_cache_holds_no_spare_room(tiny_model_dir: Path, tmp_path: Path):
    model = load(tiny_model_dir, tmp_path)
    with torch.inference_mode():
        cache = model.new_cache()
        model.extend_cache(list(range(5, 45)), cache)
        twin = cache.copy()
    for layer, original in zip(twin.kv.layers, cache.kv.layers):
        assert layer.keys.untyped_storage().nbytes() == layer.keys.nbytes
        assert torch.equal(layer.keys, original.keys)
    assert twin.nbytes == cache.nbytes


# --- through the worker ---------------------------------------------------------------------------


async def test_load_reports_float32_with_int8_weights_by_default_on_the_cpu_and_others_on_request(
    tiny_model_dir: Path, tmp_path: Path
):
    host = await Host.start_in_process("--data-dir", str(tmp_path))
    model = str(tiny_model_dir)
    try:
        info = await host.call("load", {"model": model}, timeout=120)
        assert (info["dtype"], info["quantization"]) == ("float32", "int8")
        info = await host.call("load", {"model": model, "device": "cpu:0", "quantization": "none"}, timeout=120)
        assert (info["dtype"], info["quantization"], info["device"]) == ("float32", "none", "cpu")
        info = await host.call("load", {"model": model, "dtype": "bfloat16", "quantization": "int4"}, timeout=120)
        assert (info["dtype"], info["quantization"]) == ("bfloat16", "int4")
        for wrong in ({"device": "cuda", "quantization": "int4"}, {"quantization": "int3"}):
            with pytest.raises(WorkerError) as caught:
                await host.call("load", {"model": model, **wrong})
            assert caught.value.kind == "invalid_params" and caught.value.data["field"] == "params.quantization"
        left = (await host.call("capabilities"))["model"]  # the refused loads left the model working
        assert (left["dtype"], left["quantization"]) == ("bfloat16", "int4")
        assert (await host.call("generate", {"prompt": "the cat", "max_tokens": 3}))["usage"]["completion_tokens"] >= 1
    finally:
        await host.close()


async def test_a_cache_made_with_other_weights_is_refused_naming_the_quantization(tiny_model_dir: Path, tmp_path: Path):
    host = await Host.start_in_process("--data-dir", str(tmp_path))
    try:
        await host.call("load", {"model": str(tiny_model_dir), "quantization": "none"}, timeout=120)
        await host.call("prefill", {"prompt": "the cat sat on the mat", "cache": "dense"}, timeout=60)
        await host.call("load", {"model": str(tiny_model_dir)}, timeout=120)
        with pytest.raises(WorkerError) as caught:
            await host.call("generate", {"prompt": "the cat sat on the mat and", "cache": "dense"}, timeout=60)
        assert caught.value.kind == "cache_identity_mismatch" and "quantization" in caught.value.message
        result = await host.call("generate", {"prompt": "the cat sat on the mat and", "cache": "auto"}, timeout=60)
        assert result["cache"]["reused_tokens"] == 0  # auto passes over it
    finally:
        await host.close()


NEAR = 0.5  # logits: how far below transformers' best a token of the worker's may score (int8 weights)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["default", "gemma3-270m"])
@pytest.mark.parametrize("load_params", [{}, {"quantization": "none"}], ids=["default", "dense"])
async def test_shipped_models_greedy_equals_in_process_generate_on_the_same_weights(
    tmp_path: Path, model: str, load_params: dict, monkeypatch: pytest.MonkeyPatch
):
    """Both decode through the worker's step (SmolLM2 of the Llama architecture, Gemma 3 with
    its sliding windows); with the default weights also from a prompt longer than Gemma's
    window of 512 (fed in chunks, which give quantized weights the same numbers).

    Dense weights: the same tokens. The default int8 weights: transformers' forward computes
    the layers with PyTorch's operations, whose last bits differ from the native pass's, and
    an activation block's largest number carries a last-bit difference into the whole block's
    quantization: the two part where a token's two best scores are close (0.02 to 0.26 apart
    on SmolLM2). So each token the worker chose must be transformers' best for the same tokens
    before it, or within NEAR of it: a pass computing another model parts by whole logits."""
    from protocol.methods import LoadParams
    from tests.test_gemma3_real import STORY
    from worker.backends.transformers.backend import TransformersBackend
    from worker.data_dir import default_data_dir

    from worker.backends.transformers import backend

    torch.set_num_threads(2)
    with monkeypatch.context() as patch:  # transformers' own classes, not the shell of the kept int8 weights
        patch.setattr(backend, "_kept_int8", lambda *args: None)
        reference = TransformersBackend().load_with_torch(LoadParams(model=model, **load_params), data_dir=default_data_dir())
    assert reference._passes is not None
    texts = ["def fibonacci(n):\n", "Once upon a time, in a land far away,", "1, 2, 3, 4, 5,"]
    host = await Host.start_in_process()
    try:
        await host.call("load", {"model": model, **load_params}, timeout=300)
        for text in texts + ([STORY] if not load_params else []):
            ids = reference.tokenize(text, add_special_tokens=True)
            ours = (await host.call("generate", {"tokens": ids, "max_tokens": 48}, timeout=300))["tokens"]
            with torch.inference_mode():
                if not load_params:
                    scores = reference._model(torch.tensor([ids + ours[:-1]])).logits[0, len(ids) - 1 :].float()
                    short = scores.max(-1).values - scores[torch.arange(len(ours)), ours]
                    assert float(short.max()) <= NEAR, (text, short.tolist())
                    continue
                out = reference._model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=len(ours))
            assert ours == out[0, len(ids) :].tolist(), text
    finally:
        await host.close()


def test_torch_work_off_the_model_thread_runs_on_one_thread_and_leaves_the_model_threads_alone():
    """A thread other than the model's that does torch work (the cache I/O thread) must not
    make an OpenMP pool of its own: while one exists, the model thread's decode steps wait
    for sleeping threads (worker/backends/transformers/torch_threads.py)."""
    import threading

    from worker.backends.transformers.torch_threads import keep_to_one_thread

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: list[int] = []

    def io_thread() -> None:
        keep_to_one_thread()
        torch.ones(1 << 20).sum()
        seen.append(torch.get_num_threads())

    try:
        thread = threading.Thread(target=io_thread)
        thread.start()
        thread.join()
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_cache_computed_with_one_attention_implementation_is_another_identity_than_with_another(tiny_model_dir: Path):
    """Each attention implementation gives a position other last bits (float32 SDPA for dense
    weights; for quantized ones the exact kernel, or float64 where it cannot be built): a
    cache computed with one must not pass for one computed with another."""
    from transformers import AutoConfig

    from worker.backends.transformers import hf_compat

    config = AutoConfig.from_pretrained(tiny_model_dir)
    digests = set()
    for implementation in (hf_compat.ATTENTION, hf_compat.WIDE_ATTENTION, hf_compat.EXACT_ATTENTION):
        config._attn_implementation = implementation
        digests.add(hf_compat.config_digest(config))
    assert len(digests) == 3


def test_a_cache_computed_on_a_gpu_is_another_identity_than_on_the_cpu(tiny_model_dir: Path):
    """A GPU's kernels give a position other last bits than the CPU's (and one GPU model's than
    another's), with the same dtype and configuration: the processor is in the digest, and
    caches computed on the CPU keep the identity they always had."""
    from transformers import AutoConfig

    from worker.backends.transformers import backend, hf_compat

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config._attn_implementation = hf_compat.ATTENTION
    on_cpu = hf_compat.config_digest(config, device=backend._arithmetic_device("cpu", native=True))
    gpus = {hf_compat.config_digest(config, device=gpu) for gpu in ("cuda NVIDIA H200", "cuda NVIDIA A100", "mps")}
    assert on_cpu == hf_compat.config_digest(config)
    assert len(gpus) == 3 and on_cpu not in gpus
