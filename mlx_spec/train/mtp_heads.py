"""Training parallel MTP heads on a frozen target.

Head k learns the target's own distribution of the token k + 1 ahead (its
prediction at position t + k), from the trunk state at t; losses are weighted
0.8^(k-1). Each head's loss is wrapped in `mx.checkpoint`: its logits
(`[B, S, V]`, the largest tensor) are freed after the forward and recomputed
in the backward pass, one head at a time, so only one head's logits are ever
held, whatever the number of heads.
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from mlx_spec.drafters.mtp_heads import MTPHeads, mtp_heads_config
from mlx_spec.models.llama import Model
from mlx_spec.train.common import train_blocks_on_target
from mlx_spec.train.distill import masked_mean

DECAY = 0.8


def mtp_heads_loss(heads: MTPHeads, target: Model, tokens: mx.array, mask: mx.array) -> mx.array:
    logits_t, (trunk,) = target(tokens, capture=(target.args.num_hidden_layers,))
    trunk, logits_t = mx.stop_gradient(trunk), mx.stop_gradient(logits_t).astype(mx.float32)
    S = tokens.shape[1]
    total, weights = mx.array(0.0), 0.0
    for k, head in enumerate(heads.heads, start=1):
        if S <= k:
            break

        def head_loss(params: dict, trunk: mx.array, k: int = k, head=head) -> mx.array:
            head.update(params)
            out = head(trunk, "causal", None, None)[:, : S - k]  # [B, S-k, H]
            student = target.head(out).astype(mx.float32)
            teacher = logits_t[:, k:]  # the target's prediction at t + k, of token t + k + 1
            t_lp = teacher - mx.logsumexp(teacher, axis=-1, keepdims=True)
            s_lp = student - mx.logsumexp(student, axis=-1, keepdims=True)
            return masked_mean(-(mx.exp(t_lp) * s_lp).sum(-1), mask[:, k:])

        w = DECAY ** (k - 1)
        total = total + w * mx.checkpoint(head_loss)(head.trainable_parameters(), trunk)
        weights += w
    return total / weights


def make_objective(target: Model):
    def objective(heads: MTPHeads, batch: dict) -> mx.array:
        return mtp_heads_loss(heads, target, batch["tokens"], batch["mask"])

    return objective


def run(args: argparse.Namespace) -> int:
    """`mlx-spec train mtp-heads`: train on `--data` and write OUT."""
    return train_blocks_on_target(args, "--heads", args.heads, mtp_heads_config, MTPHeads, lambda heads: heads.heads,
                                  make_objective)
