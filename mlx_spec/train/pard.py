"""PARD training (An et al. 2025; AMD-AGI/PARD `pard/pard_train.py`): a draft model learns to
fill K positions in one forward.

Each row of S tokens is read K times in one forward, all copies at the same
positions 0..S-1: copy 0 as it is, copy i (1 <= i < K) as mask tokens. The
mask at position j of copy i sees the real tokens up to j - i and the masks
after them up to itself, and learns the token at j + 1: i + 1 ahead of the
last token it sees, as the i-th mask after the last real token drafts at
inference. The loss is the cross-entropy over every position of every copy
that has a label (the tokens `--mask-prompt` keeps), the copies weighted alike.

PARD-2 (An et al. 2026; AMD-AGI/PARD `pard/pard2_train.py`), with `--target`:
each input also gets `scale * target_proj(f)`, f the frozen target's features
of the position before its last real token (zero where there is none; a row's
all dropped with probability `--feature-drop`, so that it drafts without them
too). The loss is 0.3 x the cross-entropy plus the KL divergence from the
target's own distribution, each prediction weighted by how likely the target
is to write the tokens between its last real token and the one it predicts
(`cat_weights`: confidence-adaptive tokens).
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_spec.errors import UserError
from mlx_spec.models.llama import Model
from mlx_spec.models.load import read_json
from mlx_spec.tokenizer import load_tokenizer
from mlx_spec.train.cli import export, prepare_student
from mlx_spec.train.common import KeyedBatches, data_batches, train_config
from mlx_spec.train.trainer import Trainer


CE_WEIGHT = 0.3  # PARD-2's: the cross-entropy beside the KL divergence from the target (weight 1)


def copies_mask(S: int, K: int) -> mx.array:
    """Who sees whom among K copies of S positions `[1, 1, K*S, K*S]` (True: attends): the query at
    position j of copy i sees copy 0's positions 0..j-i, and the masks from copy 1 at j-i+1 to itself
    (copy i - t at position j - t): what the i-th mask after the real token j - i sees at inference."""
    q = np.arange(K * S)
    i, j = q // S, q % S  # [KS]: each query's copy and position
    sees = (i[None, :] == 0) & (j[None, :] <= (j - i)[:, None])  # copy 0, up to j - i
    sees |= (i[None, :] >= 1) & (i[None, :] <= i[:, None]) & ((i - j)[None, :] == (i - j)[:, None])  # its chain
    return mx.array(sees)[None, None]


def copies_logits(model: Model, tokens: mx.array, K: int, pard_token: int, extra: mx.array | None = None) -> mx.array:
    """The K copies' predictions `[B, K, S-1, V]` (position j's, of token j + 1), each input's embedding plus
    `extra` `[B, K*S, H]` where given (PARD-2's)."""
    B, S = tokens.shape
    inputs = mx.concatenate([tokens] + [mx.full((B, S), pard_token, dtype=tokens.dtype)] * (K - 1), axis=1)
    positions, mask = mx.tile(mx.arange(S), (K,)), copies_mask(S, K)  # [K*S], [1, 1, K*S, K*S]
    if extra is None:
        logits, _ = model(inputs, positions=positions, mask=mask)  # [B, K*S, V]
    else:
        h = model.embed(inputs) + extra
        for i in range(len(model.layers)):
            h = model.layer(i, h, mask, None, positions)
        logits = model.head(h)
    return logits.reshape(B, K, S, -1)[:, :, :-1].astype(mx.float32)


def label_weights(mask: mx.array, K: int) -> mx.array:
    """`[B, K, S-1]`: the labelled tokens (`mask` `[B, S]`) copy i predicts; copy i at position j sees the
    tokens up to j - i, so only j >= i has anything to read."""
    has = mx.arange(mask.shape[1] - 1)[None, :] >= mx.arange(K)[:, None]  # [K, S-1]
    return mask[:, None, 1:].astype(mx.float32) * has[None].astype(mx.float32)


def pard_loss(model: Model, tokens: mx.array, mask: mx.array, K: int, pard_token: int) -> mx.array:
    """Mean cross-entropy of the K copies' predictions (see the module docstring); `tokens`, `mask` `[B, S]`."""
    B, S = tokens.shape
    ce = nn.losses.cross_entropy(copies_logits(model, tokens, K, pard_token),
                                 mx.broadcast_to(tokens[:, None, 1:], (B, K, S - 1)))  # [B, K, S-1]
    weight = label_weights(mask, K)
    return (ce * weight).sum() / mx.maximum(weight.sum(), 1.0)


def cat_weights(gold: mx.array, K: int) -> mx.array:
    """`[B, K, S-1]`: copy i's prediction at position j (of token j + 1, from the tokens up to j - i) weighs
    the target's probability of writing the i tokens between, prod_{s=1..i} p(x_{j+1-s}); `gold` `[B, S]` the
    target's probability of each token (1 for the first)."""
    B, S = gold.shape
    out, w = [], mx.ones((B, S - 1))
    for i in range(K):
        out.append(w)
        w = w * mx.concatenate([mx.ones((B, i)), gold[:, : S - 1 - i]], axis=1)  # times p(x_{j-i}), 1 before
    return mx.stack(out, axis=1)


class Pard2Student(nn.Module):
    """The draft model and the projection of the target's features into its embedding."""

    def __init__(self, model: Model, target_dim: int):
        super().__init__()
        self.model = model
        self.target_proj = nn.Linear(target_dim, model.args.hidden_size, bias=False)


def copies_features(target: Model, tokens: mx.array, capture: tuple[int, ...], K: int) -> tuple[mx.array, mx.array]:
    """(The target's features each of the K copies' positions reads `[B, K*S, F]`, the target's logits
    `[B, S, V]`): copy i at position j, whose last real token is j - i, those of j - i - 1 (zero before the
    text); the last hidden state read through the final norm, as transformers gives it."""
    S, L = tokens.shape[1], target.args.num_hidden_layers
    logits, taps = target(tokens, capture=capture)
    f = mx.stop_gradient(mx.concatenate([target.final_norm(h) if i == L else h for i, h in zip(capture, taps)], -1))
    zeros = mx.zeros_like(f)
    return mx.concatenate([mx.concatenate([zeros[:, : i + 1], f[:, : S - 1 - i]], axis=1) for i in range(K)], axis=1), \
        mx.stop_gradient(logits)


def pard2_loss(net: Pard2Student, target: Model, tokens: mx.array, mask: mx.array, key: mx.array | None,
               o: argparse.Namespace) -> mx.array:
    """PARD-2's loss (see the module docstring): `o` holds k, pard_token, capture, feature_scale, feature_drop."""
    B, S = tokens.shape
    features, logits_t = copies_features(target, tokens, o.capture, o.k)
    if key is not None and o.feature_drop > 0:
        features = features * (mx.random.uniform(shape=(B, 1, 1), key=key) >= o.feature_drop)
    extra = net.target_proj(features) * o.feature_scale  # [B, K*S, H]
    logits = copies_logits(net.model, tokens, o.k, o.pard_token, extra)  # [B, K, S-1, V]
    lp_t = mx.stop_gradient(nn.log_softmax(logits_t[:, :-1].astype(mx.float32), axis=-1))  # [B, S-1, V]
    gold = mx.exp(mx.take_along_axis(lp_t, tokens[:, 1:, None], axis=-1)[..., 0])  # p(x_{j+1})
    weight = mx.stop_gradient(cat_weights(mx.concatenate([mx.ones((B, 1)), gold], axis=1), o.k)
                              * label_weights(mask, o.k))
    lp = nn.log_softmax(logits, axis=-1)
    ce = -mx.take_along_axis(lp, mx.broadcast_to(tokens[:, None, 1:, None], (B, o.k, S - 1, 1)), axis=-1)[..., 0]
    kl = (mx.exp(lp_t)[:, None] * (lp_t[:, None] - lp)).sum(-1)  # [B, K, S-1]
    total = mx.maximum(weight.sum(), 1e-6)
    return CE_WEIGHT * (ce * weight).sum() / total + (kl * weight).sum() / total


def target_layers(value: str, L: int) -> list[int]:
    """`--target-layers`: indices into transformers' `hidden_states` of an L-layer target (-1: the final norm's
    output), as PARD-2's config names them; by default AMD's -1, -8, -16, -24, those the target has."""
    if value is None:
        return [i for i in (-1, -8, -16, -24) if -i <= L + 1]
    try:
        layers = [int(i) for i in value.split(",")]
    except ValueError:
        raise UserError(f"--target-layers: expected comma-separated layer indices, got '{value}'") from None
    if not layers or any(not -L - 1 <= i <= L for i in layers):
        raise UserError(f"--target-layers must be indices in -{L + 1}..{L}, got '{value}'")
    return layers


def run(args: argparse.Namespace) -> int:
    """`mlx-spec train pard`: turn `--student` into a PARD drafter on `--data` and write OUT (PARD-2's with
    `--target`)."""
    if args.k < 2:
        raise UserError(f"--k must be >= 2 (one real position and at least one mask), got {args.k}")
    if not 0 <= args.feature_drop < 1:
        raise UserError(f"--feature-drop must be in [0, 1), got {args.feature_drop}")
    tconfig = train_config(args)
    student, path = prepare_student(args)
    V = student.args.vocab_size
    args.pard_token = V - 1 if args.pard_token is None else args.pard_token
    if not 0 <= args.pard_token < V:
        raise UserError(f"--pard-token must be a row of the student's embedding (0..{V - 1}), got {args.pard_token}")
    tokenizer = load_tokenizer(path)
    batches, valid_batches = data_batches(args, tokenizer)
    fields = {"pard_token": args.pard_token, "spd_type": "pard"}
    if args.target is None:
        net = student

        def objective(model: Model, batch: dict) -> mx.array:
            return pard_loss(model, batch["tokens"], batch["mask"], args.k, args.pard_token)
    else:
        target, fields = _pard2_target(args, tokenizer, student, fields)
        net = Pard2Student(student, fields["pard2_target_dim"])
        batches, valid_batches = KeyedBatches(batches, args.seed), KeyedBatches(valid_batches, args.seed + 1)

        def objective(model: Pard2Student, batch: dict) -> mx.array:
            return pard2_loss(model, target, batch["tokens"], batch["mask"], batch["key"], args)

    trainer = Trainer(net, objective, batches, tconfig, valid=valid_batches)
    result = trainer.fit(resume=args.resume)
    if trainer.group.rank() == 0:
        export(args, student, path)  # the model (LoRA fused, or the base and its adapters), then what makes it PARD
        config = read_json(args.out / "config.json")
        (args.out / "config.json").write_text(json.dumps({**config, **fields}, indent=2))
        if args.target is not None:  # as AMD's converter writes it beside warp_model.bin
            warp = {"target_proj.weight": net.target_proj.weight}
            mx.save_safetensors(str(args.out / "warp_model.safetensors"), warp)
        print(json.dumps({"out": str(args.out), **result}))
    return 0


def _pard2_target(args: argparse.Namespace, tokenizer, student: Model, fields: dict) -> tuple[Model, dict]:
    """The frozen target PARD-2 reads, and the config fields that name what it reads (`args.capture` set)."""
    from mlx_spec.models import load_model
    from mlx_spec.tokenizer import check_same_vocab

    target, target_path = load_model(args.target, for_training=True)
    target.freeze()
    check_same_vocab(tokenizer, load_tokenizer(target_path), f"--student {args.student}", "the target")
    L, H = target.args.num_hidden_layers, target.args.hidden_size
    layers = target_layers(args.target_layers, L)
    args.capture = tuple(i % (L + 1) for i in layers)
    return target, {**fields, "spd_type": "pard2", "pard2_target_layers": layers, "pard2_target_dim": len(layers) * H,
                    "pard2_scale": args.feature_scale, "pard2_proj_bias": False}
