"""EAGLE (Li et al. 2024, 2025): a one-layer drafter that reads the target's features.

Slot t of the drafter holds the target's feature of token t and the embedding
of token t + 1; its output predicts token t + 2 and serves as the feature for
the next slot when drafting runs ahead of the target.

- EAGLE-1/2: the feature is the target's last hidden state after its final
  norm (the LM head's input). `fc` maps [embedding; feature] (2H) to H, one
  decoder layer without input norm runs, and the target's LM head turns the
  output into logits. EAGLE-2 is the same drafter drafting a dynamic tree.
- EAGLE-3: the features are the inputs of three target layers (by default 2,
  L/2 and L-3), concatenated and mapped by `fc` (3H -> H) at the first step; the
  layer's attention reads [input_layernorm(embedding); hidden_norm(feature)]
  (2H); its own norm and LM head predict a reduced vocabulary, mapped to the
  target's by `d2t` (draft id i is target id i + d2t[i]).

After each verification the drafter re-runs its slots over the accepted tokens
with the target's real features ("draft-extend"), so its KV cache holds exact
entries; slots it wrote while drafting ahead are dropped first.

Weights are named as in the published checkpoints (`fc.*`, `layers.0.*` for
EAGLE-1, `midlayer.*`, `norm`, `lm_head`, `d2t` for EAGLE-3); the embedding and,
for EAGLE-1, the LM head are the target's. A folder holds `config.json` (the
draft layer's Llama-style config plus an `"eagle"` section) and
`model.safetensors`.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_spec import tree
from mlx_spec.cache import KVCache, trim_cache
from mlx_spec.drafters.base import Draft, Drafter, common_prefix
from mlx_spec.errors import UserError
from mlx_spec.files import write_model_files
from mlx_spec.models.config import ModelArgs, parse_config
from mlx_spec.models.llama import MLP, Attention, Model
from mlx_spec.models.load import load_folder
from mlx_spec.models.rope import RoPE
from mlx_spec.sampling import SamplingParams, draw


def default_layers(num_layers: int) -> list[int]:
    """EAGLE-3's taps: the inputs of layers 2, L/2 and L-3 (Hugging Face hidden_states indices)."""
    return [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]


class Eagle1Layer(nn.Module):
    def __init__(self, args: ModelArgs, rope: RoPE):
        super().__init__()
        self.self_attn = Attention(args, rope)
        self.mlp = MLP(args)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Eagle3Layer(nn.Module):
    def __init__(self, args: ModelArgs, rope: RoPE):
        super().__init__()
        H = args.hidden_size
        self.self_attn = Attention(args, rope, input_size=2 * H)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)  # normalises the embedding
        self.hidden_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(H, eps=args.rms_norm_eps)


