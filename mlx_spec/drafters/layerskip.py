"""LayerSkip (Elhoushi et al. 2024): the target drafts with its own first E layers.

Drafting runs layers 0..E-1, the final norm and the LM head, writing those
layers' keys and values into the target's own cache and keeping the layer-E
input of each drafted token. Verification then reuses both: the tokens the
draft already ran need only layers E..L-1, and only the last drafted token
(which drafting never fed back) runs the first E layers. A round of K drafts
costs K early-exit steps plus one pass of the remaining layers, against
K early-exit steps and a full pass if verification started from scratch.
Under exact verification every one of these forwards is as wide as the
target's (`mlx_spec.exact`): a drafting step's padding is cut from the first
layers at once, and a verification's from the first layers' last forward.

Without a given E, `choose_exit` picks the layer whose early-exit predictions
on the prompt promise the best speedup.
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from mlx_spec.cache import KVCache, trim_cache
from mlx_spec.drafters.base import Draft, HostDrafter, Kind, Options, Recipe
from mlx_spec.errors import UserError
from mlx_spec.metrics import expected_tokens
from mlx_spec.models.llama import Model
from mlx_spec.sampling import SamplingParams, draw


def choose_exit(target: Model, prompt: list[int], k: int = 4) -> int:
    """The exit layer with the best expected speedup on `prompt`: each E's
    agreement alpha with the full model's argmax there, a draft costing E/L of
    a step and a verification (L-E)/L, speedup (1 - alpha^(k+1)) / ((1 - alpha)(k E/L + 1))."""
    L = target.args.num_hidden_layers
    if L < 2 or len(prompt) < 2:
        return max(L // 2, 1)
    logits, hidden = target(mx.array([prompt]), capture=tuple(range(1, L)))
    full = mx.argmax(logits[0], axis=-1)  # [S]
    best, best_speedup = max(L // 2, 1), 0.0
    for E, h in zip(range(1, L), hidden):
        alpha = (mx.argmax(target.head(h[0]), axis=-1) == full).mean().item()
        speedup = expected_tokens(alpha, k) / (k * E / L + 1)
        if speedup > best_speedup:
            best, best_speedup = E, speedup
    return best


class LayerSkip(HostDrafter):
    """Drafts into the target's own cache, so it serves one row."""

    kind = "layerskip"
    costly = True
    one_row = True

    def __init__(self, target: Model, exit_layer: int | None = None):
        super().__init__()
        self.target, self.fixed = target, exit_layer
        self.exit = exit_layer or max(target.args.num_hidden_layers // 2, 1)
        self.cache: list[KVCache] = []
        self.width: int | None = None  # every forward this wide (exact verification)
        self.saved: mx.array | None = None  # layer-E inputs of the drafted-over tokens [1, k, H]

    def _session(self) -> LayerSkip:
        return LayerSkip(self.target, self.fixed)

    def bind(self, cache: list[KVCache], width: int | None = None) -> None:
        self.cache, self.width = cache, width

    def restart(self, b: int, prompt: list[int], cached: int = 0) -> int:
        self.saved = None
        if self.fixed is None:
            self.exit = choose_exit(self.target, prompt)
        return cached

    def propose_row(self, b: int, context: list[int], k: int, params: SamplingParams) -> Draft:
        early = range(self.exit)
        feed = mx.array(context[-1:])[None]  # the pending token first
        states, tokens, dists = [], [], []
        for i in range(k):
            if self.width:  # throwaway tokens to the width, their keys cut at once
                feed = mx.concatenate([feed, mx.zeros((1, self.width - 1), feed.dtype)], axis=1)
            h = self.target.run_layers(self.target.embed(feed), self.cache, early, exact=bool(self.width))[:, :1]
            if self.width:
                trim_cache(self.cache[: self.exit], self.width - 1)
            states.append(h)  # [1, 1, H]
            logits = self.target.head(h)[:, -1]  # [1, V]
            token, lp = draw(logits, params)
            tokens.append(token)
            dists.append(lp)
            feed = token.reshape(1, 1)
        self.saved = mx.concatenate(states, axis=1)  # [1, k, H]: the pending token and all drafts but the last
        return Draft.steps(tokens, dists, [k])[0]

    def verify_forward(self, target, inputs: mx.array, cache: list, capture: tuple[int, ...],
                       exact: bool = False) -> tuple[mx.array, tuple[mx.array, ...]]:
        saved, self.saved = self.saved, None
        k = saved.shape[1] if saved is not None else 0  # inputs: the pending token, k drafts (then padding, exact)
        if not k or (not exact and k != inputs.shape[1] - 1):
            return super().verify_forward(target, inputs, cache, capture, exact)  # a plain round
        L, S = target.args.num_hidden_layers, inputs.shape[1]
        # Only the last draft has not been through the first E layers (exact: k more throwaway tokens after
        # the width's, cut at once, so the first layers hold as many tokens as the others).
        tail = mx.pad(inputs[:, k:], [(0, 0), (0, k)]) if exact else inputs[:, k:]
        last = target.run_layers(target.embed(tail), cache, range(self.exit), exact=exact)[:, : S - k]
        if exact:
            trim_cache(cache[: self.exit], k)
        h = target.run_layers(mx.concatenate([saved, last], axis=1), cache, range(self.exit, L), exact=exact)
        return target.head(h), ()


def build(target: Model, o: Options) -> LayerSkip:
    L = target.args.num_hidden_layers
    if not target.runs_apart:
        raise UserError(f"--drafter {o.spec}: a {target.model_type} target runs whole (on mlx-lm's forward); "
                        "LayerSkip runs its first layers apart")
    if o.source and not (o.source.isdigit() and 0 < int(o.source) < L):
        raise UserError(f"--drafter layerskip={o.source}: the exit layer must be an integer in 1..{L - 1}")
    return LayerSkip(target, int(o.source) if o.source else None)


def train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="the model to fine-tune: folder or Hub repo id")
    p.add_argument("--layer-dropout", type=float, default=0.1, help="skip probability of the last layer (rising from 0)")
    p.add_argument("--exit-scale", type=float, default=1.0,
                   help="weight of the early exits' losses (layer l: scale x (l+1)/L)")
    p.set_defaults(lr=1e-4)


TRAIN = Recipe("LayerSkip: the target is fine-tuned in place with layer dropout rising with depth and an early-exit "
               "loss; OUT is a model folder to use with --drafter layerskip[=E].", train_arguments,
               "mlx_spec.train.layerskip:run")
KINDS = (Kind("layerskip", "the target's own first E layers, its final norm and LM head (self-speculation)", build,
              source="optional", alone="E chosen from the prompt", train=TRAIN),)
