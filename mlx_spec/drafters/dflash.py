"""DFlash (z-lab): a block-diffusion drafter that fills a whole block in one forward.

The block is the last accepted token (the anchor, which the target has not
run yet) followed by mask tokens; a few Qwen3 decoder layers run over it, the
block's tokens attending to each other bidirectionally (causally in
sliding-window layers), and the target's LM head reads every position after
the anchor: B - 1 drafts for the cost of one small forward.

The target's context enters as keys and values only: the outputs of the
target's layers `target_layer_ids` are concatenated, projected by `fc` and
normed by `hidden_norm`, and every draft layer projects them with its own
`k_proj`/`v_proj` (with `k_norm` and RoPE at the tokens' positions) and puts
them before the block's own. They never enter the residual stream, and they
are all the drafter caches: each round adds the newly accepted tokens'.

The weights are z-lab's, named as published (`fc`, `hidden_norm`,
`layers.{i}.*`, `norm`); the embedding and LM head are the target's. A
z-lab folder loads as it is, and so does a speculators one (dflash_layouts.py).

DFlash 2 (`DFlash2DraftModel`, z-lab/Qwen3.8-27B-DFlash2) wraps each layer's
attention and MLP in a grouped dynamic causal convolution over the block
(`out[i, c] = sum_t (base[t, c] + delta[i, t, group(c)]) * x[i - t, c]`, its
taps never reaching before the anchor; `prepare` before the sublayer,
`finish` after it, delta projected from the sublayer's normed input), and picks
the chain with a candidate selector instead of each position's own best: from
the anchor, left to right, the next token among its position's `selector_top_k`
best scores `logit + <A[previous] * P h, B[candidate]>`. Sampling draws each
step from the softmax of those scores at the temperature, and the acceptance
rule reads exactly those distributions, so output keeps the target's; greedy
takes the best path step by step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlx_spec.attention import scaled_dot_product_attention
from mlx_spec.cache import KVCache, cut_cache
from mlx_spec.drafters.dflash_layouts import DFLASH2, dflash_settings, is_dflash2, zlab_config
from mlx_spec.drafters.base import (EMPTY, Conversion, Draft, Kind, Options, Recipe, RowStates, common_prefix, depth_tree, draw_rows,
                                    joined, padded, spread)
from mlx_spec.errors import UserError
from mlx_spec.files import write_model_files
from mlx_spec.models.config import parse_config
from mlx_spec.models.llama import DecoderLayer, Model
from mlx_spec.models.load import load_folder
from mlx_spec.models.rope import RoPE
from mlx_spec.sampling import SamplingParams


class DFlashNet(nn.Module):
    def __init__(self, config: dict, where: str = "config.json"):
        super().__init__()
        # The draft body is a Qwen3 decoder, whatever its config calls itself.
        # Sliding windows are DFlash's own here (`_mask`), not the decoder's.
        self.args = args = parse_config({**config, "model_type": "qwen3", "use_sliding_window": False}, where)
        self.settings = dflash_settings(config, where)
        H = args.hidden_size
        target_hidden = int(config.get("target_hidden_size") or H)
        rope = RoPE(args.head_dim, args.rope_theta, args.rope_scaling)
        self.fc = nn.Linear(len(self.settings["target_layer_ids"]) * target_hidden, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.layers = [DecoderLayer(args, rope) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        vocab = self.settings["draft_vocab_size"]
        if vocab:  # a draft vocabulary of its own (speculators'): its LM head, mapped to the target's by d2t
            self.lm_head = nn.Linear(H, vocab, bias=False)
            self.d2t = mx.zeros((vocab,), dtype=mx.int32)

    @property
    def block_size(self) -> int:
        return self.settings["block_size"]

    def _mask(self, i: int, lengths: list[int], N: int) -> mx.array | None:
        """`[R, 1, N, L + N]` for a block of N after each row's context (R rows,
        `lengths` of context, L the longest): block queries see their row's
        context; sliding-window layers see the block causally and only the
        context inside the window. None where nothing is masked."""
        s = self.settings
        sliding = s["layer_types"][i] == "sliding_attention"
        causal = s["causal"] if s["causal"] is not None else sliding
        aligned = all(n == lengths[0] for n in lengths)
        if aligned and not (sliding or causal):
            return None
        L = max(lengths)
        ctx = np.array(lengths)[:, None, None]  # [R, 1, 1]
        q = ctx + np.arange(N)[None, :, None]  # [R, N, 1]: the block starts right after its row's context
        k = np.arange(L)[None, None, :]  # context keys
        seen = np.broadcast_to(k < ctx, (len(lengths), N, L))
        i_, j_ = np.arange(N)[:, None], np.arange(N)[None, :]  # block queries, block keys
        own = (j_ <= i_) if causal else np.ones((N, N), dtype=bool)
        if sliding and s["sliding_window"]:
            w = s["sliding_window"]
            seen = seen & (q - k < w)
            own = own & (i_ - j_ < w) & (causal | (j_ - i_ < w))  # the window, on both sides when not causal
        own = np.broadcast_to(own, (len(lengths), N, N))
        return mx.array(np.concatenate([seen, own], axis=-1)[:, None])

    def __call__(self, block: mx.array, context: mx.array | None, cache: list[KVCache],
                 new: list[int] | None = None) -> mx.array:
        """`block` embeddings `[R, N, H]`, new context features `[R, S, F]` (or None;
        row r's first `new[r]` are real, the rest padding) -> normed output states
        `[R, N, H]`. The context's keys and values are appended to `cache` (one per
        layer); the block's are not kept."""
        if context is not None:
            self.read(context, cache, new)
        x = block
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, cache[i])
        return self.norm(x)

    def _layer(self, i: int, layer: DecoderLayer, x: mx.array, c: KVCache) -> mx.array:
        return layer.post(x, self._attend(i, layer, layer.input_layernorm(x), c))

    def _attend(self, i: int, layer: DecoderLayer, h: mx.array, c: KVCache) -> mx.array:
        """Layer i's attention of the block's normed states `h` `[R, N, H]` over each row's context and the
        block -> `[R, heads, N, D]`."""
        L = max(c.lengths)
        q, kb, vb = layer.self_attn.qkv(h, c.offset, None)  # each row's block sits right after its context
        keys = mx.concatenate([c.keys[..., :L, :], kb], axis=2) if L else kb
        values = mx.concatenate([c.values[..., :L, :], vb], axis=2) if L else vb
        mask = self._mask(i, c.lengths, h.shape[1])
        return scaled_dot_product_attention(q, keys, values, layer.self_attn.scale, mask)

    def logits(self, target: Model, h: mx.array) -> mx.array:
        """The target's LM head (or the drafter's own, over its draft vocabulary) on the block's states, scaled
        and capped as the config says."""
        s = self.settings
        logits = spread(self.lm_head(h), self.d2t, target.args.vocab_size) if "lm_head" in self else target.unembed(h)
        if s["output_multiplier"] != 1:
            logits = logits * s["output_multiplier"]
        if s["final_logit_softcapping"]:
            cap = s["final_logit_softcapping"]
            logits = mx.tanh(logits / cap) * cap
        return logits

    def read(self, context: mx.array, cache: list[KVCache], new: list[int] | None = None) -> None:
        """New context features `[R, S, F]` (row r's first `new[r]` real): every layer's keys and values of
        them (one projection, read by each layer) appended to `cache`."""
        ctx = self.hidden_norm(self.fc(context))  # [R, S, H]
        for layer, c in zip(self.layers, cache):
            before = list(c.lengths)
            c.update_and_fetch(*layer.self_attn.keys_values(ctx, c.offset))
            for r, (n, m) in enumerate(zip(before, new or [ctx.shape[1]] * len(before))):
                c.cut(r, n + m)

    def weights(self) -> dict[str, mx.array]:
        return dict(tree_flatten(self.parameters()))

    def sanitize(self, weights: dict) -> dict:
        """speculators' folders also ship `t2d`, the way back from the target's vocabulary: not needed."""
        return {k: v for k, v in weights.items() if not (k == "t2d" and "d2t" in self)}


