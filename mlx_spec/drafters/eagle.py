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

import argparse
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlx_spec.cache import KVCache
from mlx_spec.drafters.base import (EMPTY, READ_MAX, Conversion, Draft, Kind, Options, Recipe, RowStates, common_prefix,
                                    draw_rows, grow_tree, joined, padded, padded_length, spread)
from mlx_spec.errors import UserError
from mlx_spec.files import write_model_files
from mlx_spec.models.config import ARCHITECTURES, ModelArgs, parse_config
from mlx_spec.models.llama import COMPILED_MAX_TOKENS, MLP, Attention, Model
from mlx_spec.models.load import load_folder
from mlx_spec.models.rope import RoPE
from mlx_spec.sampling import SamplingParams


class _CompiledNet:
    """`EagleNet.compile`'s traces: the slots' mix and projections up to the attention, and what follows it."""

    def __init__(self, net: "EagleNet"):
        attn = net.layer().self_attn

        def pre(feature, embedding, offset, positions):
            residual, attn_in = net.mix(feature, embedding)
            return (residual, *attn.qkv(attn_in, offset, positions))

        self.pre_offset = mx.compile(lambda feature, embedding, offset: pre(feature, embedding, offset, None))
        self.pre_positions = mx.compile(lambda feature, embedding, positions: pre(feature, embedding, 0, positions))
        self.finish = mx.compile(net.finish)


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
        offset = cache.offset if cache is not None else 0
        fast = getattr(self, "_compiled", None)
        if fast is None or feature.shape[1] > COMPILED_MAX_TOKENS:
            residual, attn_in = self.mix(feature, embedding)
            q, k, v = attn.qkv(attn_in, offset, positions)
            return self.finish(residual, attn.attend(q, k, v, mask, cache))
        if positions is None:
            residual, q, k, v = fast.pre_offset(feature, embedding, mx.array(offset))
        else:
            residual, q, k, v = fast.pre_positions(feature, embedding, positions)
        return fast.finish(residual, attn.attend(q, k, v, mask, cache))

    def compile(self) -> None:
        """Faster drafting (as `llama.DecoderLayer.compile`): what runs before and after the attention is
        traced once per shape, the cache write and attention between them stay eager. A drafting step is
        a few small matmuls among many elementwise operations, each a dispatch of its own uncompiled.
        Weights must not change afterwards (a drafter being trained is not compiled)."""
        self._compiled = _CompiledNet(self)

    def logits(self, x: mx.array, target: Model) -> mx.array:
        """Output states -> logits over the target's vocabulary `[..., V]`."""
        if self.version == 1:
            return target.unembed(x)
        return spread(self.lm_head(self.norm(x)), self.d2t, target.args.vocab_size)  # [..., Vd] -> [..., V]

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
    if config["model_type"] not in ARCHITECTURES:  # a mixture of experts, say: the drafter's layer is a dense Llama's
        config["model_type"] = "llama"
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


