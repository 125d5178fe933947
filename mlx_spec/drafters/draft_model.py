"""Draft model: a smaller model with the target's tokenizer drafts autoregressively.

Its K steps are built as one lazy graph (each step's token feeds the next as an
array, never through Python), so drafting costs one evaluation. Its KV cache
keeps the longest prefix that is still valid after each verification. With a
tree budget it drafts EAGLE-2's dynamic tree instead: a forward of it a depth,
over the most confident nodes so far (a draft model's second choice is often
the target's first: the tree keeps both for a verification's width).

PARD (AMD, `amd/PARD-*`): a draft model trained to fill K positions at once.
It reads the new tokens followed by K-1 copies of its `pard_token` in one
forward; position i's distribution is the draft for token i (each drawn from
its own distribution, which does not depend on the earlier drafts), and the
mask tokens leave its cache after.

PARD-2 (`amd/PARD2-*`) adds the target's features to its input: position j
reads `embed(t_j) + scale * target_proj(f_{j-1})`, f the target's hidden
states at the layers its config names side by side (f_{-1} = 0), the mask
slots those of the last real token.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_spec.cache import TAPE_MAX, RecurrentCache, cut_cache
from mlx_spec.drafters.base import (EMPTY, READ_MAX, Conversion, Draft, Kind, Options, Recipe, RowStates,
                                    common_prefix, draw_rows, grow_tree, padded_length)
from mlx_spec.errors import UserError
from mlx_spec.models.llama import Model
from mlx_spec.sampling import SamplingParams


class DraftModel(RowStates):
    kind = "draft"
    costly = True

    def __init__(self, model: Model, target_vocab: int, path: Path | None = None, budget: int | None = None,
                 topk: int = 8, depth: int = 6):
        super().__init__()
        self.model = model
        self.vocab = target_vocab
        self.path = path  # where the model was loaded from
        self.budget, self.topk, self.depth = budget, topk, depth  # a tree's (`grow_tree`); None: a chain
        if budget is not None:
            self.k_max = min(self.k_max, depth)  # a deeper K drafts no more
        self.cache = model.make_cache(rows=0)

    @property
    def caches(self) -> list:
        return self.cache

    def new_row(self) -> dict:
        # the tokens whose K/V the cache holds; the context's length at the last proposal;
        # how many drafted tokens it wrote then, until the commit
        return {"cached": [], "base": 0, "drafted": 0}

    def _session(self) -> DraftModel:
        return DraftModel(self.model, self.vocab, self.path, self.budget, self.topk, self.depth)

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
        # target accepted are the context's next ones (all but the round's last token). With no draft
        # written it holds context alone: nothing to compare (at 8k tokens that was 0.4 ms a plain round).
        if not self.drafted[b]:
            return
        base = self.base[b]
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
        forward over all of it would hold attention scores quadratic in its length. A hybrid model's
        linear-attention layers cut padding back only within a taped forward: it reads TAPE_MAX at most."""
        most = TAPE_MAX if any(isinstance(c, RecurrentCache) for c in self.cache) else READ_MAX
        while max(len(t) for t in new) > most:
            self._read_once([t[: max(len(t) - most, 0)][:most] for t in new])
            new = [t[min(max(len(t) - most, 0), most):] for t in new]
        return self._read_once(new)

    def _read_once(self, new: list[list[int]]) -> tuple[mx.array, list[int]]:
        lengths = [len(held) for held in self.cached]
        n = [len(t) for t in new]
        S = padded_length(max(n))
        feed = mx.array([t + [0] * (S - len(t)) for t in new])  # [B, S]: padding is cut from the cache
        logits = self._forward(feed, lengths)  # [B, S, V]
        for b, (held, m) in enumerate(zip(lengths, n)):
            cut_cache(self.cache, b, held + m)
        for held, t in zip(self.cached, new):
            held.extend(t)
        return logits, n

    def _forward(self, feed: mx.array, held: list[int]) -> mx.array:
        """The model over `feed` `[B, S]`, row b's tokens from position `held[b]` on -> logits `[B, S, V]`."""
        return self.model(feed, self.cache)[0]

    def catch_up(self, contexts: list[list[int]]) -> int:
        new = [c[len(held) : len(c) - 1] for c, held in zip(contexts, self.cached)]  # `propose` feeds the last
        if any(new):
            self._read(new)
            mx.eval([c.state for c in self.cache])
        return sum(map(len, new))

    def propose(self, contexts: list[list[int]], ks: list[int], params: list[SamplingParams]) -> list[Draft]:
        K = max(ks)
        if K == 0:
            return [EMPTY() for _ in ks]
        # Every row first reads what it has not (its last token, at least), padded to one forward.
        logits, n = self._read([c[len(held):] for c, held in zip(contexts, self.cached)])
        last = logits[mx.arange(len(n)), mx.array(n) - 1]  # [B, V]: each row's last real token
        self.base = [len(c) for c in contexts]
        if self.budget is not None:
            return self._tree(self._to_target_vocab(last), ks)
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

    def _tree(self, last: mx.array, ks: list[int]) -> list[Draft]:
        """`grow_tree` from each row's root distribution `last` `[B, V]`: a depth's nodes at their own positions,
        each seeing its context and ancestors; the tree's slots leave the cache after (the kept nodes are read
        as the next round's new tokens)."""
        def step(ids, positions, mask, parent_rows):
            logits, _ = self.model(mx.array(ids), self.cache, positions=mx.array(positions), mask=mx.array(mask))
            return self._to_target_vocab(logits)  # [B, F, V]

        drafts = grow_tree(last[:, None], ks, list(self.base), lambda: list(self.cache[0].lengths), step,
                           self.budget, self.topk, self.depth)
        for b, held in enumerate(self.cached):
            self._keep(b, len(held))
        self.drafted = [0] * len(ks)
        return drafts


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


