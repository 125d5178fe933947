"""Multi-token prediction (MTP) modules shipped inside base checkpoints
(DeepSeek-V3/R1, Xiaomi MiMo, Qwen3-Next/3.5), drafting for their own target.

Module k (k = 1..D) at slot t reads h (the target's hidden state of token t for
k = 1, module k-1's output at slot t otherwise) and the embedding of token
t + k, and predicts token t + k + 1:

    x = eh_proj(concat(hnorm(h), enorm(embed(tok_{t+k}))))   # order per layout
    x = decoder_block(x)                                      # own KV cache, causal
    logits = head(norm(x))                                    # x feeds module k+1

- The target's state is the one AFTER its final norm (the LM head's input):
  vLLM passes the target's returned, normed hidden states and transformers'
  MTP generator uses `hidden_states[-1]` (research notes, section 5). The
  module's own output is passed on before its norm (vLLM's `deepseek_mtp`).
- Concatenation order: DeepSeek and Qwen3-Next put the embedding first, MiMo
  the hidden state (`hidden_first`).
- `norm` is the module's own (`shared_head.norm`, `final_layernorm`, `mtp.norm`);
  `head` is DeepSeek's `shared_head.head` when converted, else the target's LM head.
  The embedding is always the target's.
- vLLM zeroes DeepSeek's embedding at position 0; a one-slot quirk, not done here.

Drafting a chain after context t_0..t_{n-1}: depth d <= D runs module d over
its slots up to n-2 (the last d-1 of them on drafted tokens); deeper, module D
runs on its own output (DeepSeek reuses its single module recursively). Each
module keeps the slots whose inputs are all committed ("draft-extend", as
EAGLE), so its KV cache holds exact entries; drafted slots are dropped on commit.

A folder holds `config.json` (the block's Llama/Qwen-style config plus an `"mtp"`
section: `layout`, `num_modules`, `hidden_first`, `has_head`) and
`model.safetensors` named `layers.{k}.{enorm,hnorm,eh_proj,norm,head,block.*}`.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlx_spec.cache import KVCache, trim_cache
from mlx_spec.drafters.base import Draft, Drafter
from mlx_spec.errors import UserError
from mlx_spec.models.config import ModelArgs, parse_config
from mlx_spec.models.llama import DecoderLayer, Model
from mlx_spec.models.load import load_folder, read_json
from mlx_spec.models.rope import RoPE
from mlx_spec.sampling import SamplingParams, draw

LAYOUTS = ("deepseek", "mimo", "qwen3_next")


class MTPModule(nn.Module):
    def __init__(self, args: ModelArgs, rope: RoPE, hidden_first: bool, has_head: bool):
        super().__init__()
        H = args.hidden_size
        self.hidden_first = hidden_first
        self.enorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = DecoderLayer(args, rope)
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        if has_head:
            self.head = nn.Linear(H, args.vocab_size, bias=False)

    def __call__(self, hidden: mx.array, embedding: mx.array, cache: KVCache | None = None,
                 mask: mx.array | str | None = None) -> mx.array:
        """Slots' hidden states and next-token embeddings `[B, S, H]` -> outputs `[B, S, H]` (before `norm`)."""
        h, e = self.hnorm(hidden), self.enorm(embedding)
        x = self.eh_proj(mx.concatenate([h, e] if self.hidden_first else [e, h], axis=-1))  # [B, S, 2H] -> H
        return self.block(x, mask, cache, None)

    def logits(self, x: mx.array, target: Model) -> mx.array:
        """Outputs `[..., H]` -> logits `[..., V]`."""
        x = self.norm(x)
        return self.head(x) if "head" in self else target.unembed(x)


