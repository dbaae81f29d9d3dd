"""The shell a mapped gguf's model is made of (shell_model.py) against transformers' own classes:
the same module names and shapes (gguf_model fills both by name), the attributes the native pass
reads, and rotary tables equal bit for bit, for each architecture and RoPE scaling it takes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from worker.backends.transformers import shell_model  # noqa: E402

COMMON = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=4096, tie_word_embeddings=False, num_hidden_layers=2,
)
LLAMA_3_1 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
CONFIGS = {
    "llama": ("llama", {}),
    "llama-3.1-scaling": ("llama", {"rope_parameters": LLAMA_3_1}),
    "llama-biased": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "mistral-like-llama": ("llama", {"head_dim": 32}),
    "qwen2": ("qwen2", {}),
    "qwen2-linear-scaling": ("qwen2", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "gemma3": ("gemma3_text", {"head_dim": 16, "sliding_window": 16, "num_hidden_layers": 4,
                               "layer_types": ["sliding_attention", "full_attention"] * 2}),
    "gemma3-scaled": ("gemma3_text", {"head_dim": 16, "sliding_window": 16, "query_pre_attn_scalar": 24,
                                      "rope_parameters": {
                                          "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
}


def config_of(name: str):
    model_type, extra = CONFIGS[name]
    return transformers.AutoConfig.for_model(model_type, **{**COMMON, **extra})


def theirs(config):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_shell_has_transformers_module_names_and_shapes(name: str):
    config = config_of(name)
    ours = shell_model.ShellModel(config)
    expected = {key: tuple(value.shape) for key, value in theirs(config).named_parameters()}
    assert {key: tuple(value.shape) for key, value in ours.named_parameters()} == expected
    assert all(parameter.is_meta for parameter in ours.parameters())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_shell_s_layers_carry_what_the_native_pass_reads_as_transformers_classes_do(name: str):
    config = config_of(name)
    ours, reference = shell_model.ShellModel(config), theirs(config)
    for mine, their in zip(ours.model.layers, reference.model.layers):
        assert mine.self_attn.scaling == their.self_attn.scaling
        assert getattr(mine.self_attn, "sliding_window", None) == getattr(their.self_attn, "sliding_window", None)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm"):
            if hasattr(their, norm):
                epsilon = getattr(getattr(their, norm), "variance_epsilon", None) or getattr(their, norm).eps
                assert getattr(mine, norm).variance_epsilon == getattr(mine, norm).eps == epsilon
    assert (ours.model.embed_tokens.embed_scale is not None) == hasattr(reference.model.embed_tokens, "embed_scale")


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_the_shell_s_embedding_looks_rows_up_as_transformers_does_bit_for_bit(name: str):
    """Gemma's rows scaled by √hidden in float32, as its scaled embedding computes them."""
    config = config_of(name)
    reference = transformers.AutoModelForCausalLM.from_config(config).model.embed_tokens
    ours = shell_model.ShellModel(config).model.embed_tokens
    ours.weight = torch.nn.Parameter(reference.weight.detach().clone(), requires_grad=False)
    ids = torch.tensor([[0, 5, 17, 95]])
    assert torch.equal(ours(ids), reference(ids))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_shell_s_rotary_tables_equal_transformers_bit_for_bit(name: str):
    config = config_of(name)
    reference = type(theirs(config).model.rotary_emb)(config=config)
    ours = shell_model.ShellModel(config).model.rotary_emb
    hidden, positions = torch.zeros(1, 1, dtype=torch.float32), torch.arange(0, 4096)[None]
    for layer_type in sorted(set(getattr(config, "layer_types", None) or [])) if config.model_type == "gemma3_text" else [None]:
        extra = () if layer_type is None else (layer_type,)
        for mine, their in zip(ours(hidden, positions, *extra), reference(hidden, positions, *extra)):
            assert torch.equal(mine, their), (name, layer_type)


def test_the_shell_s_llama_configuration_has_transformers_fields_and_defaults():
    import dataclasses

    def fields(cls):
        return {f.name: (f.default, f.default_factory) for f in dataclasses.fields(cls)}

    assert fields(shell_model.LlamaConfig) == fields(transformers.LlamaConfig)


@pytest.mark.parametrize("name", [name for name, (model_type, _) in sorted(CONFIGS.items()) if model_type == "llama"])
def test_the_shell_s_llama_configuration_equals_transformers_as_a_dictionary(name: str):
    _, extra = CONFIGS[name]
    values = {**COMMON, **extra, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
    assert shell_model.LlamaConfig(**values).to_dict() == transformers.LlamaConfig(**values).to_dict()
    theirs_again = shell_model.transformers_configuration(shell_model.LlamaConfig(**values))
    assert type(theirs_again) is transformers.LlamaConfig
    assert theirs_again.to_dict() == transformers.LlamaConfig(**values).to_dict()


def test_the_shell_s_llama_configuration_refuses_heads_that_do_not_divide_the_hidden_size():
    from huggingface_hub.errors import StrictDataclassError

    with pytest.raises(StrictDataclassError, match="not a multiple"):
        shell_model.LlamaConfig(**{**COMMON, "hidden_size": 66})


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_5"])
def test_a_model_directory_s_configuration_reads_as_transformers_reads_it(tiny_models, family: str):
    directory = tiny_models(family)
    ours = shell_model.pretrained_configuration(directory)
    theirs_ = transformers.AutoConfig.from_pretrained(directory)
    assert ours.model_type == theirs_.model_type
    assert ours.to_dict() == theirs_.to_dict()
