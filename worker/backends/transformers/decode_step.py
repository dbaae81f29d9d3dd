"""A decode step without the framework around it, for models of the Llama architecture.

transformers' forward is written for every case (prompts, masks, padding, hooks, many
cache classes); one decode step of a small model on a CPU spends more time in that
generality than in arithmetic (bench/README.md has the profile). This step computes
the same layers for one new token per sequence (and, for the scheduler, a chunk of a
joining prompt in the same pass), with the model's own weights and rotary embedding,
and keeps the keys and values in the same cache layers that transformers' forward fills
(cache_layers.FullAttentionLayer): a prompt prefilled by transformers is continued here,
and a cache written here is stored, restored and extended like any other.

What differs from transformers' decode step, and why:
- a layer's q, k and v projections (and gate and up) are one matrix product when the
  weights are quantized (fast_weights.fused: equal bit for bit to three);
- a dense (float) linear computes ``weight @ x.T`` rather than ``x @ weight.T``: the same
  numbers for one sequence (bit for bit), and for several sequences the product PyTorch's
  CPU BLAS runs two to five times faster (measured for SmolLM2's shapes: with the
  other form, a step over 2 sequences cost 1.6 times one over 1);
- attention is hf_compat.one_query_attention, which the worker also has transformers
  use for one query position (the ``lm_worker`` attention implementations), as the
  model was loaded with it (exact_attention's kernel for quantized weights);
- RMSNorm and RoPE are transformers' operations, in its order.

So a step equals transformers' forward on the same model bit for bit, and greedy
output equals transformers' own generate() (the tests check it on the tiny model and
SmolLM2). Models this step is not written for decode through transformers' forward
(``supports``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch

from worker.backends.transformers import hf_compat
from worker.backends.transformers.fast_weights import fused

if TYPE_CHECKING:
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from worker.backends.transformers.cache_layers import FullAttentionLayer
    from worker.backends.transformers.torch_adapter import TorchCache

_ARCHITECTURES = frozenset({"llama"})
# Up to this many sequences, weight @ x.T is the faster product (bench/README.md).
_TRANSPOSED_ROWS = 4
Projection = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


def supports(model: PreTrainedModel) -> bool:
    config = model.config
    return (
        config.model_type in _ARCHITECTURES
        and getattr(config, "hidden_act", None) == "silu"
        and not getattr(config, "attention_bias", False)
        and not getattr(config, "mlp_bias", False)
        and getattr(config, "pretraining_tp", 1) == 1
    )


def _product(linear: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A linear of the rows of ``x`` (sequences, features)."""
    if type(linear) is torch.nn.Linear and linear.bias is None:
        weight = linear.weight
        return lambda x: (weight @ x.T).T if x.shape[0] <= _TRANSPOSED_ROWS else linear(x)
    return linear


def _projection(linears: list[torch.nn.Module]) -> Projection:
    """The outputs of linears that read the same input: one product where they fuse."""
    one = fused(linears)
    if one is None:
        products = [_product(linear) for linear in linears]
        return lambda x: tuple(product(x) for product in products)
    sizes = [linear.out_features for linear in linears]
    return lambda x: one(x).split(sizes, dim=-1)


