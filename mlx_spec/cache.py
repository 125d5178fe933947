"""KV cache for a batch of one or many rows, that speculation can roll back.

One buffer per layer, `[B, H_kv, capacity, D]`, grown in steps. Row b holds
`lengths[b]` tokens; rows are right-padded, so each writes its new tokens at
its own length and rolls back by setting it: a rejected chain tail is cut
(`cut`, `trim`), an accepted tree path gathered into place (`keep`). All rows'
new keys and values go in with one write. Nothing here is a silent no-op: a
roll-back the cache cannot do raises `CacheError`.

It speaks mlx-lm's cache protocol (`offset`, `update_and_fetch`, `make_mask`,
`trim`, `state`), so mlx-lm's attention layers run on it: `offset` is one int
while every row has the same length (always, for one row), else one per row.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from mlx_spec.errors import CacheError


class KVCache:
    """Keys/values of one attention layer for `rows` rows, `[B, H_kv, capacity, D]`."""

    def __init__(self, rows: int = 1, step: int = 256):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.lengths = [0] * rows
        self.step = step

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def aligned(self) -> bool:
        """Every row holds as many tokens (a batch of one always does)."""
        return all(n == self.lengths[0] for n in self.lengths)

    @property
    def offset(self) -> int | mx.array:
        """Where the next tokens go: an int while the rows are aligned, else `[B]`."""
        return self.lengths[0] if self.aligned else mx.array(self.lengths)

    def _reserve(self, end: int, k: mx.array, v: mx.array) -> None:
        have = 0 if self.keys is None else self.keys.shape[2]
        if end <= have:
            return
        size = -(-end // self.step) * self.step
        B, H, _, Dk = k.shape
        grow_k = mx.zeros((B, H, size - have, Dk), k.dtype)
        grow_v = mx.zeros((B, H, size - have, v.shape[3]), v.dtype)
        if self.keys is None:
            self.keys, self.values = grow_k, grow_v
        else:
            self.keys = mx.concatenate([self.keys, grow_k], axis=2)
            self.values = mx.concatenate([self.values, grow_v], axis=2)

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Write each row's S new keys and values (`[B, H_kv, S, D]`) at its length;
        every row advances by S. Returns every row's keys and values so far."""
        B, _, S, _ = k.shape
        if B != self.rows:
            raise CacheError(f"{B} rows of keys for a cache of {self.rows} rows")
        end = max(self.lengths) + S
        self._reserve(end, k, v)
        if self.aligned:
            start = self.lengths[0]
            self.keys[..., start:end, :] = k
            self.values[..., start:end, :] = v
        else:  # one scatter: row b's token s goes to slot lengths[b] + s
            rows = mx.arange(B)[:, None]
            slots = mx.array(self.lengths)[:, None] + mx.arange(S)[None]  # [B, S]
            self.keys[rows, :, slots] = k.transpose(0, 2, 1, 3)
            self.values[rows, :, slots] = v.transpose(0, 2, 1, 3)
        self.lengths = [n + S for n in self.lengths]
        return self.keys[..., :end, :], self.values[..., :end, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The attention mask of N tokens about to be written: each row's queries see
        that row's cache and, causally, its new tokens (and only the last
        `window_size` positions, where given). "causal" or None where SDPA needs no array."""
        if self.aligned and not return_array and window_size is None:
            return "causal" if N > 1 else None
        lengths = np.array(self.lengths)[:, None, None]  # [B, 1, 1]
        query = lengths + np.arange(N)[None, :, None]  # [B, N, 1] positions
        key = np.arange(max(self.lengths) + N)[None, None, :]
        allowed = (key < lengths) | ((key >= lengths) & (key <= query))
        if window_size is not None:
            allowed &= key > query - window_size
        return mx.array(allowed[:, None])  # [B, 1, N, L + N]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Every row forgets its last `n` tokens (a rejected chain tail)."""
        if n < 0 or n > min(self.lengths):
            raise CacheError(f"cannot trim {n} tokens from a cache holding {min(self.lengths)}")
        self.lengths = [m - n for m in self.lengths]
        return n

    def cut(self, b: int, length: int) -> None:
        """Row b keeps its first `length` tokens."""
        if not 0 <= length <= self.lengths[b]:
            raise CacheError(f"cannot cut row {b} to {length} tokens: it holds {self.lengths[b]}")
        self.lengths[b] = length

    def keep(self, indices: Sequence[int], start: int, b: int = 0) -> None:
        """Row b keeps slots `[0, start)` and the slots `indices` (ascending, all in
        `[start, length)`), moved to `start, start + 1, ...`; the rest is dropped.
        This commits the accepted path of a verified tree."""
        idx = [int(i) for i in indices]
        length = self.lengths[b]
        if not 0 <= start <= length:
            raise CacheError(f"keep: start {start} outside the cache (row {b} holds {length})")
        if any(i < start or i >= length for i in idx) or any(a >= c for a, c in zip(idx, idx[1:])):
            raise CacheError(f"keep: indices must ascend within [{start}, {length}), got {idx}")
        n = len(idx)
        if n and idx != list(range(start, start + n)):
            gather = mx.array(idx)
            self.keys[b : b + 1, :, start : start + n] = self.keys[b : b + 1, :, gather]
            self.values[b : b + 1, :, start : start + n] = self.values[b : b + 1, :, gather]
        self.lengths[b] = start + n

    def extend(self, other: KVCache) -> None:
        """Append `other`'s rows (a prompt read alone joins the batch)."""
        if other.keys is not None or self.keys is not None:
            like = other if other.keys is not None else self
            width = max(c.keys.shape[2] for c in (self, other) if c.keys is not None)
            self.keys, self.values = (
                mx.concatenate([_rows(mine, self.rows, theirs, width), _rows(o, other.rows, theirs, width)])
                for mine, o, theirs in ((self.keys, other.keys, like.keys), (self.values, other.values, like.values))
            )
        self.lengths += other.lengths

    def remove(self, b: int) -> None:
        """Row b leaves the batch."""
        keep = [i for i in range(self.rows) if i != b]
        if self.keys is not None:
            if keep:
                idx = mx.array(keep)
                self.keys, self.values = self.keys[idx], self.values[idx]
            else:
                self.keys = self.values = None
        del self.lengths[b]

    @property
    def state(self) -> list[mx.array]:
        if self.keys is None:
            return []
        return [self.keys, self.values]


def _rows(x: mx.array | None, rows: int, like: mx.array, width: int) -> mx.array:
    """`x` `[B, H, L, D]` zero-padded to `width` slots; None (rows that hold
    nothing yet): `rows` rows of zeros shaped like `like`."""
    if x is None:
        return mx.zeros((rows, like.shape[1], width, like.shape[3]), like.dtype)
    B, H, L, D = x.shape
    return x if L == width else mx.concatenate([x, mx.zeros((B, H, width - L, D), x.dtype)], axis=2)


def make_cache(num_layers: int, rows: int = 1) -> list[KVCache]:
    """One cache per layer."""
    return [KVCache(rows) for _ in range(num_layers)]


def trim_cache(cache: list[KVCache], n: int) -> None:
    for c in cache:
        c.trim(n)


def keep_cache(cache: list[KVCache], indices: Sequence[int], start: int, b: int = 0) -> None:
    for c in cache:
        c.keep(indices, start, b)


def cut_cache(cache: list[KVCache], b: int, length: int) -> None:
    for c in cache:
        c.cut(b, length)
