"""LayerSkip fine-tuning (Elhoushi et al. 2024): make the early layers exit well.

The target is trained in place with two changes: layer dropout that rises
with depth (layer l of L is skipped with probability p * l / (L - 1), per
sequence), so the model learns not to lean on its last layers; and an
early-exit loss, the final norm and LM head applied after every layer, layer
l's cross-entropy weighted by `exit_scale * (l + 1) / L` beside the last
layer's weight 1, so that early exits learn to predict while the full model
keeps its own quality.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import mlx.nn as nn

from mlx_spec.errors import UserError
from mlx_spec.files import write_model_files
from mlx_spec.models import load_model
from mlx_spec.models.llama import Model
from mlx_spec.models.load import read_json
from mlx_spec.tokenizer import load_tokenizer
from mlx_spec.train.common import KeyedBatches, data_batches, train_config
from mlx_spec.train.distill import masked_mean
from mlx_spec.train.trainer import Trainer


def layerskip_loss(model: Model, tokens: mx.array, mask: mx.array, key: mx.array | None,
                   dropout: float, exit_scale: float) -> mx.array:
    inputs, labels, m = tokens[:, :-1], tokens[:, 1:], mask[:, 1:]
    L = len(model.layers)
    h = model.embed(inputs)
    masks = model.masks(inputs.shape[1], None, range(L))
    keys = mx.random.split(key, L) if key is not None and dropout > 0 else None
    total, weights = mx.array(0.0), 0.0
    for l in range(L):
        out = model.layer(l, h, masks[l], None, None)
        if keys is not None and l > 0:
            keep = mx.random.uniform(shape=(h.shape[0], 1, 1), key=keys[l]) >= dropout * l / (L - 1)
            out = mx.where(keep, out, h)
        h = out
        w = 1.0 if l == L - 1 else exit_scale * (l + 1) / L
        if w:
            ce = nn.losses.cross_entropy(model.head(h).astype(mx.float32), labels)
            total = total + w * masked_mean(ce, m)
            weights += w
    return total / weights


def make_objective(dropout: float, exit_scale: float):
    def objective(model: Model, batch: dict) -> mx.array:
        return layerskip_loss(model, batch["tokens"], batch["mask"], batch.get("key"), dropout, exit_scale)

    return objective


def exit_agreement(model: Model, batches, n_batches: int, exit_layer: int) -> dict[str, float]:
    """On held-out text: how often the exit at `exit_layer` predicts the full model's argmax."""
    hits = count = 0.0
    for i in range(n_batches):
        batch = batches(i)
        inputs, m = batch["tokens"][:, :-1], batch["mask"][:, 1:].astype(mx.float32)
        logits, (h,) = model(inputs, capture=(exit_layer,))
        same = mx.argmax(model.head(h), -1) == mx.argmax(logits, -1)
        hits += (same * m).sum().item()
        count += m.sum().item()
    return {f"exit{exit_layer}_agreement": hits / max(count, 1.0)}


def run(args: argparse.Namespace) -> int:
    """`mlx-spec train layerskip`: train on `--data` and write OUT."""
    if not 0 <= args.layer_dropout < 1 or args.exit_scale < 0:
        raise UserError("--layer-dropout must be in [0, 1) and --exit-scale >= 0")
    tconfig = train_config(args)
    model, path = load_model(args.target, for_training=True)
    batches, valid_batches = data_batches(args, load_tokenizer(path))
    n_eval = min(args.eval_batches, len(valid_batches))
    exit_layer = max(len(model.layers) // 2, 1)
    trainer = Trainer(
        model, make_objective(args.layer_dropout, args.exit_scale), KeyedBatches(batches, args.seed), tconfig,
        valid=KeyedBatches(valid_batches, args.seed + 1),
        evaluate=lambda m: exit_agreement(m, valid_batches, n_eval, exit_layer),
    )
    result = trainer.fit(resume=args.resume)
    if trainer.group.rank() == 0:
        write_model_files(args.out, read_json(path / "config.json"), model.weights(), path)
        print(json.dumps({"out": str(args.out), **result}))
    return 0