class EagleNet(nn.Module):
    """The drafter's weights and one forward over S slots.

    `config["eagle"]`: `version` (1 or 3), `fc_bias` (EAGLE-1), `layers`
    (EAGLE-3 taps), `target_hidden_size`, `draft_vocab_size` (EAGLE-3),
    `norm_before_residual` (EAGLE-3 variant), `recycle_normed` (EAGLE 3.1:
    the state fed to the next drafting step is the normed one).
    """

    def __init__(self, config: dict, source: str = "config.json"):
        super().__init__()
        self.args = args = parse_config(config, source)
        eagle = config.get("eagle") or {}
        self.version = int(eagle.get("version", 3))
        if self.version not in (1, 3):
            raise UserError(f"{source}: eagle.version must be 1 or 3, got {self.version}")
        H = args.hidden_size
        target_hidden = int(eagle.get("target_hidden_size") or H)
        rope = RoPE(args.head_dim, args.rope_theta, args.rope_scaling)
        self.norm_before_residual = bool(eagle.get("norm_before_residual", False))
        self.recycle_normed = bool(eagle.get("recycle_normed", False))
        if self.version == 1:
            self.fc = nn.Linear(2 * H, H, bias=bool(eagle.get("fc_bias", True)))
            self.layers = [Eagle1Layer(args, rope)]
            self.taps: list[int] = []
        else:
            self.taps = [int(i) for i in eagle.get("layers") or []]
            self.fc = nn.Linear(len(self.taps or [0, 0, 0]) * target_hidden, H, bias=False)
            self.midlayer = Eagle3Layer(args, rope)
            self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
            vd = int(eagle.get("draft_vocab_size") or args.vocab_size)
            self.lm_head = nn.Linear(H, vd, bias=False)
            self.d2t = mx.zeros((vd,), dtype=mx.int32)

    def layer(self) -> nn.Module:
        return self.layers[0] if self.version == 1 else self.midlayer

    def mix(self, feature: mx.array, embedding: mx.array) -> tuple[mx.array, mx.array]:
        """(residual `[B, S, H]`, attention input) of slots with these features
        (`[B, S, F]`: the target's, or the drafter's own H-wide output) and
        next-token embeddings `[B, S, H]`."""
        if self.version == 1:
            x = self.fc(mx.concatenate([embedding, feature], axis=-1))  # embedding first
            return x, x  # no input norm
        layer = self.midlayer
        h = self.fc(feature) if feature.shape[-1] != self.args.hidden_size else feature
        normed = layer.hidden_norm(h)
        attn_in = mx.concatenate([layer.input_layernorm(embedding), normed], axis=-1)  # [B, S, 2H]
        return (normed if self.norm_before_residual else h), attn_in

    def finish(self, residual: mx.array, out: mx.array) -> mx.array:
        """Attention output `[B, heads, S, D]` -> the slots' output states `[B, S, H]`."""
        layer = self.layer()
        B, _, S, _ = out.shape
        x = residual + layer.self_attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, S, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def __call__(
        self,
        feature: mx.array,
        embedding: mx.array,
        cache: KVCache | None = None,
        positions: mx.array | None = None,
        mask: mx.array | str | None = None,
    ) -> mx.array:
        """One forward over S slots -> their output states `[B, S, H]`."""
        attn = self.layer().self_attn
        residual, attn_in = self.mix(feature, embedding)
        q, k, v = attn.qkv(attn_in, cache.offset if cache is not None else 0, positions)
        return self.finish(residual, attn.attend(q, k, v, mask, cache))

    def logits(self, x: mx.array, target: Model) -> mx.array:
        """Output states -> logits over the target's vocabulary `[..., V]`."""
        if self.version == 1:
            return target.unembed(x)
        small = self.lm_head(self.norm(x))  # [..., Vd]
        V = target.args.vocab_size
        if small.shape[-1] == V:
            return small
        ids = mx.arange(small.shape[-1]) + self.d2t  # target ids of the draft vocabulary
        full = mx.full((*small.shape[:-1], V), float("-inf"), small.dtype)
        full[..., ids] = small
        return full

    def next_feature(self, x: mx.array) -> mx.array:
        """What the next drafting step reads as its feature."""
        return self.norm(x) if self.recycle_normed and self.version == 3 else x

    def weights(self) -> dict[str, mx.array]:
        from mlx.utils import tree_flatten

        return dict(tree_flatten(self.parameters()))


def eagle_config(target: Model, version: int, layers: list[int] | None = None,
                 draft_vocab_size: int | None = None, intermediate_size: int | None = None) -> dict:
    """The config of a new drafter for `target`: its attention shape, one layer."""
    t = target.args
    keys = ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings")
    config = {k: getattr(t, k) for k in keys}
    config.update(num_hidden_layers=1, intermediate_size=intermediate_size or t.intermediate_size,
                  tie_word_embeddings=False)
    if t.rope_scaling:
        config["rope_scaling"] = dict(t.rope_scaling)
    eagle: dict = {"version": version}
    if version == 1:
        eagle["fc_bias"] = True
    else:
        eagle.update(layers=layers or default_layers(t.num_hidden_layers), target_hidden_size=t.hidden_size,
                     draft_vocab_size=draft_vocab_size or t.vocab_size)
    config["eagle"] = eagle
    return config


