"""What every drafter offers the decoding loop."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_spec import tree
from mlx_spec.sampling import SamplingParams


@dataclass
class Draft:
    """A chain or a tree of proposed tokens.

    `tokens` [K] may still be lazy (the draft model's are), so drafting and
    verification can be evaluated together. `log_probs` [K, V] are the
    distributions the tokens were drawn from; None for a deterministic drafter
    (the acceptance rule then treats p as one-hot). For a tree, `parents[i]`
    is node i's parent (-1: a child of the last context token; see
    `mlx_spec.tree`) and `log_probs[i]` the distribution node i was drawn
    from given its parent and its earlier siblings.
    """

    tokens: mx.array
    log_probs: mx.array | None = None
    parents: list[int] | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def chain(cls, tokens: list[mx.array], dists: list[mx.array | None]) -> Draft:
        """A chain from per-step tokens and `draw`'s distributions, evaluated at once."""
        draft = mx.stack(tokens).astype(mx.int32)  # [K]
        lp = mx.stack(dists) if dists and dists[0] is not None else None  # [K, V]
        mx.eval(draft, lp)
        return cls(draft, lp)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (binary search over C-level list compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Drafter(ABC):
    """Proposes tokens; keeps its own state in step with what the target accepted."""

    name = "drafter"
    # True when drafting costs model forwards (so the loop weighs its cost).
    costly = False
    # The target's hidden states this drafter reads (indices as the target's
    # `capture`); the verification returns them to `commit`.
    capture: tuple[int, ...] = ()

    def reset(self, prompt: list[int], cached: int = 0) -> int:
        """A new generation of the same session starts from `prompt`, and the
        target's cache holds `prompt[:cached]` (an earlier chat turn). Returns
        how many of those the target may keep: a drafter whose state follows
        the target's features keeps none, and the prompt is read again."""
        return cached

    def bind(self, cache: list) -> None:
        """The target's KV cache for this generation (self-speculation drafts into it)."""

    def verify_forward(self, target, inputs: mx.array, cache: list) -> tuple[mx.array, tuple[mx.array, ...]]:
        """The target's forward over a chain `[1, K+1]` -> (logits, the `capture`d hidden
        states); a drafter that already ran part of it (LayerSkip) reuses that."""
        return target(inputs, cache, capture=self.capture)

    @abstractmethod
    def new_session(self) -> "Drafter":
        """A drafter like this one (same weights, same settings) with no history."""

    @abstractmethod
    def propose(self, context: list[int], k: int, params: SamplingParams) -> Draft:
        """Up to `k` tokens to follow `context` (the prompt and every committed token)."""

    def commit(self, context: list[int], features: tuple[mx.array, ...] = ()) -> None:
        """The target accepted up to the end of `context`; drop stale state.

        `features` hold, per `capture` index, the target's hidden states
        `[1, n, H]` of the last n tokens of `context` but its last (which the
        target has not run yet): after a verification, the previous round's
        last token and the accepted drafts; while the prompt is read, a chunk
        of it.
        """


def depth_tree(logits: mx.array, k: int, paths: list[list[int]] | None = None, budget: int | None = None,
               topk: int = 10) -> Draft:
    """A deterministic tree from one distribution per depth (`logits` `[D, V]`):
    Medusa's heads, DFlash's block. Its nodes are the top candidates of each
    depth, combined along static `paths` (ranks per depth) or, with `budget`,
    the best-first tree of that many nodes by cumulative log-probability; at
    most `k` deep."""
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    topk = min(topk, lp.shape[-1])
    candidates = mx.argsort(-lp, axis=-1)[:, :topk]  # [D, topk], most likely first
    depth_max = min(k, lp.shape[0])
    if budget is not None:
        scores = np.array(mx.take_along_axis(lp, candidates, axis=-1)[:depth_max])  # [D, topk], descending
        paths = tree.best_first(scores, budget)
    else:
        paths = [p for p in paths or [] if len(p) <= depth_max and max(p) < topk]
    if not paths:
        return Draft(mx.array([], dtype=mx.int32))
    parents, depth, rank = tree.from_paths(paths)
    tokens = candidates[mx.array(depth) - 1, mx.array(rank)].astype(mx.int32)  # [N]
    return Draft(tokens, None, parents)
