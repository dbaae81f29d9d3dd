"""A Llama model's whole pass in one native call (native_forward): which models take it, that
it computes the layers' numbers to rounding, and that a position's numbers depend on its
tokens alone however the pass around it is made (steps, drafts and prompt chunks together).
The worker's greedy and cache exactness tests run on it too: it is the default path."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.test_fast_decode import TEXT, load

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True, scope="module")
def native_kernel(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The native pass built (once a process), or these tests skipped where it cannot be
    (no C compiler: the worker then keeps PyTorch's operations, as the last test checks)."""
    from worker.backends.transformers import exact_attention, native_forward

    try:
        native_forward.load_kernel(tmp_path_factory.mktemp("data"))
    except exact_attention.KernelUnavailable as exc:
        pytest.skip(f"the native pass cannot be built here: {exc}")


def test_llama_and_gemma3_models_with_int8_weights_compute_their_passes_natively_and_others_keep_pytorchs_operations(
    tiny_models, tmp_path: Path
):
    from worker.backends.transformers.decode_step import DecodeStep
    from worker.backends.transformers.native_forward import NativeForward

    for family in ("llama", "gemma3"):
        assert type(load(tiny_models(family), tmp_path)._passes) is NativeForward
    for family, quantization in (("llama", "int4"), ("llama", "none"), ("gemma3", "none")):
        assert type(load(tiny_models(family), tmp_path, quantization=quantization)._passes) is DecodeStep
    assert load(tiny_models("qwen3_5"), tmp_path)._passes is None


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_native_pass_gives_the_logits_of_the_layers_pytorch_operations_to_rounding(
    tiny_models, tmp_path: Path, family
):
    """Only RMSNorm's sum and the activation's exponential are computed otherwise
    (native_forward.c): the logits of a prompt (past Gemma 3's window) and of greedy steps
    after it stay within rounding of decode_step's, and greedy picks the same tokens."""
    from worker.backends.transformers.decode_step import DecodeStep

    model = load(tiny_models(family), tmp_path)
    operations = DecodeStep(model._model)
    ids = model.tokenize(TEXT, add_special_tokens=True)
    with torch.inference_mode():
        native_cache, torch_cache = model.new_cache(), model.new_cache()
        ours = model._passes.forward([ids], [native_cache], [len(ids)])
        theirs = operations.forward([ids], [torch_cache], [len(ids)])
        for _ in range(12):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
            assert ours[-1].argmax() == theirs[-1].argmax()
            token = int(ours[-1].argmax())
            ours, theirs = model._passes([token], [native_cache]), operations([token], [torch_cache])
    for mine, other in zip(native_cache.kv.layers, torch_cache.kv.layers):
        torch.testing.assert_close(mine.keys, other.keys, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_steps_drafts_and_a_prompt_chunk_in_one_pass_give_each_sequence_what_it_gets_alone(
    tiny_models, tmp_path: Path, family
):
    """Sequences of one new position go to one attention call, those of several each to their
    own: every sequence's logits and keys are still those of its positions fed alone, in
    one piece, also where they pass the tiny Gemma 3's window of 16 positions."""
    model = load(tiny_models(family), tmp_path)
    step = model._passes
    ids = model.tokenize(TEXT, add_special_tokens=True)
    # (positions cached before, new positions): a step, a draft of 3, a chunk of 9, a step on an
    # empty cache, a chunk across the window's edge, a step past it
    shapes = [(4, 1), (7, 3), (2, 9), (0, 1), (12, 8), (24, 1)]
    assert len(ids) > 25
    with torch.inference_mode():
        caches, alone = [], []
        for held, _ in shapes:
            cache = model.new_cache()
            if held:
                step.forward([ids[:held]], [cache])
            caches.append(cache)
            alone.append(cache.copy())
        new = [ids[held : held + n] for held, n in shapes]
        together = step.forward(new, caches, [n for _, n in shapes])
        expected = torch.cat([step.forward([tokens], [cache], [len(tokens)]) for tokens, cache in zip(new, alone)])
        whole = [model.new_cache() for _ in shapes]
        in_one_piece = [step.forward([ids[: held + n]], [cache], [n]) for (held, n), cache in zip(shapes, whole)]
    assert torch.equal(together, expected)
    assert torch.equal(together, torch.cat(in_one_piece))
    for cache, other, one_piece in zip(caches, alone, whole):
        assert cache.length == other.length == one_piece.length
        for a, b, c in zip(cache.kv.layers, other.kv.layers, one_piece.kv.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.keys, c.keys)
            assert torch.equal(a.values, b.values) and torch.equal(a.values, c.values)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_steps_read_the_keys_they_keep_transposed_and_give_one_pass_numbers_across_growth_and_cut_backs(
    tiny_models, tmp_path: Path, family
):
    """A sequence's steps keep its keys transposed (kv_buffers.TransposedKeys) and transpose
    only the new ones: greedy steps give the logits of one pass over the same tokens, past the
    window and across the buffers' growth (a prompt of n positions has room for n + 256), and
    again after the cache is cut back and goes another way. And a step reads what is kept:
    spoiled, the next step's logits change."""
    model = load(tiny_models(family), tmp_path)
    step = model._passes
    prompt = model.tokenize(TEXT, add_special_tokens=True)

    def steps(cache, token: int, count: int) -> tuple[list[int], list]:
        tokens, logits = [], []
        for _ in range(count):
            out = step.forward([[token]], [cache])
            tokens.append(token)
            logits.append(out[0])
            token = int(out[0].argmax())
        return tokens, logits

    def one_pass(tokens: list[int], count: int):
        return step.forward([tokens], [model.new_cache()], [count])

    with torch.inference_mode():
        cache = model.new_cache()
        step.forward([prompt[:-1]], [cache])
        fed, logits = steps(cache, prompt[-1], 300)
        assert torch.equal(torch.stack(logits), one_pass(prompt[:-1] + fed, 300))
        keep = len(prompt) + 40
        cache.crop(keep)
        other = (fed[41] + 1) % 500
        fed_again, logits = steps(cache, other, 30)
        assert torch.equal(torch.stack(logits), one_pass(prompt[:-1] + fed[:41] + fed_again, 30))
        untouched = cache.copy()  # without transposed keys: its step transposes them all
        for layer in cache.kv.layers:
            layer.transposed.tiles[:, : layer.transposed.valid // 2].fill_(1e3)
        spoiled, kept_well = step.forward([[5]], [cache]), step.forward([[5]], [untouched])
    assert not torch.equal(spoiled, kept_well)



@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_pass_finds_each_rows_highest_where_numpys_argmax_does(threads):
    """A greedy step takes the pass's own choice (found by the threads that computed each part
    of a row): the first of equal numbers, the first NaN where a row has one, infinities and
    signed zeros as numpy orders them, in rows shorter than a vector and parts of any size."""
    import numpy

    from worker.backends.transformers import native_pass

    generator = numpy.random.default_rng(7)
    specials = numpy.array([numpy.nan, numpy.inf, -numpy.inf, 0.0, -0.0, 1.0, 2.0], dtype=numpy.float32)
    for n in (1, 2, 15, 16, 17, 33, 64, 1000, 49152):
        rows = generator.integers(-3, 3, size=(6, n)).astype(numpy.float32)  # many ties
        rows[1] = generator.standard_normal(n)
        rows[2] = -numpy.inf
        for row in rows[3:]:
            places = generator.integers(0, n, size=min(n, 4))
            row[places] = generator.choice(specials, size=len(places))
        rows[5, n - 1] = numpy.nan  # a NaN in the last part only
        found = native_pass.highest(rows, threads)
        assert found == [int(numpy.argmax(row)) for row in rows], n


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_pass_gives_the_highest_of_each_logits_row_it_returns(tiny_models, tmp_path: Path, family):
    """Steps of several sequences, a draft's rows and a prompt chunk's: each choice the pass
    reports is where sampling.highest finds the highest of the logits it returned."""
    from worker.sampling import highest

    model = load(tiny_models(family), tmp_path)
    ids = model.tokenize(TEXT, add_special_tokens=True)
    caches = [model.new_cache() for _ in range(3)]
    with torch.inference_mode():
        for cache, cut in zip(caches, (5, 9, 14)):
            model._passes.forward([ids[:cut]], [cache])
        logits, best = model._passes.forward_highest([[ids[5]], ids[9:12], ids[14:20]], caches, [1, 3, 2])
    assert best == [highest(row.numpy()) for row in logits]

def test_a_cache_stepped_in_inference_mode_is_cut_back_outside_it(tiny_models, tmp_path: Path):
    """The worker steps in inference mode and cuts a drafting sequence's cache back outside it:
    the transposed keys' count is cut back there too (as a tensor made in inference mode it
    could not be: every drafted generation failed), and the next steps give one pass's logits."""
    model = load(tiny_models("llama"), tmp_path)
    step = model._passes
    prompt = model.tokenize(TEXT, add_special_tokens=True)
    cache = model.new_cache()
    with torch.inference_mode():
        step.forward([prompt], [cache])
        for token in (5, 6, 7, 8):
            step.forward([[token]], [cache])
    cache.crop(len(prompt) + 1)
    with torch.inference_mode():
        logits = step.forward([[9]], [cache])
        assert torch.equal(logits, step.forward([prompt + [5, 9]], [model.new_cache()]))


def test_a_step_whose_pass_fails_leaves_the_cache_as_it_was_and_later_steps_give_one_pass_numbers(
    tiny_models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A pass that runs out of memory part way has written keys (and their transposed tiles)
    past the cache's positions. It raises MemoryError, and what it wrote is not taken as the
    cache's: steps with other tokens after it give one pass's logits, at each position within
    a tile of the kernel's keys (16 in a row)."""
    from worker.backends.transformers import native_pass

    model = load(tiny_models("llama"), tmp_path)
    step = model._passes
    prompt = model.tokenize(TEXT, add_special_tokens=True)
    real = native_pass._forward

    def fails_after_writing(*args):
        real(*args)
        return 1

    with torch.inference_mode():
        cache, fed = model.new_cache(), list(prompt)
        step.forward([fed], [cache])
        for token in range(100, 116):
            monkeypatch.setattr(native_pass, "_forward", fails_after_writing)
            with pytest.raises(MemoryError):
                step.forward([[token + 50]], [cache])
            monkeypatch.setattr(native_pass, "_forward", real)
            assert cache.length == len(fed)
            logits = step.forward([[token]], [cache])
            fed.append(token)
            assert torch.equal(logits, step.forward([fed], [model.new_cache()]))


def test_the_cache_identity_names_the_native_pass_and_a_model_without_it_keeps_another(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch, caplog
):
    """The native pass gives a position other last bits than PyTorch's operations: a cache
    computed with one must not be read as the other's. Where native_forward.c cannot be built
    the model keeps PyTorch's operations, and the log says why."""
    from worker.backends.transformers import backend, exact_attention, hf_compat, native_forward, native_pass
    from worker.backends.transformers.decode_step import DecodeStep

    native = load(tiny_model_dir, tmp_path)
    config = native._model.config
    products = "lm_worker_int8_blocks"
    assert native.cache_identity().config_sha256 == hf_compat.config_digest(config, products, native_forward.FORWARD)

    def unbuildable(data_dir: Path) -> None:
        raise exact_attention.KernelUnavailable("cc could not build native_forward.c: (the compiler's words)")

    monkeypatch.setattr(native_pass, "_forward", None)
    monkeypatch.setattr(native_pass, "load_kernel", unbuildable)  # nor a load without torch (int8_model)
    with caplog.at_level(logging.WARNING):
        without = load(tiny_model_dir, tmp_path)
    assert type(without._passes) is DecodeStep
    assert without.cache_identity().config_sha256 == hf_compat.config_digest(
        config, products, device=backend._arithmetic_device("cpu", native=False)
    )
    assert "could not build native_forward.c" in caplog.text


async def test_a_cache_file_from_pytorchs_operations_is_refused_by_a_worker_on_the_native_pass(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch
):
    """A cache written before the native pass (or by a worker that could not build it) has
    other last bits: the worker refuses it by name, saying the arithmetic may be what differs."""
    from worker.backends.transformers import native_forward
    from worker.host import Host, WorkerError

    caches = str(tmp_path / "caches")
    with monkeypatch.context() as patched:
        patched.setattr(native_forward, "applies", lambda *args: False)
        before = await Host.start_in_process("--cache-dir", caches)
        try:
            await before.call("load", {"model": str(tiny_model_dir)})
            await before.call("prefill", {"prompt": TEXT, "cache": "before"})
        finally:
            await before.close()
    host = await Host.start_in_process("--cache-dir", caches)
    try:
        await host.call("load", {"model": str(tiny_model_dir)})
        with pytest.raises(WorkerError) as caught:
            await host.call("generate", {"prompt": TEXT + " again", "cache": "before", "max_tokens": 2})
        assert caught.value.kind == "cache_identity_mismatch"
        assert "config_sha256" in caught.value.message and "arithmetic" in caught.value.message
        plain = await host.call("generate", {"prompt": TEXT, "max_tokens": 2})  # and it keeps serving
        assert len(plain["tokens"]) == 2
    finally:
        await host.close()


async def test_a_worker_process_decodes_natively_and_gives_the_same_greedy_tokens_from_a_cache_file(
    tiny_model_dir: Path, tmp_path: Path
):
    """Through `python -m worker` over its pipes: the load builds the native pass (no fallback
    on stderr), and greedy output from a stored cache equals greedy output without one."""
    from tests.conftest import TORCH_ENV
    from worker.host import Host

    env = {**TORCH_ENV, "LM_WORKER_DATA_DIR": str(tmp_path / "data")}
    host = await Host.spawn("--cache-dir", str(tmp_path / "caches"), env=env)
    try:
        await host.call("load", {"model": str(tiny_model_dir)}, timeout=120)
        prompt = TEXT + " and then"
        plain = await host.call("generate", {"prompt": prompt, "max_tokens": 12})
        await host.call("prefill", {"prompt": TEXT, "cache": "story"})
        cached = await host.call("generate", {"prompt": prompt, "max_tokens": 12, "cache": "story"})
    finally:
        await host.close()
    assert cached["usage"]["cache_read_tokens"] > 0
    assert cached["tokens"] == plain["tokens"]
    assert "PyTorch operations" not in host.stderr.decode()
    assert any(path.name.startswith("native_forward-") for path in (tmp_path / "data" / "kernels").iterdir())
