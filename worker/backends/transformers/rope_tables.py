"""The native pass's RoPE tables: each position's (cos, signed sin) rows, the same bits on every
machine. Torch-free (numpy).

A position's rotation is cos and sin of its angles, the position times each of the head's
inverse frequencies. PyTorch computes them in float32 with its own vectorized pow, cos and sin,
whose last bits follow the library's build and the processor's vectors; native_forward.c
computes everything else in an order of its own, so its tables are computed here, in one
fixed way, from the configuration alone:

- the inverse frequencies, base^(-2i/dim), to 40 digits by Python's decimal module (software:
  the same digits everywhere), rounded to double; linear and Llama 3 scaling, and a gguf's
  ``rope_freqs`` factors, applied in double as transformers writes them;
- each angle, position times frequency, in double; its cos and sin by fdlibm's reduction
  (three parts of pi/2, exact for angles under 2^19 pi) and its polynomials, in numpy's
  elementwise double operations (each one IEEE rounding, whatever the vector width), rounded
  to float32.

So a table's row depends on its position alone, and on no library. RoPE types whose
frequencies change with the sequence's length (dynamic, YaRN, LongRoPE) are not taken here
(``inverse_frequencies`` gives None): such a model keeps PyTorch's tables (decode_step.Ropes).
"""

from __future__ import annotations

import decimal
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# The RoPE types computed here (transformers' rope_type names).
TAKEN = ("default", "linear", "llama3")
_DIGITS = 40
_FIRST_ROWS = 256  # a table's first size, in positions; it doubles as positions come

# fdlibm's pi/2 in three parts of 33 bits (their products by a quadrant count under 2^20 exact)
_INVPIO2 = 6.36619772367581382433e-01
_PIO2_1 = 1.57079632673412561417e00
_PIO2_2 = 6.07710050630396597660e-11
_PIO2_3 = 2.02226624871116645580e-21
# fdlibm's k_sin.c and k_cos.c: sin and cos on [-pi/4, pi/4]
_S1, _S2, _S3 = -1.66666666666666324348e-01, 8.33333333332248946124e-03, -1.98412698298579493134e-04
_S4, _S5, _S6 = 2.75573137070700676789e-06, -2.50507602534068634195e-08, 1.58969099521155010221e-10
_C1, _C2, _C3 = 4.16666666666666019037e-02, -1.38888888888741095749e-03, 2.48015872894767294178e-05
_C4, _C5, _C6 = -2.75573143513906633035e-07, 2.08757232129817482790e-09, -1.13596475577881948265e-11


def inverse_frequencies(parameters: Mapping[str, Any], dim: int, factors: np.ndarray | None = None) -> np.ndarray | None:
    """A rotary embedding's dim / 2 inverse frequencies (float64) from its RoPE parameters as
    transformers keeps them (``rope_type``, ``rope_theta``, and a scaling's ``factor`` and the
    rest), divided by ``factors`` where given (a gguf's rope_freqs); None for a type not in TAKEN
    or a rotation of part of the head."""
    kind = parameters.get("rope_type", "default")
    if kind not in TAKEN or parameters.get("partial_rotary_factor", 1.0) != 1.0 or dim % 2:
        return None
    frequencies = _powers(float(parameters["rope_theta"]), dim)
    if kind == "linear":
        frequencies = frequencies / float(parameters["factor"])
    elif kind == "llama3":
        frequencies = _llama3(frequencies, parameters)
    if factors is not None:
        frequencies = frequencies / factors.astype(np.float64)
    return frequencies


