"""A decode step without the framework around it, for models of the Llama and Gemma 3 architectures.

transformers' forward is written for every case (prompts, masks, padding, hooks, many
cache classes); one decode step of a small model on a CPU spends more time in that
generality than in arithmetic (bench/README.md has the profile). This step computes
the same layers for one new token per sequence (and, for the scheduler, a chunk of a
joining prompt in the same pass), with the model's own weights and rotary embedding,
and keeps the keys and values in the same cache layers that transformers' forward fills
(cache_layers.GrowingKeysAndValues): a prompt prefilled by transformers is continued here,
and a cache written here is stored, restored and extended like any other.

What differs from transformers' decode step, and why:
- a layer's q, k and v projections (and gate and up) are one matrix product when the
  weights are quantized (fast_weights.fused: equal bit for bit to three);
- a dense (float) linear of a few rows computes ``weight @ x.T`` rather than ``x @ weight.T``:
  the same numbers for one sequence (bit for bit), and for several sequences the form
  PyTorch's CPU BLAS runs faster, so that a step over several sequences costs little more
  than one over one (bench/README.md, "Figures behind constants");
- attention is hf_compat.one_query_attention, which the worker also has transformers
  use for one query position (the ``lm_worker`` attention implementations), as the
  model was loaded with it (exact_attention's kernel for quantized weights); a
  sliding-window layer attends the positions its cache layer hands transformers;
- RMSNorm (each family's form), RoPE (Gemma 3: one per layer type) and the activation are
  transformers' operations, in its order.

Gemma 3 differs from Llama in what this step reads from the model: norms that scale by one
plus their weight, in float32 before the cast back; norms of each query and key head; the
output of attention and of the MLP normalized before it joins the residual stream;
sliding-window layers with their own RoPE; the attention scale its config gives. The
embedding's scale is its module's.

So a step equals transformers' forward on the same model bit for bit, and greedy
output equals transformers' own generate() (the tests check it on the tiny models and
SmolLM2). Models this step is not written for decode through transformers' forward
(``supports``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch

from worker.backends.transformers import exact_attention, hf_compat
from worker.backends.transformers.fast_weights import fused

if TYPE_CHECKING:
    from transformers import Gemma3ForCausalLM, LlamaForCausalLM, PretrainedConfig, PreTrainedModel
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer, Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    from worker.backends.transformers.cache_layers import GrowingKeysAndValues, SlidingWindowLayer
    from worker.backends.transformers.torch_adapter import TorchCache

# Up to this many sequences, weight @ x.T is the faster product (bench/README.md, "Figures
# behind constants").
_TRANSPOSED_ROWS = 4
Projection = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
Norm = Callable[[torch.Tensor], torch.Tensor]


def supports(config: PretrainedConfig) -> bool:
    """Whether this step computes models of this configuration (the Llama, Qwen2, Qwen3 and Gemma 3
    architectures)."""
    plain = (
        not getattr(config, "attention_bias", False)
        and not getattr(config, "mlp_bias", False)
        and getattr(config, "pretraining_tp", 1) == 1
    )
    if config.model_type == "llama":
        return plain
    if config.model_type in ("qwen2", "qwen3"):  # Llama with q, k and v biases (Qwen2) or head norms (Qwen3)
        return plain and not getattr(config, "use_sliding_window", False)
    if config.model_type == "gemma3_text":  # without the soft-capping Gemma 2 has, causal
        return (
            plain
            and getattr(config, "attn_logit_softcapping", None) is None
            and getattr(config, "final_logit_softcapping", None) is None
            and not getattr(config, "use_bidirectional_attention", False)
        )
    return False


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


def _llama_norm(module: LlamaRMSNorm) -> Norm:
    """transformers' LlamaRMSNorm, operation for operation."""
    weight, epsilon = module.weight, module.variance_epsilon

    def norm(x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + epsilon)
        return weight * x32.to(x.dtype)

    return norm


