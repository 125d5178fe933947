"""Targets of every other family mlx-lm implements: mlx-lm's own forward, whole.

The targets in `llama.py` and `mlxlm.py` run the layers one by one themselves,
which lets them verify trees and exit early (LayerSkip). A
family they do not know (Gemma 4's per-layer inputs and shared keys and
values, Gemma 2's soft-capped logits, GLM-4-MoE, ...) runs here through
mlx-lm's own model `__call__`, untouched: it is handed mlx-spec's KV cache
(which speaks mlx-lm's cache protocol: masks per row, trim), one per cache
mlx-lm's `make_cache` would make, and each of its layers is wrapped so that
the hidden state entering it is captured for the drafters that read the
target's features. What mlx-lm does between the layers is then whatever the
family does. A target verifies chains (the family's attention takes no
per-token positions), with no early exit. A family
whose layers keep a short convolution's last inputs beside keys and values
(LFM2), and a state space model's state (Granite 4.0-H's and Nemotron-H's
Mamba-2 layers), has both taped as a Gated DeltaNet's are
(`cache.RecurrentCache`): a cut takes the window ending at the last kept token
and replays the state space model over the kept tokens. Any other state (a
recurrence mlx-spec has no replay for) is refused: mlx-spec could not roll it
back.
"""

from __future__ import annotations

import contextvars
import importlib.util
from pathlib import Path
from typing import NoReturn, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlx_spec.cache import KVCache, LayerCaches, RecurrentCache, RowOf
from mlx_spec.errors import UserError
from mlx_spec.exact import EXACTLY
from mlx_spec.models.config import check_fields, mlx_lm_config
from mlx_spec.models.dtypes import cast_floating
from mlx_spec.models.mlxlm import MLXLMTarget, attends_exactly, classes, rebind

# model_type -> what it is; each checked against transformers' logits and greedy tokens (tests/test_whole_targets.py)
CHECKED = {
    "gemma4_text": "Gemma 4 text models (sliding and full layers, shared keys and values, per-layer inputs, softcap)",
    "gemma4": "Gemma 4 as published (its text model in `text_config`; the vision tower is not read)",
    "gemma2": "Gemma 2 (attention and final logit softcaps)",
    "glm4_moe": "GLM-4.5 / 4.6 mixture of experts",
    "lfm2": "LiquidAI LFM2 / LFM2.5 (short gated convolutions beside attention layers)",
    "lfm2_moe": "LiquidAI LFM2 mixture of experts (LFM2-8B-A1B)",
    "granitemoehybrid": "IBM Granite 4.0-H (Mamba-2 layers beside attention, mixture of experts)",
    "nemotron_h": "NVIDIA Nemotron-H / Nemotron 3 Nano (Mamba-2, attention, MLP and mixture-of-experts blocks)",
    "deepseek_v32": "DeepSeek-V3.2 (latent attention, its sparse attention's indexer, mixture of experts)",
}
# Families whose layers keep, beside keys and values, a convolution's last inputs and, in Mamba-2 layers,
# a state space model's state (mlx-lm's `ArraysCache`): model_type -> (the module of such a layer that
# reads and writes them, the name of its convolution). Both are taped and cut back (`_tape_state`).
TAPED = {"lfm2": ("conv", "conv"), "lfm2_moe": ("conv", "conv"), "granitemoehybrid": ("mamba", "conv1d"),
         "nemotron_h": ("mixer", "conv1d")}
# model_type -> mlx-lm's names for the parts drafters read, where they are not Llama's (`model`, and in it
# `embed_tokens` and the final `norm`)
NAMES = {"lfm2": {"norm": "embedding_norm"}, "lfm2_moe": {"norm": "embedding_norm"},
         "nemotron_h": {"model": "backbone", "embed_tokens": "embeddings", "norm": "norm_f"}}
# Families whose attention takes a batch's per-row masks (`[B, 1, S, L]`), checked with rows of a batch
# (tests/test_whole_targets.py); the others run a batch's rows one forward each (mlx-lm's gemma2, with
# grouped queries, broadcasts such a mask across heads wrongly).
BATCHED = ("gemma4_text", "gemma4", "glm4_moe", "deepseek_v32", *TAPED)
# The hidden states captured in the forward being run: layer index -> state entering it.
_STATES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("states", default=None)
# The states being taped in the forward being run: cache index -> its RecurrentCache.
_TAPES: contextvars.ContextVar[dict] = contextvars.ContextVar("tapes", default={})