class Eagle(RowStates):
    """Drafts a chain (`budget` None) or an EAGLE-2 dynamic tree of `budget` nodes,
    expanding the `topk` most confident nodes per depth, `depth` deep at most.
    Every row drafts in the same forward, one per step (a tree: one per depth)."""

    costly = True

    def __init__(self, net: EagleNet, target: Model, budget: int | None = None, topk: int = 8, depth: int = 6):
        super().__init__()
        self.net, self.target = net, target
        self.budget, self.topk, self.depth = budget, topk, depth
        if budget is not None:
            self.k_max = min(self.k_max, depth)  # a tree grows `depth` deep at most: a deeper K drafts no more
        self.kind = f"eagle{'3' if net.version == 3 else ''}"
        L = target.args.num_hidden_layers
        self.capture = (L,) if net.version == 1 else tuple(net.taps or default_layers(L))
        self.cache = self.caches = [KVCache(rows=0)]

    def new_row(self) -> dict:
        # slots holding the target's real features; each round's features (taps [1, n, H]) of the next
        # slots; the output state [H] of the last committed slot; the tokens the slots were computed from
        return {"committed": 0, "pending": [], "ahead": None, "context": []}

    def _session(self) -> Eagle:
        return Eagle(self.net, self.target, self.budget, self.topk, self.depth)

    def restart(self, b: int, prompt: list[int], cached: int = 0) -> int:
        # Slot j read token j's features and token j + 1: it stands while both do. Features that came while the
        # rows decoded plainly are read first (else the target would read those tokens again).
        self._extend(self.context)
        keep = max(0, min(self.committed[b], common_prefix(self.context[b], prompt) - 1, cached))
        self.cache[0].cut(b, keep)
        self.committed[b], self.pending[b], self.ahead[b] = keep, [], None
        return keep

    def commit(self, b: int, context: list[int], features: tuple[mx.array, ...] = ()) -> None:
        self.context[b] = context
        self.cache[0].cut(b, self.committed[b])  # drop the slots drafting wrote ahead
        if features:
            self.pending[b].append(features)

    def catch_up(self, contexts: list[list[int]]) -> int:
        read = sum(f[0].shape[1] for pending in self.pending for f in pending)  # features [1, m, H] a round
        self._extend(contexts)
        mx.eval(self.cache[0].state, [a for a in self.ahead if a is not None])
        return read

    def _extend(self, contexts: list[list[int]]) -> None:
        """Run each row's committed slots over the features that came since its last round (one forward, or
        one every READ_MAX slots: one forward over a long prompt would hold attention scores quadratic in it)."""
        if not any(self.pending):
            return
        parts = [joined(p) for p in self.pending]
        self.pending = [[] for _ in parts]
        for lo in range(0, max(0 if p is None else p.shape[1] for p in parts), READ_MAX):
            self._run([None if p is None or p.shape[1] <= lo else p[:, lo : lo + READ_MAX] for p in parts], contexts)

    def _run(self, parts: list[mx.array | None], contexts: list[list[int]]) -> None:
        """Each row's next slots over its features `[1, m, F]` (None: none)."""
        f, n = padded(parts, padded_length(max(0 if p is None else p.shape[1] for p in parts)))  # [B, S, F]
        if self.net.version == 1:
            f = self.target.final_norm(f)
        S = f.shape[1]
        tokens = mx.array([c[start + 1 : start + 1 + m] + [0] * (S - m)  # the token after each slot's
                           for c, start, m in zip(contexts, self.committed, n)])
        cache = self.cache[0]
        x = self.net(f, self.target.embed_tokens(tokens), cache, mask=cache.make_mask(S))
        for b, m in enumerate(n):
            self.committed[b] += m
            cache.cut(b, self.committed[b])
            if m:
                self.ahead[b] = x[b, m - 1]

    def propose(self, contexts: list[list[int]], ks: list[int], params: list[SamplingParams]) -> list[Draft]:
        self._extend(contexts)
        # A row drafts once its slots have caught up (a one-token prompt brings no features).
        ks = [k if a is not None and n == len(c) - 1 else 0
              for k, a, n, c in zip(ks, self.ahead, self.committed, contexts)]
        if max(ks) == 0:
            return [EMPTY() for _ in ks]
        H = self.net.args.hidden_size
        ahead = mx.stack([a if a is not None else mx.zeros((H,)) for a in self.ahead])  # [B, H]
        if self.budget is None:
            return self._chain(ahead, ks, params)
        return self._tree(ahead, ks)

    def _step(self, feature: mx.array, tokens: mx.array, positions=None, mask=None) -> mx.array:
        cache = self.cache[0]
        if mask is None:
            mask = cache.make_mask(tokens.shape[1])
        return self.net(feature, self.target.embed_tokens(tokens), cache, positions, mask)

    def _chain(self, ahead: mx.array, ks: list[int], params: list[SamplingParams]) -> list[Draft]:
        x = ahead[:, None]  # [B, 1, H]
        K = max(ks)
        drafted, dists = [], []
        for i in range(K):
            logits = self.net.logits(x[:, -1], self.target)  # [B, V]
            token, lp = draw_rows(logits, params)
            drafted.append(token)
            dists.append(lp)
            if i + 1 < K:
                x = self._step(self.net.next_feature(x), token[:, None])
        return Draft.steps(drafted, dists, ks)

    def _tree(self, ahead: mx.array, ks: list[int]) -> list[Draft]:
        """EAGLE-2 (`grow_tree`): a node's step reads its parent's output state and its own token."""
        states = ahead[:, None]  # [B, 1, H]: the frontier's output states

        def step(ids, positions, mask, parent_rows):
            nonlocal states
            previous = mx.take_along_axis(states, mx.array(parent_rows)[..., None], axis=1)  # [B, F, H]
            states = self._step(self.net.next_feature(previous), mx.array(ids), mx.array(positions), mx.array(mask))
            return self.net.logits(states, self.target)

        return grow_tree(self.net.logits(states, self.target), ks, list(self.committed),
                         lambda: list(self.cache[0].lengths), step, self.budget, self.topk, self.depth)

def build(version: int, target: Model, o: Options) -> Eagle:
    net, _, _ = load_eagle(o.source, o.revision)
    if net.version != version:
        raise UserError(f"--drafter {o.spec}: an EAGLE-{net.version} drafter; use eagle{'3' if net.version == 3 else ''}=")
    check_eagle_fits(net, target, f"--drafter {o.spec}")
    net.compile()
    return Eagle(net, target, o.tree_budget, o.topk, o.depth)