def _gemma_norm(module: Gemma3RMSNorm) -> Norm:
    """transformers' Gemma3RMSNorm, operation for operation (its ``1 + weight`` made once)."""
    scale, epsilon = 1.0 + module.weight.float(), module.eps

    def norm(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + epsilon)
        return (x32 * scale).type_as(x)

    return norm


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: rotate_half's minus, moved from x onto sin."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb, for one of q and k: x·cos + rotate_half(x)·sin, with
    rotate_half(x) = (-x2, x1) taken as x rolled by half times _signed_sin (a sign moves
    exactly, so the numbers are the same): 4 operations where transformers' form takes 7, and
    each has its dispatch; two calls a layer."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class Ropes:
    """A model's rotary embeddings: Gemma 3's gives each layer type its own (cos, sin); Llama's has one.

    A position's (cos, sin) depend on the position alone (where the frequencies do not change
    with the sequence's length, as dynamic and longrope scaling's do), so they are made once, in
    tables that grow as positions come, each piece of TABLE_PIECE positions in one call of the
    model's own rotary embedding: a pass then picks its rows rather than computing them, which
    costs a visible part of a step (bench/README.md, "Figures behind constants"). A position's
    numbers are those of the same call of the same piece whatever pass asks for them."""

    TABLE_PIECE = 256

    def __init__(self, model: LlamaForCausalLM | Gemma3ForCausalLM) -> None:
        self._rotary = model.model.rotary_emb
        typed = "layer_type" in inspect.signature(self._rotary.forward).parameters
        layer_types = list(getattr(model.config, "layer_types", None) or []) if typed else []
        self.kinds: list[str | None] = sorted(set(layer_types)) or [None]
        # each layer's kind
        self.of_layers: list[str | None] = list(layer_types) or [None] * len(model.model.layers)
        rope_types = getattr(self._rotary, "rope_type", None)
        rope_types = rope_types.values() if isinstance(rope_types, dict) else [rope_types]
        self._tabled = not any(kind in ("dynamic", "longrope") for kind in rope_types)
        self._tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}  # kind -> (cos, signed sin), (n, head_dim)

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """Each kind's (cos, signed sin) for the positions ((total, 1) of them): (total, 1, head_dim) each."""
        if not self._tabled:
            return self._computed(hidden, positions)
        self._make_room(hidden, int(positions.max()) + 1)
        rows = positions.view(-1)
        return {rope: (cos[rows].unsqueeze(1), sin[rows].unsqueeze(1)) for rope, (cos, sin) in self._tables.items()}

    def _computed(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        made = {}
        for rope in self.kinds:
            cos, sin = self._rotary(hidden, positions) if rope is None else self._rotary(hidden, positions, rope)
            made[rope] = (cos, _signed_sin(sin))
        return made

    def _make_room(self, hidden: torch.Tensor, positions: int) -> None:
        """Tables for at least ``positions`` positions, in ``hidden``'s dtype and device (twice
        the rows they held, at least: the pieces they lack are made, the others kept)."""
        held = next(iter(self._tables.values()), None)
        if held is not None and (held[0].dtype, held[0].device) != (hidden.dtype, hidden.device):
            self._tables, held = {}, None
        have = 0 if held is None else held[0].shape[0]
        if have >= positions:
            return
        piece = self.TABLE_PIECE
        parts = [
            self._computed(hidden, torch.arange(start, start + piece, device=hidden.device)[:, None])
            for start in range(have, max(positions, 2 * have), piece)
        ]

        def grown(rope: str | None, side: int) -> torch.Tensor:  # side 0: cos, 1: signed sin
            rows = [part[rope][side][:, 0] for part in parts]
            return torch.cat([self._tables[rope][side], *rows] if self._tables else rows)

        self._tables = {rope: (grown(rope, 0), grown(rope, 1)) for rope in self.kinds}


class _Layer:
    def __init__(self, layer: LlamaDecoderLayer | Gemma3DecoderLayer, norm: Callable[..., Norm], rope: str | None) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        self.qkv = _projection([attention.q_proj, attention.k_proj, attention.v_proj])
        self.out = _product(attention.o_proj)
        self.gate_up = _projection([mlp.gate_proj, mlp.up_proj])
        self.down = _product(mlp.down_proj)
        self.activation = mlp.act_fn.forward  # no hooks to run
        self.scaling = float(attention.scaling)
        self.window: int | None = getattr(attention, "sliding_window", None)  # Gemma 3's sliding layers
        self.rope = rope
        self.norm_in = norm(layer.input_layernorm)
        q_norm, k_norm = getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)
        self.heads_norms = (norm(q_norm), norm(k_norm)) if q_norm is not None and k_norm is not None else None
        pre_mlp = getattr(layer, "pre_feedforward_layernorm", None)
        if pre_mlp is not None:  # Gemma 3: each sublayer's output normalized too
            self.norm_attended: Norm | None = norm(layer.post_attention_layernorm)
            self.norm_mid = norm(pre_mlp)
            self.norm_out: Norm | None = norm(getattr(layer, "post_feedforward_layernorm"))
        else:  # Llama: post_attention_layernorm is the MLP's input norm
            self.norm_attended, self.norm_mid, self.norm_out = None, norm(layer.post_attention_layernorm), None


