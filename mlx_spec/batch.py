"""Batched speculative decoding: several sequences, one target forward a round.

Each row drafts on its own (its own drafter session and draft length), then
one target forward verifies every row's draft (padded to the longest, masked),
and each row accepts its own number of tokens. Rows are right-padded in one
cache with a length per row (`BatchCache`), so they progress at different
speeds; rows join and leave between rounds (continuous batching). Acceptance
is the single-sequence decoder's, row by row, so each row produces exactly
what it would alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx
import numpy as np

from mlx_spec import tree
from mlx_spec.cache import KVCache
from mlx_spec.decoding import DraftLength, StepEvent, prefill
from mlx_spec.drafters.base import Draft, Drafter
from mlx_spec.errors import UserError
from mlx_spec.models.llama import Model
from mlx_spec.sampling import (
    SamplingParams,
    accept_greedy,
    accept_sampled,
    accept_tree_greedy,
    accept_tree_sampled,
    sample,
)


def batchable(drafter: Drafter | None) -> bool:
    """Whether the drafter's rows can share a batched verification: not when it
    verifies with its own forward (self-speculation reuses its activations)."""
    return drafter is None or type(drafter).verify_forward is Drafter.verify_forward


class BatchCache:
    """One layer's keys and values for B rows, `[B, H_kv, capacity, D]`; row b
    holds `lengths[b]` tokens, the rest is padding that attention masks out."""

    def __init__(self, step: int = 256):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.lengths: list[int] = []
        self.step = step

    @property
    def offset(self) -> int:
        return max(self.lengths, default=0)

    def _reserve(self, needed: int, like: mx.array) -> None:
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if needed <= capacity:
            return
        size = (needed + self.step - 1) // self.step * self.step
        _, H, _, D = like.shape
        B = like.shape[0] if self.keys is None else self.keys.shape[0]
        keys = mx.zeros((B, H, size, D), like.dtype)
        values = mx.zeros((B, H, size, D), like.dtype)
        if self.keys is not None:
            keys[:, :, :capacity] = self.keys
            values[:, :, :capacity] = self.values
        self.keys, self.values = keys, values

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Write row b's S new keys and values at `lengths[b]`; every row advances by S."""
        S = k.shape[2]
        self._reserve(self.offset + S, k)
        for b, n in enumerate(self.lengths):
            self.keys[b : b + 1, :, n : n + S] = k[b : b + 1]
            self.values[b : b + 1, :, n : n + S] = v[b : b + 1]
        self.lengths = [n + S for n in self.lengths]
        end = self.offset
        return self.keys[:, :, :end], self.values[:, :, :end]

    def set_length(self, b: int, n: int) -> None:
        self.lengths[b] = n

    def keep(self, b: int, indices: Sequence[int], start: int) -> None:
        """Row b keeps the slots `indices` (ascending, >= start) moved to `start...`."""
        if indices:
            idx = mx.array(indices)
            self.keys[b : b + 1, :, start : start + len(indices)] = self.keys[b : b + 1, :, idx]
            self.values[b : b + 1, :, start : start + len(indices)] = self.values[b : b + 1, :, idx]
        self.lengths[b] = start + len(indices)

    def add(self, cache: KVCache) -> None:
        """A new last row: a single sequence's cache (its prompt, read alone)."""
        n = cache.offset
        k, v = cache.keys[..., :n, :], cache.values[..., :n, :]  # [1, H, n, D]
        if self.keys is None:
            self._reserve(n, k)
            self.keys, self.values = self.keys[:0], self.values[:0]
        self._reserve(max(self.offset, n), k)
        pad = self.keys.shape[2] - n
        k = mx.concatenate([k, mx.zeros((1, k.shape[1], pad, k.shape[3]), k.dtype)], axis=2)
        v = mx.concatenate([v, mx.zeros((1, v.shape[1], pad, v.shape[3]), v.dtype)], axis=2)
        self.keys = mx.concatenate([self.keys, k])
        self.values = mx.concatenate([self.values, v])
        self.lengths.append(n)

    def remove(self, b: int) -> None:
        keep = [i for i in range(len(self.lengths)) if i != b]
        if keep:
            idx = mx.array(keep)
            self.keys, self.values = self.keys[idx], self.values[idx]
        else:
            self.keys = self.values = None
        del self.lengths[b]


