"""A gguf file's own Q4_1 and Q8_0 blocks as the model's weights (gguf_weights): the kernel's
products are llama.cpp's arithmetic, each row gets the numbers it gets alone, the blocks land
on the right linears (q and k rows un-permuted), and the decode paths stay exact on them. The
slow tier holds greedy output on the shipped SmolLM2 to llama.cpp's own tokens."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest

from worker.host import Host
from tests.test_fast_decode import assert_a_batch_steps_as_each_alone
from tests.test_transformers_backend import generate, reap

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
LLAMA_CPP_TOKENS = Path(__file__).parent / "data" / "llama_cpp_greedy.json"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory):
    from worker.backends.transformers import exact_attention, gguf_weights

    try:
        gguf_weights.load_kernel(tmp_path_factory.mktemp("data"))
    except exact_attention.KernelUnavailable as exc:  # the worker loads int8 then (tested below)
        pytest.skip(f"no C compiler here: {exc}")
    return gguf_weights


def f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def llama_cpp_product(kind, blocks: np.ndarray, x: np.ndarray) -> np.ndarray:
    """llama.cpp's CPU arithmetic for one weight type, written out in numpy: each row of x
    quantized to 8-bit blocks (quantize_row_q8_1 / q8_0), then per output ggml_vec_dot's
    8 lanes of 4 weights, fused multiply-adds (float64 then rounded: one rounding), and its sum tree."""
    rows, inputs = x.shape[0], x.shape[1]
    groups = x.reshape(rows, -1, 32)
    largest = np.abs(groups).max(-1, keepdims=True)
    d = largest / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(largest != 0, np.float32(127) / largest, np.float32(0))
    q = np.rint(groups * inverse).astype(np.int32)
    xd, xs = f16(d[..., 0]), f16(d[..., 0] * q.sum(-1).astype(np.float32))
    per_block = blocks.reshape(blocks.shape[0], -1, 34 if kind == Q8_0 else 20)
    wd = per_block[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == Q8_0:
        wq = per_block[..., 2:].copy().view(np.int8).astype(np.int32)
    else:
        wm = per_block[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = per_block[..., 4:].astype(np.int32)
        wq = np.concatenate([packed & 15, packed >> 4], -1)
    out = np.zeros((rows, blocks.shape[0]), np.float32)
    for i in range(rows):
        for r in range(blocks.shape[0]):
            acc = np.zeros(8, np.float32)
            sum_m = np.float32(0)
            for b in range(inputs // 32):
                lanes = (wq[r, b] * q[i, b]).reshape(8, 4).sum(-1).astype(np.float32)
                scale = np.float32(wd[r, b] * xd[i, b])
                acc = (scale.astype(np.float64) * lanes + acc).astype(np.float32)
                if kind == Q4_1:
                    sum_m = np.float32(sum_m + np.float32(wm[r, b] * xs[i, b]))
            total = ((acc[4] + acc[0]) + (acc[6] + acc[2])) + ((acc[5] + acc[1]) + (acc[7] + acc[3]))
            out[i, r] = np.float32(total + sum_m)
    return out


@pytest.mark.parametrize("kind", [Q4_1, Q8_0])
def test_the_kernel_multiplies_gguf_blocks_as_llama_cpp_does(kernel, kind):
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((24, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(weights, kind)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    x[1, :32] = 0.0  # a block of zeros: scale 0, quantized to zeros
    linear = kernel.GgufLinear(int(kind), torch.from_numpy(blocks), 96)
    ours = linear(torch.from_numpy(x)).numpy()
    assert np.array_equal(ours, llama_cpp_product(kind, blocks, x))
    dense = x @ gguf.quants.dequantize(blocks, kind).T
    assert np.abs(ours - dense).max() < 0.05 * np.abs(dense).max()


@pytest.mark.parametrize("kind", [Q4_1, Q8_0])
def test_activation_rows_taken_together_multiply_as_llama_cpp_does(kernel, kind):
    """The kernel takes a weight row (or, with AVX-512, a pair of rows) against up to 4 (8)
    activation rows at once: 1 to 17 rows (each count of the rows left over, past one group and
    two) against 23 weight rows (a work item of 16, then 7: pairs and a row alone)."""
    rng = np.random.default_rng(2)
    blocks = gguf.quants.quantize(rng.standard_normal((23, 64)).astype(np.float32), kind)
    linear = kernel.GgufLinear(int(kind), torch.from_numpy(blocks), 64)
    for n in range(1, 18):
        x = rng.standard_normal((n, 64)).astype(np.float32)
        assert np.array_equal(linear(torch.from_numpy(x)).numpy(), llama_cpp_product(kind, blocks, x)), n


@pytest.mark.parametrize("flags", [["-mavx2", "-mfma", "-mf16c"], []], ids=["avx2", "plain-c"])
def test_the_kernel_built_for_narrower_processors_multiplies_as_llama_cpp_does(kernel, flags, tmp_path: Path):
    """The worker builds the kernel for the machine it runs on; these are the code paths a
    processor without AVX-512 (or without AVX2) takes, built here on purpose and held to the
    same numbers for every count of activation rows."""
    import ctypes

    from tests.conftest import kernel_variant

    matmul = kernel_variant(kernel.KERNEL_SOURCE, tmp_path / "gguf_kernel.so", flags, "lmw_gguf_matmul")
    matmul.argtypes, matmul.restype = kernel._ARGTYPES, ctypes.c_int
    rng = np.random.default_rng(3)
    for kind in (Q4_1, Q8_0):
        blocks = gguf.quants.quantize(rng.standard_normal((23, 64)).astype(np.float32), kind)
        for n in (1, 2, 5, 9):
            x = rng.standard_normal((n, 64)).astype(np.float32)
            out = np.empty((n, 23), np.float32)
            assert matmul(int(kind), blocks.ctypes.data, 23, 64, x.ctypes.data, n, 64, out.ctypes.data, 1) == 0
            assert np.array_equal(out, llama_cpp_product(kind, blocks, x)), (kind, n)


def test_each_row_gets_the_numbers_it_gets_alone(kernel):
    rng = np.random.default_rng(1)
    blocks = gguf.quants.quantize(rng.standard_normal((576, 576)).astype(np.float32), Q4_1)
    linear = kernel.GgufLinear(int(Q4_1), torch.from_numpy(blocks), 576)
    x = torch.randn(300, 576)
    together = linear(x)
    for start, count in ((0, 1), (17, 3), (100, 156), (299, 1)):
        assert torch.equal(linear(x[start : start + count]), together[start : start + count])


def llama_cpp_permuted(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of q and k rows (convert_hf_to_gguf's permute)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def write_gguf(model, path: Path, kinds: dict[str, object]) -> dict[str, np.ndarray]:
    """A gguf of the model's linears as llama.cpp's converter writes them (q and k permuted),
    each of the type ``kinds`` gives its kind of tensor (default Q4_1); returns the
    dequantized weights by module name, in transformers' row order (None: float32)."""
    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, "llama")
    expected = {}
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear:
            continue
        gguf_name = names.get_name(f"{name}.weight", try_suffixes=(".weight",))
        kind = kinds.get(gguf_name.split(".")[-2], Q4_1)
        weights = module.weight.detach().numpy()
        stored = weights
        if name.endswith("q_proj"):
            stored = llama_cpp_permuted(weights, config.num_attention_heads)
        elif name.endswith("k_proj"):
            stored = llama_cpp_permuted(weights, config.num_key_value_heads)
        if kind in (Q4_1, Q8_0):
            writer.add_tensor(gguf_name, gguf.quants.quantize(stored, kind), raw_dtype=kind)
            expected[name] = gguf.quants.dequantize(gguf.quants.quantize(weights, kind), kind)
        else:
            writer.add_tensor(gguf_name, stored.astype(np.float32))
            expected[name] = None
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.fixture
def tiny_gguf(tiny_model_dir: Path, tmp_path: Path, monkeypatch):
    """The tiny model, with a gguf of its weights (Q4_1, the output Q8_0, the down projections
    float32) that the worker takes for the model's own gguf file."""
    from transformers import AutoModelForCausalLM
    from worker.backends.transformers import backend

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    path = tmp_path / "tiny.gguf"
    expected = write_gguf(model, path, {"output": Q8_0, "ffn_down": None})
    monkeypatch.setattr(backend, "_gguf_source", lambda model, where: path if where == tiny_model_dir.resolve() else None)
    return expected