class GroupedConv(nn.Module):
    """DFlash 2's grouped dynamic causal convolution over a block (see the module docstring)."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.group = group
        self.base_kernel = mx.zeros((2, kernel, hidden))  # [prepare / finish, tap, channel]
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """`x` `[R, N, H]` -> (x convolved, the taps `finish` applies `[R, N, kernel, groups]`)."""
        taps = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.base_kernel.shape[1], -1)
        return self._convolve(x, taps[..., 0, :, :], 0), taps[..., 1, :, :]

    def finish(self, x: mx.array, taps: mx.array) -> mx.array:
        return self._convolve(x, taps, 1)

    def _convolve(self, x: mx.array, taps: mx.array, which: int) -> mx.array:
        R, N, H = x.shape
        x = x.reshape(R, N, -1, self.group)  # [R, N, groups, group]
        out = mx.zeros_like(x)
        for t in range(self.base_kernel.shape[1]):
            behind = x if t == 0 else mx.concatenate([mx.zeros_like(x[:, :t]), x[:, :-t]], axis=1)  # x[i - t]
            out = out + (self.base_kernel[which, t].reshape(1, 1, -1, self.group) + taps[:, :, t, :, None]) * behind
        return out.reshape(R, N, H)


class CandidateSelector(nn.Module):
    """DFlash 2's choice of the chain among each position's best candidates (see the module docstring)."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def __call__(self, h: mx.array, logits: mx.array, anchor: mx.array, params: list[SamplingParams]
                 ) -> tuple[mx.array, mx.array | None]:
        """States `[R, K, H]`, logits `[R, K, V]`, anchors `[R]` -> the chains `[R, K]` and the distributions
        they were drawn from `[R, K, V]` (None when every row is greedy)."""
        candidates = mx.argpartition(logits, -self.top_k, axis=-1)[..., -self.top_k :]  # [R, K, k]
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        projected = self.hidden_projection(h)  # [R, K, rank]
        greedy = mx.array([p.temp == 0 for p in params])
        temp = mx.array([p.temp or 1.0 for p in params])[:, None]
        previous, tokens, dists = anchor, [], []
        for i in range(h.shape[1]):
            edges = (self.predecessor_codebook(previous)[:, None] * projected[:, i, None]
                     * self.successor_codebook(candidates[:, i])).sum(axis=-1)  # [R, k]
            scores = unary[:, i] + edges
            lq = scores / temp - mx.logsumexp(scores / temp, axis=-1, keepdims=True)
            pick = mx.where(greedy, mx.argmax(scores, axis=-1), mx.random.categorical(lq))  # [R]
            lq = mx.where(greedy[:, None], mx.log(mx.arange(self.top_k) == pick[:, None]), lq)
            previous = mx.take_along_axis(candidates[:, i], pick[:, None], axis=-1)[:, 0]
            tokens.append(previous)
            dists.append(mx.put_along_axis(mx.full(logits[:, i].shape, -mx.inf), candidates[:, i], lq, axis=-1))
        return mx.stack(tokens, axis=1), None if all(p.temp == 0 for p in params) else mx.stack(dists, axis=1)