@dataclass
class Row:
    """One sequence of the batch: its drafter session, sampling, where it stands."""

    key: object
    context: list[int]
    params: SamplingParams
    max_tokens: int
    drafter: Drafter | None
    length: DraftLength
    produced: int = 0


@dataclass
class SizeStats:
    """What the policy has measured at one batch size."""

    costs: DraftLength  # forward times per verified length
    tokens: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})  # speculating? -> running sums
    seconds: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})
    rounds: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    since_plain: int = 0  # speculative rounds since plain ones were last measured
    left: int = 0  # rounds left of a measuring run
    left_k: int = 0  # its K
    plain_rounds: int = 0

    def rate(self, speculating: bool) -> float:
        return self.tokens[speculating] / self.seconds[speculating]


class BatchPolicy:
    """One draft length K a round for the whole batch (each row drafts at
    most its own adaptive length within it), from the rows' measured
    acceptance and the measured time of a batched forward over B rows of
    S = K + 1 tokens: the K with the least time per token.

    The model assumes every row fills its draft; a drafter that often finds
    nothing (prompt lookup) makes the others' padded verification wasted
    work, and drafters that must read every token cost something even in a
    plain round. So the measured throughput of whole rounds decides too:
    runs of plain rounds are measured beside the speculative ones, and once
    plain rounds at this batch size produce tokens faster, as they do when a
    large batch makes the forward compute-bound rather than memory-bound,
    K = 0 (plain decoding for everyone), with a run of speculative rounds now
    and then in case that changed."""

    LEARN = 8  # speculative rounds before the first comparison
    RUN = 4  # rounds in a measuring run
    MEASURE_PLAIN = 32  # speculative rounds between two runs of plain ones
    PROBE_EVERY = 32  # plain rounds between two runs of speculative ones
    DECAY = 0.95  # per round, of the running sums

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.by_size: dict[int, SizeStats] = {}

    def stats(self, B: int) -> SizeStats:
        return self.by_size.setdefault(B, SizeStats(DraftLength(self.k_max, adaptive=True)))

    def next(self, rows: list[Row]) -> int:
        if not any(r.drafter is not None for r in rows):
            return 0
        stats = self.stats(len(rows))
        costs = stats.costs
        if not costs.verify_cost:
            return self.k_max

        def time_per_token(k: int) -> float:
            tokens = 0.0
            draft = 0.0
            for r in rows:
                if r.drafter is None or k == 0:
                    tokens += 1
                    continue
                alpha = min(r.length.accepted / r.length.reached, 0.999)
                tokens += (1 - alpha ** (k + 1)) / (1 - alpha)
                draft += k * (r.length.draft_cost or 0.0)
            return (draft + costs.verify_time(k)) / tokens

        best = min(range(self.k_max + 1), key=time_per_token)
        if best and stats.left:  # a measuring run goes on
            stats.left -= 1
            return stats.left_k
        if best and stats.rounds[True] >= self.LEARN and (
                stats.rounds[False] == 0 or stats.since_plain >= self.MEASURE_PLAIN):
            stats.left, stats.left_k = self.RUN - 1, 0
            return 0
        if best and (stats.rounds[True] < self.LEARN or stats.rounds[False] == 0
                     or stats.rate(True) >= stats.rate(False)):
            return best
        stats.plain_rounds += 1
        if stats.plain_rounds % self.PROBE_EVERY == 0:
            k = best or min(DraftLength.PROBE_K, self.k_max)
            stats.left, stats.left_k = self.RUN - 1, k
            return k
        return 0

    def record(self, B: int, k: int, S: int, tokens: int, seconds: float, verify_time: float) -> None:
        """A round's outcome: K chosen, S tokens a row verified in `verify_time`,
        `tokens` produced in `seconds`."""
        stats = self.stats(B)
        spec = k > 0
        if S - 1 in stats.costs.seen:  # a length's first round also compiles: not a rate to learn from
            stats.tokens[spec] = self.DECAY * stats.tokens[spec] + tokens
            stats.seconds[spec] = self.DECAY * stats.seconds[spec] + seconds
            stats.rounds[spec] += 1
        stats.since_plain = stats.since_plain + 1 if spec else 0
        stats.costs.update(S - 1, 0, 0.0, verify_time)


