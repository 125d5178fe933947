"""Multi-token prediction with parallel heads (Gloeckle et al. 2024).

Beside the target's own next-token prediction, head k (k = 1..n) is one
transformer block over the trunk's output (the target's last hidden state,
before its final norm), followed by the shared unembedding (the target's
final norm and LM head), and predicts the token k + 1 ahead. Every head reads
the same trunk state, so one round drafts a chain of the heads' top tokens, or
a tree of their candidates; each head keeps its own KV cache over the trunk
states of the committed tokens.

A folder holds `config.json` (the target's layer shape and
`mtp_heads: {"num_heads": n}`) and `model.safetensors` (`heads.{k}.*`, a
decoder layer each, Hugging Face names).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_spec.cache import KVCache, cut_cache
from mlx_spec.drafters.base import EMPTY, Draft, Kind, Options, Recipe, RowStates, depth_tree, draw_rows, padded
from mlx_spec.errors import UserError
from mlx_spec.models.config import parse_config
from mlx_spec.models.llama import DecoderLayer, Model, default_mask
from mlx_spec.models.load import load_folder
from mlx_spec.models.rope import RoPE
from mlx_spec.sampling import SamplingParams


class MTPHeads(nn.Module):
    def __init__(self, config: dict, where: str = "config.json"):
        super().__init__()
        self.args = args = parse_config(config, where)
        n = (config.get("mtp_heads") or {}).get("num_heads")
        if not isinstance(n, int) or n < 1:
            raise UserError(f"{where}: 'mtp_heads.num_heads' must be a positive integer")
        rope = RoPE(args.head_dim, args.rope_theta, args.rope_scaling)
        self.heads = [DecoderLayer(args, rope) for _ in range(n)]

    def __call__(self, trunk: mx.array, caches: list[KVCache] | None = None) -> list[mx.array]:
        """Trunk states `[B, S, H]` -> each head's output states `[B, S, H]` (causal)."""
        return [self.head(k, trunk, caches[k] if caches else None) for k in range(len(self.heads))]

    def head(self, k: int, trunk: mx.array, cache: KVCache | None = None) -> mx.array:
        """Head k's output states `[B, S, H]` for trunk states `[B, S, H]` (causal)."""
        return self.heads[k](trunk, default_mask(trunk.shape[1], [cache] if cache is not None else None), cache, None)

    def weights(self) -> dict[str, mx.array]:
        return dict(tree_flatten(self.parameters()))


def mtp_heads_config(target: Model, num_heads: int) -> dict:
    t = target.args
    config = {k: v for k, v in t.extra.items() if k not in ("quantization", "lora", "mlx_spec")}
    config["mtp_heads"] = {"num_heads": num_heads}
    return config


def load_mtp_heads(path_or_repo: str, revision: str | None = None) -> tuple[MTPHeads, dict, Path]:
    heads, config, path = load_folder(path_or_repo, revision, MTPHeads, "mtp_heads", "train heads with mlx-spec train mtp-heads")
    return heads, config, path


def check_mtp_heads_fit(heads: MTPHeads, target: Model, what: str) -> None:
    if heads.args.hidden_size != target.args.hidden_size:
        raise UserError(f"{what}: heads read hidden size {heads.args.hidden_size}, the target's is {target.args.hidden_size}")