class Pard2(Pard):
    """PARD-2: PARD reading the target's features (see the module docstring)."""

    def __init__(self, model: Model, target_vocab: int, pard_token: int, proj: nn.Linear, scale: float,
                 capture: tuple[int, ...], norm: nn.Module | None, path: Path | None = None):
        super().__init__(model, target_vocab, pard_token, path)
        self.proj, self.scale, self.norm = proj, scale, norm
        self.capture = capture  # the target's hidden states it reads; with `norm`, the last is the final norm's output

    def new_row(self) -> dict:
        # the target's features `[T, F]` of positions `start` on (None: none yet), then each round's taps
        # since the last read, `pending` (joined when read: a plain round adds no work), up to position `end`
        return {**super().new_row(), "features": None, "pending": [], "start": 0, "end": 0}

    def _session(self) -> Pard2:
        return Pard2(self.model, self.vocab, self.pard_token, self.proj, self.scale, self.capture, self.norm, self.path)

    def restart(self, b: int, prompt: list[int], cached: int = 0) -> int:
        # The draft model keeps what it shares with the prompt, but position j read the features of j - 1:
        # the target reads again from the one before the first it will read.
        shared = min(common_prefix(self.cached[b], prompt), len(prompt) - 1)
        kept = min(cached, max(shared - 1, 0))
        self._keep(b, min(shared, kept + 1))
        self.features[b], self.pending[b], self.base[b] = None, [], len(self.cached[b])
        self.start[b] = self.end[b] = kept
        return kept

    def commit(self, b: int, context: list[int], features: tuple[mx.array, ...] = ()) -> None:
        super().commit(b, context)
        if not features:
            return
        at = len(context) - 1 - features[0].shape[1]  # the position of their first token
        if at != self.end[b]:  # not where the last ended: these alone
            self.features[b], self.pending[b], self.start[b] = None, [], at
        self.pending[b].append(features)
        self.end[b] = at + features[0].shape[1]

    def _row_features(self, b: int, first: int) -> mx.array | None:
        """Row b's features `[T, F]` from position `first` on (None: none came), those before dropped."""
        if self.pending[b]:
            last = max(self.capture) if self.norm is not None else None
            taps = [mx.concatenate(tap, axis=1)[0] for tap in zip(*self.pending[b])]  # each [n, H]
            new = mx.concatenate([self.norm(h) if i == last else h for i, h in zip(self.capture, taps)], axis=-1)
            held = self.features[b]
            self.features[b] = new if held is None else mx.concatenate([held, new])
            self.pending[b] = []
        f = self.features[b]
        if f is not None and first > self.start[b]:
            drop = min(first - self.start[b], f.shape[0] - 1)
            self.features[b], self.start[b] = f[drop:], self.start[b] + drop
        return self.features[b]

    def _forward(self, feed: mx.array, held: list[int]) -> mx.array:
        S, F = feed.shape[1], self.proj.weight.shape[1]
        rows = []
        for b, first in enumerate(held):
            f = self._row_features(b, first - 1)
            want = np.arange(first - 1, first - 1 + S)  # position j reads the features of j - 1
            if f is None:
                rows.append(mx.zeros((S, F), self.proj.weight.dtype))
                continue
            at = np.clip(want - self.start[b], 0, f.shape[0] - 1)  # past the last (the masks): the last
            rows.append(f[mx.array(at)] * mx.array(want >= 0)[:, None])  # before the text: none
        h = self.model.embed(feed) + self.proj(mx.stack(rows)) * self.scale  # [B, S, H]
        return self.model.head(self.model.run_layers(h, self.cache, range(len(self.model.layers))))


