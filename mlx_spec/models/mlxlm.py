"""Targets of the architectures mlx-lm implements, through mlx-lm's own model code.

mlx-lm's loader builds the model (its classes, its `sanitize`, quantized or
not); this wrapper gives it mlx-spec's target contract: the hidden states
entering chosen layers captured in the verification forward, mlx-spec's KV
cache (which speaks mlx-lm's cache protocol, so mlx-lm's attention layers
write and roll back in it), the final norm and LM head for heads drafters.
Only the loop over the layers is mlx-spec's: mlx-lm's model `__call__` would
hide the states between layers.

Per family, what mlx-spec gives mlx-lm's modules beside the loop: each layer's
mask (full, a sliding window, or none for a linear-attention layer), Gemma's
embedding scale as transformers computes it, transformers' YaRN where mlx-lm
rounds it, gpt-oss's experts as transformers stores them, and the tape that
rolls a Gated DeltaNet layer back (`cache.RecurrentCache`); for trees, each
token rotated to its own position and the tree's mask; under `--exact`, attention
that verifies exactly (`exact.sdpa`, and `models/exact_attention.py` for the
modules that attend by hand). Hybrid targets verify chains only (the recurrence
would have to follow each branch). docs/targets.md lists it all.
"""

from __future__ import annotations

import contextvars
import re
import types
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlx_spec.attention import TreeMask, causal_array
from mlx_spec.cache import KVCache, RecurrentCache
from mlx_spec.errors import UserError
from mlx_spec.exact import EXACTLY, sdpa
from mlx_spec.models.config import check_fields, mlx_lm_config
from mlx_spec.models.dtypes import cast_floating
from mlx_spec.models.exact_attention import own
from mlx_spec.models.llama import Model as LlamaModel, default_mask
from mlx_spec.models.rope import SUPPORTED, RoPE, at_positions

# model_type -> what it is; each checked against transformers' greedy output (tests/test_mlxlm_targets.py)
FAMILIES = {
    "qwen3_moe": "Qwen3 mixture of experts (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B)",
    "mimo": "Xiaomi MiMo (Qwen2 blocks, MTP modules beside them)",
    "mixtral": "Mixtral mixture of experts",
    "qwen2_moe": "Qwen2 / Qwen1.5 mixture of experts (with a shared expert)",
    "olmoe": "OLMoE mixture of experts",
    "gpt_oss": "OpenAI gpt-oss (sliding and full layers, attention sinks, mixture of experts)",
    "gemma3_text": "Gemma 3 text models (sliding and full layers)",
    "qwen3_next": "Qwen3-Next (Gated DeltaNet and gated attention layers, mixture of experts)",
    "qwen3_5": "Qwen3.5 / Qwen3.6 (Gated DeltaNet and gated attention layers; the text model of the published checkpoints)",
    "qwen3_5_moe": "Qwen3.5 / Qwen3.6 mixture of experts (Qwen3.5-35B-A3B, ...)",
    "deepseek_v3": "DeepSeek-V3 / R1 (multi-head latent attention, mixture of experts)",
}
HYBRID = ("qwen3_next", "qwen3_5", "qwen3_5_moe")  # linear-attention layers beside attention: chains only
RECURRENT = "recurrent"  # a layer kind: linear attention, no mask, a RecurrentCache
SCALED_EMBEDDING = ("gemma3_text", "gemma2", "gemma4", "gemma4_text")  # embeddings times sqrt(hidden size)
ARRAY_MASKS = ("deepseek_v3",)  # attention that applies the mask itself: a boolean array, never "causal"


