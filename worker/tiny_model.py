"""Build the tiny offline test model: a byte-level BPE tokenizer and a 2-layer Llama.

    python -m worker.tiny_model DIR

Deterministic (same seed, same files for a given transformers version) and
quick (well under a second once torch is imported). The weights are random with
a large init range, so greedy output varies with the prompt; the tokenizer
merges multi-byte characters partly, so streaming meets split UTF-8. The
tokenizer adds a BOS token, which tests that BOS is added exactly once.
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


def build(directory: str | os.PathLike[str], *, seed: int = 0, vocab_size: int = 512) -> Path:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # tokenizer training stays deterministic
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT_LENGTH,
        initializer_range=0.3,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.tiny_model", description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(build(args.directory, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
