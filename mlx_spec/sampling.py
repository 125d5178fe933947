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
import numpy as np

from mlx_spec.errors import UserError
from mlx_spec.tree import children


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


def draw(logits: mx.array, params: SamplingParams) -> tuple[mx.array, mx.array | None]:
    """A drafter's tokens from `logits` `[..., V]`, and the log-probabilities they
    were drawn from (None when greedy: the argmax, a deterministic draft)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1), None
    lp = log_probs(logits, params)
    return mx.random.categorical(lp, axis=-1), lp


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
    K, V = draft.shape[0], logits.shape[-1]
    u = mx.random.uniform(shape=(K,))  # drawn outside the compiled rule: it stays a pure function
    gumbel = mx.random.gumbel(shape=(K + 1, V))
    rule = _compiled_accept(params, draft_log_probs is None)
    return tuple(rule(logits, draft, u, gumbel) if draft_log_probs is None else
                 rule(logits, draft, u, gumbel, draft_log_probs))


@lru_cache(maxsize=16)
def _compiled_accept(params: SamplingParams, one_hot: bool) -> Callable:
    return mx.compile(lambda logits, draft, u, gumbel, *lp: _accept_sampled(logits, draft, u, gumbel, params,
                                                                            None if one_hot else lp[0]))


def _accept_sampled(logits: mx.array, draft: mx.array, u: mx.array, gumbel: mx.array, params: SamplingParams,
                    draft_log_probs: mx.array | None) -> tuple[mx.array, mx.array]:
    """`accept_sampled` with its uniforms `u` [K] and Gumbel noise `gumbel` [K+1, V] given."""
    K = draft.shape[0]
    q = mx.exp(_log_probs(logits, params))  # [K+1, V]
    V = q.shape[-1]
    if draft_log_probs is None:
        p = (mx.arange(V)[None, :] == draft[:, None]).astype(q.dtype)  # [K, V] one-hot
    else:
        p = mx.exp(draft_log_probs)
    idx = draft[:, None]
    q_x = mx.take_along_axis(q[:K], idx, axis=-1)[:, 0]  # [K]
    p_x = mx.take_along_axis(p, idx, axis=-1)[:, 0]
    keep = u * p_x < q_x  # u < q/p, without dividing
    n = mx.cumprod(keep.astype(mx.int32)).sum()
    residual = mx.maximum(q[:K] - p, 0.0)  # [K, V]
    # A row with no residual mass (p == q there) is never reached: rejection
    # has probability 0. Fall back to q only to keep its sample finite.
    empty = residual.sum(axis=-1, keepdims=True) <= 0
    residual = mx.where(empty, q[:K], residual)
    rows = mx.concatenate([residual, q[K:]], axis=0)  # [K+1, V]
    candidates = mx.argmax(mx.log(rows) + gumbel, axis=-1)  # [K+1]: a draw from each row (Gumbel-max)
    return n, mx.take(candidates, n)


# Acceptance rules for a tree of N draft nodes verified in one target forward
# (`mlx_spec.tree`). Row 0 of the target's scores is for the children of the
# root (the pending token), row i + 1 for those of node i. They walk down from
# the root on the host, over arrays already evaluated, and return (path,
# next): the accepted nodes, root to leaf, and the token that follows them.


def accept_tree_greedy(target: list[int], tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """Follow, from the root, the child equal to the target's argmax (`target` [N+1])."""
    kids = children(parents)
    path, node = [], -1
    while True:
        want = target[node + 1]
        node = next((c for c in kids[node] if tokens[c] == want), None)
        if node is None:
            return path, want
        path.append(node)