def _capture(layer: nn.Module, i: int, last: bool) -> None:
    """Layer i of an mlx-lm model, as it is (its parameters where they were), recording the hidden
    state entering it (and, for the last layer, the one leaving it) while a forward that asks runs."""
    cls = type(layer)

    def call(self, x: mx.array, *args, **kwargs):
        out = cls.__call__(self, x, *args, **kwargs)
        states = _STATES.get()
        if states is not None:
            states[i] = x
            if last:  # some families' layers return more than the state (Gemma 4: its keys and values)
                states[i + 1] = out[0] if isinstance(out, tuple) else out
        return out

    layer.__class__ = type(cls.__name__, (cls,), {"__call__": call})


def _tape_state(module: nn.Module, conv: str, i: int) -> None:
    """A stateful module, as mlx-lm writes it, handing the i-th of the target's caches its tape while a taped
    forward runs: its convolution's input `[B, K - 1 + S, C]` (the window, then the forward's S inputs)
    and, where it calls mlx-lm's `ssm_update` (Mamba-2), a replay of that call (mlx-lm's module untouched:
    its methods run with `ssm_update` bound to the taped one)."""
    cls = type(module[conv])

    def call(self, x: mx.array) -> mx.array:
        cache = _TAPES.get().get(i)
        if cache is not None:
            cache.record_conv(x)
        return cls.__call__(self, x)

    module[conv].__class__ = type(cls.__name__, (cls,), {"__call__": call})
    rebind(module, "ssm_update", lambda update: _taped_ssm(update, i))


def _stepwise(update):
    """mlx-lm's `ssm_update`, a token at a time (exact verification): a chunk's scan sums each token's
    terms in an order that depends on where the token sits in the forward."""

    def step(x, A_log, B, C, D, dt, dt_bias, state=None, limit=(0.001, 100.0), mask=None, lengths=None):
        ys = []
        for t in range(x.shape[1]):  # (a row's token past its length: -1, its state kept)
            y, state = update(x[:, t : t + 1], A_log, B[:, t : t + 1], C[:, t : t + 1], D, dt[:, t : t + 1], dt_bias,
                              state, limit, None if mask is None else mask[..., t : t + 1],
                              None if lengths is None else mx.where(lengths > t, 1, -1))
            ys.append(y)
        return mx.concatenate(ys, axis=1), state

    return step


def _taped_ssm(update, i: int):
    """mlx-lm's `ssm_update` for the module of the i-th cache, handing that cache a replay: the state after
    each row's first kept[b] of the forward's tokens, from the state before it (rows that keep as many run
    together); a token at a time in a forward that verifies exactly, and so its replay."""

    def taped(x, A_log, B, C, D, dt, dt_bias, state=None, limit=(0.001, 100.0), *args, **kwargs):
        run = _stepwise(update) if EXACTLY.get() else update
        cache = _TAPES.get().get(i)
        if cache is not None:
            def replay(kept: list[int]) -> mx.array:
                before = state if state is not None else mx.zeros((x.shape[0], *x.shape[2:], B.shape[-1]))
                rows = [None] * len(kept)
                for n in set(kept):
                    at = [b for b, m in enumerate(kept) if m == n]
                    idx = mx.array(at)
                    s = before[idx]
                    if n:  # [R, H, Dh, Ds]
                        s = run(x[idx, :n], A_log, B[idx, :n], C[idx, :n], D, dt[idx, :n], dt_bias, s, limit)[1]
                    for j, b in enumerate(at):
                        rows[b] = s[j : j + 1]
                return mx.concatenate(rows)
            cache.record_recurrence(replay)
        return run(x, A_log, B, C, D, dt, dt_bias, state, limit, *args, **kwargs)

    return taped