class MTPNet(nn.Module):
    """The D modules of a checkpoint. `config["mtp"]`: `layout`, `num_modules`,
    `hidden_first`, `has_head`."""

    def __init__(self, config: dict, source: str = "config.json"):
        super().__init__()
        self.args = args = parse_config(config, source)
        mtp = config.get("mtp") or {}
        self.layout = mtp.get("layout")
        if self.layout not in LAYOUTS:
            raise UserError(f"{source}: mtp.layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        n = int(mtp.get("num_modules", 1))
        if n < 1:
            raise UserError(f"{source}: mtp.num_modules must be at least 1, got {n}")
        rope = RoPE(args.head_dim, args.rope_theta, args.rope_scaling)
        self.layers = [
            MTPModule(args, rope, bool(mtp.get("hidden_first", False)), bool(mtp.get("has_head", False)))
            for _ in range(n)
        ]

    def weights(self) -> dict[str, mx.array]:
        from mlx.utils import tree_flatten

        return dict(tree_flatten(self.parameters()))


def load_mtp(path_or_repo: str, revision: str | None = None) -> tuple[MTPNet, dict, Path]:
    """An MTP folder written by `convert.mtp.convert_mtp`."""
    net, config, path = load_folder(path_or_repo, revision, MTPNet, "mtp", "extract MTP modules with convert.mtp.convert_mtp")
    return net, config, path


def check_mtp_fits(net: MTPNet, target: Model, what: str) -> None:
    a, t = net.args, target.args
    if a.hidden_size != t.hidden_size:
        raise UserError(f"{what}: MTP hidden size {a.hidden_size}, the target's is {t.hidden_size}")
    if a.vocab_size != t.vocab_size:
        raise UserError(f"{what}: MTP vocabulary {a.vocab_size}, the target's is {t.vocab_size}")


class MTP(Drafter):
    """Drafts a chain with the target's own MTP modules."""

    name = "mtp"
    costly = True

    def __init__(self, net: MTPNet, target: Model):
        self.net, self.target = net, target
        self.capture = (target.args.num_hidden_layers,)  # the last hidden state, before the final norm
        self.reset([])

    def new_session(self) -> MTP:
        return MTP(self.net, self.target)

    def reset(self, prompt: list[int], cached: int = 0) -> int:
        D = len(self.net.layers)
        self.cache = [KVCache() for _ in range(D)]
        self.committed = [0] * D  # per module: slots whose inputs are all committed
        # Per module: the committed input states [1, m, H] of its next slots, not yet run.
        self.inputs: list[mx.array | None] = [None] * D
        self.ahead: mx.array | None = None  # module 1's output at the last committed slot [1, 1, H]
        return 0

    def commit(self, context: list[int], features: tuple[mx.array, ...] = ()) -> None:
        for cache, n in zip(self.cache, self.committed):
            trim_cache([cache], cache.offset - n)
        if features:
            self._push(0, self.target.model.norm(features[0]))

    def _push(self, k: int, states: mx.array) -> None:
        self.inputs[k] = states if self.inputs[k] is None else mx.concatenate([self.inputs[k], states], axis=1)

    def _embed(self, tokens: list[int]) -> mx.array:
        return self.target.model.embed_tokens(mx.array(tokens)[None])  # [1, S, H]

    def _extend(self, context: list[int]) -> None:
        """Run every module over its newly committed slots; module k (0-based) may
        commit slot i once token i + k + 1 is in `context`."""
        n = len(context)
        for k, module in enumerate(self.net.layers):
            h = self.inputs[k]
            start = self.committed[k]
            m = 0 if h is None else min(h.shape[1], n - 1 - k - start)
            if m <= 0:
                continue
            x = module(h[:, :m], self._embed(context[start + k + 1 : start + k + 1 + m]), self.cache[k],
                       "causal" if m > 1 else None)
            self.inputs[k] = h[:, m:] if m < h.shape[1] else None
            self.committed[k] += m
            if k + 1 < len(self.net.layers):
                self._push(k + 1, x)
            if k == 0:
                self.ahead = x[:, -1:]

    def propose(self, context: list[int], k: int, params: SamplingParams) -> Draft:
        self._extend(context)
        n = len(context)
        if self.ahead is None or self.committed[0] != n - 1:
            return Draft(mx.array([], dtype=mx.int32))  # no features yet (a one-token prompt)
        layers = self.net.layers
        drafted, dists = [], []

        def ids(lo: int, hi: int) -> mx.array:
            """Tokens lo..hi-1 of the context followed by the drafts (kept lazy) -> `[1, S]`."""
            parts = [mx.array(context[lo:min(hi, n)], dtype=mx.int32)] if lo < n else []
            if hi > n:
                parts.append(mx.stack(drafted[max(lo, n) - n : hi - n]).reshape(-1).astype(mx.int32))
            return mx.concatenate(parts)[None]

        x = self.ahead  # module 1's output at slot n - 2
        for d in range(1, k + 1):
            j = min(d, len(layers)) - 1  # 0-based module
            if d > 1 and j == d - 1:
                # Module d over its slots committed[j] .. n-2: committed inputs, then the
                # previous module's outputs at the slots it has just run on drafted tokens.
                start = self.committed[j]
                fresh = x[:, x.shape[1] - (n - 1 - start - self._pending(j)):]
                h = fresh if self.inputs[j] is None else mx.concatenate([self.inputs[j], fresh], axis=1)
                x = layers[j](h, self.target.model.embed_tokens(ids(start + j + 1, n + j)), self.cache[j],
                              "causal" if h.shape[1] > 1 else None)
            elif d > 1:
                # Past the last module: it reads its own output and the token it drafted.
                x = layers[j](x[:, -1:], self.target.model.embed_tokens(drafted[-1].reshape(1, 1)), self.cache[j])
            token, lp = draw(layers[j].logits(x[0, -1], self.target), params)
            drafted.append(token)
            dists.append(lp)
        return Draft.chain(drafted, dists)

    def _pending(self, k: int) -> int:
        return 0 if self.inputs[k] is None else self.inputs[k].shape[1]


def mtp_from_checkpoint(path: Path, target: Model) -> MTPNet:
    """The MTP modules a target's own checkpoint holds, read from the shards that hold them."""
    from mlx.utils import tree_flatten

    from mlx_spec.convert.mtp import mtp_config, read_mtp
    from mlx_spec.models.load import check_weights

    target_config = read_json(path / "config.json")
    layout, weights = read_mtp(path, target_config)
    net = MTPNet(mtp_config(layout, weights, target_config), str(path / "config.json"))
    check_weights(dict(tree_flatten(net.parameters())), weights, {k: path for k in weights}, path, "MTP modules")
    dtype = mx.float32 if target.model.embed_tokens.weight.dtype == mx.float32 else None
    net.load_weights([(k, v.astype(dtype) if dtype else v) for k, v in weights.items()])
    mx.eval(net.parameters())
    return net