def _draw(dist: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from a non-negative vector (normalised here)."""
    cdf = np.cumsum(dist, dtype=np.float64)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(dist) - 1))


def accept_tree_sampled(q: np.ndarray, u: list[float], tokens: list[int], parents: list[int],
                        draft_log_probs: np.ndarray | None) -> tuple[list[int], int]:
    """Recursive rejection sampling over siblings (SpecInfer, Sequoia): exact.

    At a node whose children x_1, x_2, ... were drawn from p_1, p_2, ...
    (`draft_log_probs` [N, V], each given the siblings before it; None:
    one-hot, a deterministic drafter), start from r = q, the target's
    distribution there (`q` [N+1, V]). Child x_i is kept with probability
    min(1, r(x_i) / p_i(x_i)), and the walk moves into it; on rejection r
    becomes the normalised max(0, r - p_i). When every child is rejected the
    token is drawn from r. Each trial returns a draw from r, so the walk draws
    each token from q. `u`: one uniform per trial and one for the final draw.
    """
    u = list(u)
    kids = children(parents)
    path, node = [], -1
    while True:
        r = np.array(q[node + 1], dtype=np.float64)
        for c in kids[node]:
            x = tokens[c]
            p = np.exp(draft_log_probs[c].astype(np.float64)) if draft_log_probs is not None else None
            p_x = 1.0 if p is None else p[x]
            if u.pop() * p_x < r[x]:
                path.append(c)
                node = c
                break
            if p is None:
                r[x] = 0.0
            else:
                r = np.maximum(r - p, 0.0)
            total = r.sum()
            # Zero mass left means this rejection had probability 0: unreachable.
            r = r / total if total > 0 else np.array(q[node + 1], dtype=np.float64)
        else:
            return path, _draw(r, u.pop())


def accept_tree_typical(q: np.ndarray, ok: list[bool], samples: list[int], tokens: list[int],
                        parents: list[int]) -> tuple[list[int], int]:
    """Medusa's typical acceptance: NOT distribution-preserving. `ok[i]`: node i
    is acceptable (see `typical_ok`); the longest acceptable path wins, and the
    next token is the one `samples` drew after its last node."""
    best: list[int] = []
    kids = children(parents)
    stack = [(c, [c]) for c in reversed(kids[-1]) if ok[c]]
    while stack:
        node, path = stack.pop()
        if len(path) > len(best):
            best = path
        stack.extend((c, path + [c]) for c in reversed(kids[node]) if ok[c])
    return best, samples[best[-1] + 1 if best else 0]


def typical_ok(logits: mx.array, tokens: mx.array, parents: list[int], params: SamplingParams,
               threshold: float = 0.09, alpha: float = 0.3) -> mx.array:
    """Medusa's bar: a node is acceptable when the target gives it probability
    above min(threshold, alpha * exp(-entropy)) at its parent. `[N]` bool."""
    lp = log_probs(logits, params)  # [N+1, V]
    q = mx.exp(lp)
    entropy = -(q * mx.where(q > 0, lp, 0.0)).sum(axis=-1)  # [N+1]
    bar = mx.minimum(threshold, alpha * mx.exp(-entropy))
    at = mx.array(parents) + 1
    q_x = mx.take_along_axis(q[at], tokens[:, None], axis=-1)[:, 0]  # [N]
    return q_x > bar[at]


def verdict_arrays(logits: mx.array, drafts: list, params: list[SamplingParams], rule: str = "exact") -> list:
    """What every row's verdict on its draft is read from, built lazily from one verification: `logits`
    `[B, S, V]`, row b's scores at its pending token and at each of its draft's nodes (then padding).
    Chains and trees, greedy, sampled (exact) or typical (Medusa's lossy rule, trees only); the
    decoder reads them with the round's other values (`host.read`), and `verdicts` finishes."""
    lazy = []
    for b, (draft, p) in enumerate(zip(drafts, params)):
        n = len(draft)
        scores = logits[b, : n + 1]  # [n+1, V]
        if n == 0:
            lazy.append(sample(scores[-1], p))
        elif draft.parents is None and p.greedy:
            lazy.append(mx.stack(accept_greedy(scores, draft.tokens)))
        elif draft.parents is None:
            lazy.append(mx.stack(accept_sampled(scores, draft.tokens, draft.log_probs, p)))
        elif p.greedy:
            lazy.append(mx.argmax(scores, axis=-1))
        elif rule == "typical":
            lazy.append([mx.exp(log_probs(scores, p)), typical_ok(scores, draft.tokens, draft.parents, p),
                         sample(scores, p)])
        else:
            lazy.append([mx.exp(log_probs(scores, p)), mx.random.uniform(shape=(n + 1,))]
                        + ([draft.log_probs] if draft.log_probs is not None else []))
    return lazy


def verdicts(read: list, drafted: list[list[int]], drafts: list, params: list[SamplingParams],
             rule: str = "exact") -> list[tuple[list[int], int]]:
    """Per row, from `verdict_arrays` as read on the host and its drafted tokens: the accepted draft
    nodes (in order) and the token that follows them (tree walks run here)."""
    out = []
    for draft, tokens, p, r in zip(drafts, drafted, params, read):
        if len(draft) == 0:
            out.append(([], r))
        elif draft.parents is None:
            k, token = r
            out.append((list(range(k)), token))
        elif p.greedy:
            out.append(accept_tree_greedy(r, tokens, draft.parents))
        elif rule == "typical":
            q, ok, samples = r
            out.append(accept_tree_typical(q, ok, samples, tokens, draft.parents))
        else:
            q, u, *lp = r
            out.append(accept_tree_sampled(q, u, tokens, draft.parents, lp[0] if lp else None))
    return out