def load(model_dir: Path, data_dir: Path, **params):
    from protocol.methods import LoadParams
    from worker.backends.transformers.backend import TransformersBackend

    torch.set_num_threads(1)
    return TransformersBackend().load(LoadParams(model=str(model_dir), **params), data_dir=data_dir)


def test_the_blocks_land_on_their_linears_and_other_types_get_int8_rows(kernel, tiny_model_dir: Path, tmp_path: Path, tiny_gguf):
    from worker.backends.transformers.fast_weights import Int8Linear

    model = load(tiny_model_dir, tmp_path, quantization="gguf")
    assert model.info.quantization == "gguf"
    linears = {name: module for name, module in model._model.named_modules() if hasattr(module, "in_features")}
    assert set(tiny_gguf) == set(linears)
    for name, module in linears.items():
        if tiny_gguf[name] is None:
            assert type(module) is Int8Linear, name
        else:
            assert type(module) is kernel.GgufLinear and module.kind == (Q8_0 if name == "lm_head" else Q4_1), name
            assert np.array_equal(kernel.dequantized(module.kind, module.blocks).numpy(), tiny_gguf[name]), name


def test_auto_stays_int8_and_gguf_without_a_gguf_file_is_int8(kernel, tiny_model_dir: Path, tmp_path: Path, tiny_gguf, tiny_models):
    assert load(tiny_model_dir, tmp_path).info.quantization == "int8"
    assert load(tiny_models("gemma3"), tmp_path, quantization="gguf").info.quantization == "int8"


