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

import argparse
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from mlx_spec.attention import causal_array
from mlx_spec.cache import KVCache, cut_cache
from mlx_spec.drafters import assistant
from mlx_spec.drafters.assistant import Assistant
from mlx_spec.drafters.base import (EMPTY, READ_MAX, Conversion, Draft, Kind, Options, Recipe, RowStates, draw_rows,
                                    padded)
from mlx_spec.errors import UserError
from mlx_spec.models.config import ModelArgs, parse_config
from mlx_spec.models.llama import DecoderLayer, Model
from mlx_spec.models.load import load_folder
from mlx_spec.models.rope import RoPE
from mlx_spec.published import find
from mlx_spec.sampling import SamplingParams

LAYOUTS = ("deepseek", "mimo", "qwen3_next")


def mlx_lm_block(config: dict) -> nn.Module:
    """The MTP block of the families whose block is a layer of the model itself, mlx-lm's own class,
    built from the model's (text) config: Qwen3-Next's and Qwen3.5's full-attention layer (gated
    attention, partial rotary embeddings), DeepSeek-V3's mixture-of-experts layer (latent attention)."""
    from mlx_lm.models import deepseek_v3, qwen3_5, qwen3_next

    from mlx_spec.models.config import mlx_lm_config

    fields = mlx_lm_config(config)
    if config["model_type"] == "deepseek_v3":
        args = deepseek_v3.ModelArgs.from_dict(fields)
        return deepseek_v3.DeepseekV3DecoderLayer(args, layer_idx=args.first_k_dense_replace)
    if config["model_type"] == "qwen3_next":
        args = qwen3_next.ModelArgs.from_dict(fields)
        return qwen3_next.Qwen3NextDecoderLayer(args, layer_idx=args.full_attention_interval - 1)
    args = qwen3_5.TextModelArgs.from_dict(fields)
    return qwen3_5.DecoderLayer(args, layer_idx=args.full_attention_interval - 1)


# The MTP blocks of these model types are mlx-lm's layers (`mlx_lm_block`); the others are ours.
MLX_LM_BLOCKS = ("qwen3_next", "qwen3_5", "qwen3_5_text", "deepseek_v3")


class MTPModule(nn.Module):
    def __init__(self, args: ModelArgs, block: nn.Module, hidden_first: bool, has_head: bool):
        super().__init__()
        H = args.hidden_size
        self.hidden_first = hidden_first
        self.enorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)
        if has_head:
            self.head = nn.Linear(H, args.vocab_size, bias=False)

    def __call__(self, hidden: mx.array, embedding: mx.array, cache: KVCache | None = None,
                 mask: mx.array | str | None = None) -> mx.array:
        """Slots' hidden states and next-token embeddings `[B, S, H]` -> outputs `[B, S, H]` (before `norm`)."""
        h, e = self.hnorm(hidden), self.enorm(embedding)
        x = self.eh_proj(mx.concatenate([h, e] if self.hidden_first else [e, h], axis=-1))  # [B, S, 2H] -> H
        if isinstance(self.block, DecoderLayer):
            return self.block(x, mask, cache, None)
        if isinstance(mask, str):  # mlx-lm's layer: an array (DeepSeek's attention applies it itself)
            mask = causal_array(x.shape[1], cache)
        return self.block(x, mask, cache)

    def logits(self, x: mx.array, target: Model) -> mx.array:
        """Outputs `[..., H]` -> logits `[..., V]`."""
        x = self.norm(x)
        return self.head(x) if "head" in self else target.unembed(x)