class DFlash2Net(DFlashNet):
    """DFlash 2: DFlash's layers in convolutions, and a candidate selector."""

    def __init__(self, config: dict, where: str = "config.json"):
        super().__init__(config, where)
        extra = config.get("dflash_config") or {}
        kernel, group, rank, top_k = (extra.get(k, config.get(k)) for k in DFLASH2)
        H, V = self.args.hidden_size, self.args.vocab_size
        for name, value in (("conv_kernel_size", kernel), ("selector_rank", rank), ("selector_top_k", top_k)):
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{where}: dflash_config.{name} must be a positive integer, got {value!r}")
        if not isinstance(group, int) or group < 1 or H % group:
            raise UserError(f"{where}: dflash_config.conv_group_size must divide hidden_size {H}, got {group!r}")
        for layer in self.layers:
            layer.attention_conv = GroupedConv(H, kernel, group)
            layer.mlp_conv = GroupedConv(H, kernel, group)
        self.candidate_selector = CandidateSelector(V, H, rank, min(top_k, V))

    def _layer(self, i: int, layer: DecoderLayer, x: mx.array, c: KVCache) -> mx.array:
        R, N, _ = x.shape
        h, taps = layer.attention_conv.prepare(layer.input_layernorm(x))
        out = self._attend(i, layer, h, c).transpose(0, 2, 1, 3).reshape(R, N, -1)
        x = x + layer.attention_conv.finish(layer.self_attn.o_proj(out), taps)
        h, taps = layer.mlp_conv.prepare(layer.post_attention_layernorm(x))
        return x + layer.mlp_conv.finish(layer.mlp(h), taps)

    def sanitize(self, weights: dict) -> dict:
        """The selector's codebooks are stored bare (`candidate_selector.successor_codebook`)."""
        books = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
        return {f"{k}.weight" if k in books else k: v for k, v in super().sanitize(weights).items()}


