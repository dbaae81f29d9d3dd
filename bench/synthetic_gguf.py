"""Write a gguf with the shapes of a Qwen2.5 model (7B, 3B or 1.5B) in Q4_K_M's block types, its
blocks random.

    .venv/bin/python bench/synthetic_gguf.py /tmp/qwen2-7b-shaped.gguf            # 28 layers, hidden 3584
    .venv/bin/python bench/synthetic_gguf.py /tmp/qwen2-1.5b-shaped.gguf --shape 1.5b
    .venv/bin/python bench/synthetic_gguf.py OUT --layers 4                        # a quicker, smaller one

The output is noise, but everything the worker and llama.cpp do with the file is real: the
mapping, the memory it takes, the bytes a token reads and the time the products take. The
shapes are Qwen2.5-7B's (28 layers, hidden 3584, 28 query and 4 key/value heads of 128,
feed-forward 18,944, q/k/v biases), 3B's (36 layers, hidden 2048, 16 and 2 heads, feed-forward
11,008, the output tied to the embedding) or 1.5B's (28 layers, hidden 1536, 12 and 2 heads,
feed-forward 8,960, tied); the tokenizer and chat template are copied from the shipped
Qwen2.5-Coder-0.5B gguf (its 151,936 tokens, so the embedding and output have that many rows).
The block types are those llama.cpp's Q4_K_M gives such a model: Q4_K for most matrices, Q6_K for
the output (the embedding, where the output is tied to it), for v in every other layer and for
the feed-forward down projection in every other layer; norms and biases float32. Each block's scales are drawn so that weights are of the size a
trained model's are (about 0.02), the rest of its bytes uniformly at random.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

import numpy as np


class Shape(NamedTuple):
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool


SHAPES = {
    "7b": Shape(layers=28, hidden=3584, heads=28, kv_heads=4, ffn=18944, tied=False),
    "3b": Shape(layers=36, hidden=2048, heads=16, kv_heads=2, ffn=11008, tied=True),
    "1.5b": Shape(layers=28, hidden=1536, heads=12, kv_heads=2, ffn=8960, tied=True),
}
HEAD_DIM, CONTEXT = 128, 32768
SOURCE = Path.home() / ".local" / "share" / "lm-worker" / "models" / "qwen2.5-coder-0.5b-instruct.gguf"


def blocks(kind, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """``rows`` rows of ``columns`` weights of ``kind`` (Q4_K or Q6_K), as (rows, bytes) uint8."""
    import gguf

    weights, size = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows, columns // weights, size), dtype=np.uint8)
    if kind == gguf.GGMLQuantizationType.Q4_K:  # d, dmin (float16) lead the block
        data[..., 0:2] = np.frombuffer(np.float16(0.0025).tobytes(), np.uint8)
        data[..., 2:4] = np.frombuffer(np.float16(0.02).tobytes(), np.uint8)
    else:  # Q6_K: 16 signed 8-bit scales at 192, d (float16) last
        data[..., 192:208] = rng.integers(-8, 9, (rows, columns // weights, 16), dtype=np.int8).view(np.uint8)
        data[..., 208:210] = np.frombuffer(np.float16(0.0008).tobytes(), np.uint8)
    return data.reshape(rows, -1)


def write(out: Path, shape: Shape, layers: int, seed: int = 0) -> Path:
    import gguf

    hidden, heads, kv_heads, ffn = shape.hidden, shape.heads, shape.kv_heads, shape.ffn
    Q4_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    rng = np.random.default_rng(seed)
    source = gguf.GGUFReader(SOURCE)
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(str(out), "qwen2")
    size = next(name for name, known in SHAPES.items() if known == shape).upper()
    writer.add_name(f"synthetic Qwen2 {size}-shaped (random Q4_K_M blocks)")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            value = field.contents()
            kind = field.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                writer.add_array(key, value)
            else:
                writer.add_key_value(key, value, kind)
    ones = np.ones(hidden, dtype=np.float32)
    embedding = Q6_K if shape.tied else Q4_K
    writer.add_tensor("token_embd.weight", blocks(embedding, vocab, hidden, rng), raw_dtype=embedding)
    writer.add_tensor("output_norm.weight", ones)
    if not shape.tied:
        writer.add_tensor("output.weight", blocks(Q6_K, vocab, hidden, rng), raw_dtype=Q6_K)
    for layer in range(layers):
        name = f"blk.{layer}"
        heavy = Q6_K if layer % 2 == 0 else Q4_K  # llama.cpp's Q4_K_M: every other layer's v and down in Q6_K
        writer.add_tensor(f"{name}.attn_norm.weight", ones)
        writer.add_tensor(f"{name}.ffn_norm.weight", ones)
        for part, outputs, kind in (("q", heads * HEAD_DIM, Q4_K), ("k", kv_heads * HEAD_DIM, Q4_K),
                                    ("v", kv_heads * HEAD_DIM, heavy)):
            writer.add_tensor(f"{name}.attn_{part}.weight", blocks(kind, outputs, hidden, rng), raw_dtype=kind)
            writer.add_tensor(f"{name}.attn_{part}.bias", rng.normal(0, 0.02, outputs).astype(np.float32))
        writer.add_tensor(f"{name}.attn_output.weight", blocks(Q4_K, hidden, heads * HEAD_DIM, rng), raw_dtype=Q4_K)
        writer.add_tensor(f"{name}.ffn_gate.weight", blocks(Q4_K, ffn, hidden, rng), raw_dtype=Q4_K)
        writer.add_tensor(f"{name}.ffn_up.weight", blocks(Q4_K, ffn, hidden, rng), raw_dtype=Q4_K)
        writer.add_tensor(f"{name}.ffn_down.weight", blocks(heavy, hidden, ffn, rng), raw_dtype=heavy)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's, for a quicker file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    layers = args.layers or shape.layers
    path = write(args.out, shape, layers, args.seed)
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB, {layers} layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