class MTPNet(nn.Module):
    """The D modules of a checkpoint. `config["mtp"]`: `layout`, `num_modules`,
    `hidden_first`, `has_head`."""

    def __init__(self, config: dict, source: str = "config.json"):
        super().__init__()
        theirs = config.get("model_type") in MLX_LM_BLOCKS  # the block is mlx-lm's layer
        if theirs:
            from mlx_spec.models.config import mlx_lm_config
            from mlx_spec.models.mlxlm import TargetArgs

            self.args = args = TargetArgs.of(mlx_lm_config(config), 1)
        else:
            self.args = args = parse_config(config, source)
        mtp = config.get("mtp") or {}
        self.layout = mtp.get("layout")
        if self.layout not in LAYOUTS:
            raise UserError(f"{source}: mtp.layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        n = int(mtp.get("num_modules", 1))
        if n < 1:
            raise UserError(f"{source}: mtp.num_modules must be at least 1, got {n}")
        rope = None if theirs else RoPE(args.head_dim, args.rope_theta, args.rope_scaling)
        self.layers = [
            MTPModule(args, mlx_lm_block(config) if theirs else DecoderLayer(args, rope),
                      bool(mtp.get("hidden_first", False)), bool(mtp.get("has_head", False)))
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


class MTP(RowStates):
    """Drafts a chain with the target's own MTP modules; each module runs once a
    step for every row (rows run different numbers of slots, padded)."""

    kind = "mtp"
    costly = True

    def __init__(self, net: MTPNet, target: Model):
        self.net, self.target = net, target
        super().__init__()
        self.capture = (target.args.num_hidden_layers,)  # the last hidden state, before the final norm
        self.cache = self.caches = [KVCache(rows=0) for _ in net.layers]

    def new_row(self) -> dict:
        # Per module: slots whose inputs are all committed; the committed input states of its next slots,
        # not yet run, as they came ([1, m, H] each, joined when read; module 1's are the target's hidden
        # states, normed when it runs). Module 1's output at the last committed slot [1, 1, H].
        D = len(self.net.layers)
        return {"committed": [0] * D, "inputs": [[] for _ in range(D)], "ahead": None}

    def _session(self) -> MTP:
        return MTP(self.net, self.target)

    def restart(self, b: int, prompt: list[int], cached: int = 0) -> int:
        cut_cache(self.cache, b, 0)
        for name, value in self.new_row().items():
            getattr(self, name)[b] = value
        return 0

    def commit(self, b: int, context: list[int], features: tuple[mx.array, ...] = ()) -> None:
        for cache, n in zip(self.cache, self.committed[b]):
            cache.cut(b, n)
        if features:
            self._push(b, 0, features[0])  # normed when module 1 runs over them (`_extend`)

    def _push(self, b: int, k: int, states: mx.array) -> None:
        self.inputs[b][k].append(states)

    def _held(self, b: int, k: int) -> mx.array | None:
        """Module k's committed inputs `[1, m, H]` (None: none), joined once however many rounds they came in
        (joined as each came, a long run of plain rounds would copy them over and over)."""
        parts = self.inputs[b][k]
        if len(parts) > 1:
            parts[:] = [mx.concatenate(parts, axis=1)]
        return parts[0] if parts else None

    def _run(self, k: int, hidden: list[mx.array | None], tokens: list[mx.array | None]) -> list[mx.array | None]:
        """Module k over each row's slots: states `[1, m, H]` and their next tokens `[m]`
        (None: nothing for that row), padded into one forward -> each row's outputs."""
        if all(h is None for h in hidden):
            return [None] * len(hidden)
        h, n = padded(hidden)
        ids, _ = padded([t[None, :, None] if t is not None else None for t in tokens], h.shape[1])
        cache = self.cache[k]
        before = list(cache.lengths)
        x = self.net.layers[k](h, self.target.embed_tokens(ids[..., 0]), cache, cache.make_mask(h.shape[1]))
        for b, (start, m) in enumerate(zip(before, n)):
            cache.cut(b, start + m)
        return [x[b : b + 1, :m] if m else None for b, m in enumerate(n)]

    def catch_up(self, contexts: list[list[int]]) -> int:
        before = sum(row[0] for row in self.committed)  # the first module's slots
        self._extend(contexts)
        mx.eval([c.state for c in self.cache], [a for a in self.ahead if a is not None],
                [part for row in self.inputs for parts in row for part in parts])
        return sum(row[0] for row in self.committed) - before

    def _extend(self, contexts: list[list[int]]) -> None:
        """Run every module over each row's newly committed slots; module k (0-based)
        may commit slot i once token i + k + 1 is in the row's context. READ_MAX slots a forward at most, as
        often as it takes: one forward over a long prompt would hold attention scores quadratic in it."""
        while self._extend_part(contexts):
            pass

    def _extend_part(self, contexts: list[list[int]]) -> bool:
        """Each module over up to READ_MAX of each row's slots; whether any ran."""
        ran = False
        for k in range(len(self.net.layers)):
            hidden, tokens, counts = [], [], []
            for b, context in enumerate(contexts):
                h, start = self._held(b, k), self.committed[b][k]
                m = 0 if h is None else min(h.shape[1], len(context) - 1 - k - start, READ_MAX)
                counts.append(max(m, 0))
                # module 1 reads the target's last hidden states, normed (a row's once, however many rounds)
                hidden.append(None if m <= 0 else self.target.final_norm(h[:, :m]) if k == 0 else h[:, :m])
                tokens.append(mx.array(context[start + k + 1 : start + k + 1 + m]) if m > 0 else None)
            outputs = self._run(k, hidden, tokens)
            for b, (x, m) in enumerate(zip(outputs, counts)):
                if x is None:
                    continue
                h = self._held(b, k)
                self.inputs[b][k] = [h[:, m:]] if m < h.shape[1] else []
                self.committed[b][k] += m
                if k + 1 < len(self.net.layers):
                    self._push(b, k + 1, x)
                if k == 0:
                    self.ahead[b] = x[:, -1:]
            ran = ran or any(counts)
        return ran

    def propose(self, contexts: list[list[int]], ks: list[int], params: list[SamplingParams]) -> list[Draft]:
        self._extend(contexts)
        # A row drafts once module 1 has run its slot n - 2 (a one-token prompt brings no features).
        ks = [k if a is not None and c[0] == len(ctx) - 1 else 0
              for k, a, c, ctx in zip(ks, self.ahead, self.committed, contexts)]
        K = max(ks)
        if K == 0:
            return [EMPTY() for _ in ks]
        layers = self.net.layers
        B = len(ks)
        drafted: list[list[mx.array]] = [[] for _ in range(B)]  # per row: drafted tokens [1], lazy
        H = self.net.args.hidden_size
        x = [a if a is not None else mx.zeros((1, 1, H)) for a in self.ahead]  # module 1's output at slot n - 2
        tokens, dists = [], []
        for d in range(1, K + 1):
            j = min(d, len(layers)) - 1  # 0-based module
            if d > 1:
                hidden, ids = [], []
                for b, (ctx, out) in enumerate(zip(contexts, x)):
                    n = len(ctx)
                    if d > ks[b]:  # this row's draft is complete
                        hidden.append(None)
                        ids.append(None)
                    elif j == d - 1:
                        # Module d over its slots committed .. n - 2: committed inputs, then the previous
                        # module's outputs at the slots it has just run on drafted tokens.
                        start, pending = self.committed[b][j], self._pending(b, j)
                        fresh = out[:, out.shape[1] - (n - 1 - start - pending):]
                        held = self._held(b, j)
                        hidden.append(fresh if held is None else mx.concatenate([held, fresh], axis=1))
                        ids.append(self._ids(ctx, drafted[b], start + j + 1, n + j))
                    else:
                        # Past the last module: it reads its own output and the token it drafted.
                        hidden.append(out[:, -1:])
                        ids.append(drafted[b][-1].astype(mx.int32))
                x = [new if new is not None else old for new, old in zip(self._run(j, hidden, ids), x)]
            logits = layers[j].logits(mx.concatenate([out[:, -1] for out in x]), self.target)  # [B, V]
            token, lp = draw_rows(logits, params)
            tokens.append(token)
            dists.append(lp)
            for b in range(B):
                drafted[b].append(token[b : b + 1])
        return Draft.steps(tokens, dists, ks)

    @staticmethod
    def _ids(context: list[int], drafted: list[mx.array], lo: int, hi: int) -> mx.array:
        """Tokens lo..hi-1 of the context followed by the drafts (kept lazy) -> `[hi - lo]`."""
        n = len(context)
        parts = [mx.array(context[lo:min(hi, n)], dtype=mx.int32)] if lo < n else []
        if hi > n:
            parts.append(mx.concatenate(drafted[max(lo, n) - n : hi - n]).astype(mx.int32))
        return mx.concatenate(parts)

    def _pending(self, b: int, k: int) -> int:
        return sum(h.shape[1] for h in self.inputs[b][k])


def build(target: Model, o: Options) -> MTP | Assistant:
    if o.source is None and getattr(target, "model_type", None) in assistant.TARGETS and o.target_source:
        # Gemma 4's MTP drafter is published beside the model: its assistant
        return assistant.build(target, replace(o, source=find("assistant", assistant.PUBLISHED, o.target_source)))
    if o.source is None:
        raise UserError("--drafter mtp: give the modules as mtp=PATH (alone, they are the target checkpoint's own)")
    net, _, _ = load_mtp(o.source, o.revision)
    check_mtp_fits(net, target, f"--drafter {o.spec}")
    return MTP(net, target)


def train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model: folder or Hub repo id")
    p.add_argument("--modules", type=int, default=1, help="depth D (drafting reuses the last module beyond it)")
    p.set_defaults(lr=1e-3)


TRAIN = Recipe("MTP modules (DeepSeek-V3): module k combines the depth k-1 hidden state with the embedding of the "
               "token k ahead; OUT is a folder that --drafter mtp=OUT loads.", train_arguments, "mlx_spec.train.mtp:run")
# A target checkpoint's own modules are cut out of it, shaped by the target; a folder with an "mtp" section loads.
CONVERT = Conversion("mtp", as_is=lambda path, config: isinstance(config.get("mtp"), dict))
KINDS = (Kind("mtp", "DeepSeek-style sequential multi-token-prediction modules", build, source="optional",
              alone="the target checkpoint's own modules (DeepSeek-V3, MiMo and Qwen3-Next layouts); on Gemma 4, "
                    "its published assistant",
              train=TRAIN, convert=CONVERT),)