@dataclass
class TargetArgs:
    """What drafters read of a target's shape (and a new drafter's config copies)."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    sliding_window: int | None = None  # (each layer's window is the wrapper's: `MLXLMTarget.kinds`)
    routed: tuple[int, int] | None = None  # a mixture of experts: (experts a token runs, experts per layer)

    @property
    def extra(self) -> dict:
        """The config a new drafter's layers copy (`train mtp`, `train mtp-heads`): a dense Llama
        layer of this target's attention shape (mlx-spec's layers are not its experts or linear attention)."""
        keys = ("hidden_size", "num_hidden_layers", "vocab_size", "tie_word_embeddings", "max_position_embeddings",
                "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "rope_theta", "rope_scaling")
        return {"model_type": "llama", **{k: getattr(self, k) for k in keys}}

    @classmethod
    def of(cls, config: dict, layers: int) -> "TargetArgs":
        """From the config as mlx-lm reads it (`mlx_lm_config`)."""
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(config["model_type"], hidden, layers, int(config["vocab_size"]),
                   bool(config.get("tie_word_embeddings", False)), int(config.get("max_position_embeddings") or 4096),
                   int(config.get("intermediate_size") or config.get("moe_intermediate_size") or 4 * hidden), heads,
                   int(config.get("num_key_value_heads") or heads), int(config.get("head_dim") or hidden // heads),
                   float(config.get("rms_norm_eps", 1e-6)), float(config.get("rope_theta", 10000.0)),
                   _own_rope(config.get("rope_scaling")), None, _routed(config))


def _own_rope(scaling: dict | None) -> dict | None:
    """The target's RoPE scaling, for a new drafter's layers (mlx-spec's RoPE) to copy, where
    mlx-spec's RoPE has it; else none (Gemma 4's "proportional": the drafter's rotation is its own)."""
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    return scaling if kind in SUPPORTED else None


def _routed(config: dict) -> tuple[int, int] | None:
    experts = config.get("num_experts") or config.get("n_routed_experts")
    per_token = config.get("num_experts_per_tok")
    return (int(per_token), int(experts)) if experts and per_token else None


def _layer_kinds(text: nn.Module, config: dict) -> list:
    """Per layer: None (full attention), the window of a sliding-window layer, or RECURRENT,
    as mlx-lm's modules compute them (each module says, else the config's `layer_types`)."""
    window = config.get("sliding_window")
    types_ = getattr(text.model, "layer_types", None) or config.get("layer_types")
    kinds = []
    for i, layer in enumerate(text.model.layers):
        if getattr(layer, "is_linear", False):
            kinds.append(RECURRENT)
        elif hasattr(getattr(layer, "self_attn", None), "is_sliding"):
            kinds.append(window if layer.self_attn.is_sliding else None)
        elif types_:
            kinds.append(window if types_[i] == "sliding_attention" else None)
        else:  # a Mistral-style config: every layer slides, where it says so
            kinds.append(window if config.get("use_sliding_window", True) else None)
    return kinds


# A tree's per-token positions `[B, S]` while a layer runs over it (set around one layer's call).
_POSITIONS: contextvars.ContextVar[mx.array | None] = contextvars.ContextVar("positions", default=None)


class _TreeRoPE:
    """An mlx-lm attention layer's RoPE, rotating each token to its own position while a tree is
    verified (tree nodes share depths, not consecutive offsets); else as it is."""

    def __init__(self, rope):
        self.rope = rope

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        positions = _POSITIONS.get()
        if positions is None:
            return self.rope(x, offset=offset)
        rotate = lambda rows, at: self.rope(rows, offset=at)  # noqa: E731
        return at_positions(rotate, x.transpose(0, 2, 1, 3), positions).transpose(0, 2, 1, 3)


def _window_start(cache: KVCache | None, window) -> int:
    """The first cache slot any query of the next forward sees in a sliding layer of `window`
    (0: all of them); the slots before it are left out of attention altogether."""
    if cache is None or not isinstance(window, int) or not cache.rows:
        return 0
    return max(0, min(cache.lengths) - window + 1)


class _Window:
    """A sliding layer's view of its cache: the keys and values from slot `lo` on (what its
    queries can see), so attention costs the window, not the whole text."""

    def __init__(self, cache: KVCache, lo: int):
        self.cache, self.lo = cache, lo

    @property
    def offset(self):
        return self.cache.offset

    def update_and_fetch(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        keys, values = self.cache.update_and_fetch(k, v)
        return keys[..., self.lo:, :], values[..., self.lo:, :]


def _tree_mask(tree, window: int | None, cache: KVCache | None, positions: mx.array) -> mx.array:
    """A tree's mask (`TreeMask` or `[B, 1, S, L + S]`) as an array; in a sliding layer, keys
    only within `window` positions of each query (a cached key's position is its slot)."""
    dense = tree.dense if isinstance(tree, TreeMask) else tree
    if window is None:
        return dense
    starts = np.array(cache.lengths if cache is not None else [0])[:, None]  # [B, 1]
    pos = np.broadcast_to(np.array(positions), (len(starts), np.array(positions).shape[-1]))  # [B, S]
    slots = np.arange(dense.shape[-1])[None]  # [1, L + S]
    within = np.clip(slots - starts, 0, pos.shape[1] - 1)
    key = np.where(slots < starts, slots, np.take_along_axis(pos, within, axis=1))  # [B, L + S] key positions
    near = key[:, None, :] > pos[:, :, None] - window  # [B, S, L + S]
    return dense & mx.array(near[:, None])


# The linear-attention layer whose forward is being taped (set around one layer's call).
_TAPE: contextvars.ContextVar[RecurrentCache | None] = contextvars.ContextVar("tape", default=None)


def _taped(recurrence):
    """mlx-lm's `gated_delta_update`, handing the cache being taped a replay of it."""

    def update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kw):
        cache = _TAPE.get()
        if cache is not None:
            def replay(kept: list[int]) -> mx.array | None:
                n = max(kept)
                if n == 0:
                    return state
                rows = None if min(kept) == n else mx.arange(n)[None] < mx.array(kept)[:, None]  # [B, n]
                return recurrence(q[:, :n], k[:, :n], v[:, :n], a[:, :n], b[:, :n], A_log, dt_bias, state, rows, **kw)[1]
            cache.record_recurrence(replay)
        return recurrence(q, k, v, a, b, A_log, dt_bias, state, mask, **kw)

    return update


class _TapedConv(nn.Conv1d):
    """A Gated DeltaNet's convolution, handing its input to the cache being taped."""

    def __call__(self, x: mx.array) -> mx.array:
        cache = _TAPE.get()
        if cache is not None:
            cache.record_conv(x)
        return super().__call__(x)


def rebind(module: nn.Module, name: str, wrap) -> None:
    """`module`'s methods that call the module-level function `name`, run with it bound to
    `wrap(function)` (mlx-lm's class untouched: `module` gets a subclass of it)."""
    cls, methods = type(module), {}
    for klass in reversed(cls.__mro__):
        for attr, f in vars(klass).items():
            if isinstance(f, types.FunctionType) and name in f.__code__.co_names and name in f.__globals__:
                scope = dict(f.__globals__, **{name: wrap(f.__globals__[name])})
                methods[attr] = types.FunctionType(f.__code__, scope, f.__name__, f.__defaults__, f.__closure__)
    if methods:
        module.__class__ = type(cls.__name__, (cls,), methods)


def attends_exactly(model: nn.Module, model_type: str) -> None:
    """Every attention module of `model` attending exactly (`exact.sdpa`) while a forward verifies exactly;
    those that compute attention themselves, as `models.exact_attention` says for `model_type`."""
    for module in model.modules():
        rebind(module, "scaled_dot_product_attention", sdpa)
        own(module, model_type)


def _tape(layer: nn.Module) -> None:
    """Give a linear-attention module (mlx-lm's `GatedDeltaNet`) its tape: the same forward, as
    mlx-lm writes it, with its recurrence call taped and its convolution's input recorded."""
    rebind(layer, "gated_delta_update", _taped)
    layer.conv1d.__class__ = _TapedConv


def _yarn_untruncated(text: nn.Module, config: dict) -> None:
    """mlx-lm's YaRN rounds the ramp's ends, as transformers does only with `truncate: true`;
    gpt-oss says false: its attention layers get transformers' frequencies."""
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") != "yarn" or scaling.get("truncate", True):
        return
    for layer in text.model.layers:
        _set_rope(layer.self_attn, RoPE(layer.self_attn.head_dim, config["rope_theta"], scaling))


def _set_rope(attn: nn.Module, rope) -> None:
    """Replace an attention layer's RoPE (a module mlx-lm keeps as a child) by `rope`."""
    if "rope" in attn:
        del attn["rope"]
    attn.rope = rope


def _without_mtp_layers(weights: dict, config: dict) -> dict:
    """DeepSeek-V3 ships its MTP module as layer `num_hidden_layers` (`--drafter mtp` reads it apart)."""
    L = int(config["num_hidden_layers"])
    return {k: v for k, v in weights.items()
            if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= L)}


