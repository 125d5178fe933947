"""Training DeepSeek-style sequential MTP modules on a frozen target.

Module k reads the hidden state of depth k - 1 at position i (the target's
own, normed, for k = 1; module k - 1's output after) and the embedding of the
token k ahead, and learns the target's distribution of the token k + 1
ahead (its prediction at position i + k). The loss is the seed's:
lambda / D times the sum of the D depths' cross-entropies.
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from mlx_spec.drafters.mtp import MTPNet
from mlx_spec.models.llama import Model
from mlx_spec.train.common import train_blocks_on_target
from mlx_spec.train.distill import masked_mean


def mtp_config(target: Model, num_modules: int) -> dict:
    """A new DeepSeek-layout MTP folder's config for `target`."""
    config = {k: v for k, v in target.args.extra.items() if k not in ("quantization", "lora", "mlx_spec")}
    config.update(num_hidden_layers=1, tie_word_embeddings=False)
    config["mtp"] = {"layout": "deepseek", "num_modules": num_modules, "hidden_first": False, "has_head": False}
    return config


def mtp_loss(net: MTPNet, target: Model, tokens: mx.array, mask: mx.array, weight: float = 1.0) -> mx.array:
    logits_t, (hidden,) = target(tokens, capture=(target.args.num_hidden_layers,))
    h = mx.stop_gradient(target.final_norm(hidden))  # [B, S, H]
    logits_t = mx.stop_gradient(logits_t).astype(mx.float32)
    embedding = mx.stop_gradient(target.embed_tokens(tokens))
    S = tokens.shape[1]
    total = mx.array(0.0)
    for k, module in enumerate(net.layers, start=1):
        n = S - k  # positions that have a token k ahead
        if n <= 0:
            break
        h = module(h[:, :n], embedding[:, k : k + n], mask="causal")  # [B, n, H], before the module's norm
        student = module.logits(h, target).astype(mx.float32)
        teacher = logits_t[:, k : k + n]  # the target's prediction at i + k, of token i + k + 1
        t_lp = teacher - mx.logsumexp(teacher, axis=-1, keepdims=True)
        s_lp = student - mx.logsumexp(student, axis=-1, keepdims=True)
        total = total + masked_mean(-(mx.exp(t_lp) * s_lp).sum(-1), mask[:, k : k + n])
    return weight * total / len(net.layers)


def make_objective(target: Model):
    def objective(net: MTPNet, batch: dict) -> mx.array:
        return mtp_loss(net, target, batch["tokens"], batch["mask"])

    return objective


def run(args: argparse.Namespace) -> int:
    """`mlx-spec train mtp`: train on `--data` and write OUT."""
    return train_blocks_on_target(args, "--modules", args.modules, mtp_config, MTPNet,
                                  lambda net: [module.block for module in net.layers], make_objective)
