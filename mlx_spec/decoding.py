"""The decoding loop: prefill, then one step event per round.

Plain decoding is the baseline every drafter is measured against, and the
reference its output must equal. Each step yields a `StepEvent`; streaming, the
CLI, the benchmark and the chat all read these.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import mlx.core as mx

from mlx_spec import tree
from mlx_spec.attention import TreeMask
from mlx_spec.cache import KVCache, keep_cache, trim_cache
from mlx_spec.drafters.base import Draft, Drafter
from mlx_spec.errors import UserError
from mlx_spec.models.llama import Model
from mlx_spec.sampling import (
    SamplingParams,
    accept_greedy,
    accept_sampled,
    accept_tree_greedy,
    accept_tree_sampled,
    accept_tree_typical,
    sample,
)

PREFILL_STEP = 512


@dataclass
class StepEvent:
    tokens: list[int]  # committed this step, in order
    from_draft: list[bool]  # which of `tokens` came from the draft
    drafted: list[int] = field(default_factory=list)  # what the drafter proposed (a tree's nodes in order)
    draft_time: float = 0.0  # seconds
    verify_time: float = 0.0
    tree_depth: int | None = None  # for a tree draft: its depth

    @property
    def depth(self) -> int:
        """Draft positions verified this round: a chain's length, a tree's depth."""
        return len(self.drafted) if self.tree_depth is None else self.tree_depth

    @property
    def accepted(self) -> int:
        return sum(self.from_draft)


def prefill(
    model: Model,
    tokens: Sequence[int],
    cache: list[KVCache],
    capture: tuple[int, ...] = (),
    consume: Callable[[int, tuple[mx.array, ...]], None] | None = None,
) -> None:
    """Run `tokens` through the target to fill the cache; no logits are evaluated.

    With `capture`, `consume(end, hidden)` receives each chunk's hidden states
    (`[1, chunk, H]` per index), `end` being where the chunk stops in `tokens`.
    """
    ids = mx.array(tokens)
    for start in range(0, len(tokens), PREFILL_STEP):
        _, hidden = model(ids[None, start : start + PREFILL_STEP], cache, capture=capture)
        mx.eval([c.state for c in cache], hidden)
        if consume is not None:
            consume(min(start + PREFILL_STEP, len(tokens)), hidden)


def cached_prefix(cache: list[KVCache], prompt: Sequence[int]) -> int:
    """How many of `prompt`'s first tokens `cache` holds: its caller keeps a
    cache only for a prompt that extends what it holds (`trim_cache` first
    where they part), and at least the last prompt token is run again."""
    held = cache[0].offset
    if held >= len(prompt):
        raise ValueError(f"the cache holds {held} tokens, the prompt has only {len(prompt)}")
    return held


def plain_steps(
    model: Model,
    prompt: Sequence[int],
    params: SamplingParams,
    max_tokens: int,
    cache: list[KVCache] | None = None,
) -> Iterator[StepEvent]:
    """Plain decoding, one token per event.

    The next step is queued with `mx.async_eval` before the current token is
    read, so host work overlaps the device's. A `cache` given may already hold
    the prompt's first tokens (an earlier chat turn; see `cached_prefix`).
    """
    if not prompt:
        raise ValueError("the prompt is empty")
    cache = cache if cache is not None else model.make_cache(len(prompt) + max_tokens + 1)
    prefill(model, prompt[cached_prefix(cache, prompt) : -1], cache)

    def step(tokens: mx.array) -> mx.array:
        logits, _ = model(tokens[None], cache)  # [1, S, V]
        return sample(logits[:, -1, :], params)  # [1]

    tic = time.perf_counter()
    y = step(mx.array(prompt[-1:]))
    mx.async_eval(y)
    for n in range(max_tokens):
        if n + 1 < max_tokens:
            next_y = step(y)
            mx.async_eval(next_y)
        token = y.item()
        toc = time.perf_counter()
        yield StepEvent([token], [False], verify_time=toc - tic)
        tic = toc
        if n % 256 == 255:
            mx.clear_cache()
        if n + 1 < max_tokens:
            y = next_y


def ema(old: float | None, new: float, decay: float) -> float:
    """A running mean that keeps `decay` of the past."""
    return new if old is None else decay * old + (1 - decay) * new


class DraftLength:
    """Chooses K each round from measured acceptance and costs.

    With per-token acceptance alpha, a round of K drafts yields
    E(K) = (1 - alpha^(K+1)) / (1 - alpha) tokens (Leviathan et al.) and costs
    K drafted tokens plus one verification of K + 1 tokens. The seed's formula
    takes the verification as flat in K (memory-bound decoding); on a CPU, or
    for a small target, it is not, so we keep a running time per verified
    length and fit a line through them. We pick the K in 0..k_max with the
    least time per token; K = 0 is plain decoding, probed again now and then in
    case acceptance has changed.
    """

    PROBE_EVERY = 4  # plain rounds between two probes
    PROBE_K = 2
    DECAY = 0.8  # weight of the past in the running estimates

    def __init__(self, k_max: int, adaptive: bool):
        self.k_max, self.adaptive = k_max, adaptive
        self.accepted, self.reached = 0.8, 1.0  # prior: alpha = 0.8, weak
        self.draft_cost: float | None = None  # seconds per drafted token
        self.verify_cost: dict[int, float] = {}  # K -> seconds per verification of K + 1 tokens
        self.plain_rounds = 0
        self.seen: set[int] = set()  # lengths verified at least once
        self.last_k = -1

    def verify_time(self, k: int) -> float:
        """Measured, or from a line through the measured lengths (flat with one)."""
        if k in self.verify_cost:
            return self.verify_cost[k]
        ks = list(self.verify_cost)
        ts = [self.verify_cost[j] for j in ks]
        if len(ks) == 1:
            return ts[0]
        mk, mt = sum(ks) / len(ks), sum(ts) / len(ts)
        slope = sum((a - mk) * (b - mt) for a, b in zip(ks, ts)) / sum((a - mk) ** 2 for a in ks)
        return max(mt + max(slope, 0.0) * (k - mk), min(ts))

    def time_per_token(self, k: int) -> float:
        alpha = min(self.accepted / self.reached, 0.999)
        tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
        return (k * (self.draft_cost or 0.0) + self.verify_time(k)) / tokens

    def next(self) -> int:
        if not self.adaptive or not self.verify_cost:
            return self.k_max
        k = min(range(self.k_max + 1), key=self.time_per_token)
        if k == 0:
            self.plain_rounds += 1
            if self.plain_rounds % self.PROBE_EVERY == 0:
                return min(self.PROBE_K, self.k_max)
        return k

    def update(self, k: int, n: int, draft_time: float, verify_time: float) -> None:
        d = self.DECAY
        # A length's first round also traces and compiles its graphs: not a cost to learn from.
        first = k not in self.seen
        self.seen.add(k)
        # After plain rounds, a drafter first catches up on the tokens it missed.
        catching_up = self.last_k == 0
        self.last_k = k
        if not first:
            self.verify_cost[k] = ema(self.verify_cost.get(k), verify_time, d)
        if k == 0:
            return
        if not (first or catching_up):
            self.draft_cost = ema(self.draft_cost, draft_time / k, d)
        # Position i is reached when the drafts before it were all accepted.
        self.accepted = d * self.accepted + n
        self.reached = d * self.reached + n + (n < k)


def _verify_chain(model, cache, context, draft, params, drafter):
    """One target forward over [last context token] + chain -> (accepted node indices, next token, hidden)."""
    k = len(draft)
    inputs = mx.concatenate([mx.array(context[-1:], dtype=mx.int32), draft.tokens])
    logits, hidden = drafter.verify_forward(model, inputs[None], cache)  # [1, K+1, V]
    logits = logits[0]
    if k == 0:
        n, token = mx.array(0), sample(logits[-1], params)
    elif params.greedy:
        n, token = accept_greedy(logits, draft.tokens)
    else:
        n, token = accept_sampled(logits, draft.tokens, draft.log_probs, params)
    mx.eval(n, token)
    n = n.item()
    trim_cache(cache, k - n)
    return list(range(n)), token.item(), hidden


def _verify_tree(model, cache, context, draft, params, capture, acceptance):
    """One target forward over [last context token] + tree -> (accepted path, next token, hidden)."""
    parents = draft.parents
    start = cache[0].offset  # the last context token's slot
    inputs = mx.concatenate([mx.array(context[-1:], dtype=mx.int32), draft.tokens])
    positions = mx.array([0] + tree.depths(parents)) + start
    mask = TreeMask((-1, *(p + 1 for p in parents)), start)
    logits, hidden = model(inputs[None], cache, positions=positions[None], mask=mask, capture=capture)
    logits = logits[0]  # [N+1, V]
    tokens = draft.tokens.tolist()
    if params.greedy:
        path, token = accept_tree_greedy(logits, tokens, parents)
    elif acceptance == "typical":
        path, token = accept_tree_typical(logits, tokens, parents, params)
    else:
        path, token = accept_tree_sampled(logits, tokens, parents, draft.log_probs, params)
    keep_cache(cache, [start + 1 + i for i in path], start + 1)
    return path, token, hidden


def _depth_limited(draft: Draft, k: int) -> Draft:
    """A tree cut to depth <= k, so a round never commits more than k + 1 tokens."""
    keep = tree.truncate(draft.parents, k)
    if len(keep) == len(draft):
        return draft
    idx = mx.array(keep)
    lp = draft.log_probs[idx] if draft.log_probs is not None else None
    return Draft(draft.tokens[idx], lp, tree.subtree(draft.parents, keep))


def speculative_steps(
    model: Model,
    prompt: Sequence[int],
    params: SamplingParams,
    max_tokens: int,
    drafter: Drafter,
    num_draft: int | None = None,
    k_max: int = 8,
    cache: list[KVCache] | None = None,
    acceptance: str = "exact",
) -> Iterator[StepEvent]:
    """Draft -> one target forward over the draft -> accept -> commit.

    Exact: greedy output equals plain greedy decoding token for token, and
    sampled output is distributed as the target's (see `accept_sampled` and
    `accept_tree_sampled`). `num_draft` fixes K (a tree's depth); otherwise a
    costly drafter's K adapts (`DraftLength`). `acceptance="typical"` is
    Medusa's lossy rule for trees at temperature > 0.
    """
    if not prompt:
        raise ValueError("the prompt is empty")
    if acceptance not in ("exact", "typical"):
        raise UserError(f"--acceptance must be exact or typical, got '{acceptance}'")
    k_max = num_draft or k_max
    cache = cache if cache is not None else model.make_cache(len(prompt) + max_tokens + k_max + 1)
    context = list(prompt)
    drafter.bind(cache)
    # An earlier turn's K/V stays as far as the drafter's own state still matches it.
    held = cached_prefix(cache, prompt)
    kept = drafter.reset(context, held)
    trim_cache(cache, held - kept)
    # A drafter reading the target's features gets the prompt's as they are computed.
    consume = (lambda end, hidden: drafter.commit(context[: kept + end + 1], hidden)) if drafter.capture else None
    prefill(model, prompt[kept:-1], cache, drafter.capture, consume)
    length = DraftLength(k_max, adaptive=num_draft is None and drafter.costly)
    produced = 0
    while produced < max_tokens:
        k = min(length.next(), max_tokens - produced - 1)  # the round adds one target token
        tic = time.perf_counter()
        draft = drafter.propose(context, k, params) if k > 0 else Draft(mx.array([], dtype=mx.int32))
        if draft.parents is not None:
            draft = _depth_limited(draft, k)
        mid = time.perf_counter()
        if draft.parents is None:
            path, token, hidden = _verify_chain(model, cache, context, draft, params, drafter)
        else:
            path, token, hidden = _verify_tree(model, cache, context, draft, params, drafter.capture, acceptance)
        toc = time.perf_counter()
        drafted = draft.tokens.tolist()
        tokens = [drafted[i] for i in path] + [token]
        context.extend(tokens)
        rows = mx.array([0] + [i + 1 for i in path])
        drafter.commit(context, tuple(h[:, rows] for h in hidden))
        n = len(path)
        depth = None if draft.parents is None else max(tree.depths(draft.parents), default=0)
        length.update(len(draft) if depth is None else depth, n, mid - tic, toc - mid)
        produced += len(tokens)
        yield StepEvent(tokens, [True] * n + [False], drafted, mid - tic, toc - mid, depth)
