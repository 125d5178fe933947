"""Training DFlash drafters on a frozen target.

Each training row holds several blocks, each starting at a randomly sampled
anchor token: the block is [anchor, mask, ..., mask] at the anchor's
positions, and it sees the target's context features of every token before
its anchor, and its own block (bidirectionally; causally in sliding-window
layers), never another block. So all blocks of a row train in one forward,
as at inference, with a block-sparse attention mask. Position i of a block
learns the target's own distribution of the token i ahead of the anchor,
weighted decay^(i-1): early positions decide how much of a block is accepted.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np

from mlx_spec.drafters.dflash import DFlashNet, save_dflash
from mlx_spec.drafters.dflash_layouts import dflash_config
from mlx_spec.errors import UserError
from mlx_spec.models.llama import Model
from mlx_spec.train.common import frozen_target_and_data, layer_list, start_from, train_config
from mlx_spec.train.distill import masked_mean
from mlx_spec.train.trainer import Trainer


class AnchoredBatches:
    """Adds `anchors` `[B, n]` to each batch: block starts drawn from the step
    and the seed alone, so a resumed run draws the same."""

    def __init__(self, batches, block_size: int, blocks_per_row: int, seed: int):
        self.batches, self.block, self.n, self.seed = batches, block_size, blocks_per_row, seed

    def __len__(self) -> int:
        return len(self.batches)

    def __call__(self, i: int) -> dict[str, mx.array]:
        batch = self.batches(i)
        B, S = batch["tokens"].shape
        rng = np.random.default_rng([self.seed, i])
        high = max(S - self.block, 1)
        anchors = np.sort(rng.integers(0, high, size=(B, self.n)), axis=1)
        return {**batch, "anchors": mx.array(anchors, dtype=mx.int32)}


def block_mask(anchors: mx.array, S: int, block: int, causal: bool, window: int = 0) -> mx.array:
    """`[B, 1, n*block, S + n*block]` bool: block b's queries see the context
    before its anchor and their own block."""
    B, n = anchors.shape
    q_pos = (anchors[:, :, None] + mx.arange(block)).reshape(B, n * block)  # [B, nb]
    q_blk = mx.repeat(mx.arange(n), block)  # [nb]
    ctx = mx.arange(S)[None, None, :] < mx.repeat(anchors, block, axis=1)[:, :, None]  # [B, nb, S]
    same = q_blk[:, None] == q_blk[None, :]  # [nb, nb]
    if causal:
        same = same & (mx.arange(n * block)[None, :] <= mx.arange(n * block)[:, None])
    allowed = mx.concatenate([ctx, mx.broadcast_to(same, (B, n * block, n * block))], axis=2)
    if window:
        k_pos = mx.concatenate([mx.broadcast_to(mx.arange(S), (B, S)), q_pos], axis=1)  # [B, S + nb]
        gap = q_pos[:, :, None] - k_pos[:, None, :]
        allowed = allowed & (gap < window) & (causal | (-gap < window))
    return allowed[:, None]


def dflash_loss(net: DFlashNet, target: Model, tokens: mx.array, mask: mx.array, anchors: mx.array,
                decay: float) -> mx.array:
    """Weighted soft cross-entropy of every block position to the target's distribution."""
    settings = net.settings
    taps = tuple(j + 1 for j in settings["target_layer_ids"])
    logits_t, hidden = target(tokens, capture=taps)
    feats = mx.stop_gradient(mx.concatenate(hidden, axis=-1))  # [B, S, F]
    B, S = tokens.shape
    n = anchors.shape[1]
    block = net.block_size
    ctx = net.hidden_norm(net.fc(feats))  # [B, S, H]
    offsets = mx.arange(block)
    positions = (anchors[:, :, None] + offsets).reshape(B, n * block)  # [B, nb]
    ids = mx.broadcast_to(mx.array(settings["mask_token_id"]), (B, n, block))
    first = mx.take_along_axis(tokens, anchors, axis=1)  # [B, n]: the anchors' tokens
    ids = mx.concatenate([first[:, :, None], ids[:, :, 1:]], axis=2).reshape(B, n * block)
    x = mx.stop_gradient(target.embed_tokens(ids))  # [B, nb, H]
    for i, layer in enumerate(net.layers):
        attn = layer.self_attn
        kc, vc = attn.keys_values(ctx, 0)  # context at positions 0..S-1
        q, kb, vb = layer.pre(x, 0, positions)
        sliding = settings["layer_types"][i] == "sliding_attention"
        causal = settings["causal"] if settings["causal"] is not None else sliding
        m = block_mask(anchors, S, block, causal, settings["sliding_window"] if sliding else 0)
        out = mx.fast.scaled_dot_product_attention(
            q, mx.concatenate([kc, kb], axis=2), mx.concatenate([vc, vb], axis=2), scale=attn.scale, mask=m
        )
        x = layer.post(x, out)
    student = target.unembed(net.norm(x)).astype(mx.float32).reshape(B, n, block, -1)[:, :, 1:]  # [B, n, b-1, V]
    # Position i of a block drafts token anchor + i: the target's distribution at anchor + i - 1.
    where = mx.minimum(anchors[:, :, None] + offsets[None, None, :-1], S - 1)  # [B, n, b-1]
    teacher = mx.take_along_axis(mx.stop_gradient(logits_t).astype(mx.float32), where.reshape(B, -1)[..., None], axis=1)
    teacher = teacher.reshape(B, n, block - 1, -1)
    t_lp = teacher - mx.logsumexp(teacher, axis=-1, keepdims=True)
    s_lp = student - mx.logsumexp(student, axis=-1, keepdims=True)
    ce = -(mx.exp(t_lp) * s_lp).sum(-1)  # [B, n, b-1]
    target_pos = anchors[:, :, None] + offsets[None, None, 1:]  # the drafted tokens' positions
    valid = (target_pos < S) & mx.take_along_axis(mask, mx.minimum(target_pos, S - 1).reshape(B, -1), axis=1).reshape(
        B, n, block - 1
    )
    weights = decay ** mx.arange(block - 1).astype(mx.float32)  # [b-1]
    return masked_mean(ce * weights, valid) / masked_mean(mx.broadcast_to(weights, valid.shape), valid)


