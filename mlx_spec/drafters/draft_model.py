"""Draft model: a smaller model with the target's tokenizer drafts autoregressively.

Its K steps are built as one lazy graph (each step's token feeds the next as an
array, never through Python), so drafting costs one evaluation. Its KV cache
keeps the longest prefix that is still valid after each verification.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from mlx_spec.cache import KVCache, trim_cache
from mlx_spec.drafters.base import Draft, Drafter, common_prefix
from mlx_spec.models.llama import Model
from mlx_spec.sampling import SamplingParams, draw


class DraftModel(Drafter):
    name = "draft"
    costly = True

    def __init__(self, model: Model, target_vocab: int, path: Path | None = None):
        self.model = model
        self.vocab = target_vocab
        self.path = path  # where the model was loaded from
        self.cache: list[KVCache] = model.make_cache()
        self.cached: list[int] = []  # the tokens whose K/V the cache holds
        self.base = 0  # context length at the last proposal

    def new_session(self) -> DraftModel:
        return DraftModel(self.model, self.vocab, self.path)

    def _keep(self, n: int) -> None:
        trim_cache(self.cache, len(self.cached) - n)
        del self.cached[n:]

    def reset(self, prompt: list[int], cached: int = 0) -> int:
        # Reuse what the cache shares with the new prompt (an earlier chat turn).
        # The last prompt token is always fed again, for its logits.
        self._keep(min(common_prefix(self.cached, prompt), len(prompt) - 1))
        return cached

    def commit(self, context: list[int], features: tuple[mx.array, ...] = ()) -> None:
        # The cache holds the old context and the draft but its last token; keep
        # the drafted tokens the target accepted (the context has them next).
        base = self.base
        n = 0
        for drafted, kept in zip(self.cached[base:], context[base:]):
            if drafted != kept:
                break
            n += 1
        self._keep(min(base + n, len(context) - 1))

    def _to_target_vocab(self, logits: mx.array) -> mx.array:
        """Cut or pad (with -inf) the draft's padded vocabulary to the target's."""
        V = logits.shape[-1]
        if V > self.vocab:
            return logits[..., : self.vocab]
        if V < self.vocab:
            pad = mx.full((*logits.shape[:-1], self.vocab - V), float("-inf"), logits.dtype)
            return mx.concatenate([logits, pad], axis=-1)
        return logits

    def propose(self, context: list[int], k: int, params: SamplingParams) -> Draft:
        new = context[len(self.cached) :]
        feed = mx.array(new)[None]  # [1, S], S >= 1
        self.cached.extend(new)
        self.base = len(context)
        tokens, dists = [], []
        for _ in range(k):
            logits, _ = self.model(feed, self.cache)
            logits = self._to_target_vocab(logits[0, -1])  # [V]
            token, lp = draw(logits, params)
            tokens.append(token)
            dists.append(lp)
            feed = token.reshape(1, 1)
        draft = Draft.chain(tokens, dists)
        # The cache now holds the context and every draft token but the last.
        self.cached.extend(draft.tokens[:-1].tolist())
        return draft
