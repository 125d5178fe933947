"""Prompt lookup: draft what followed the last n-gram's latest earlier occurrence.

The context is indexed incrementally: each committed token adds the n-grams that
end just before it, mapped to where their continuation starts, so a lookup costs
O(max_n) whatever the context length (no rescan).
"""

from __future__ import annotations

import mlx.core as mx

from mlx_spec.drafters.base import Draft, HostDrafter, Kind
from mlx_spec.errors import UserError
from mlx_spec.sampling import SamplingParams


class Index:
    """One row's n-grams: n-gram -> index of the token that followed its latest occurrence."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.seen = 0  # tokens of the context indexed so far
        self.next: dict[tuple[int, ...], int] = {}

    def add(self, context: list[int]) -> None:
        # The loop only appends to the context; index the new tokens.
        for t in range(max(self.seen, 1), len(context)):
            # n-grams ending at t - 1 are followed by the token at t
            for n in range(self.min_n, min(self.max_n, t) + 1):
                self.next[tuple(context[t - n : t])] = t
        self.seen = len(context)

    def draft(self, context: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            start = self.next.get(tuple(context[-n:]))
            if start is not None:
                # A continuation that runs into the end of the context goes on
                # with the draft itself: repeating text keeps repeating.
                draft = context[start : start + k]
                while len(draft) < k:
                    draft.append(draft[len(draft) - (len(context) - start)])
                return draft
        return []


class PromptLookup(HostDrafter):
    kind = "lookup"
    guesses = True
    k_max = 16  # a copy costs nothing to draft: only the verification grows with it

    def __init__(self, min_n: int = 1, max_n: int = 4):
        super().__init__()
        if not 1 <= min_n <= max_n:
            raise UserError(f"--drafter lookup: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def _session(self) -> PromptLookup:
        return PromptLookup(self.min_n, self.max_n)

    def restart(self, b: int, prompt: list[int], cached: int = 0) -> int:
        self.states[b] = Index(self.min_n, self.max_n)
        self.states[b].add(prompt)
        return cached

    def commit(self, b: int, context: list[int], features: tuple[mx.array, ...] = ()) -> None:
        self.states[b].add(context)

    def propose_row(self, b: int, context: list[int], k: int, params: SamplingParams) -> Draft:
        return Draft(mx.array(self.states[b].draft(context, k), dtype=mx.int32))

    def guess(self, b: int, context: list[int]) -> int | None:
        return next(iter(self.states[b].draft(context, 1)), None)


KINDS = (Kind("lookup", "the tokens that followed the last n-gram earlier in the text (--ngram-min, --ngram-max)",
              lambda target, o: PromptLookup(*o.ngram), source="none"),)