def make_objective(target: Model, decay: float):
    def objective(net: DFlashNet, batch: dict) -> mx.array:
        return dflash_loss(net, target, batch["tokens"], batch["mask"], batch["anchors"], decay)

    return objective


def run(args: argparse.Namespace) -> int:
    """`mlx-spec train dflash`: train on `--data` and write OUT."""
    if args.num_layers < 1 or args.block_size < 2 or not 0 < args.loss_decay <= 1:
        raise UserError("--num-layers must be >= 1, --block-size >= 2 and --loss-decay in (0, 1]")
    if args.block_size > args.seq_len:
        raise UserError(f"--block-size {args.block_size} is longer than --seq-len {args.seq_len}")
    tconfig = train_config(args)
    target, _, batches, valid_batches = frozen_target_and_data(args)
    L, V = target.args.num_hidden_layers, target.args.vocab_size
    taps = layer_list("--target-layers", args.target_layers, L) if args.target_layers else None
    mask_id = V - 1 if args.mask_token_id is None else args.mask_token_id
    if not 0 <= mask_id < V:
        raise UserError(f"--mask-token-id must be a row of the target's embedding (0..{V - 1}), got {mask_id}")
    per_row = args.blocks_per_row or max(1, args.seq_len // args.block_size)
    config = dflash_config(target, args.num_layers, args.block_size, mask_id, taps, args.intermediate_size)
    net = DFlashNet(config)
    for i, layer in enumerate(net.layers):  # from target layers spread over its depth: a useful start
        start_from(layer, target.layers[round(i * (L - 1) / max(args.num_layers - 1, 1))])
    trainer = Trainer(
        net, make_objective(target, args.loss_decay), AnchoredBatches(batches, args.block_size, per_row, args.seed),
        tconfig, valid=AnchoredBatches(valid_batches, args.block_size, per_row, args.seed + 1),
    )
    result = trainer.fit(resume=args.resume)
    if trainer.group.rank() == 0:
        save_dflash(args.out, net, config)
        print(json.dumps({"out": str(args.out), **result}))
    return 0