class WholeTarget(MLXLMTarget):
    """An mlx-lm model of a family mlx-spec has no layer loop for, as a target: chains only."""

    verifies_trees = False
    runs_apart = False

    def _prepare(self, text: nn.Module, shape: dict) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        layers = self.model.layers
        attends_exactly(text, self.model_type)
        for i, layer in enumerate(layers):
            _capture(layer, i, i == len(layers) - 1)
        kept = make_prompt_cache(self.inner)
        self.caches = len(kept)  # mlx-lm's count (Gemma 4's shared layers, Nemotron-H's MLP blocks have none)
        self.stateful = {j for j, c in enumerate(kept) if type(c).__name__ == "ArraysCache"}
        self.several = {j: len(c.caches) for j, c in enumerate(kept) if type(c).__name__ == "CacheList"}
        if self.stateful:  # the k-th such cache is the k-th stateful module's, in layer order
            module, conv = TAPED[self.model_type]
            owners = [layer[module] for layer in layers if module in layer and conv in layer[module]]
            for j, owner in zip(sorted(self.stateful), owners):
                _tape_state(owner, conv, j)

    def make_cache(self, rows: int = 1) -> list:
        return [RecurrentCache(rows) if i in self.stateful else
                LayerCaches([KVCache(rows) for _ in range(self.several[i])]) if i in self.several else KVCache(rows)
                for i in range(self.caches)]

    def _named(self, part: str) -> str:
        return NAMES.get(self.model_type, {}).get(part, part)

    @property
    def model(self) -> nn.Module:
        return self._text[self._named("model")]

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model[self._named("embed_tokens")]

    @property
    def final_norm(self) -> nn.Module:
        return self.model[self._named("norm")]

    def masks(self, *args, **kwargs) -> list:
        self._whole()

    def _whole(self) -> NoReturn:
        raise UserError(f"a {self.model_type} target runs on mlx-lm's forward, whole: its layers do not run "
                        "apart (as --drafter layerskip and skip need)")

    def __call__(self, tokens: mx.array, cache: Sequence[KVCache] | None = None, positions: mx.array | None = None,
                 mask: mx.array | None = None, capture: Sequence[int] = (), exit_layer: int | None = None,
                 exact: bool = False) -> tuple[mx.array, tuple[mx.array, ...]]:
        if positions is not None or mask is not None:
            raise UserError(f"a {self.model_type} target runs on mlx-lm's forward, which verifies chains only: "
                            "give no --tree or --tree-budget")
        if exit_layer is not None:
            self._whole()
        if tokens.shape[0] > 1 and cache is not None and self.model_type not in BATCHED:
            rows = [self._forward(tokens[b : b + 1], [RowOf(c, b) for c in cache], capture, exact)
                    for b in range(tokens.shape[0])]
            return (mx.concatenate([logits for logits, _ in rows]),
                    tuple(mx.concatenate([states[i] for _, states in rows]) for i in range(len(capture))))
        return self._forward(tokens, cache, capture, exact)

    def _forward(self, tokens: mx.array, cache, capture: Sequence[int], exact: bool) -> tuple[mx.array, tuple]:
        S = tokens.shape[1]
        stateful = {i: c for i, c in enumerate(cache or ()) if isinstance(c, RecurrentCache)}
        states: dict[int, mx.array] = {}
        token = _STATES.set(states if capture else None)
        exactly = EXACTLY.set(exact)  # the attention modules read it (`exact.sdpa`), and Mamba-2's `ssm_update`
        taping = _TAPES.set({i: c for i, c in stateful.items() if c.begin(S)})  # (begin applies pending cuts)
        try:
            inner = [c.arrays if i in stateful else c for i, c in enumerate(cache)] if cache is not None else None
            logits = self.inner(tokens, cache=inner)  # [B, S, V]
        finally:
            _STATES.reset(token)
            _TAPES.reset(taping)
            EXACTLY.reset(exactly)
        for c in stateful.values():
            c.end(S)
        return logits, tuple(states[i] for i in capture)


def implements(model_type: str) -> bool:
    """Whether mlx-lm has model code for `model_type` (its own remapping of names included)."""
    from mlx_lm.utils import MODEL_REMAPPING

    if not isinstance(model_type, str) or not model_type.isidentifier():
        return False
    name = MODEL_REMAPPING.get(model_type, model_type)
    return importlib.util.find_spec(f"mlx_lm.models.{name}") is not None


def load(path: Path, config: dict, dtype: mx.Dtype | None, lazy: bool = False) -> WholeTarget:
    """The mlx-lm model in `path`, run whole (see the module docstring)."""
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache as MLXLMCache, RotatingKVCache, make_prompt_cache
    from mlx_lm.utils import load_model as mlx_lm_load

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not implements(model_type):
        raise UserError(f"{path / 'config.json'}: model_type '{model_type}' is not supported "
                        "(neither mlx-spec nor mlx-lm implements it)")
    check_fields(config, str(path / "config.json"))
    try:
        inner, _ = mlx_lm_load(path, lazy=lazy, model_config=mlx_lm_config(config), get_model_classes=classes)
    except (ValueError, TypeError, KeyError, FileNotFoundError, AttributeError) as e:
        raise UserError(f"{path / 'config.json'}: mlx-lm cannot build model_type '{model_type}' from it "
                        f"({' '.join(str(e).split())})") from None
    caches = make_prompt_cache(inner)
    listed = {type(m).__name__ for c in caches if isinstance(c, CacheList) for m in c.caches}  # (keys and values only)
    kept = {type(c).__name__ for c in caches} | listed
    keys = {MLXLMCache.__name__, RotatingKVCache.__name__}
    if listed - keys or kept - keys - {CacheList.__name__} - ({ArraysCache.__name__} if model_type in TAPED else set()):
        raise UserError(f"{path}: a {model_type} model keeps state mlx-spec cannot roll back after a rejected "
                        f"draft ({', '.join(sorted(kept))}), beside keys and values")
    return WholeTarget(cast_floating(inner, dtype), config)