def save_eagle(out: Path, net: EagleNet, config: dict) -> None:
    write_model_files(out, config, net.weights())


def load_eagle(path_or_repo: str, revision: str | None = None) -> tuple[EagleNet, dict, Path]:
    """An EAGLE folder written by `mlx-spec convert` or `mlx-spec train eagle3`."""
    net, config, path = load_folder(path_or_repo, revision, EagleNet, "eagle",
                                    "convert published EAGLE drafters with mlx-spec convert")
    if net.version == 3:
        net.d2t = net.d2t.astype(mx.int32)  # published as int64
    return net, config, path


def check_eagle_fits(net: EagleNet, target: Model, what: str) -> None:
    """The drafter must read the target's features and speak its vocabulary."""
    a, t = net.args, target.args
    if a.vocab_size != t.vocab_size:
        raise UserError(f"{what}: drafter vocabulary {a.vocab_size}, the target's is {t.vocab_size}")
    if net.version == 1 and a.hidden_size != t.hidden_size:
        raise UserError(f"{what}: drafter hidden size {a.hidden_size}, the target's is {t.hidden_size}")
    if net.version == 3:
        taps = net.taps or default_layers(t.num_hidden_layers)
        if any(not 0 <= i <= t.num_hidden_layers for i in taps):
            raise UserError(f"{what}: layers {taps} outside the target's 0..{t.num_hidden_layers}")
        if net.fc.weight.shape[1] != len(taps) * t.hidden_size:
            raise UserError(
                f"{what}: fc reads {net.fc.weight.shape[1]} features, the target gives "
                f"{len(taps)} x {t.hidden_size}"
            )
        if a.hidden_size != t.hidden_size:
            raise UserError(f"{what}: drafter hidden size {a.hidden_size}, the target's embedding is {t.hidden_size}")