def load_dflash(path_or_repo: str, revision: str | None = None) -> tuple[DFlashNet, dict, Path]:
    """A DFlash folder as published, z-lab's (DFlash or DFlash 2) or speculators', or one `mlx-spec convert`
    or `train dflash` wrote."""

    def build(published: dict, where: str) -> DFlashNet:
        config = zlab_config(published, where)
        return (DFlash2Net if is_dflash2(config) else DFlashNet)(config, where)

    net, config, path = load_folder(path_or_repo, revision, build)
    if "d2t" in net:
        net.d2t = net.d2t.astype(mx.int32)  # published as int64
    return net, config, path


def save_dflash(out: Path, net: DFlashNet, config: dict) -> None:
    write_model_files(out, config, net.weights())


def check_dflash_fits(net: DFlashNet, target: Model, what: str) -> None:
    t = target.args
    s = net.settings
    if any(not 0 <= j < t.num_hidden_layers for j in s["target_layer_ids"]):
        raise UserError(f"{what}: target_layer_ids {s['target_layer_ids']} outside the target's 0..{t.num_hidden_layers - 1}")
    if net.fc.weight.shape[1] != len(s["target_layer_ids"]) * t.hidden_size:
        raise UserError(f"{what}: fc reads {net.fc.weight.shape[1]} features, the target gives "
                        f"{len(s['target_layer_ids'])} x {t.hidden_size}")
    if net.args.hidden_size != t.hidden_size:
        raise UserError(f"{what}: drafter hidden size {net.args.hidden_size}, the target's is {t.hidden_size}")
    if not 0 <= s["mask_token_id"] < t.vocab_size:
        raise UserError(f"{what}: mask_token_id {s['mask_token_id']} is outside the target's embedding (0..{t.vocab_size - 1})")
    ids = mx.arange(net.d2t.size) + net.d2t if "d2t" in net else None  # the target's ids of its draft tokens
    if ids is not None and not 0 <= int(mx.min(ids)) <= int(mx.max(ids)) < t.vocab_size:
        raise UserError(f"{what}: its d2t maps draft tokens outside the target's vocabulary (0..{t.vocab_size - 1})")
    if "candidate_selector" in net and net.args.vocab_size != t.vocab_size:
        raise UserError(f"{what}: its candidate selector knows {net.args.vocab_size} tokens, the target {t.vocab_size}")