def test_a_cache_of_gguf_blocks_names_llama_cpp_s_arithmetic_and_is_not_int8_s(
    kernel, tiny_model_dir: Path, tmp_path: Path, tiny_gguf
):
    """On gguf blocks the native pass computes a Llama model as llama.cpp's CPU backend does
    (float16 keys and values, its attention's order, RoPE and SwiGLU): other numbers than the
    worker's own arithmetic, so another cache identity."""
    from worker.backends.transformers import fast_weights, hf_compat, native_forward

    gguf = load(tiny_model_dir, tmp_path, quantization="gguf")
    config = gguf._model.config
    products = fast_weights.KERNEL_PRODUCTS
    named = hf_compat.config_digest(config, products, native_forward.FORWARD_LLAMA_CPP)
    assert gguf.cache_identity().config_sha256 == named
    assert named != hf_compat.config_digest(config, products, native_forward.FORWARD)


def test_gguf_weights_keep_a_position_s_logits_however_its_prompt_was_cut_and_batched(
    kernel, tiny_model_dir: Path, tmp_path: Path, tiny_gguf
):
    model = load(tiny_model_dir, tmp_path, quantization="gguf")
    text = "the cat sat on the mat and the dog ran to the river, a red sun over the hills " * 6
    ids = model.tokenize(text, add_special_tokens=True)[:160]

    def logits(cuts: list[int], steps_from: int) -> torch.Tensor:
        cache, rows, start = model.new_cache(), [], 0
        with torch.inference_mode():
            for cut in [*cuts, steps_from]:  # prompt chunks as the worker feeds them: the native pass
                rows.append(torch.from_numpy(model.forward_chunk(cache, ids[start:cut])))
                start = cut
            rows += [model._passes([token], [cache]) for token in ids[steps_from:]]
        return torch.cat(rows[len(cuts):])

    whole = logits([], 100)
    assert torch.equal(logits([37, 64, 91], 100), whole)
    assert torch.equal(logits([50], 80)[20:], whole)
    assert_a_batch_steps_as_each_alone(model, [ids[:9], ids[20:51]])