def train_arguments(version: int, p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model: folder or Hub repo id")
    p.add_argument("--ttt-steps", type=int, default=3, help="drafting steps unrolled in training (training-time test)")
    p.add_argument("--intermediate-size", type=int, default=None, help="the drafter's MLP width (default: the target's)")
    p.add_argument("--regenerate", action="store_true",
                   help="replace the answers of prompt/completion and chat examples by the target's own (greedy)")
    if version == 3:
        p.add_argument("--draft-vocab", type=int, default=32000,
                       help="predict only the N most frequent tokens of the data (at most the target's vocabulary)")
        p.add_argument("--layers", default=None, help="target layers to read, e.g. 2,14,25 (default: 2, L/2, L-3)")
        p.add_argument("--recycle-normed", action="store_true",
                       help="EAGLE 3.1: feed the normed output state to the next drafting step")
    p.set_defaults(lr=1e-3, version=version)


def recipe(version: int) -> Recipe:
    kind = "eagle3" if version == 3 else "eagle"
    return Recipe(f"EAGLE-{version}: a one-layer drafter on the target's features, trained with training-time "
                  f"test; OUT is a folder that --drafter {kind}=OUT loads.", partial(train_arguments, version),
                  "mlx_spec.train.eagle:run")


def conversion(version: int) -> Conversion:
    """EAGLE-{1,3} checkpoints convert; a folder `mlx-spec train` wrote (an "eagle" section) loads as it is."""
    return Conversion("eagle3" if version == 3 else "eagle",
                      as_is=lambda path, config: isinstance(config.get("eagle"), dict))


PUBLISHED_EAGLE3 = {
    "lmsys/vicuna-13b-v1.3": ("yuhuili/EAGLE3-Vicuna1.3-13B",),
    "meta-llama/Llama-3.1-8B-Instruct": (
        "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        "lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B",
        "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3",
    ),
    "meta-llama/Llama-3.3-70B-Instruct": ("yuhuili/EAGLE3-LLaMA3.3-Instruct-70B",),
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": ("yuhuili/EAGLE3-DeepSeek-R1-Distill-LLaMA-8B",),
    "Qwen/Qwen3-1.7B": ("AngelSlim/Qwen3-1.7B_eagle3",),
    "Qwen/Qwen3-4B": ("AngelSlim/Qwen3-4B_eagle3",),
    "Qwen/Qwen3-8B": ("AngelSlim/Qwen3-8B_eagle3", "Tengyunw/qwen3_8b_eagle3", "Zjcxy-SmartAI/Eagle3-Qwen3-8B-zh"),
    "Qwen/Qwen3-14B": ("AngelSlim/Qwen3-14B_eagle3",),
    "Qwen/Qwen3-32B": ("AngelSlim/Qwen3-32B_eagle3",),
    "openai/gpt-oss-120b": ("lmsys/EAGLE3-gpt-oss-120b-bf16", "nvidia/gpt-oss-120b-Eagle3"),
}
PUBLISHED_EAGLE = {  # EAGLE-1 weights, also decoded EAGLE-2 style (dynamic trees)
    "lmsys/vicuna-7b-v1.3": ("yuhuili/EAGLE-Vicuna-7B-v1.3",),
    "lmsys/vicuna-13b-v1.3": ("yuhuili/EAGLE-Vicuna-13B-v1.3",),
    "lmsys/vicuna-33b-v1.3": ("yuhuili/EAGLE-Vicuna-33B-v1.3",),
    "meta-llama/Llama-2-7b-chat-hf": ("yuhuili/EAGLE-llama2-chat-7B",),
    "meta-llama/Llama-2-13b-chat-hf": ("yuhuili/EAGLE-llama2-chat-13B",),
    "meta-llama/Llama-2-70b-chat-hf": ("yuhuili/EAGLE-llama2-chat-70B",),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": ("yuhuili/EAGLE-mixtral-instruct-8x7B",),
    "meta-llama/Meta-Llama-3-8B-Instruct": ("yuhuili/EAGLE-LLaMA3-Instruct-8B",),
    "meta-llama/Meta-Llama-3-70B-Instruct": ("yuhuili/EAGLE-LLaMA3-Instruct-70B",),
    "meta-llama/Llama-3.1-8B-Instruct": ("yuhuili/EAGLE-LLaMA3.1-Instruct-8B",),
    "Qwen/Qwen2-7B-Instruct": ("yuhuili/EAGLE-Qwen2-7B-Instruct",),
    "Qwen/Qwen2-72B-Instruct": ("yuhuili/EAGLE-Qwen2-72B-Instruct",),
}
_SUMMARY = ("one layer on the target's features: a chain, or with --tree-budget N an EAGLE-2 dynamic tree "
            "(--depth, --topk)")
KINDS = (Kind("eagle", "an EAGLE-1 drafter, " + _SUMMARY, partial(build, 1), takes=("tree_budget",),
              train=recipe(1), convert=conversion(1), published=PUBLISHED_EAGLE),
         Kind("eagle3", "an EAGLE-3 drafter, " + _SUMMARY, partial(build, 3), takes=("tree_budget",),
              train=recipe(3), convert=conversion(3), published=PUBLISHED_EAGLE3))