class DFlash(RowStates):
    """One block per round: a chain of its drafts, or with `budget` a DDTree
    (the best-first tree of that many nodes over the block's per-position
    distributions). Every row's block runs in the same forward."""

    kind = "dflash"
    costly = True

    def __init__(self, net: DFlashNet, target: Model, budget: int | None = None, block_size: int | None = None):
        super().__init__()
        self.net, self.target, self.budget = net, target, budget
        self.block_size = block_size or net.block_size
        self.k_max = self.block_size - 1  # one forward drafts the whole block
        self.capture = tuple(j + 1 for j in net.settings["target_layer_ids"])  # outputs of those layers
        self.cache = self.caches = [KVCache(rows=0) for _ in self.net.layers]  # each row's context keys and values

    def new_row(self) -> dict:
        # features [1, n, K * H] not in the cache yet; the tokens the cache was computed from
        return {"pending": [], "context": []}

    def _session(self) -> DFlash:
        return DFlash(self.net, self.target, self.budget, self.block_size)

    def restart(self, b: int, prompt: list[int], cached: int = 0) -> int:
        # Position j's keys and values came from the target's features at j: they stand while the tokens up
        # to j do. Features that came while the rows decoded plainly are read first (else the target reads
        # those tokens again).
        self.catch_up(self.context)
        keep = min(self.cache[0].lengths[b], common_prefix(self.context[b], prompt), cached)
        cut_cache(self.cache, b, keep)
        self.pending[b] = []
        return keep

    def commit(self, b: int, context: list[int], features: tuple[mx.array, ...] = ()) -> None:
        self.context[b] = context
        if features:
            self.pending[b].append(features)  # taps [1, n, H]

    def _pending(self) -> tuple[mx.array | None, list[int] | None]:
        """The features the rows have not read, `[R, n_max, taps * H]`, and each row's n (None: none came)."""
        ctx, new = padded([joined(p) for p in self.pending]) if any(self.pending) else (None, None)
        self.pending = [[] for _ in self.pending]
        return ctx, new

    def catch_up(self, contexts: list[list[int]]) -> int:
        ctx, new = self._pending()
        if ctx is not None:
            self.net.read(ctx, self.cache, new)
            mx.eval([c.state for c in self.cache])
        return sum(new or ())

    def propose(self, contexts: list[list[int]], ks: list[int], params: list[SamplingParams]) -> list[Draft]:
        ctx, new = self._pending()
        N = self.block_size
        ks = [min(k, N - 1) for k in ks]
        s = self.net.settings
        anchors = mx.array([c[-1] for c in contexts])
        block = mx.concatenate([anchors[:, None], mx.full((len(ks), N - 1), s["mask_token_id"])], axis=1)  # [R, N]
        embedded = self.target.embed(block)
        if s["input_embedding_scale"] != 1:
            embedded = embedded * s["input_embedding_scale"]
        # The context holds every token before the anchor (none for a one-token prompt).
        h = self.net(embedded, ctx, self.cache, new)
        K = max(ks)
        if K == 0:
            return [EMPTY() for _ in ks]
        h = h[:, 1 : 1 + K]  # [R, K, H]: position i + 1 drafts token i
        logits = self.net.logits(self.target, h)  # [R, K, V]
        if "candidate_selector" in self.net:
            return Draft.rows(*self.net.candidate_selector(h, logits, anchors, params), ks)
        if self.budget is not None:
            return [depth_tree(logits[b], k, budget=self.budget) if k else EMPTY() for b, k in enumerate(ks)]
        # Each position is drawn from its own distribution: p_i does not depend on the earlier drafts.
        tokens, lp = draw_rows(logits, params)  # [R, K], [R, K, V]
        return Draft.rows(tokens, lp, ks)


def build(target: Model, o: Options) -> DFlash:
    if o.source is None:
        raise UserError("--drafter dflash: give the drafter as dflash=PATH_OR_REPO (alone, it is the one "
                        "published for --model)")
    net, _, _ = load_dflash(o.source, o.revision)
    check_dflash_fits(net, target, f"--drafter {o.spec}")
    if o.tree_budget is not None and "candidate_selector" in net:
        raise UserError(f"--drafter {o.spec}: a DFlash 2 drafter's candidate selector drafts a chain; "
                        "give no --tree-budget")
    return DFlash(net, target, o.tree_budget, o.block_size)


