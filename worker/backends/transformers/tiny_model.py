"""Build the tiny offline test models: a byte-level BPE tokenizer and a small random model.

    python -m worker.backends.transformers.tiny_model DIR [--family llama|gemma3|qwen3_5] [--thinking] [--gguf FILE]

One model per family of cache layers the worker supports:

- ``llama``: full attention in every layer (2 layers);
- ``gemma3``: sliding-window layers (a window of 16 positions, shorter than the
  test prompts) between full-attention ones, as Gemma 2, 3 and 4 have;
- ``qwen3_5``: a linear-attention layer (conv and recurrent state) before a
  full-attention one, as in Qwen3.5 and Qwen3-Next.

Deterministic (same seed, same files for a given transformers version) and
quick (well under a second once torch is imported). Each family's init range is
one whose greedy output varies with the prompt (a too large one makes some
families repeat one token forever, so that no equality check on them could
fail); the tokenizer merges multi-byte characters partly, so streaming meets
split UTF-8. The tokenizer adds a BOS token, which tests that BOS is added
exactly once.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

BOS, EOS, PAD = "<s>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = [PAD, BOS, "<|im_start|>", EOS]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A reasoning model's template (as Qwen3's thinking ones and DeepSeek-R1's): the generation
# prompt opens the thinking, and earlier answers are rendered without theirs.
THINKING_CHATML = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip() %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)
CONTEXT_LENGTH = 2048
_WORDS = "the cat dog sat on mat a red blue sun moon river stone runs sings and but is was hello world one two".split()
_WORDS += ["café", "naïve", "über", "日本", "こんにちは", "🙂", "🎉", "Ωmega"]
_SYLLABLES = "ka lo mi ne ru ta shi po ve zu or an el is um br st qu".split()


def corpus(seed: int, sentences: int = 2000) -> list[str]:
    rng = random.Random(seed)
    words = _WORDS + ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(400)]
    return [
        " ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) + rng.choice([".", "!", "?", ","])
        for _ in range(sentences)
    ]


FAMILIES = ("llama", "gemma3", "qwen3_5")
# Further architectures, for the gguf files written of them (each one family of cache layers above).
GGUF_FAMILIES = ("qwen2", "qwen3", "gemma3-gguf", "phi3")
SLIDING_WINDOW = 16


def build(
    directory: str | os.PathLike[str], *, seed: int = 0, vocab_size: int = 512, family: str = "llama",
    chat_template: str = CHATML,
) -> Path:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizer training stays deterministic
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(seed), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=PAD,
        chat_template=chat_template,
        model_max_length=CONTEXT_LENGTH,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family, fast)).eval()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


# transformers' model_type: gguf's general.architecture, for the architectures a gguf is written of
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3", "phi3": "phi3"}


def write_gguf(model_dir: str | os.PathLike[str], out: str | os.PathLike[str], matrices: int = 8) -> Path:
    """The tiny model of ``model_dir`` (of an architecture in GGUF_ARCHITECTURES) as a .gguf file
    laid out as llama.cpp's converter writes one: its tokenizer as a GPT-2 BPE, a Llama model's
    query and key rows permuted, Gemma's norm scales as one plus their weight, its matrices (the
    linears and the embedding) in blocks of ggml type ``matrices`` (Q8_0 unless told; 0 keeps
    them float32) and its vectors float32, as a downloaded gguf holds them."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    source = Path(model_dir)
    config = AutoConfig.from_pretrained(source)
    arch = GGUF_ARCHITECTURES[config.model_type]
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.rope_parameters  # Gemma 3's: one for each kind of layer, the full layers' in the file
    writer.add_rope_freq_base((rope if "rope_theta" in rope else rope["full_attention"])["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    described = json.loads((source / "tokenizer.json").read_text())
    vocab = sorted(described["model"]["vocab"].items(), key=lambda item: item[1])
    special = set(SPECIAL_TOKENS)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL for token, _ in vocab])
    writer.add_token_merges([" ".join(merge) if isinstance(merge, list) else merge for merge in described["model"]["merges"]])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHATML)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for name, tensor in load_file(source / "model.safetensors").items():
        base, suffix = name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            rows = heads if "attn_q" in gguf_name else config.num_key_value_heads
            tensor = tensor.reshape(rows, 2, tensor.shape[0] // rows // 2, *tensor.shape[1:]).swapaxes(1, 2).reshape(tensor.shape)
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            tensor = tensor + 1
        tensor = np.ascontiguousarray(tensor, dtype=np.float32)
        if tensor.ndim == 2 and matrices:
            kind = gguf.GGMLQuantizationType(matrices)
            writer.add_tensor(gguf_name, gguf.quants.quantize(tensor, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


def _config(family: str, tokenizer):
    from transformers import AutoConfig

    common = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=CONTEXT_LENGTH, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    if family == "llama":
        return AutoConfig.for_model("llama", num_hidden_layers=2, initializer_range=0.3, **common)
    if family == "gemma3":
        return AutoConfig.for_model(
            "gemma3_text", num_hidden_layers=4, head_dim=16, sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            initializer_range=0.1, **common,
        )
    if family == "qwen3_5":
        return AutoConfig.for_model(
            "qwen3_5_text", num_hidden_layers=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, initializer_range=0.1, **common,
        )
    if family in ("qwen2", "qwen3"):  # the architectures a gguf is also written of (write_gguf)
        return AutoConfig.for_model(family, num_hidden_layers=2, initializer_range=0.3, **common)
    if family == "gemma3-gguf":  # Gemma 3 as a gguf describes it: llama.cpp's fixed pattern of layer kinds
        return AutoConfig.for_model("gemma3_text", num_hidden_layers=2, head_dim=16, sliding_window=SLIDING_WINDOW,
                                    initializer_range=0.1, **common)
    if family == "phi3":
        return AutoConfig.for_model("phi3", num_hidden_layers=2, initializer_range=0.3, **common)
    raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES + GGUF_FAMILIES)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.backends.transformers.tiny_model", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=FAMILIES + GGUF_FAMILIES, default="llama")
    parser.add_argument("--thinking", action="store_true", help="a reasoning model's chat template (<think>)")
    parser.add_argument("--gguf", metavar="FILE", help="also write the model as a .gguf file (llama, qwen2, qwen3, gemma3-gguf, phi3)")
    args = parser.parse_args(argv)
    template = THINKING_CHATML if args.thinking else CHATML
    print(build(args.directory, seed=args.seed, family=args.family, chat_template=template))
    if args.gguf:
        print(write_gguf(args.directory, args.gguf))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