class Passes:
    """What computes a model's passes: new positions of several sequences, each with its own
    cache (TorchCache), in one pass (DecodeStep here, native_forward.NativeForward)."""

    def __call__(self, tokens: Sequence[int], caches: Sequence[TorchCache]) -> torch.Tensor:
        """Logits of the next position of each sequence, shape (len(tokens), vocab); each
        cache then covers its token too."""
        return self.forward([[token] for token in tokens], caches)

    def forward(
        self, sequences: Sequence[Sequence[int]], caches: Sequence[TorchCache], last: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Each sequence's new tokens fed after its cache (a decode step's one, a prompt chunk's
        or a draft's several: one pass over the weights for all of them). Logits of the last
        ``last[i]`` (default 1) new positions of each sequence, in order, shape (sum(last), vocab)."""
        raise NotImplementedError

    def forward_highest(
        self, sequences: Sequence[Sequence[int]], caches: Sequence[TorchCache], last: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, list[int] | None]:
        """``forward``'s logits, and the index of each row's highest where the pass finds it
        (sampling.highest's choice; None: it does not)."""
        return self.forward(sequences, caches, last), None


class DecodeStep(Passes):
    """One token for each of several sequences, each with its own cache (TorchCache)."""

    def __init__(self, model: PreTrainedModel) -> None:
        # ``supports`` admits only models of the Llama and Gemma 3 architectures, whose modules
        # this reads (a linear may be a quantized one of fast_weights, which computes the same product).
        model = cast("LlamaForCausalLM | Gemma3ForCausalLM", model)
        inner = model.model
        config = model.config
        norm: Callable[..., Norm] = _gemma_norm if config.model_type == "gemma3_text" else _llama_norm
        self._embed = inner.embed_tokens
        self._ropes = Ropes(model)
        self._norm = norm(inner.norm)
        self._head = _product(model.lm_head)
        self._layers = [
            _Layer(cast("LlamaDecoderLayer | Gemma3DecoderLayer", layer), norm, rope)
            for layer, rope in zip(inner.layers, self._ropes.of_layers)
        ]
        self._heads = config.num_attention_heads
        self._kv_heads = config.num_key_value_heads or self._heads  # None only before the config resolves it
        self._head_dim = getattr(config, "head_dim", None) or config.hidden_size // self._heads
        self._attention = hf_compat.attention_implementation(config)
        # A step of one position per sequence runs each layer's attention in one kernel call
        # (with exact attention, where the kernel takes the model's heads, and float32 keys and
        # values: the kernel writes the new ones into the cache's buffers).
        float32 = self._embed.weight.dtype == torch.float32
        self._kernel = hf_compat.step_kernel(self._attention, self._heads, self._kv_heads, self._head_dim) if float32 else None

    def _attend_each(
        self, index: int, layer: _Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        caches: Sequence[TorchCache], lengths: Sequence[int],
    ) -> torch.Tensor:
        """Attention of each sequence's new positions in turn; (total, heads, dim)."""
        heads, kv_heads, dim = self._heads, self._kv_heads, self._head_dim
        outputs, first = [], 0
        for cache, n in zip(caches, lengths):
            rows = slice(first, first + n)
            first += n
            # (1, kv_heads, n, dim), as the layers hold them: the cache layers of the models this
            # step supports are lm-worker's own full-attention and sliding-window ones (cache_layers.new_cache)
            cached = cast("GrowingKeysAndValues", cache.kv.layers[index])
            keys, values = cached.update_and_fetch(k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None])
            if self._attention == hf_compat.WIDE_ATTENTION:
                keys, values = cached.wide_state(torch.float64)
            if layer.window is not None:
                keys, values = cast("SlidingWindowLayer", cached).window(keys, values, n)
            if n == 1:
                query = q[rows].view(kv_heads, heads // kv_heads, dim)
                attended = hf_compat.one_query_attention(query, keys[0], values[0], layer.scaling, self._attention)
            else:
                attended = hf_compat.chunk_attention(
                    q[rows].transpose(0, 1)[None], keys, values, layer.scaling, self._attention, layer.window
                )
            outputs.append(attended.reshape(n, heads, dim))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _attend_at_once(
        self, index: int, layer: _Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        caches: Sequence[TorchCache],
    ) -> torch.Tensor:
        """Attention of one new position of each sequence in one call of the exact kernel, which
        also appends its key and value to the sequence's buffers (the numbers _attend_each gives:
        the same kernel arithmetic, the same keys); (batch, heads, dim)."""
        assert self._kernel is not None
        like_keys, like_values = k[:1].transpose(0, 1)[None], v[:1].transpose(0, 1)[None]  # (1, kv_heads, 1, dim)
        places = exact_attention.StepPlaces()
        appended = []
        for cache in caches:
            cached = cast("GrowingKeysAndValues", cache.kv.layers[index])
            if not cached.is_initialized:
                cached.lazy_initialization(like_keys, like_values)
            total = cache.length + 1
            keys, values = cached.reserve(total, like_keys, like_values)
            start = 0 if layer.window is None else cast("SlidingWindowLayer", cached).first_visible(total, 1)
            places.add(keys, values, start, 0, total - start)
            appended.append((cached, total))
        attended = self._kernel.step_attention(q, k, v, places, layer.scaling)
        for cached, total in appended:
            cached.hold(total)
        return attended

    def forward(
        self, sequences: Sequence[Sequence[int]], caches: Sequence[TorchCache], last: Sequence[int] | None = None
    ) -> torch.Tensor:
        """As a step, but each sequence may bring several new tokens (a chunk of a prompt fed
        beside the decoding requests, or a decoding's drafted tokens to check: one pass over
        the weights for all of them). Logits of the last ``last[i]`` (default 1) new
        positions of each sequence, in order, shape (sum(last), vocab)."""
        heads, kv_heads, dim = self._heads, self._kv_heads, self._head_dim
        lengths = [len(sequence) for sequence in sequences]
        total = sum(lengths)
        device = self._embed.weight.device
        ids = torch.tensor([token for sequence in sequences for token in sequence], dtype=torch.long, device=device)
        positions = torch.tensor(
            [[cache.length + i] for cache, n in zip(caches, lengths) for i in range(n)], dtype=torch.long, device=device
        )
        hidden = self._embed(ids)  # (total, hidden)
        ropes = self._ropes(hidden, positions)
        at_once = self._kernel is not None and total == len(lengths)
        for index, layer in enumerate(self._layers):
            q, k, v = layer.qkv(layer.norm_in(hidden))
            q, k = q.view(total, heads, dim), k.view(total, kv_heads, dim)
            if layer.heads_norms is not None:
                q, k = layer.heads_norms[0](q), layer.heads_norms[1](k)
            cos, sin = ropes[layer.rope]
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            v = v.view(total, kv_heads, dim)
            if at_once:
                attended = self._attend_at_once(index, layer, q, k, v, caches)
            else:
                attended = self._attend_each(index, layer, q, k, v, caches, lengths)
            attended = layer.out(attended.reshape(total, heads * dim).to(hidden.dtype))
            if layer.norm_attended is not None:
                attended = layer.norm_attended(attended)
            hidden = hidden + attended
            gate, up = layer.gate_up(layer.norm_mid(hidden))
            mlp = layer.down(layer.activation(gate) * up)
            if layer.norm_out is not None:
                mlp = layer.norm_out(mlp)
            hidden = hidden + mlp
        for cache, n in zip(caches, lengths):
            cache.length += n
        wanted = [1] * len(lengths) if last is None else last
        if sum(wanted) < total:
            ends = torch.tensor(lengths).cumsum(0).tolist()
            rows = [end - k + j for end, k in zip(ends, wanted) for j in range(k)]
            hidden = hidden[torch.tensor(rows, device=device)]
        return self._head(self._norm(hidden))