def train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model: folder or Hub repo id")
    p.add_argument("--num-layers", type=int, default=2, help="drafter layers (started from target layers)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--target-layers", default=None,
                   help="target layers whose outputs it reads, e.g. 1,9,17 (default: z-lab's spread)")
    p.add_argument("--mask-token-id", type=int, default=None, help="the mask token (default: the embedding's last row)")
    p.add_argument("--loss-decay", type=float, default=0.9, help="weight of block position i: decay^(i-1)")
    p.add_argument("--blocks-per-row", type=int, default=None,
                   help="anchors sampled per row (default: seq-len / block-size)")
    p.add_argument("--intermediate-size", type=int, default=None, help="the drafter's MLP width (default: the target's)")
    p.add_argument("--regenerate", action="store_true",
                   help="replace the answers of prompt/completion and chat examples by the target's own (greedy)")
    p.set_defaults(lr=1e-3)


PUBLISHED = {
    "Qwen/Qwen3-4B": ("z-lab/Qwen3-4B-DFlash-b16",),
    "Qwen/Qwen3-8B": ("z-lab/Qwen3-8B-DFlash-b16",),
    "Qwen/Qwen3-Coder-30B-A3B-Instruct": ("z-lab/Qwen3-Coder-30B-A3B-DFlash",),
    "Qwen/Qwen3-Coder-Next": ("z-lab/Qwen3-Coder-Next-DFlash",),
    "meta-llama/Llama-3.1-8B-Instruct": ("z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",),
    "openai/gpt-oss-20b": ("z-lab/gpt-oss-20b-DFlash",),
    "openai/gpt-oss-120b": ("z-lab/gpt-oss-120b-DFlash",),
    "Qwen/Qwen3.5-4B": ("z-lab/Qwen3.5-4B-DFlash",),
    "Qwen/Qwen3.5-9B": ("z-lab/Qwen3.5-9B-DFlash",),
    "Qwen/Qwen3.5-27B": ("z-lab/Qwen3.5-27B-DFlash",),
    "Qwen/Qwen3.5-35B-A3B": ("z-lab/Qwen3.5-35B-A3B-DFlash",),
    "Qwen/Qwen3.5-122B-A10B": ("z-lab/Qwen3.5-122B-A10B-DFlash",),
    "Qwen/Qwen3.5-397B-A17B": ("z-lab/Qwen3.5-397B-A17B-DFlash",),
    "Qwen/Qwen3.6-27B": ("z-lab/Qwen3.6-27B-DFlash",),
    "Qwen/Qwen3.6-35B-A3B": ("z-lab/Qwen3.6-35B-A3B-DFlash",),
    "Qwen/Qwen3.8-27B": ("z-lab/Qwen3.8-27B-DFlash2",),
    "moonshotai/Kimi-K2.5": ("z-lab/Kimi-K2.5-DFlash",),
    "google/gemma-4-31B-it": ("z-lab/gemma-4-31B-it-DFlash",),
    "google/gemma-4-26B-A4B-it": ("z-lab/gemma-4-26B-A4B-it-DFlash",),
}
TRAIN = Recipe("DFlash: a few layers that fill a block of drafts in one forward, reading the target's features "
               "as keys and values; OUT is a folder that --drafter dflash=OUT loads.", train_arguments,
               "mlx_spec.train.dflash:run")
# z-lab's and speculators' folders load as published (another checkpoint is converted, or told apart, on first use).
CONVERT = Conversion("dflash", as_is=lambda path, config: config.get("speculators_model_type", "dflash") in
                     ("dflash", "dflash2"))
KINDS = (Kind("dflash", "a DFlash block drafter (z-lab's, as published): a whole block of drafts in one small "
              "forward; --tree-budget N verifies a DDTree over the block; --block-size", build,
              source="optional", alone="the one published for --model", takes=("tree_budget", "block_size"),
              train=TRAIN, convert=CONVERT, published=PUBLISHED),)
