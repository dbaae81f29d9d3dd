"""Build the tiny offline test models: a byte-level BPE tokenizer and a small random model.

    python -m worker.backends.transformers.tiny_model DIR [--family llama|gemma3|qwen3_5]

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
SLIDING_WINDOW = 16


def build(directory: str | os.PathLike[str], *, seed: int = 0, vocab_size: int = 512, family: str = "llama") -> Path:
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
        chat_template=CHATML,
        model_max_length=CONTEXT_LENGTH,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family, fast)).eval()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


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
    raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.backends.transformers.tiny_model", description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    args = parser.parse_args(argv)
    print(build(args.directory, seed=args.seed, family=args.family))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
