"""Medusa-1 training: the heads learn on a frozen target.

Head k, reading the target's final normed hidden state at position t, learns
token t + 2 + k; the heads' losses are weighted 0.8^k (later heads are
harder and matter less, as each is only reached through the earlier ones).
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import mlx.nn as nn

from mlx_spec.drafters.medusa import MedusaHeads, save_medusa
from mlx_spec.errors import UserError
from mlx_spec.models import load_model
from mlx_spec.models.llama import Model
from mlx_spec.tokenizer import load_tokenizer
from mlx_spec.train.common import data_batches, train_config
from mlx_spec.train.distill import masked_mean
from mlx_spec.train.trainer import Trainer

DECAY = 0.8


def medusa_loss(heads: MedusaHeads, target: Model, tokens: mx.array, mask: mx.array) -> mx.array:
    """Weighted cross-entropy of every head, over `tokens` `[B, S]` (`mask` True on targets)."""
    _, (hidden,) = target(tokens, capture=(target.args.num_hidden_layers,))
    h = mx.stop_gradient(target.final_norm(hidden))  # [B, S, H], the LM head's input
    S = tokens.shape[1]
    loss = mx.array(0.0)
    for k, head in enumerate(heads.heads):
        shift = k + 2
        if S <= shift:
            break
        z = h[:, : S - shift]
        for block in head[:-1]:
            z = block(z)
        logits = head[-1](z).astype(mx.float32)  # [B, S - shift, V]; one head's logits at a time
        ce = nn.losses.cross_entropy(logits, tokens[:, shift:])
        loss = loss + DECAY**k * masked_mean(ce, mask[:, shift:])
    return loss


def make_objective(target: Model):
    def objective(heads: MedusaHeads, batch: dict) -> mx.array:
        return medusa_loss(heads, target, batch["tokens"], batch["mask"])

    return objective


def head_accuracy(heads: MedusaHeads, target: Model, batches, n_batches: int) -> dict[str, float]:
    """On held-out text, how often each head's top token is the one `k + 2` ahead."""
    hits = [0.0] * len(heads.heads)
    counts = [0.0] * len(heads.heads)
    for i in range(n_batches):
        batch = batches(i)
        tokens, mask = batch["tokens"], batch["mask"].astype(mx.float32)
        _, (hidden,) = target(tokens, capture=(target.args.num_hidden_layers,))
        logits = heads(target.final_norm(hidden))  # [B, S, K, V]
        S = tokens.shape[1]
        for k in range(len(heads.heads)):
            shift = k + 2
            if S <= shift:
                break
            right = mx.argmax(logits[:, : S - shift, k], axis=-1) == tokens[:, shift:]
            hits[k] += (right * mask[:, shift:]).sum().item()
            counts[k] += mask[:, shift:].sum().item()
    return {f"head{k}_top1": h / max(c, 1.0) for k, (h, c) in enumerate(zip(hits, counts))}


def run(args: argparse.Namespace) -> int:
    """`mlx-spec train medusa`: train on `--data` and write OUT."""
    if args.heads < 1 or args.layers < 0:
        raise UserError(f"--heads must be >= 1 and --layers >= 0, got {args.heads}, {args.layers}")
    tconfig = train_config(args)
    target, target_path = load_model(args.target, for_training=True)
    target.freeze()
    batches, valid_batches = data_batches(args, load_tokenizer(target_path))
    heads = MedusaHeads(args.heads, args.layers, target.args.hidden_size, target.args.vocab_size)
    heads.init_from_target(target)
    n_eval = min(args.eval_batches, len(valid_batches))
    trainer = Trainer(
        heads, make_objective(target), batches, tconfig, valid=valid_batches,
        evaluate=lambda m: head_accuracy(m, target, valid_batches, n_eval),
    )
    result = trainer.fit(resume=args.resume)
    if trainer.group.rank() == 0:
        save_medusa(args.out, heads, {"base_model_name_or_path": args.target})
        print(json.dumps({"out": str(args.out), **result}))
    return 0