def _powers(base: float, dim: int) -> np.ndarray:
    """base^(-2i/dim) for i below dim / 2, each the double nearest a 40-digit value."""
    context = decimal.Context(prec=_DIGITS)
    ln_base = context.ln(decimal.Decimal(base))
    return np.array([float(context.exp(context.multiply(ln_base, context.divide(-2 * i, dim)))) for i in range(dim // 2)])


def _llama3(frequencies: np.ndarray, parameters: Mapping[str, Any]) -> np.ndarray:
    """Llama 3's scaling (transformers' _compute_llama3_parameters), in double."""
    factor, low, high = (float(parameters[key]) for key in ("factor", "low_freq_factor", "high_freq_factor"))
    context = float(parameters["original_max_position_embeddings"])
    wavelength = 2 * np.pi / frequencies
    scaled = np.where(wavelength > context / low, frequencies / factor, frequencies)
    smooth = (context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < context / high) & ~(wavelength > context / low)
    return np.where(medium, smoothed, scaled)


def cos_sin(angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of float64 ``angles`` (non-negative, under 2^19 pi for full accuracy), each
    by the same double operations on every machine."""
    quadrants = np.rint(angles * _INVPIO2)
    x = ((angles - quadrants * _PIO2_1) - quadrants * _PIO2_2) - quadrants * _PIO2_3
    z = x * x
    w = z * z
    sine = x + (z * x) * (_S1 + z * (_S2 + z * (_S3 + z * _S4) + z * w * (_S5 + z * _S6)))
    r = z * (_C1 + z * (_C2 + z * _C3)) + w * w * (_C4 + z * (_C5 + z * _C6))
    half = 0.5 * z
    one_less = 1.0 - half
    cosine = one_less + (((1.0 - one_less) - half) + z * r)
    turn = quadrants.astype(np.int64) & 3
    sin = np.select([turn == 0, turn == 1, turn == 2], [sine, cosine, -sine], -cosine)
    cos = np.select([turn == 0, turn == 1, turn == 2], [cosine, -sine, -cosine], sine)
    return cos, sin


class Tables:
    """The (cos, signed sin) rows of each kind of rotary embedding (Gemma 3's layer types each
    have one; other models one, kind None), float32 (dim wide: each angle's value at d and
    d + dim/2, sin's first half negated, as native_forward.c rotates), in tables grown as
    positions come."""

    def __init__(self, frequencies: Mapping[str | None, np.ndarray], of_layers: Sequence[str | None]) -> None:
        self.kinds: list[str | None] = list(frequencies)
        self.of_layers = list(of_layers)  # each layer's kind
        self.frequencies = [frequencies[kind] for kind in self.kinds]  # each kind's inverse frequencies
        dim = 2 * len(self.frequencies[0])
        self._cos = np.empty((len(self.kinds), 0, dim), np.float32)
        self._sin = np.empty((len(self.kinds), 0, dim), np.float32)

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of ``positions`` (int64), (kinds, len(positions), dim) each, contiguous."""
        if len(positions):
            self._make_room(int(positions.max()) + 1)
        return np.ascontiguousarray(self._cos[:, positions]), np.ascontiguousarray(self._sin[:, positions])

    def _make_room(self, positions: int) -> None:
        have = self._cos.shape[1]
        if positions <= have:
            return
        size = max(positions, 2 * have, _FIRST_ROWS)
        rows = np.arange(have, size, dtype=np.float64)
        made = [cos_sin(rows[:, None] * frequencies[None, :]) for frequencies in self.frequencies]
        cos = np.stack([np.concatenate([c, c], axis=1) for c, _ in made]).astype(np.float32)
        sin = np.stack([np.concatenate([-s, s], axis=1) for _, s in made]).astype(np.float32)
        self._cos = np.concatenate([self._cos, cos], axis=1)
        self._sin = np.concatenate([self._sin, sin], axis=1)


def of_config(config: Any, dim: int, layers: int) -> Tables | None:
    """The tables of a transformers configuration's rotary embeddings (``rope_parameters``, per
    layer type where it is keyed so: Gemma 3's), None where one is of a type not taken here."""
    parameters: Mapping[str, Any] = getattr(config, "rope_parameters", None) or {}
    layer_types = list(getattr(config, "layer_types", None) or [])
    if layer_types and all(isinstance(parameters.get(kind), Mapping) for kind in layer_types):
        frequencies = {kind: inverse_frequencies(parameters[kind], dim) for kind in sorted(set(layer_types))}
        of_layers: list[str | None] = list(layer_types)
    else:
        frequencies = {None: inverse_frequencies(parameters, dim)}
        of_layers = [None] * layers
    if getattr(config, "partial_rotary_factor", 1.0) not in (None, 1.0):
        return None
    taken = {kind: value for kind, value in frequencies.items() if value is not None}
    return Tables(taken, of_layers) if len(taken) == len(frequencies) else None
