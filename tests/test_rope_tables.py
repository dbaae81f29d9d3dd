"""The native pass's RoPE tables (rope_tables): transformers' rotations to float32's rounding,
computed in one fixed way (the same bits on every machine: pinned here), for the RoPE types
the torch-free pass takes; the native pass over a torch model uses them too."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from worker.backends.transformers import rope_tables

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
PINNED = "8ec9d40501604f585bf3ab25016340ec26e1eab6a80b01e904a649c935cdd404"  # the tables below, computed once


def test_cos_and_sin_are_the_correctly_rounded_float32s_of_each_angle():
    frequencies = rope_tables.inverse_frequencies({"rope_type": "default", "rope_theta": 10000.0}, 64)
    assert frequencies is not None
    angles = np.arange(0, 70000, 7, dtype=np.float64)[:, None] * frequencies[None, :]
    cos, sin = rope_tables.cos_sin(angles)
    assert np.abs(cos - np.cos(angles)).max() < 4e-16 and np.abs(sin - np.sin(angles)).max() < 4e-16
    assert np.array_equal(cos.astype(np.float32), np.cos(angles).astype(np.float32))
    assert np.array_equal(sin.astype(np.float32), np.sin(angles).astype(np.float32))


def test_the_tables_bits_are_pinned():
    """The same bits on every machine and numpy: a change of the arithmetic shows here (and
    then native_forward.FORWARD names a new one)."""
    frequencies = {kind: rope_tables.inverse_frequencies(parameters, 64) for kind, parameters in (
        ("a", {"rope_type": "default", "rope_theta": 10000.0}), ("b", LLAMA3),
        ("c", {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}),
    )}
    tables = rope_tables.Tables({kind: value for kind, value in frequencies.items() if value is not None}, ["a"])
    cos, sin = tables(np.arange(0, 40000, 13))
    digest = hashlib.sha256(cos.tobytes() + sin.tobytes()).hexdigest()
    assert digest == PINNED, digest



def test_frequencies_are_transformers_own_to_float32_rounding():
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for parameters in ({"rope_type": "default", "rope_theta": 10000.0}, LLAMA3,
                       {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}):
        config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=parameters)
        kind = parameters["rope_type"]
        if kind == "default":
            dim = 64
            theirs = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        else:
            theirs, _ = ROPE_INIT_FUNCTIONS[kind](config)
        ours = rope_tables.inverse_frequencies(config.rope_parameters, 64)
        assert ours is not None
        np.testing.assert_allclose(ours, theirs.double().numpy(), rtol=4e-7)  # float32: a few of its steps


def test_a_rope_type_that_changes_with_the_length_is_not_taken():
    for kind in ("dynamic", "yarn", "longrope"):
        assert rope_tables.inverse_frequencies({"rope_type": kind, "rope_theta": 10000.0, "factor": 2.0}, 64) is None
    assert rope_tables.inverse_frequencies({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, 64) is None


def test_a_row_depends_on_its_position_alone_however_the_table_grew():
    frequencies = rope_tables.inverse_frequencies({"rope_type": "default", "rope_theta": 10000.0}, 16)
    assert frequencies is not None
    grown, once = rope_tables.Tables({None: frequencies}, [None]), rope_tables.Tables({None: frequencies}, [None])
    for end in (3, 300, 700, 2000):
        grown(np.arange(end))
    positions = np.array([1999, 0, 511, 256, 1024])
    for ours, theirs in zip(grown(positions), once(positions)):
        assert ours.flags.c_contiguous and np.array_equal(ours, theirs)
    cos, sin = once(np.array([5]))
    assert cos[0, 0, 3] == cos[0, 0, 11] == np.float32(math.cos(5 * frequencies[3]))
    assert -sin[0, 0, 3] == sin[0, 0, 11] == np.float32(math.sin(5 * frequencies[3]))



@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_model_whose_frequencies_are_not_its_configuration_s_keeps_them_in_the_native_pass(
    tiny_models, tmp_path, family
):
    """A gguf's rope_freqs divides the model's frequencies after its configuration made them:
    the native pass then rotates by the model's own (PyTorch's tables), and its logits stay
    those of the layers' PyTorch operations to rounding."""
    torch = pytest.importorskip("torch")
    from tests.test_fast_decode import TEXT, load
    from worker.backends.transformers import native_forward
    from worker.backends.transformers.decode_step import DecodeStep
    from worker.c_build import KernelUnavailable

    try:
        native_forward.load_kernel(tmp_path / "data")
    except KernelUnavailable as exc:
        pytest.skip(f"the native pass cannot be built here: {exc}")
    loaded = load(tiny_models(family), tmp_path / "data")
    model = loaded._model
    for name, frequencies in model.model.rotary_emb.named_buffers():
        if name.endswith("inv_freq") and "original" not in name:
            frequencies.div_(torch.linspace(1.0, 8.0, len(frequencies)))
    ids = loaded.tokenize(TEXT, add_special_tokens=True)
    with torch.inference_mode():
        ours = native_forward.NativeForward(model, "int8").forward([ids], [loaded.new_cache()], [len(ids)])
        theirs = DecodeStep(model).forward([ids], [loaded.new_cache()], [len(ids)])
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
