"""KV cache: one preallocated buffer per layer that speculation can roll back.

Verification writes the draft's keys and values after the accepted prefix; then
`trim(n)` drops a rejected chain tail, or `keep(indices, start)` gathers the
accepted tree nodes into contiguous slots. Nothing here is a silent no-op: a
roll-back the cache cannot do raises `CacheError`.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from mlx_spec.errors import CacheError


class KVCache:
    """Keys/values of one attention layer, `[B, H_kv, capacity, D]`, valid up to `offset`."""

    def __init__(self, capacity: int = 0, step: int = 256):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.capacity = capacity  # slots to allocate on the first write
        self.step = step

    def _reserve(self, k: mx.array, v: mx.array, needed: int) -> None:
        have = 0 if self.keys is None else self.keys.shape[2]
        if needed <= have:
            return
        size = max(needed, self.capacity)
        size = ((size + self.step - 1) // self.step) * self.step
        B, H, _, Dk = k.shape
        new_k = mx.zeros((B, H, size, Dk), k.dtype)
        new_v = mx.zeros((B, H, size, v.shape[3]), v.dtype)
        if self.keys is not None and self.offset:
            new_k[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_v[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = new_k, new_v
        self.capacity = size

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Append `k, v` (`[B, H_kv, S, D]`) and return all valid keys and values."""
        S = k.shape[2]
        end = self.offset + S
        self._reserve(k, v, end)
        self.keys[..., self.offset : end, :] = k
        self.values[..., self.offset : end, :] = v
        self.offset = end
        return self.keys[..., :end, :], self.values[..., :end, :]

    def trim(self, n: int) -> int:
        """Forget the last `n` tokens (a rejected chain tail)."""
        if n < 0 or n > self.offset:
            raise CacheError(f"cannot trim {n} tokens from a cache holding {self.offset}")
        self.offset -= n
        return n

    def keep(self, indices: Sequence[int], start: int) -> None:
        """Keep slots `[0, start)` and the slots `indices` (ascending, all in
        `[start, offset)`), moved to `start, start + 1, ...`; drop the rest.

        This commits the accepted path of a verified tree.
        """
        idx = [int(i) for i in indices]
        if not 0 <= start <= self.offset:
            raise CacheError(f"keep: start {start} outside the cache (offset {self.offset})")
        if any(i < start or i >= self.offset for i in idx) or any(
            a >= b for a, b in zip(idx, idx[1:])
        ):
            raise CacheError(
                f"keep: indices must ascend within [{start}, {self.offset}), got {idx}"
            )
        n = len(idx)
        if n and idx != list(range(start, start + n)):
            gather = mx.array(idx)
            self.keys[..., start : start + n, :] = self.keys[..., gather, :]
            self.values[..., start : start + n, :] = self.values[..., gather, :]
        self.offset = start + n

    @property
    def state(self) -> list[mx.array]:
        if self.keys is None:
            return []
        return [self.keys, self.values]


def make_cache(num_layers: int, capacity: int = 0) -> list[KVCache]:
    """One cache per layer; `capacity` preallocates that many slots."""
    return [KVCache(capacity) for _ in range(num_layers)]


def trim_cache(cache: list[KVCache], n: int) -> None:
    for c in cache:
        c.trim(n)


def keep_cache(cache: list[KVCache], indices: Sequence[int], start: int) -> None:
    for c in cache:
        c.keep(indices, start)
