"""Llama, Mistral, Qwen2 and Qwen3: one decoder, with config switches.

Parameter names are the Hugging Face checkpoint names, so a checkpoint loads
without renaming. The forward follows mlx-spec's target contract:

    logits, hidden = model(tokens, cache, positions=None, mask=None,
                           capture=(), exit_layer=None, exact=False)

- `positions` `[B, S]` or `[S]`: per-token RoPE positions (tree nodes share
  depths); default: each row's cache length onwards.
- `mask`: boolean, True = attend, broadcastable to `[B, 1, S, cached + S]`,
  or a `TreeMask` (the new tokens' parents) for tree attention; default: the
  cache's (each row sees its own cache, and its new tokens causally).
- `capture`: indices into Hugging Face's `hidden_states`: 0 is the embedding
  output, i is the output of layer i - 1 (the input of layer i), and
  `num_hidden_layers` is the last layer's output before the final norm.
  `hidden` holds one `[B, S, H]` array per index, in order.
- `exit_layer=E`: run layers 0..E-1, then the final norm and LM head (LayerSkip).
- `exact=True`: attention over whole blocks of keys, each query on its own (`mlx_spec.exact`).

Mistral's `sliding_window` W (Mistral-7B-v0.1's 4096): each token attends to the
last W positions, itself included, once the text is longer; a tree reaching past
the window is refused.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlx_spec import exact
from mlx_spec.attention import TreeMask, scaled_dot_product_attention, tree_attention
from mlx_spec.cache import KVCache, make_cache
from mlx_spec.cpu_exp import silu
from mlx_spec.errors import UserError
from mlx_spec.exact import EXACTLY, ExactMask
from mlx_spec.models.config import ModelArgs
from mlx_spec.models.rope import RoPE


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, rope: RoPE, input_size: int | None = None):
        """`input_size`: width of the queries' and keys' input when it is not
        the hidden size (EAGLE-3 attends over [embedding; feature])."""
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = D = args.head_dim
        self.scale = D**-0.5
        hidden = args.hidden_size
        width = input_size or hidden
        self.q_proj = nn.Linear(width, self.n_heads * D, bias=args.qkv_bias)
        self.k_proj = nn.Linear(width, self.n_kv_heads * D, bias=args.qkv_bias)
        self.v_proj = nn.Linear(width, self.n_kv_heads * D, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * D, hidden, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        self.rope = rope

    def qkv(
        self, x: mx.array, offset: int | mx.array, positions: mx.array | None
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values `[B, H, S, D]`, rotated to their positions."""
        B, S, _ = x.shape
        q = self.q_proj(x).reshape(B, S, self.n_heads, self.head_dim)  # [B, S, H, D]
        if self.qk_norm:
            q = self.q_norm(q)
        k, v = self.keys_values(x, offset, positions)
        return self._rotate(q, offset, positions), k, v

    def keys_values(
        self, x: mx.array, offset: int | mx.array, positions: mx.array | None = None
    ) -> tuple[mx.array, mx.array]:
        """Keys (rotated) and values `[B, H_kv, S, D]` alone (DFlash's context)."""
        B, S, _ = x.shape
        k = self.k_proj(x).reshape(B, S, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, S, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            k = self.k_norm(k)
        return self._rotate(k, offset, positions), v.transpose(0, 2, 1, 3)

    def _rotate(self, x: mx.array, offset: int | mx.array, positions: mx.array | None) -> mx.array:
        """`[B, S, heads, D]` -> rotated `[B, heads, S, D]`."""
        if positions is None:
            return self.rope(x.transpose(0, 2, 1, 3), offset)
        return self.rope.at_positions(x, positions).transpose(0, 2, 1, 3)

    def attend(
        self, q: mx.array, k: mx.array, v: mx.array, mask: mx.array | str | None, cache: KVCache | None
    ) -> mx.array:
        if cache is None:  # training (and forwards that keep nothing): the fast SDPA, which has a gradient
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        k, v = cache.update_and_fetch(k, v)  # [B, H_kv, cached + S, D]
        if isinstance(mask, TreeMask):
            return tree_attention(q, k, v, mask, self.scale)
        if isinstance(mask, ExactMask):  # whole blocks of the cache's buffer
            return exact.attention(q, cache.keys, cache.values, mask, self.scale)
        return scaled_dot_product_attention(q, k, v, self.scale, mask)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h, i, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, rope: RoPE):
        super().__init__()
        self.self_attn = Attention(args, rope)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def pre(self, x: mx.array, offset: int | mx.array, positions: mx.array | None):
        return self.self_attn.qkv(self.input_layernorm(x), offset, positions)

    def post(self, x: mx.array, out: mx.array) -> mx.array:
        """Output projection, residual, MLP: `out` `[B, H, S, D]` -> `[B, S, hidden]`."""
        B, S, _ = x.shape
        h = x + self.self_attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, S, -1))
        return h + self.mlp(self.post_attention_layernorm(h))

    def compile(self) -> None:
        """Compile `pre` and `post` for inference (shapes are fixed per token count,
        so one trace serves every step). Weights must not change afterwards."""
        self._compiled = _CompiledLayer(self)

    def __call__(self, x, mask, cache, positions) -> mx.array:
        offset = cache.offset if cache is not None else 0
        fast = getattr(self, "_compiled", None)
        if fast is None or x.shape[1] > COMPILED_MAX_TOKENS:
            q, k, v = self.pre(x, offset, positions)
            return self.post(x, self.self_attn.attend(q, k, v, mask, cache))
        if positions is None:
            q, k, v = fast.pre_offset(x, mx.array(offset))
        else:
            q, k, v = fast.pre_positions(x, positions)
        return fast.post(x, self.self_attn.attend(q, k, v, mask, cache))


