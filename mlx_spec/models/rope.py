"""Rotary position embeddings, with the scalings of Hugging Face transformers.

The frequencies follow transformers' `modeling_rope_utils` (our reference where
it and mlx-lm disagree); they are applied with `mx.fast.rope`, which takes one
offset per batch row. Per-token positions (tree nodes share depths) use a
reshape to one-token rows, each with its own offset.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from mlx_spec.errors import UserError

SUPPORTED = ("default", "linear", "llama3", "yarn")


def _inv_freq(dims: int, base: float, scaling: dict | None) -> tuple[np.ndarray, float]:
    """Inverse frequencies `[dims/2]` and the attention factor scaling cos/sin."""
    inv = 1.0 / (base ** (np.arange(0, dims, 2, dtype=np.float64) / dims))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "llama3":
        old_len = scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return np.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        old_len = scaling["original_max_position_embeddings"]

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = scaling.get("attention_factor")
        if attn is None:
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        fast = scaling.get("beta_fast") or 32
        slow = scaling.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return dims * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = correction_dim(fast), correction_dim(slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dims - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(dims // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        extrapolate = 1 - ramp
        return inv / factor * (1 - extrapolate) + inv * extrapolate, float(attn)
    raise UserError(
        f"config.json: rope_type '{kind}' is not supported (supported: {', '.join(SUPPORTED)})"
    )


class RoPE:
    """Applies rotary embeddings to `[B, H, S, D]` queries or keys."""

    def __init__(self, dims: int, base: float, scaling: dict | None = None):
        inv, self.attention_factor = _inv_freq(dims, base, scaling)
        self.dims = dims
        # mx.fast.rope's `freqs` are periods: angle = position / freq.
        self.freqs = mx.array((1.0 / inv).astype(np.float32))

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if self.attention_factor != 1.0:
            # transformers scales cos and sin; rotation is linear, so scale x.
            x = x * self.attention_factor
        return mx.fast.rope(
            x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self.freqs
        )

    def at_positions(self, x: mx.array, positions: mx.array) -> mx.array:
        """`x` is `[B, S, H, D]` (before the head transpose); `positions` `[B, S]` or `[S]`."""
        return at_positions(self, x, positions)


def at_positions(rope, x: mx.array, positions: mx.array) -> mx.array:
    """`rope(x, offset)` (any RoPE taking `[B, H, S, D]` and one offset per row) applied to `x`
    `[B, S, H, D]` with each token at its own position (`positions` `[B, S]` or `[S]`)."""
    B, S, H, D = x.shape
    pos = mx.broadcast_to(positions, (B, S)).reshape(B * S)
    y = rope(x.reshape(B * S, H, 1, D), pos)  # one row per token, its own offset
    return y.reshape(B, S, H, D)