class Eagle(Drafter):
    """Drafts a chain (`budget` None) or an EAGLE-2 dynamic tree of `budget` nodes,
    expanding the `topk` most confident nodes per depth, `depth` deep at most."""

    costly = True

    def __init__(self, net: EagleNet, target: Model, budget: int | None = None, topk: int = 8, depth: int = 6):
        self.net, self.target = net, target
        self.budget, self.topk, self.depth = budget, topk, depth
        self.name = f"eagle{net.version}"
        L = target.args.num_hidden_layers
        self.capture = (L,) if net.version == 1 else tuple(net.taps or default_layers(L))
        self.cache: list[KVCache] = [KVCache()]
        self.committed = 0  # slots holding the target's real features
        self.pending: list[mx.array] = []  # features [1, n, F] of the next slots
        self.ahead: mx.array | None = None  # output state of the last committed slot
        self.context: list[int] = []  # the tokens the slots were computed from

    def new_session(self) -> Eagle:
        return Eagle(self.net, self.target, self.budget, self.topk, self.depth)

    def reset(self, prompt: list[int], cached: int = 0) -> int:
        # Slot j read token j's features and token j + 1: it stands while both do.
        keep = max(0, min(self.committed, common_prefix(self.context, prompt) - 1, cached))
        trim_cache(self.cache, self.cache[0].offset - keep)
        self.committed, self.pending, self.ahead = keep, [], None
        return keep

    def commit(self, context: list[int], features: tuple[mx.array, ...] = ()) -> None:
        self.context = context
        trim_cache(self.cache, self.cache[0].offset - self.committed)
        if not features:
            return
        f = self.target.model.norm(features[0]) if self.net.version == 1 else mx.concatenate(features, axis=-1)
        self.pending.append(f)

    def _extend(self, context: list[int]) -> None:
        """Run the committed slots over the features that came since the last round."""
        if not self.pending:
            return
        f = mx.concatenate(self.pending, axis=1)  # [1, n, F]
        n = f.shape[1]
        start = self.committed
        tokens = mx.array(context[start + 1 : start + 1 + n])[None]  # the token after each slot's
        x = self.net(f, self.target.model.embed_tokens(tokens), self.cache[0], mask="causal" if n > 1 else None)
        self.committed += n
        self.pending = []
        self.ahead = x[:, -1:]  # [1, 1, H]

    def propose(self, context: list[int], k: int, params: SamplingParams) -> Draft:
        self._extend(context)
        if self.ahead is None or self.committed != len(context) - 1:
            return Draft(mx.array([], dtype=mx.int32))  # no features yet (a one-token prompt)
        if self.budget is None:
            return self._chain(k, params)
        return self._tree(k)

    def _step(self, feature: mx.array, tokens: mx.array, positions=None, mask=None) -> mx.array:
        return self.net(feature, self.target.model.embed_tokens(tokens), self.cache[0], positions, mask)

    def _chain(self, k: int, params: SamplingParams) -> Draft:
        x = self.ahead
        drafted, dists = [], []
        for i in range(k):
            logits = self.net.logits(x[0, -1], self.target)  # [V]
            token, lp = draw(logits, params)
            drafted.append(token)
            dists.append(lp)
            if i + 1 < k:
                x = self._step(self.net.next_feature(x), token.reshape(1, 1))
        return Draft.chain(drafted, dists)

    def _tree(self, k: int) -> Draft:
        """EAGLE-2: grow by cumulative confidence, then keep the best `budget` nodes."""
        depth_max = min(k, self.depth)
        base = self.committed  # the first tree slot
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []  # cumulative log-probabilities
        slot_of: dict[int, int] = {}  # node -> its slot in the drafter's cache, once run
        states: dict[int, mx.array] = {-1: self.ahead[0, -1]}  # node -> output state [H]
        frontier = [-1]
        for depth in range(1, depth_max + 1):
            if depth > 1:
                # Run the frontier's nodes: each sees the committed slots and its ancestors.
                cached = self.cache[0].offset
                mask = np.zeros((len(frontier), cached + len(frontier)), dtype=bool)
                mask[:, :base] = True
                for row, node in enumerate(frontier):
                    for a in tree.path_to(parents, node)[:-1]:
                        mask[row, slot_of[a]] = True
                    mask[row, cached + row] = True
                feature = mx.stack([states[parents[n]] for n in frontier])[:, None]  # [S, 1, H]
                x = self._step(
                    self.net.next_feature(feature).reshape(1, len(frontier), -1),
                    mx.array([tokens[n] for n in frontier])[None],
                    positions=mx.array([base - 1 + depth - 1] * len(frontier))[None],
                    mask=mx.array(mask),
                )
                for row, node in enumerate(frontier):
                    slot_of[node] = cached + row
                    states[node] = x[0, row]
            logits = mx.stack([self.net.logits(states[n], self.target) for n in frontier])  # [F, V]
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            top = mx.argsort(-lp, axis=-1)[:, : self.topk]
            top_lp = mx.take_along_axis(lp, top, axis=-1)
            top, top_lp = np.array(top), np.array(top_lp)
            children = []
            for row, node in enumerate(frontier):
                base_score = scores[node] if node >= 0 else 0.0
                for j in range(top.shape[1]):
                    tokens.append(int(top[row, j]))
                    parents.append(node)
                    scores.append(base_score + float(top_lp[row, j]))
                    children.append(len(tokens) - 1)
            frontier = sorted(children, key=lambda n: -scores[n])[: self.topk]
        keep = tree.top_nodes(parents, scores, self.budget)
        kept_parents = tree.subtree(parents, keep)
        return Draft(mx.array([tokens[i] for i in keep], dtype=mx.int32), None, kept_parents)
