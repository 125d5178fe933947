"""Prompt lookup: draft what followed the last n-gram's latest earlier occurrence.

The context is indexed incrementally: each committed token adds the n-grams that
end just before it, mapped to where their continuation starts, so a lookup costs
O(max_n) whatever the context length (no rescan).
"""

from __future__ import annotations

import mlx.core as mx

from mlx_spec.drafters.base import Draft, Drafter
from mlx_spec.errors import UserError
from mlx_spec.sampling import SamplingParams


class PromptLookup(Drafter):
    name = "lookup"

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise UserError(f"--drafter lookup: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.seen = 0  # tokens of the context indexed so far
        # n-gram -> index of the token that followed its latest occurrence
        self.index: dict[tuple[int, ...], int] = {}

    def new_session(self) -> PromptLookup:
        return PromptLookup(self.min_n, self.max_n)

    def reset(self, prompt: list[int], cached: int = 0) -> int:
        self.seen, self.index = 0, {}
        self.commit(prompt)
        return cached

    def commit(self, context: list[int], features: tuple[mx.array, ...] = ()) -> None:
        # The loop only appends to the context; index the new tokens.
        for t in range(max(self.seen, 1), len(context)):
            # n-grams ending at t - 1 are followed by the token at t
            for n in range(self.min_n, min(self.max_n, t) + 1):
                self.index[tuple(context[t - n : t])] = t
        self.seen = len(context)

    def propose(self, context: list[int], k: int, params: SamplingParams) -> Draft:
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            start = self.index.get(tuple(context[-n:]))
            if start is not None:
                # A continuation that runs into the end of the context goes on
                # with the draft itself: repeating text keeps repeating.
                draft = context[start : start + k]
                while len(draft) < k:
                    draft.append(draft[len(draft) - (len(context) - start)])
                return Draft(mx.array(draft, dtype=mx.int32))
        return Draft(mx.array([], dtype=mx.int32))