def _gpt_oss_experts(weights: dict, config: dict) -> dict:
    """transformers stores gpt-oss's experts as matmul operands, `experts.gate_up_proj` `[E, H, 2I]`
    and `experts.down_proj` `[E, I, H]`; mlx-lm's sanitize reads OpenAI's `[E, out, in]` weights."""
    fused = ("experts.gate_up_proj", "experts.down_proj")
    return {k: v for name, w in weights.items()
            for k, v in [(name + ".weight", w.swapaxes(-1, -2)) if name.endswith(fused) else (name, w)]}


EXPERT = re.compile(r"(.+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def stack_experts(weights: dict) -> dict:
    """A mixture of experts stored one tensor per expert (`mlp.experts.{e}.up_proj.weight`, as
    transformers 5 saves Qwen3.5-MoE) stacked as mlx-lm's layers hold them (`mlp.switch_mlp.up_proj.weight`
    `[E, out, in]`), as mlx-lm's own sanitize does for the families that it reads so."""
    experts: dict[tuple[str, str], dict[int, mx.array]] = {}
    out = {}
    for name, value in weights.items():
        match = EXPERT.fullmatch(name)
        if match is None:
            out[name] = value
        else:
            experts.setdefault((match.group(1), match.group(3)), {})[int(match.group(2))] = value
    for (prefix, proj), by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise UserError(f"experts of {prefix}: numbered {sorted(by_index)}, not 0..{len(by_index) - 1}")
        out[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack([by_index[e] for e in range(len(by_index))])
    return out


BEFORE_SANITIZE = {"gpt_oss": _gpt_oss_experts, "qwen3_5_moe": lambda weights, config: stack_experts(weights),
                   "deepseek_v3": _without_mtp_layers}  # (weights, config) -> weights


def classes(config: dict):
    """mlx-lm's classes for `config`, reading the weights as `BEFORE_SANITIZE` says first."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    fix = BEFORE_SANITIZE.get(config.get("model_type"))
    if fix is None:
        return model_class, args_class
    return type(model_class.__name__, (model_class,),
                {"sanitize": lambda self, w: model_class.sanitize(self, fix(w, config))}), args_class


class MLXLMTarget(LlamaModel):
    """An mlx-lm model meeting mlx-spec's target contract: `models.llama.Model`'s
    forward (embedding, the layers one by one, final norm and head) over mlx-lm's modules."""

    def __init__(self, inner: nn.Module, config: dict):
        nn.Module.__init__(self)
        self.inner = inner
        self.model_type = config["model_type"]
        text = self._text
        shape = mlx_lm_config(config)
        shape = {**shape.get("text_config", {}), **{k: v for k, v in shape.items() if k != "text_config"}} \
            if "text_config" in shape else shape
        self.args = TargetArgs.of(shape, len(self.model.layers))
        self.args.tie_word_embeddings = "lm_head" not in text
        self._embed_scale = shape["hidden_size"] ** 0.5 if self.model_type in SCALED_EMBEDDING else None
        self.softcap = shape.get("final_logit_softcapping")  # transformers' tanh cap on the logits, where set
        self._prepare(text, shape)

    def _prepare(self, text: nn.Module, shape: dict) -> None:
        """What mlx-spec's layer loop needs of mlx-lm's layers: each layer's kind, transformers'
        YaRN, a tape on linear attention, RoPE that rotates tree tokens to their own positions,
        attention that verifies exactly when asked."""
        self.kinds = _layer_kinds(text, shape)
        _yarn_untruncated(text, shape)
        attends_exactly(text, self.model_type)
        for layer, kind in zip(text.model.layers, self.kinds):
            if kind == RECURRENT:
                _tape(layer.linear_attn)
            else:
                _set_rope(layer.self_attn, _TreeRoPE(layer.self_attn.rope))

    @property
    def verifies_trees(self) -> bool:
        return RECURRENT not in self.kinds

    @property
    def _text(self) -> nn.Module:
        """The language model (Qwen3.5's published checkpoints hold it beside a vision tower)."""
        return self.inner["language_model"] if "language_model" in self.inner else self.inner

    @property
    def model(self) -> nn.Module:
        return self._text.model

    @property
    def lm_head(self) -> nn.Module:
        text = self._text
        return text.lm_head if "lm_head" in text else self.embed_tokens

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.embed_tokens(tokens)
        if self._embed_scale is None:
            return h
        return h * mx.array(self._embed_scale, dtype=h.dtype)  # as transformers: sqrt(H) in the weights' dtype

    def unembed(self, h: mx.array) -> mx.array:
        logits = super().unembed(h)
        if not self.softcap:
            return logits
        cap = mx.array(self.softcap, dtype=logits.dtype)
        return mx.tanh(logits / cap) * cap

    def compile(self) -> None:
        """mlx-lm's layers run as they are."""

    def weights(self) -> dict[str, mx.array]:
        """mlx-lm's parameters, under the names its loader reads back (as mlx-lm's `sanitize` left them)."""
        return dict(tree_flatten(self.inner.parameters()))

    def make_cache(self, rows: int = 1) -> list:
        return [RecurrentCache(rows) if kind == RECURRENT else KVCache(rows) for kind in self.kinds]

    def masks(self, S: int, first, layers: range, tree=None, positions: mx.array | None = None,
              exact: bool = False) -> list:
        """Per layer of `layers`: its causal or sliding-window mask, none for a linear-attention
        layer; with a `tree`, the tree's mask (within each sliding layer's window); `exact`: over all
        the keys (exact attention reads whole blocks of them, `exact.sdpa`)."""
        if tree is not None and not self.verifies_trees:
            raise UserError(f"a {self.model_type} target verifies chains only (its linear-attention layers "
                            "roll back a chain): give no --tree or --tree-budget")
        made: dict = {}
        out = []
        for i in layers:
            kind = self.kinds[i]
            if kind != RECURRENT and kind not in made:
                made[kind] = self._mask(S, first, kind, tree, positions, exact)
            out.append(None if kind == RECURRENT else made[kind])
        return out

    def _mask(self, S: int, first: KVCache | None, window: int | None, tree, positions: mx.array | None,
              exact: bool = False):
        """One attention kind's mask: over the keys from the window's first slot on, where it slides
        (all of them, `exact`)."""
        lo = 0 if exact else _window_start(first, window)
        if lo and tree is None and S == 1 and first.aligned:
            return None  # one query, the window's keys alone: all of them
        mask = default_mask(S, [first] if first is not None else None, window) if tree is None else \
            _tree_mask(tree, window, first, positions)
        if isinstance(mask, str) and self.model_type in ARRAY_MASKS:
            mask = causal_array(S, first)
        return mask[..., lo:] if lo else mask

    def layer(self, i: int, h: mx.array, mask, cache: KVCache | None, positions: mx.array | None) -> mx.array:
        if not isinstance(cache, RecurrentCache):
            lo = 0 if EXACTLY.get() else _window_start(cache, self.kinds[i])
            view = _Window(cache, lo) if lo else cache
            if positions is None:
                return self.layers[i](h, mask, view)
            token = _POSITIONS.set(positions)  # the attention's RoPE rotates each token to its own position
            try:
                return self.layers[i](h, mask, view)
            finally:
                _POSITIONS.reset(token)
        S = h.shape[1]
        token = _TAPE.set(cache if cache.begin(S) else None)  # the layer's hooks hand `cache` its tape
        try:
            out = self.layers[i](h, None, cache.arrays)
        finally:
            _TAPE.reset(token)
        cache.end(S)
        return out


def load(path: Path, config: dict, dtype: mx.Dtype | None, lazy: bool = False) -> MLXLMTarget:
    """The mlx-lm model in `path` (its config already read as `config`, a model_type of `FAMILIES`),
    its floating weights in `dtype` (None: as stored), read now or when first evaluated (`lazy`)."""
    from mlx_lm.utils import load_model as mlx_lm_load

    model_type = config.get("model_type")
    check_fields(config, str(path / "config.json"))
    try:
        inner, _ = mlx_lm_load(path, lazy=lazy, model_config=mlx_lm_config(config), get_model_classes=classes)
    except (ValueError, TypeError, KeyError, FileNotFoundError) as e:
        raise UserError(f"{path}: mlx-lm cannot load it as {model_type} ({e})".splitlines()[0]) from None
    return MLXLMTarget(cast_floating(inner, dtype), config)
