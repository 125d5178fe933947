"""Targets of the architectures mlx-lm implements, through mlx-lm's own model code.

mlx-lm's loader builds the model (its classes, its `sanitize`, quantized or
not); this wrapper gives it mlx-spec's target contract: the hidden states
entering chosen layers captured in the verification forward, mlx-spec's KV
cache (which speaks mlx-lm's cache protocol, so mlx-lm's attention layers
write and roll back in it), the final norm and LM head for heads drafters.
Only the loop over the layers is mlx-spec's: mlx-lm's model `__call__` would
hide the states between layers.

mlx-lm does not read every config as transformers writes it: transformers 5
puts RoPE in `rope_parameters` and names the experts' count
`num_local_experts`, which mlx-lm's argument classes miss (falling back to a
RoPE base of 10000), so `mlx_lm_config` rewrites them first.

Supported here: the families whose decoder is mlx-lm's standard one
(`model.embed_tokens`, `model.layers[i](h, mask, cache)`, `model.norm`, an LM
head or tied embeddings) and whose every layer attends to the whole context
(`FAMILIES`), for chain drafters; trees and sliding windows are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

from mlx_spec.cache import KVCache
from mlx_spec.errors import UserError
from mlx_spec.models.llama import Model as LlamaModel

# model_type -> what it is; each checked against transformers' greedy output (tests/test_mlxlm_targets.py)
FAMILIES = {
    "qwen3_moe": "Qwen3 mixture of experts (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B)",
    "mimo": "Xiaomi MiMo (Qwen2 blocks, MTP modules beside them)",
    "mixtral": "Mixtral mixture of experts",
    "qwen2_moe": "Qwen2 / Qwen1.5 mixture of experts (with a shared expert)",
    "olmoe": "OLMoE mixture of experts",
}


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
    sliding_window: int | None = None  # (sliding-window configs are refused: their layers differ)

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
                   config.get("rope_scaling"))


def mlx_lm_config(config: dict) -> dict:
    """`config` as mlx-lm's argument classes read it (see the module docstring)."""
    out = dict(config)
    rope = out.pop("rope_parameters", None)
    if isinstance(rope, dict):
        rope = dict(rope)
        out.setdefault("rope_theta", rope.pop("rope_theta", 10000.0))
        kind = rope.pop("rope_type", rope.pop("type", "default"))
        if kind != "default" and out.get("rope_scaling") is None:
            out["rope_scaling"] = {"type": kind, "rope_type": kind, **rope}
    if "num_local_experts" in out:
        out.setdefault("num_experts", out["num_local_experts"])
    return out


class Model(LlamaModel):
    """An mlx-lm model meeting mlx-spec's target contract: `models.llama.Model`'s
    forward (embedding, the layers one by one, final norm and head) over mlx-lm's modules."""

    def __init__(self, inner: nn.Module, config: dict):
        nn.Module.__init__(self)
        self.inner = inner
        self.model_type = config["model_type"]
        self.args = TargetArgs.of(mlx_lm_config(config), len(inner.model.layers))

    @property
    def model(self) -> nn.Module:
        return self.inner.model

    @property
    def lm_head(self) -> nn.Module:
        return self.inner.model.embed_tokens if self.args.tie_word_embeddings else self.inner.lm_head

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.inner.model.embed_tokens

    def compile(self) -> None:
        """mlx-lm's layers run as they are."""

    def layer(self, i: int, h: mx.array, mask, cache: KVCache | None, positions: mx.array | None) -> mx.array:
        if positions is not None:  # a tree: mlx-lm's attention takes no per-token positions
            raise UserError(f"a {self.model_type} target verifies chains only: give no --tree or --tree-budget")
        return self.layers[i](h, mask, cache)


def load(path: Path, config: dict, dtype: mx.Dtype | None) -> Model:
    """The mlx-lm model in `path` (its config already read as `config`), its
    floating weights in `dtype` (None: as stored)."""
    from mlx_lm.utils import load_model as mlx_lm_load

    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise UserError(f"{path / 'config.json'}: model_type '{model_type}' is not supported")
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        raise UserError(f"{path / 'config.json'}: sliding_window {config['sliding_window']}: sliding-window "
                        f"layers are not supported for {model_type}")
    try:
        inner, _ = mlx_lm_load(path, model_config=mlx_lm_config(config))
    except (ValueError, TypeError, KeyError, FileNotFoundError) as e:
        raise UserError(f"{path}: mlx-lm cannot load it as {model_type} ({e})".splitlines()[0]) from None
    if dtype is not None:
        floating = tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a,
                            inner.parameters())
        inner.update(floating)
        mx.eval(inner.parameters())
    return Model(inner, config)
