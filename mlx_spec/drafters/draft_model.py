"""Draft model: a smaller model with the target's tokenizer drafts autoregressively.

Its K steps are built as one lazy graph (each step's token feeds the next as an
array, never through Python), so drafting costs one evaluation. Its KV cache
keeps the longest prefix that is still valid after each verification.

PARD (AMD, `amd/PARD-*`): a draft model trained to fill K positions at once.
It reads the new tokens followed by K-1 copies of its `pard_token` in one
forward; position i's distribution is the draft for token i (each drawn from
its own distribution, which does not depend on the earlier drafts), and the
mask tokens leave its cache after.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx.core as mx

from mlx_spec.cache import cut_cache
from mlx_spec.drafters.base import (EMPTY, READ_MAX, Conversion, Draft, Kind, Options, Recipe, RowStates,
                                    common_prefix, draw_rows, padded_length)
from mlx_spec.errors import UserError
from mlx_spec.models.llama import Model
from mlx_spec.sampling import SamplingParams


class DraftModel(RowStates):
    kind = "draft"
    costly = True

    def __init__(self, model: Model, target_vocab: int, path: Path | None = None):
        super().__init__()
        self.model = model
        self.vocab = target_vocab
        self.path = path  # where the model was loaded from
        self.cache = model.make_cache(rows=0)

    @property
    def caches(self) -> list:
        return self.cache

    def new_row(self) -> dict:
        # the tokens whose K/V the cache holds; the context's length at the last proposal;
        # how many drafted tokens it wrote then, until the commit
        return {"cached": [], "base": 0, "drafted": 0}

    def _session(self) -> DraftModel:
        return DraftModel(self.model, self.vocab, self.path)

    def _keep(self, b: int, n: int) -> None:
        cut_cache(self.cache, b, n)
        del self.cached[b][n:]

    def restart(self, b: int, prompt: list[int], cached: int = 0) -> int:
        # Reuse what the cache shares with the new prompt (an earlier chat turn).
        # The last prompt token is always fed again, for its logits.
        self._keep(b, min(common_prefix(self.cached[b], prompt), len(prompt) - 1))
        self.base[b] = len(self.cached[b])  # a plain round may come first: its commit compares from here
        return cached

    def commit(self, b: int, context: list[int], features: tuple[mx.array, ...] = ()) -> None:
        # The cache holds the old context and the draft but its last token; the drafted tokens the
        # target accepted are the context's next ones (all but the round's last token).
        base = self.base[b]
        if self.drafted[b]:
            self.cached[b].extend(context[base : base + min(self.drafted[b], len(context) - 1 - base)])
            self.drafted[b] = 0
        n = common_prefix(self.cached[b][base:], context[base:])
        self._keep(b, min(base + n, len(context) - 1))

    def _to_target_vocab(self, logits: mx.array) -> mx.array:
        """Cut or pad (with -inf) the draft's padded vocabulary to the target's."""
        V = logits.shape[-1]
        if V > self.vocab:
            return logits[..., : self.vocab]
        if V < self.vocab:
            pad = mx.full((*logits.shape[:-1], self.vocab - V), float("-inf"), logits.dtype)
            return mx.concatenate([logits, pad], axis=-1)
        return logits

    def _read(self, new: list[list[int]]) -> tuple[mx.array, list[int]]:
        """Each row's `new` tokens into the cache, padded to one forward -> logits `[B, S, V]`, each row's n.
        A long span (a prompt) is read READ_MAX tokens a forward first, but for each row's last READ_MAX: one
        forward over all of it would hold attention scores quadratic in its length."""
        while max(len(t) for t in new) > READ_MAX:
            self._read_once([t[: max(len(t) - READ_MAX, 0)][:READ_MAX] for t in new])
            new = [t[min(max(len(t) - READ_MAX, 0), READ_MAX):] for t in new]
        return self._read_once(new)

    def _read_once(self, new: list[list[int]]) -> tuple[mx.array, list[int]]:
        lengths = [len(held) for held in self.cached]
        n = [len(t) for t in new]
        S = padded_length(max(n))
        feed = mx.array([t + [0] * (S - len(t)) for t in new])  # [B, S]: padding is cut from the cache
        logits, _ = self.model(feed, self.cache)  # [B, S, V]
        for b, (held, m) in enumerate(zip(lengths, n)):
            cut_cache(self.cache, b, held + m)
        for held, t in zip(self.cached, new):
            held.extend(t)
        return logits, n

    def catch_up(self, contexts: list[list[int]]) -> None:
        new = [c[len(held) : len(c) - 1] for c, held in zip(contexts, self.cached)]  # `propose` feeds the last
        if any(new):
            self._read(new)
            mx.eval([c.state for c in self.cache])

    def propose(self, contexts: list[list[int]], ks: list[int], params: list[SamplingParams]) -> list[Draft]:
        K = max(ks)
        if K == 0:
            return [EMPTY() for _ in ks]
        # Every row first reads what it has not (its last token, at least), padded to one forward.
        logits, n = self._read([c[len(held):] for c, held in zip(contexts, self.cached)])
        last = logits[mx.arange(len(n)), mx.array(n) - 1]  # [B, V]: each row's last real token
        self.base = [len(c) for c in contexts]
        # K steps, each token feeding the next as an array: one evaluation for all.
        tokens, dists = [], []
        for i in range(K):
            token, lp = draw_rows(self._to_target_vocab(last), params)  # [B], [B, V]
            tokens.append(token)
            dists.append(lp)
            if i + 1 < K:
                logits, _ = self.model(token[:, None], self.cache)
                last = logits[:, -1]
        # The cache now holds each context and every draft token but the last: those
        # the target keeps join `cached` at the commit.
        self.drafted = [K - 1] * len(ks)
        return Draft.steps(tokens, dists, ks)


class Pard(DraftModel):
    """PARD: K drafts in one forward of a draft model (see the module docstring)."""

    kind = "pard"
    k_max = 16  # one forward whatever K: far positions cost little

    def __init__(self, model: Model, target_vocab: int, pard_token: int, path: Path | None = None):
        super().__init__(model, target_vocab, path)
        self.pard_token = pard_token

    def _session(self) -> Pard:
        return Pard(self.model, self.vocab, self.pard_token, self.path)

    def propose(self, contexts: list[list[int]], ks: list[int], params: list[SamplingParams]) -> list[Draft]:
        K = max(ks)
        if K == 0:
            return [EMPTY() for _ in ks]
        logits, n = self._read([c[len(held):] + [self.pard_token] * (K - 1) for c, held in zip(contexts, self.cached)])
        at = mx.array([[m - K + i for i in range(K)] for m in n])  # [B, K]: the last real token, then the masks
        logits = mx.take_along_axis(logits, at[..., None], axis=1)  # [B, K, V]
        for b, c in enumerate(contexts):
            self._keep(b, len(c))  # the masks leave the cache
        self.base, self.drafted = [len(c) for c in contexts], [0] * len(ks)
        tokens, lp = draw_rows(self._to_target_vocab(logits), params)  # [B, K], [B, K, V]
        return Draft.rows(tokens, lp, ks)


def build(target: Model, o: Options) -> DraftModel:
    """A draft model; a PARD model (its config names a `pard_token`) drafts as one, whether given
    as `pard=` or `draft=`."""
    from mlx_spec.models import load_model
    from mlx_spec.models.load import read_json
    from mlx_spec.tokenizer import check_same_vocab, load_tokenizer

    model, path = load_model(o.source, o.revision)
    if o.tokenizer is not None:
        check_same_vocab(load_tokenizer(Path(path)), o.tokenizer, f"--drafter {o.spec}", "the target")
    token = read_json(Path(path) / "config.json").get("pard_token")
    if token is None:
        if o.spec.startswith("pard"):
            raise UserError(f"--drafter {o.spec}: {Path(path) / 'config.json'} names no pard_token (not a PARD model)")
        return DraftModel(model, target.args.vocab_size, Path(path))
    if not isinstance(token, int) or not 0 <= token < model.args.vocab_size:
        raise UserError(f"{Path(path) / 'config.json'}: pard_token must be a token id below {model.args.vocab_size}, "
                        f"got {token!r}")
    return Pard(model, target.args.vocab_size, token, Path(path))


# A model in safetensors loads as it is; one published in pytorch_model.bin form only is converted.
CONVERT = Conversion("llama", whole=True, as_is=lambda path, config: any(path.glob("*.safetensors"))
                     or not any(path.glob("pytorch_model*.bin")))


def train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--student", required=True, help="the draft model to adapt: folder or Hub repo id")
    p.add_argument("--k", type=int, default=8,
                   help="positions it learns to fill in one forward (the real one and K-1 masks)")
    p.add_argument("--pard-token", type=int, default=None, help="the mask token (default: the embedding's last row)")
    p.set_defaults(lr=1e-4)


TRAIN = Recipe("PARD (AMD's recipe): the draft model reads each row K times in one forward, its copies 1..K-1 as "
               "mask tokens that see the real tokens up to i before them, and learns the token i + 1 ahead; OUT is "
               "a folder that --drafter pard=OUT loads.", train_arguments, "mlx_spec.train.pard:run")
PUBLISHED_PARD = {  # AMD's, target-independent: each serves its family's models
    "Qwen/Qwen3-8B": ("amd/PARD-Qwen3-0.6B",), "Qwen/Qwen3-4B": ("amd/PARD-Qwen3-0.6B",),
    "Qwen/Qwen3-14B": ("amd/PARD-Qwen3-0.6B",), "Qwen/Qwen3-32B": ("amd/PARD-Qwen3-0.6B",),
    "meta-llama/Llama-3.1-8B-Instruct": ("amd/PARD-Llama-3.2-1B",),
    "meta-llama/Llama-3.3-70B-Instruct": ("amd/PARD-Llama-3.2-1B",),
}
KINDS = (Kind("draft", "a smaller model with the same tokenizer (trained with mlx-spec distill; a PARD model "
              "drafts as one)", build, convert=CONVERT),
         Kind("pard", "a PARD draft model (AMD's, as published): K drafts in one forward of it", build,
              source="optional", alone="the one published for --model", convert=CONVERT, published=PUBLISHED_PARD,
              train=TRAIN))