class MTPHeadsDrafter(RowStates):
    """A chain of the heads' tokens, or with `budget` a best-first tree of their
    candidates; each head runs once a round for every row."""

    kind = "mtp-heads"
    costly = True

    def __init__(self, heads: MTPHeads, target: Model, budget: int | None = None):
        self.heads, self.target, self.budget = heads, target, budget
        self.k_max = len(heads.heads)  # a head a position: a deeper K drafts no more
        super().__init__()
        self.capture = (target.args.num_hidden_layers,)
        self.caches = [KVCache(rows=0) for _ in heads.heads]

    def new_row(self) -> dict:
        # per head: the trunk states it has yet to read; its output at the last committed token
        n = len(self.heads.heads)
        return {"pending": [[] for _ in range(n)], "last": [None] * n}

    def _session(self) -> MTPHeadsDrafter:
        return MTPHeadsDrafter(self.heads, self.target, self.budget)

    def restart(self, b: int, prompt: list[int], cached: int = 0) -> int:
        cut_cache(self.caches, b, 0)
        for name, value in self.new_row().items():
            getattr(self, name)[b] = value
        return 0

    def commit(self, b: int, context: list[int], features: tuple[mx.array, ...] = ()) -> None:
        if features:
            for pending in self.pending[b]:
                pending.append(features[0])

    def _read(self, ks: list[int]) -> None:
        """Heads 0..ks[b] - 1 read row b's new trunk states (one forward a head)."""
        for i in range(max(ks)):
            parts = [mx.concatenate(p[i], axis=1) if p[i] and k > i else None for p, k in zip(self.pending, ks)]
            if all(part is None for part in parts):
                continue
            trunk, m = padded(parts)
            cache = self.caches[i]
            before = list(cache.lengths)
            out = self.heads.head(i, trunk, cache)  # [B, m_max, H]
            for b, (start, count) in enumerate(zip(before, m)):
                cache.cut(b, start + count)
                if count:
                    self.pending[b][i] = []
                    self.last[b][i] = out[b, count - 1]

    def catch_up(self, contexts: list[list[int]]) -> int:
        read = sum(part.shape[1] for pending in self.pending for part in pending[0])  # the first head's trunk states
        self._read([len(self.heads.heads)] * len(contexts))
        mx.eval([c.state for c in self.caches], [s for last in self.last for s in last if s is not None])
        return read

    def propose(self, contexts: list[list[int]], ks: list[int], params: list[SamplingParams]) -> list[Draft]:
        n = len(self.heads.heads)
        ks = [min(k, n) for k in ks]
        # Only the heads this round drafts with read the new trunk states; the
        # others catch up when a round needs them, so a short draft costs only its heads.
        self._read(ks)
        # A row drafts once each head it drafts with has read its trunk (a one-token prompt has none).
        ks = [k if all(last[i] is not None and self.caches[i].lengths[b] == len(c) - 1 for i in range(k)) else 0
              for b, (k, last, c) in enumerate(zip(ks, self.last, contexts))]
        K = max(ks)
        if K == 0:
            return [EMPTY() for _ in ks]
        H = self.heads.args.hidden_size
        states = mx.stack([mx.stack([s if s is not None else mx.zeros((H,)) for s in last[:K]])
                           for last in self.last])  # [B, K, H]
        logits = self.target.head(states)  # [B, K, V]: head i drafts the token i + 1 ahead
        if self.budget is not None:
            return [depth_tree(logits[b], k, budget=self.budget) if k else EMPTY() for b, k in enumerate(ks)]
        # The heads predict independently: each draft is drawn from its own head's distribution.
        tokens, lp = draw_rows(logits, params)
        return Draft.rows(tokens, lp, ks)


def build(target: Model, o: Options) -> MTPHeadsDrafter:
    heads, _, _ = load_mtp_heads(o.source, o.revision)
    check_mtp_heads_fit(heads, target, f"--drafter {o.spec}")
    return MTPHeadsDrafter(heads, target, o.tree_budget)


def train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model: folder or Hub repo id")
    p.add_argument("--heads", type=int, default=3, help="number of heads (head k predicts the token k + 1 ahead)")
    p.set_defaults(lr=1e-3)


TRAIN = Recipe("MTP heads (Gloeckle et al.): a transformer block per head on the target's last hidden state, "
               "sharing its unembedding; OUT is a folder that --drafter mtp-heads=OUT loads.", train_arguments,
               "mlx_spec.train.mtp_heads:run")
KINDS = (Kind("mtp-heads", "parallel multi-token-prediction heads on the target's last hidden state: a chain, "
              "or a tree with --tree-budget", build, takes=("tree_budget",), train=TRAIN),)