class BatchDecoder:
    """Continuous batching: `add` a sequence (its prompt is read alone, then it
    joins), `step` runs one round for every row and returns each row's event;
    a row leaves when it has produced `max_tokens` (or with `remove`)."""

    def __init__(self, model: Model, k_max: int = 8):
        self.model = model
        self.k_max = k_max
        self.cache = [BatchCache() for _ in model.layers]
        self.rows: list[Row] = []
        self.policy = BatchPolicy(k_max)

    def add(self, key, prompt: list[int], params: SamplingParams, max_tokens: int,
            drafter: Drafter | None = None) -> None:
        if not prompt:
            raise ValueError("the prompt is empty")
        if not batchable(drafter):
            raise UserError(f"the {drafter.name} drafter verifies with its own forward: it cannot be batched")
        single = self.model.make_cache(len(prompt))
        context = list(prompt)
        if drafter is not None:
            drafter.bind(single)
            drafter.reset(context)
            consume = (lambda end, hidden: drafter.commit(context[: end + 1], hidden)) if drafter.capture else None
            prefill(self.model, prompt[:-1], single, drafter.capture, consume)
        else:
            prefill(self.model, prompt[:-1], single)
        for layer, c in zip(self.cache, single):
            if c.offset:
                layer.add(c)
            else:
                layer.lengths.append(0)
                if layer.keys is not None:
                    B, H, n, D = layer.keys.shape
                    layer.keys = mx.concatenate([layer.keys, mx.zeros((1, H, n, D), layer.keys.dtype)])
                    layer.values = mx.concatenate([layer.values, mx.zeros((1, H, n, D), layer.values.dtype)])
        self.rows.append(Row(key, context, params, max_tokens, drafter, DraftLength(self.k_max, adaptive=True)))

    def remove(self, key) -> None:
        b = next(i for i, r in enumerate(self.rows) if r.key == key)
        for layer in self.cache:
            layer.remove(b)
        del self.rows[b]

    def step(self) -> dict[object, StepEvent]:
        """One round: every row drafts, one target forward verifies all, each accepts its own."""
        rows = self.rows
        k = self.policy.next(rows)
        tic = time.perf_counter()
        drafts = []
        for r in rows:
            room = r.max_tokens - r.produced - 1  # the round adds one target token
            kr = min(k, room, r.length.next()) if r.drafter is not None and k else 0
            drafts.append(r.drafter.propose(r.context, kr, r.params) if kr > 0 else Draft(mx.array([], dtype=mx.int32)))
        mid = time.perf_counter()
        capture = tuple(sorted({i for r in rows if r.drafter is not None for i in r.drafter.capture}))
        starts = list(self.cache[0].lengths)  # each row's last context token goes here
        inputs, positions, mask, S = self._inputs(rows, drafts)
        logits, hidden = self.model(inputs, self.cache, positions=positions, mask=mask, capture=capture)
        accepted = [self._accept(b, r, d, logits[b], starts[b]) for b, (r, d) in enumerate(zip(rows, drafts))]
        toc = time.perf_counter()
        verify_time = toc - mid
        events = {}
        for b, (r, draft) in enumerate(zip(rows, drafts)):
            path, token = accepted[b]
            drafted = draft.tokens.tolist()
            tokens = [drafted[i] for i in path] + [token]
            r.context.extend(tokens)
            if r.drafter is not None:
                sel = mx.array([0] + [i + 1 for i in path])
                features = tuple(hidden[capture.index(i)][b : b + 1, sel] for i in r.drafter.capture)
                r.drafter.commit(r.context, features)
                depth = len(draft) if draft.parents is None else max(tree.depths(draft.parents), default=0)
                r.length.update(depth, len(path), (mid - tic) / len(rows), verify_time)
            r.produced += len(tokens)
            depth = None if draft.parents is None else max(tree.depths(draft.parents), default=0)
            events[r.key] = StepEvent(tokens, [True] * len(path) + [False], drafted, (mid - tic) / len(rows),
                                      verify_time, depth)
        self.policy.record(len(rows), k, S, sum(len(e.tokens) for e in events.values()), time.perf_counter() - tic,
                           verify_time)
        for r in [r for r in rows if r.produced >= r.max_tokens]:
            self.remove(r.key)
        return events

    def _inputs(self, rows: list[Row], drafts: list[Draft]):
        """Tokens `[B, S]`, positions `[B, S]` and the mask `[B, 1, S, L + S]`
        of one verification: row b's last token and draft (chain or tree),
        padded; each row sees its own cache and its own draft's ancestry."""
        lengths = self.cache[0].lengths
        S = 1 + max(len(d) for d in drafts)
        end = max(n + S for n in lengths)
        tokens = np.zeros((len(rows), S), dtype=np.int32)
        positions = np.zeros((len(rows), S), dtype=np.int32)
        mask = np.zeros((len(rows), 1, S, end), dtype=bool)
        for b, (r, d) in enumerate(zip(rows, drafts)):
            n, L = len(d), lengths[b]
            tokens[b, 0] = r.context[-1]
            tokens[b, 1 : n + 1] = d.tokens.tolist()
            mask[b, 0, :, :L] = True
            if d.parents is None:
                positions[b] = L + np.arange(S)
                mask[b, 0, : n + 1, L : L + n + 1] = np.tril(np.ones((n + 1, n + 1), dtype=bool))
            else:
                depths = [0] + tree.depths(d.parents)
                positions[b, : n + 1] = L + np.array(depths)
                mask[b, 0, : n + 1, L : L + n + 1] = tree.ancestor_matrix([-1, *(p + 1 for p in d.parents)])
            mask[b, 0, n + 1 :, L] = True  # padding queries: anything, their outputs are dropped
        return mx.array(tokens), mx.array(positions), mx.array(mask), S

    def _accept(self, b: int, r: Row, draft: Draft, logits: mx.array, start: int) -> tuple[list[int], int]:
        """Row b's accepted draft nodes and next token (as the single-sequence
        decoder decides), its cache cut to them."""
        n = len(draft)
        logits = logits[: n + 1]
        if draft.parents is None:
            if n == 0:
                path, token = [], sample(logits[-1], r.params).item()
            else:
                if r.params.greedy:
                    k, t = accept_greedy(logits, draft.tokens)
                else:
                    k, t = accept_sampled(logits, draft.tokens, draft.log_probs, r.params)
                mx.eval(k, t)
                path, token = list(range(k.item())), t.item()
            for layer in self.cache:
                layer.set_length(b, start + 1 + len(path))
            return path, token
        tokens = draft.tokens.tolist()
        if r.params.greedy:
            path, token = accept_tree_greedy(logits, tokens, draft.parents)
        else:
            path, token = accept_tree_sampled(logits, tokens, draft.parents, draft.log_probs, r.params)
        for layer in self.cache:
            layer.keep(b, [start + 1 + i for i in path], start + 1)
        return path, token