# --- the shipped SmolLM2 (slow) -----------------------------------------------------------------


@contextlib.asynccontextmanager
async def default_on_gguf_blocks():
    host = await Host.spawn()  # `python -m worker`; the default data directory: the converted model is kept
    try:
        info = await host.call("load", {"model": "default", "quantization": "gguf"}, timeout=300)
        assert info["quantization"] == "gguf"
        yield host
    finally:
        await reap(host)


# llama.cpp's greedy answer on the shipped gguf to the chat question "What is the capital of
# France?" (the chat template's rendering, 37 tokens), its first 12 tokens: "L'Étoile, la
# Marseillaise,". Made once with node-llama-cpp 3.21.1 as tests/data/llama_cpp_greedy.json was
# (2 threads, temperature 0). Dense or int8 weights in the worker answer "Paris" (the two first
# tokens are 0.08 apart in the logits): the published 4-bit model does not.
LLAMA_CPP_CAPITAL_ANSWER = [60, 23, 39614, 1141, 552, 28, 2618, 2828, 313, 7712, 769, 28]


@pytest.mark.slow
async def test_the_default_model_on_its_gguf_blocks_answers_the_capital_question_as_llama_cpp_does():
    question = [{"role": "user", "content": "What is the capital of France?"}]
    async with default_on_gguf_blocks() as host:
        answer, _ = await generate(host, {"messages": question, "max_tokens": len(LLAMA_CPP_CAPITAL_ANSWER)}, timeout=120)
    assert answer["tokens"] == LLAMA_CPP_CAPITAL_ANSWER, answer["text"]


@pytest.mark.slow
async def test_default_model_greedy_output_on_its_gguf_blocks_is_llama_cpp_s_token_for_token():
    """The quality gate: on the shipped Q4_1 gguf, greedy output on the file's own blocks is
    llama.cpp's greedy tokens (tests/data/llama_cpp_greedy.json: made once with node-llama-cpp,
    its note says how) for 128 tokens on at least 3 of its 4 prompts (all 4 since the native
    pass computes the rest of the model in llama.cpp's arithmetic too: 1 of 4 before)."""
    recorded = json.loads(LLAMA_CPP_TOKENS.read_text())
    same = []
    async with default_on_gguf_blocks() as host:
        for prompt in recorded["prompts"]:
            expected = prompt["llama_cpp_tokens"]
            result, _ = await generate(host, {"tokens": prompt["tokens"], "max_tokens": len(expected)}, timeout=300)
            same.append(result["tokens"] == expected)
    assert sum(same) >= 3, same


@pytest.mark.slow
async def test_without_a_c_compiler_gguf_weights_are_int8_rows_and_stderr_says_why(tmp_path: Path):
    from worker.data_dir import default_data_dir
    from worker.backends.transformers.shipped import CONVERTED_NAME
    from tests.conftest import TORCH_ENV

    converted = default_data_dir() / "models" / CONVERTED_NAME
    if not (converted / "config.json").is_file():
        pytest.skip("needs the default model converted in the default data directory (load it once)")
    (tmp_path / "data" / "models").mkdir(parents=True)
    (tmp_path / "data" / "models" / CONVERTED_NAME).symlink_to(converted)
    env = {**TORCH_ENV, "CC": str(tmp_path / "no-such-compiler"), "LM_WORKER_DATA_DIR": str(tmp_path / "data")}
    host = await Host.spawn(env=env)
    try:
        loaded = await host.call("load", {"model": "default", "quantization": "gguf"}, timeout=300)
        assert loaded["quantization"] == "int8"
        result = await host.call("generate", {"prompt": "The capital of France is", "max_tokens": 4}, timeout=120)
        assert result["usage"]["completion_tokens"] == 4
    finally:
        await host.close(timeout=120)  # a crowded machine takes a while to let go of SmolLM2
    assert "int8 weights instead of the gguf's own" in host.stderr.decode() and "no C compiler" in host.stderr.decode()
