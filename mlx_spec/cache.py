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

A linear-attention layer (Gated DeltaNet: Qwen3-Next, Qwen3.5) holds no keys to
cut, only a convolution window and a recurrent state that every token updated.
`RecurrentCache` rolls it back exactly without a second forward: a forward of a
few tokens keeps its inputs (the tape: the convolution's input and the
recurrence's), and a cut re-applies the recurrence to the kept tokens only,
from the state before that forward.
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from mlx_spec.errors import CacheError


class _Rows:
    """Per-row token counts, and the attention mask they imply."""

    lengths: list[int]

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

    def empty_row(self) -> _Rows:
        """A cache like this one of one row holding nothing (to `extend` it by a row)."""
        return type(self)()

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
        for b, m in enumerate(self.lengths):
            self.cut(b, m - n)
        return n

    def can_trim(self, n: int) -> bool:
        return 0 <= n <= min(self.lengths, default=0)


STEP = 256  # slots a buffer grows by: exact verification reads whole steps (`mlx_spec.exact.BLOCK`)


class KVCache(_Rows):
    """Keys/values of one attention layer for `rows` rows, `[B, H_kv, capacity, D]`."""

    def __init__(self, rows: int = 1, step: int = STEP):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.lengths = [0] * rows
        self.step = step

    def _reserve(self, end: int, k: mx.array, v: mx.array) -> None:
        have = 0 if self.keys is None else self.keys.shape[2]
        if end <= have:
            return
        size = -(-end // self.step) * self.step
        B, (_, H, _, Dk) = self.rows, k.shape
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

    def cut(self, b: int, length: int) -> None:
        """Row b keeps its first `length` tokens."""
        if not 0 <= length <= self.lengths[b]:
            raise CacheError(f"cannot cut row {b} to {length} tokens: it holds {self.lengths[b]}")
        self.lengths[b] = length

    def keep(self, paths: dict[int, tuple[int, Sequence[int]]]) -> None:
        """Each row b of `paths` (b -> (start, indices)) keeps slots `[0, start)` and the slots `indices` (ascending,
        in `[start, length)`), moved to `start, start + 1, ...`: the accepted paths of verified trees, every row's
        moves in one gather and one write (a write a row copied the whole buffer each time)."""
        moves = []  # (row, to, from)
        for b, (start, indices) in paths.items():
            idx, length = [int(i) for i in indices], self.lengths[b]
            if not 0 <= start <= length:
                raise CacheError(f"keep: start {start} outside the cache (row {b} holds {length})")
            if any(i < start or i >= length for i in idx) or any(a >= c for a, c in zip(idx, idx[1:])):
                raise CacheError(f"keep: indices must ascend within [{start}, {length}), got {idx}")
            moves += [(b, start + j, i) for j, i in enumerate(idx) if i != start + j]
        self.lengths = [paths[b][0] + len(paths[b][1]) if b in paths else n for b, n in enumerate(self.lengths)]
        if moves:
            rows, to, src = (mx.array(v) for v in zip(*moves))  # [M] each
            self.keys[rows, :, to] = self.keys[rows, :, src]  # [M, H_kv, D]
            self.values[rows, :, to] = self.values[rows, :, src]

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

    def row(self, b: int) -> KVCache:
        """Row b alone, a cache of its own: its tokens' keys and values copied (a view would keep the
        batch's whole buffer alive), computed now."""
        one = KVCache(1, self.step)
        n = one.lengths[0] = self.lengths[b]
        if self.keys is not None and n:
            one.keys, one.values = (mx.contiguous(x[b : b + 1, :, :n]) for x in (self.keys, self.values))
            mx.eval(one.keys, one.values)
        return one

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

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


class RowOf(_Rows):
    """Row b of a batch's `KVCache` as a cache of its own (exact verification runs a batch's rows
    one forward each): it writes into the batch's buffer, and its `keys` are that row's buffer."""

    def __init__(self, cache: KVCache, b: int):
        self.cache, self.b = cache, b

    @property
    def lengths(self) -> list[int]:
        return [self.cache.lengths[self.b]]

    @property
    def keys(self) -> mx.array:
        return self.cache.keys[self.b : self.b + 1]

    @property
    def values(self) -> mx.array:
        return self.cache.values[self.b : self.b + 1]

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        c, b = self.cache, self.b
        start, end = c.lengths[b], c.lengths[b] + k.shape[2]
        c._reserve(end, k, v)
        c.keys[b : b + 1, :, start:end] = k
        c.values[b : b + 1, :, start:end] = v
        c.lengths[b] = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class LayerCaches(_Rows):
    """The KV caches of a layer that keeps several (mlx-lm's `CacheList`: DeepSeek-V3.2's attention's and
    its indexer's keys), `[i]` the i-th: every row's tokens in each, cut, kept and extended together."""

    def __init__(self, caches: Sequence[KVCache]):
        self.caches = list(caches)

    def __getitem__(self, i: int) -> KVCache:
        return self.caches[i]

    @property
    def lengths(self) -> list[int]:
        return self.caches[0].lengths

    @lengths.setter
    def lengths(self, lengths: list[int]) -> None:
        for c in self.caches:
            c.lengths = list(lengths)

    def cut(self, b: int, length: int) -> None:
        for c in self.caches:
            c.cut(b, length)

    def keep(self, paths: dict[int, tuple[int, Sequence[int]]]) -> None:
        for c in self.caches:
            c.keep(paths)

    def extend(self, other: LayerCaches) -> None:
        for c, o in zip(self.caches, other.caches):
            c.extend(o)

    def row(self, b: int) -> LayerCaches:
        return LayerCaches([c.row(b) for c in self.caches])

    def empty_row(self) -> LayerCaches:
        return LayerCaches([c.empty_row() for c in self.caches])

    def remove(self, b: int) -> None:
        for c in self.caches:
            c.remove(b)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    @property
    def state(self) -> list[mx.array]:
        return [a for c in self.caches for a in c.state]


def alone(cache: list, b: int) -> list:
    """Row b of a target's caches, as caches of its own for a forward of that row alone (exact verification
    runs a batch's rows one forward each): a KV cache's writes into the batch's buffer (`RowOf`), a
    linear-attention layer's is joined back after the forward (`rejoin`)."""
    return [RowOf(c, b) if isinstance(c, KVCache) else c.alone(b) if isinstance(c, RecurrentCache) else
            LayerCaches([RowOf(x, b) for x in c.caches]) for c in cache]


def rejoin(cache: list, rows: list[list]) -> None:
    """After each row's forward alone (`alone`): the linear-attention layers' rows back in `cache`."""
    for i, c in enumerate(cache):
        if isinstance(c, RecurrentCache):
            c.join([r[i] for r in rows])


def parts(cache: list) -> list:
    """A target's caches, each layer's several (`LayerCaches`) one by one."""
    return [c for layer in cache for c in (layer.caches if isinstance(layer, LayerCaches) else [layer])]


# The tape holds the last forwards of at most this many tokens in all (verifications, decoding
# steps, LayerSkip's drafts one token at a time); a longer forward (a prompt) clears it, and
# cannot be cut into.
TAPE_MAX = 64


class RecurrentCache(_Rows):
    """Convolution window and recurrent state of one linear-attention layer for `rows` rows.

    `arrays` is what the layer reads and writes (mlx-lm's `ArraysCache` protocol: [0] the
    convolution's last inputs `[B, K - 1, C]`, [1] the recurrent state `[B, H, Dv, Dk]`). Around
    a forward of S tokens the target calls `begin(S)` and `end(S)`; the layer's hooks hand it
    that forward's tape: `record_conv(x)` the convolution's input `[B, K - 1 + S, C]`, and
    `record_recurrence(replay)` a function giving the state after each row's first n of the S
    tokens. A cut back into the taped forwards is applied (replayed) before the next forward."""

    def __init__(self, rows: int = 1):
        from mlx_lm.models.cache import ArraysCache

        self.arrays = ArraysCache(2)
        self.lengths = [0] * rows
        self.tape: list[dict] = []  # the forwards since the last cut, oldest first
        self.cuts: dict[int, int] = {}  # row -> length, not yet applied

    def begin(self, S: int) -> bool:
        """A forward of S tokens is about to run; whether it is taped."""
        self.settle()
        if S > TAPE_MAX:
            self.tape = []
            return False
        self._taped({"S": S, "starts": list(self.lengths)})
        return True

    def _taped(self, forward: dict) -> None:
        """`forward` (about to run from the rows' present lengths) on the tape, which keeps TAPE_MAX tokens."""
        self.tape.append(forward)
        while self.lengths[0] - self.tape[0]["starts"][0] + forward["S"] > TAPE_MAX:  # (rows advance together)
            self.tape.pop(0)

    def end(self, S: int) -> None:
        self.lengths = [n + S for n in self.lengths]

    def record_conv(self, x: mx.array) -> None:
        self.tape[-1]["conv"] = x

    def record_recurrence(self, replay) -> None:
        self.tape[-1]["replay"] = replay

    def _earliest(self, b: int) -> int:
        return self.tape[0]["starts"][b] if self.tape else self.lengths[b]

    def cut(self, b: int, length: int) -> None:
        """Row b keeps its first `length` tokens: at least those before the taped forwards."""
        if length == self.lengths[b]:
            return
        if not self._earliest(b) <= length < self.lengths[b]:
            raise CacheError(f"cannot cut row {b} of a linear-attention layer to {length} tokens: it holds "
                             f"{self.lengths[b]}, and can go back only to {self._earliest(b)}")
        self.cuts[b] = length
        self.lengths[b] = length

    def can_trim(self, n: int) -> bool:
        return all(self._earliest(b) <= m - n for b, m in enumerate(self.lengths))

    def settle(self) -> None:
        """Apply the cuts: each cut row's window and state after its kept tokens, replayed from
        the taped forward they end in. The tape keeps the forwards before it (and that one, up to
        the cut, where every row kept as many of its tokens): a later cut may go back into them."""
        cuts, tape = self.cuts, self.tape
        if not cuts:
            return
        self.cuts = {}
        groups: dict[int, list[int]] = {}
        for b, length in cuts.items():
            groups.setdefault(max(j for j, t in enumerate(tape) if t["starts"][b] <= length), []).append(b)
        first = min(groups)
        self.tape = tape[:first]
        kept = {cuts[b] - tape[first]["starts"][b] for b in cuts}
        if len(cuts) == self.rows and len(groups) == 1 and len(kept) == 1:
            t, n = tape[first], kept.pop()
            self.tape.append({**t, "S": n, "conv": t["conv"][:, : t["conv"].shape[1] - t["S"] + n]})
        for j, rows in groups.items():
            t = tape[j]
            kept = [cuts[b] - t["starts"][b] if b in rows else t["S"] for b in range(self.rows)]
            width = t["conv"].shape[1] - t["S"]
            at = (mx.array(kept)[:, None] + mx.arange(width)[None])[..., None]  # [B, K - 1, 1]
            replay = t.get("replay", lambda kept: None)  # (a short convolution alone: no recurrence)
            values = (mx.take_along_axis(t["conv"], at, axis=1), replay(kept))
            for i, value in enumerate(values):
                if len(rows) < self.rows and value is not None:  # the other rows keep theirs
                    chosen = mx.array([b in rows for b in range(self.rows)]).reshape(-1, *[1] * (value.ndim - 1))
                    value = mx.where(chosen, value, self.arrays[i])
                self.arrays[i] = value

    def keep(self, paths: dict[int, tuple[int, Sequence[int]]]) -> None:
        for b, (start, indices) in paths.items():
            if [int(i) for i in indices] != list(range(start, start + len(indices))):
                raise CacheError("a linear-attention layer cannot keep a tree's path: verify chains")
            self.cut(b, start + len(indices))

    def extend(self, other: RecurrentCache) -> None:
        self.settle()
        other.settle()
        for i in range(2):
            mine, theirs = self.arrays[i], other.arrays[i]
            like = mine if mine is not None else theirs
            if like is not None:
                mine = mine if mine is not None else mx.zeros((self.rows, *like.shape[1:]), like.dtype)
                theirs = theirs if theirs is not None else mx.zeros((other.rows, *like.shape[1:]), like.dtype)
                self.arrays[i] = mx.concatenate([mine, theirs])
        self.lengths += other.lengths
        self.tape = []

    def row(self, b: int) -> RecurrentCache:
        """Row b alone, a cache of its own: its window and state after its tokens, with no tape (it
        cannot be cut back)."""
        self.settle()
        one = RecurrentCache(1)
        for i in range(2):
            if self.arrays[i] is not None:
                one.arrays[i] = mx.contiguous(self.arrays[i][b : b + 1])
        mx.eval(one.arrays.cache)
        one.lengths = [self.lengths[b]]
        return one

    def alone(self, b: int) -> RecurrentCache:
        """Row b as a cache of its own for a forward of that row alone, joined back after it (`join`)."""
        self.settle()
        one = RecurrentCache(1)
        for i in range(2):
            if self.arrays[i] is not None:
                one.arrays[i] = self.arrays[i][b : b + 1]
        one.lengths = [self.lengths[b]]
        return one

    def join(self, rows: list[RecurrentCache]) -> None:
        """Each row's window, state and the forward it ran alone (`alone`), as this cache's: a cut replays
        each row's own tape."""
        for i in range(2):
            if rows[0].arrays[i] is not None:
                self.arrays[i] = mx.concatenate([r.arrays[i] for r in rows])
        tapes = [r.tape[-1] for r in rows]
        forward = {"S": tapes[0]["S"], "starts": list(self.lengths), "conv": mx.concatenate([t["conv"] for t in tapes])}
        if "replay" in tapes[0]:
            forward["replay"] = lambda kept: mx.concatenate([t["replay"]([n]) for t, n in zip(tapes, kept)])
        self._taped(forward)
        self.end(forward["S"])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    def remove(self, b: int) -> None:
        self.settle()
        keep = mx.array([i for i in range(self.rows) if i != b])
        for i in range(2):
            if self.arrays[i] is not None:
                self.arrays[i] = self.arrays[i][keep] if self.rows > 1 else None
        del self.lengths[b]
        self.tape = []

    @property
    def state(self) -> list[mx.array]:
        self.settle()
        return [a for a in self.arrays.cache if a is not None]


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


def rewound(cache: list, keep: int, fresh: Callable[[], list]) -> list:
    """`cache` cut to its first `keep` tokens (an earlier chat turn's, that the next prompt
    shares), or `fresh()` where a linear-attention layer cannot go back so far (it reads
    the whole prompt again)."""
    n = cache[0].lengths[0] - keep
    if not all(c.can_trim(n) for c in cache):
        return fresh()
    trim_cache(cache, n)
    return cache


def trim_cache(cache: list[KVCache], n: int) -> None:
    for c in cache:
        c.trim(n)


def keep_cache(cache: list[KVCache], paths: dict[int, tuple[int, Sequence[int]]]) -> None:  # `KVCache.keep`
    for c in cache:
        c.keep(paths)


def cut_cache(cache: list[KVCache], b: int, length: int) -> None:
    for c in cache:
        c.cut(b, length)
