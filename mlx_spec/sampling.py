"""Logits -> the distribution tokens are really drawn from.

Processing follows transformers' warpers, in order: temperature, top-k, top-p,
min-p. Speculative acceptance needs these exact distributions (q for the target,
p for the draft), so sampling and acceptance share `log_probs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import mlx.core as mx

from mlx_spec.errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    temp: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off

    def __post_init__(self) -> None:
        if self.temp < 0:
            raise UserError(f"--temp must be >= 0, got {self.temp}")
        if self.top_k < 0:
            raise UserError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise UserError(f"--min-p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temp == 0


NEG_INF = float("-inf")


def _log_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    x = logits.astype(mx.float32) / params.temp  # [..., V]
    if 0 < params.top_k < x.shape[-1]:
        kth = mx.topk(x, params.top_k, axis=-1).min(axis=-1, keepdims=True)
        x = mx.where(x >= kth, x, NEG_INF)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    if params.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p.
        desc = -mx.sort(-lp, axis=-1)
        mass_before = mx.cumsum(mx.exp(desc), axis=-1) - mx.exp(desc)
        kept = mx.where(mass_before < params.top_p, desc, float("inf"))
        lp = mx.where(lp >= kept.min(axis=-1, keepdims=True), lp, NEG_INF)
    if params.min_p > 0.0:
        floor = lp.max(axis=-1, keepdims=True) + mx.log(mx.array(params.min_p))
        lp = mx.where(lp >= floor, lp, NEG_INF)
    if params.top_p < 1.0 or params.min_p > 0.0:
        lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    return lp


@lru_cache(maxsize=16)
def _compiled_log_probs(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    return mx.compile(lambda logits: _log_probs(logits, params))


def log_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Log-probabilities `[..., V]` of the processed distribution (sampling only)."""
    return _compiled_log_probs(params)(logits)


def sample(logits: mx.array, params: SamplingParams) -> mx.array:
    """Draw one token per row of `logits` `[..., V]` -> `[...]` (argmax when greedy)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(log_probs(logits, params), axis=-1)


# Acceptance rules for a chain of K draft tokens verified in one target forward.
# `logits` [K+1, V] are the target's at the pending token and at each draft
# token; row i scores the token after draft position i. Both rules return
# (n, next): how many draft tokens are accepted, and the token that follows
# them (the target's correction, or the bonus token when all K are accepted).


def accept_greedy(logits: mx.array, draft: mx.array) -> tuple[mx.array, mx.array]:
    """Accept the longest prefix of `draft` [K] equal to the target's argmax."""
    target = mx.argmax(logits, axis=-1)  # [K+1]
    K = draft.shape[0]
    n = mx.cumprod((target[:K] == draft).astype(mx.int32)).sum()
    return n, mx.take(target, n)


def accept_sampled(
    logits: mx.array,
    draft: mx.array,
    draft_log_probs: mx.array | None,
    params: SamplingParams,
) -> tuple[mx.array, mx.array]:
    """Speculative sampling (Leviathan et al., Chen et al.): exact for any draft.

    Draft token x at position i is kept with probability min(1, q_i(x)/p_i(x)),
    where q is the target's processed distribution and p the one x was really
    drawn from (`draft_log_probs` [K, V]; None means a deterministic drafter,
    p one-hot). At the first rejection the token is drawn from the normalised
    residual max(0, q_i - p_i); if all are kept, the bonus from q_K.
    """
    K = draft.shape[0]
    q = mx.exp(log_probs(logits, params))  # [K+1, V]
    V = q.shape[-1]
    if draft_log_probs is None:
        p = (mx.arange(V)[None, :] == draft[:, None]).astype(q.dtype)  # [K, V] one-hot
    else:
        p = mx.exp(draft_log_probs)
    idx = draft[:, None]
    q_x = mx.take_along_axis(q[:K], idx, axis=-1)[:, 0]  # [K]
    p_x = mx.take_along_axis(p, idx, axis=-1)[:, 0]
    keep = mx.random.uniform(shape=(K,)) * p_x < q_x  # u < q/p, without dividing
    n = mx.cumprod(keep.astype(mx.int32)).sum()
    residual = mx.maximum(q[:K] - p, 0.0)  # [K, V]
    # A row with no residual mass (p == q there) is never reached: rejection
    # has probability 0. Fall back to q only to keep its sample finite.
    empty = residual.sum(axis=-1, keepdims=True) <= 0
    residual = mx.where(empty, q[:K], residual)
    rows = mx.concatenate([residual, q[K:]], axis=0)  # [K+1, V]
    candidates = mx.random.categorical(mx.log(rows), axis=-1)  # [K+1]
    return n, mx.take(candidates, n)