def _rms_norm(weight: torch.Tensor, epsilon: float, x: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm, operation for operation."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + epsilon)
    return weight * x32.to(x.dtype)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: rotate_half's minus, moved from x onto sin."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb, for one of q and k: x·cos + rotate_half(x)·sin, with
    rotate_half(x) = (-x2, x1) taken as x rolled by half times _signed_sin (a sign moves
    exactly, so the numbers are the same), in 4 operations instead of 7: ~9 µs less a call,
    two calls a layer."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class _Layer:
    def __init__(self, layer: LlamaDecoderLayer) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        self.qkv = _projection([attention.q_proj, attention.k_proj, attention.v_proj])
        self.out = _product(attention.o_proj)
        self.gate_up = _projection([mlp.gate_proj, mlp.up_proj])
        self.down = _product(mlp.down_proj)
        self.norm_in = (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        self.norm_mid = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)


class DecodeStep:
    """One token for each of several sequences, each with its own cache (TorchCache)."""

    def __init__(self, model: PreTrainedModel) -> None:
        # ``supports`` admits only models of the Llama architecture: their modules are Llama's
        # (a linear may be a quantized one of fast_weights, which computes the same product).
        llama = cast("LlamaForCausalLM", model)
        inner = llama.model
        config = cast("LlamaConfig", llama.config)
        self._embed = inner.embed_tokens
        self._rotary = inner.rotary_emb
        self._norm = (inner.norm.weight, inner.norm.variance_epsilon)
        self._head = _product(llama.lm_head)
        self._layers = [_Layer(cast("LlamaDecoderLayer", layer)) for layer in inner.layers]
        self._heads = config.num_attention_heads
        self._kv_heads = config.num_key_value_heads or self._heads  # None only before the config resolves it
        self._head_dim = getattr(config, "head_dim", None) or config.hidden_size // self._heads
        self._scaling = self._head_dim**-0.5
        self._attention = hf_compat.attention_implementation(config)

    def __call__(self, tokens: Sequence[int], caches: Sequence[TorchCache]) -> torch.Tensor:
        """Logits of the next position of each sequence, shape (len(tokens), vocab); each
        cache then covers its token too."""
        return self.forward([[token] for token in tokens], caches)

    def forward(
        self, sequences: Sequence[Sequence[int]], caches: Sequence[TorchCache], last: Sequence[int] | None = None
    ) -> torch.Tensor:
        """As a step, but each sequence may bring several new tokens (a chunk of a prompt fed
        beside the decoding requests, or a decoding's drafted tokens to check: one pass over
        the weights for all of them). Logits of the last ``last[i]`` (default 1) new
        positions of each sequence, in order, shape (sum(last), vocab)."""
        heads, kv_heads, dim = self._heads, self._kv_heads, self._head_dim
        groups = heads // kv_heads
        lengths = [len(sequence) for sequence in sequences]
        total = sum(lengths)
        device = self._embed.weight.device
        ids = torch.tensor([token for sequence in sequences for token in sequence], dtype=torch.long, device=device)
        positions = torch.tensor(
            [[cache.length + i] for cache, n in zip(caches, lengths) for i in range(n)], dtype=torch.long, device=device
        )
        hidden = self._embed(ids)  # (total, hidden)
        cos, sin = self._rotary(hidden, position_ids=positions)  # (total, 1, head_dim): one row per head
        sin = _signed_sin(sin)
        for index, layer in enumerate(self._layers):
            q, k, v = layer.qkv(_rms_norm(*layer.norm_in, hidden))
            q = _rotate(q.view(total, heads, dim), cos, sin)
            k = _rotate(k.view(total, kv_heads, dim), cos, sin)
            v = v.view(total, kv_heads, dim)
            outputs, first = [], 0
            for cache, n in zip(caches, lengths):
                rows = slice(first, first + n)
                first += n
                # (1, kv_heads, n, dim), as the layers hold them: a Llama model's cache layers are
                # all full attention, lm-worker's own (cache_layers.new_cache)
                cached = cast("FullAttentionLayer", cache.kv.layers[index])
                keys, values = cached.update_and_fetch(k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None])
                if self._attention == hf_compat.WIDE_ATTENTION:
                    keys, values = cached.wide_state(torch.float64)
                if n == 1:
                    query = q[rows].view(kv_heads, groups, dim)
                    attended = hf_compat.one_query_attention(query, keys[0], values[0], self._scaling, self._attention)
                else:
                    attended = hf_compat.chunk_attention(
                        q[rows].transpose(0, 1)[None], keys, values, self._scaling, self._attention
                    )
                outputs.append(attended.reshape(n, heads * dim))
            attended = (outputs[0] if len(outputs) == 1 else torch.cat(outputs)).to(hidden.dtype)
            hidden = hidden + layer.out(attended)
            gate, up = layer.gate_up(_rms_norm(*layer.norm_mid, hidden))
            hidden = hidden + layer.down(torch.nn.functional.silu(gate) * up)
        for cache, n in zip(caches, lengths):
            cache.length += n
        wanted = [1] * len(lengths) if last is None else last
        if sum(wanted) < total:
            ends = torch.tensor(lengths).cumsum(0).tolist()
            rows = [end - k + j for end, k in zip(ends, wanted) for j in range(k)]
            hidden = hidden[torch.tensor(rows, device=device)]
        return self._head(_rms_norm(*self._norm, hidden))