# Decoding and verification run few tokens at a time, always the same few
# lengths: those are compiled (one trace per length). Prompts come in every
# length, and are long enough that the eager overhead does not matter.
COMPILED_MAX_TOKENS = 32


class _CompiledLayer:
    """Compiled halves of a decoder layer; the KV cache write and attention
    between them stay eager, so the cache is updated in place."""

    def __init__(self, layer: DecoderLayer):
        self.pre_offset = mx.compile(lambda x, offset: layer.pre(x, offset, None))
        self.pre_positions = mx.compile(lambda x, positions: layer.pre(x, 0, positions))
        self.post = mx.compile(layer.post)


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        rope = RoPE(args.head_dim, args.rope_theta, args.rope_scaling)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, rope) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(nn.Module):
    verifies_trees = True  # per-token positions and tree masks (a hybrid target's linear layers have none)
    runs_apart = True  # its layers run one by one, some without the others (LayerSkip, Draft & Verify)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def compile(self) -> None:
        """Faster inference: compile every layer (see `DecoderLayer.compile`)."""
        for layer in self.layers:
            layer.compile()

    def weights(self) -> dict[str, mx.array]:
        """The parameters under their checkpoint names (a fine-tuned target is written with them)."""
        return dict(tree_flatten(self.parameters()))

    def enable_grad_checkpoint(self) -> None:
        """Training: recompute each layer's activations in the backward pass."""
        self._grad_checkpoint = True

    def make_cache(self, rows: int = 1) -> list[KVCache]:
        return make_cache(len(self.layers), rows)

    def run_layers(self, h: mx.array, cache: Sequence[KVCache], layers: range, exact: bool = False) -> mx.array:
        """Layers `layers` only, over `h` `[B, S, H]` (causal), each with its cache
        (LayerSkip drafts with the first ones and verifies with the rest)."""
        masks = self.masks(h.shape[1], cache[layers[0]], layers, exact=exact)
        token = EXACTLY.set(exact)  # (read by the attention of a target on mlx-lm's modules)
        try:
            for i, mask in zip(layers, masks):
                h = self.layer(i, h, mask, cache[i], None)
        finally:
            EXACTLY.reset(token)
        return h

    def masks(self, S: int, first: KVCache | None, layers: range, tree=None,
              positions: mx.array | None = None, exact: bool = False) -> list:
        """Each of `layers`' masks over S new tokens: causal, from `first`, the cache of the first
        of them (LayerSkip's first layers run ahead of the rest), or the `tree` mask given; `exact`:
        as an `ExactMask` (`mlx_spec.exact`)."""
        window = self.args.sliding_window
        if exact:
            held = max(first.lengths)
            if tree is None:
                mask = first.make_mask(S, return_array=True, window_size=window if window and held + S > window else None)
            else:
                mask = tree.dense[None, None] if isinstance(tree, TreeMask) else tree
                if window and held + S > window:
                    raise UserError(f"--exact: a tree reaching past the sliding window ({window} tokens) of this "
                                    f"{self.model_type} target: verify chains (no --tree, --tree-budget)")
            return [ExactMask.of(mask, tree if isinstance(tree, TreeMask) else None)] * len(layers)
        if tree is None:
            return [default_mask(S, [first] if first is not None else None, window)] * len(layers)
        if window and (max(first.lengths) if first is not None else 0) + S > window:
            raise UserError(f"a tree reaching past the sliding window ({window} tokens) of this {self.model_type} "
                            "target: verify chains (no --tree, --tree-budget)")
        return [tree] * len(layers)

    def embed(self, tokens: mx.array) -> mx.array:
        """`[B, S]` -> `[B, S, H]`."""
        return self.embed_tokens(tokens)

    def layer(self, i: int, h: mx.array, mask, cache: KVCache | None, positions: mx.array | None) -> mx.array:
        """Layer i over `h` `[B, S, H]`."""
        return self.layers[i](h, mask, cache, positions)

    def head(self, h: mx.array) -> mx.array:
        """Final norm and LM head: `[B, S, H] -> [B, S, V]`."""
        return self.unembed(self.final_norm(h))

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def final_norm(self) -> nn.Module:
        """The norm between the last layer and the LM head (heads drafters and EAGLE read through it)."""
        return self.model.norm

    def unembed(self, h: mx.array) -> mx.array:
        """The LM head alone, on already normed states."""
        if self.args.tie_word_embeddings:
            return self.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def __call__(
        self,
        tokens: mx.array,
        cache: Sequence[KVCache] | None = None,
        positions: mx.array | None = None,
        mask: mx.array | None = None,
        capture: Sequence[int] = (),
        exit_layer: int | None = None,
        exact: bool = False,
    ) -> tuple[mx.array, tuple[mx.array, ...]]:
        n_layers = len(self.layers) if exit_layer is None else exit_layer
        if not 0 < n_layers <= len(self.layers):
            raise ValueError(f"exit_layer must be in 1..{len(self.layers)}, got {exit_layer}")
        if any(not 0 <= i <= n_layers for i in capture):
            raise ValueError(f"capture indices must be in 0..{n_layers}, got {list(capture)}")
        h = self.embed(tokens)  # [B, S, H]
        masks = self.masks(tokens.shape[1], cache[0] if cache else None, range(n_layers), mask, positions, exact)
        states = {0: h}
        checkpoint = getattr(self, "_grad_checkpoint", False)
        token = EXACTLY.set(mask if exact and isinstance(mask, TreeMask) else exact)  # (read by the attention of
        # a target on mlx-lm's modules: the tree it verifies, each query's keys as its decoding holds them)
        try:
            for i in range(n_layers):
                if checkpoint:
                    h = _checkpointed(self, i, h, masks[i], positions)
                else:
                    h = self.layer(i, h, masks[i], cache[i] if cache is not None else None, positions)
                states[i + 1] = h
        finally:
            EXACTLY.reset(token)
        return self.head(h), tuple(states[i] for i in capture)


def default_mask(S: int, cache: Sequence[KVCache] | None, window: int | None = None):
    """Causal over S new tokens; with a cache, its mask (rows of different lengths);
    with a sliding `window`, only the last `window` positions, once they are more."""
    held = max(cache[0].lengths) if cache is not None else 0
    window = window if window and held + S > window else None  # within the window: plainly causal
    if cache is not None:
        return cache[0].make_mask(S, window_size=window)
    if window is None:
        return "causal" if S > 1 else None
    query, key = np.arange(S)[:, None], np.arange(S)[None, :]
    return mx.array((key <= query) & (key > query - window))[None, None]  # [1, 1, S, S]


def _checkpointed(model: Model, i: int, h: mx.array, mask, positions) -> mx.array:
    """Layer i of `model` without keeping its activations for the backward pass."""
    layer = model.layers[i]

    def run(params: dict, h: mx.array) -> mx.array:
        layer.update(params)
        return model.layer(i, h, mask, None, positions)

    return mx.checkpoint(run)(layer.trainable_parameters(), h)