WARP = ("warp_model.bin", "warp_model.safetensors")  # AMD's (torch.save), or as its converter and mlx-spec write it


def _pard2(model: Model, target, token: int, path: Path, config: dict, o: Options) -> Pard2:
    """A PARD-2 drafter: its projection from `warp_model.bin` (beside its weights in the repo), reading the
    target's layers its config names (indices into Hugging Face's `hidden_states`, the last the final norm's)."""
    from mlx_spec import hub
    from mlx_spec.torch_pickle import read_torch_file

    name = path / "config.json"
    L, H = target.args.num_hidden_layers, target.args.hidden_size
    layers, dim, scale = (config.get(f"pard2_{field}", default) for field, default in
                          (("target_layers", None), ("target_dim", 4096), ("scale", 0.02)))  # AMD's defaults
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) and -L - 1 <= i <= L for i in layers):
        raise UserError(f"{name}: pard2_target_layers must list the target's hidden states (-{L + 1}..{L}), "
                        f"got {layers!r}")
    if dim != len(layers) * H:
        raise UserError(f"{name}: pard2_target_dim is {dim!r}, the target gives {len(layers)} x {H}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise UserError(f"{name}: pard2_scale must be a number, got {scale!r}")
    if not isinstance(model, Model):
        raise UserError(f"{name}: a PARD-2 drafter must be a Llama, Qwen2 or Qwen3 model")
    folder = hub.resolve(o.source, o.revision, WARP)
    warp = next((folder / file for file in WARP if (folder / file).is_file()), folder / WARP[0])
    if not warp.is_file():
        raise UserError(f"{warp}: missing (PARD-2's feature projection)")
    try:
        weights = read_torch_file(warp) if warp.suffix == ".bin" else mx.load(str(warp))
    except (ValueError, RuntimeError) as e:
        raise UserError(f"{warp}: not readable ({e})") from None
    bias = bool(config.get("pard2_proj_bias", False))
    proj = nn.Linear(dim, model.args.hidden_size, bias=bias)
    for key, shape in [("weight", (model.args.hidden_size, dim))] + [("bias", (model.args.hidden_size,))] * bias:
        value = weights.get(f"target_proj.{key}")
        if value is None or tuple(value.shape) != shape:
            raise UserError(f"{warp}: target_proj.{key} must be {list(shape)}, got "
                            f"{list(value.shape) if value is not None else 'none'}")
        setattr(proj, key, value)
    capture = tuple(i % (L + 1) for i in layers)
    norm = target.final_norm if L in capture else None
    return Pard2(model, target.args.vocab_size, token, proj, float(scale), capture, norm, path)


def build(target: Model, o: Options) -> DraftModel:
    """A draft model; a PARD model (its config names a `pard_token`) drafts as one, whether given
    as `pard=` or `draft=`."""
    from mlx_spec.models import load_model
    from mlx_spec.models.load import read_json
    from mlx_spec.tokenizer import check_same_vocab, load_tokenizer

    model, path = load_model(o.source, o.revision)
    if o.tokenizer is not None:
        check_same_vocab(load_tokenizer(Path(path)), o.tokenizer, f"--drafter {o.spec}", "the target")
    config = read_json(Path(path) / "config.json")
    token = config.get("pard_token")
    if o.tree_budget is not None and (token is not None or not isinstance(model, Model)
                                      or any(isinstance(c, RecurrentCache) for c in model.make_cache())):
        raise UserError(f"--tree-budget: the draft model {path} cannot draft a tree (a PARD model drafts its K in one "
                        "forward; a linear-attention layer's state has no branches)")
    if token is None:
        if o.spec.startswith("pard"):
            raise UserError(f"--drafter {o.spec}: {Path(path) / 'config.json'} names no pard_token (not a PARD model)")
        return DraftModel(model, target.args.vocab_size, Path(path), o.tree_budget, o.topk, o.depth)
    if not isinstance(token, int) or not 0 <= token < model.args.vocab_size:
        raise UserError(f"{Path(path) / 'config.json'}: pard_token must be a token id below {model.args.vocab_size}, "
                        f"got {token!r}")
    if config.get("spd_type") == "pard2" or config.get("pard2") is True:
        return _pard2(model, target, token, Path(path), config, o)
    return Pard(model, target.args.vocab_size, token, Path(path))


# A model in safetensors loads as it is; one published in pytorch_model.bin form only is converted.
CONVERT = Conversion("llama", whole=True, as_is=lambda path, config: any(path.glob("*.safetensors"))
                     or not any(path.glob("pytorch_model*.bin")))


def train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--student", required=True, help="the draft model to adapt: folder or Hub repo id")
    p.add_argument("--k", type=int, default=8,
                   help="positions it learns to fill in one forward (the real one and K-1 masks)")
    p.add_argument("--pard-token", type=int, default=None, help="the mask token (default: the embedding's last row)")
    p.add_argument("--target", default=None,
                   help="PARD-2: the target whose features the drafter reads (folder or Hub repo id)")
    p.add_argument("--target-layers", default=None,
                   help="PARD-2: the target's hidden states read, as transformers indexes them (-1: the final "
                        "norm's output; default -1,-8,-16,-24, those the target has)")
    p.add_argument("--feature-scale", type=float, default=0.02, help="PARD-2: the projected features' scale")
    p.add_argument("--feature-drop", type=float, default=0.5,
                   help="PARD-2: how often a row's features are dropped (it drafts without them too)")
    p.set_defaults(lr=1e-4)


TRAIN = Recipe("PARD (AMD's recipe): the draft model reads each row K times in one forward, its copies 1..K-1 as "
               "mask tokens that see the real tokens up to i before them, and learns the token i + 1 ahead; with "
               "--target, PARD-2's (the target's features projected into each input, the target's distribution "
               "weighted by how likely it is to reach each token); OUT is a folder that --drafter pard=OUT loads.",
               train_arguments, "mlx_spec.train.pard:run")
# AMD's PARD drafters are target-independent: each serves its family's models. A PARD-2 one, trained on one
# target's features (AMD's evaluation pairs), comes first where there is one.
PUBLISHED_PARD = {
    "Qwen/Qwen3-4B": ("amd/PARD-Qwen3-0.6B",), "Qwen/Qwen3-32B": ("amd/PARD-Qwen3-0.6B",),
    "Qwen/Qwen3-8B": ("amd/PARD2-Qwen3-8B", "amd/PARD-Qwen3-0.6B"),
    "Qwen/Qwen3-14B": ("amd/PARD2-Qwen3-14B", "amd/PARD-Qwen3-0.6B"),
    "meta-llama/Llama-3.1-8B-Instruct": ("amd/PARD2-Llama-3.1-8B", "amd/PARD-Llama-3.2-1B"),
    "meta-llama/Llama-3.3-70B-Instruct": ("amd/PARD-Llama-3.2-1B",),
}
KINDS = (Kind("draft", "a smaller model with the same tokenizer (trained with mlx-spec distill; a PARD model "
              "drafts as one)", build, takes=("tree_budget",), convert=CONVERT),
         Kind("pard", "a PARD or PARD-2 draft model (AMD's, as published): K drafts in one forward of it", build,
              source="optional", alone="the one published for --model", convert=CONVERT, published=PUBLISHED_PARD,
              train=TRAIN))
