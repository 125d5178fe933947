"""Training EAGLE drafters on a frozen target, with training-time test.

At inference the drafter runs ahead of the target: after the slots fed with
the target's real features, each further slot reads the drafter's own output
from the slot before. Training-time test (EAGLE-3) unrolls that: step 0 runs
every slot on real features; step j runs every slot s on the output of step
j - 1 at slot s - 1, attending to the real slots up to s - j and to its own
chain (step i's key at slot s - j + i, for 1 <= i <= j), exactly what slot s
sees when it is the j-th drafted slot after s - j. Every step predicts the
target's own next-next-token distribution (soft labels, over the draft
vocabulary); EAGLE-1 also regresses the next feature.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_spec.drafters.eagle import EagleNet, default_layers, eagle_config, save_eagle
from mlx_spec.errors import UserError
from mlx_spec.models.llama import Model
from mlx_spec.train.common import frozen_target_and_data, layer_list, train_config
from mlx_spec.train.distill import masked_mean
from mlx_spec.train.trainer import Trainer

DECAY = 0.8  # weight of step j: 0.8^j (later steps matter less: each is reached through the earlier)


def draft_vocabulary(examples, vocab_size: int, size: int) -> np.ndarray:
    """The `size` most frequent target tokens of the data, ascending (EAGLE-3's `d2t` source)."""
    counts = Counter(t for ex in examples for t in ex.tokens)
    top = [t for t, _ in counts.most_common(size)]
    # Fill up with the lowest unused ids when the data holds fewer distinct tokens.
    rest = (t for t in range(vocab_size) if t not in counts)
    while len(top) < size:
        top.append(next(rest))
    return np.sort(np.array(top, dtype=np.int64))


def ttt_mask(S: int, step: int) -> mx.array:
    """`[S, (step + 1) S]` bool: which keys slot s attends to at `step`.

    Keys are laid out step by step; step 0's are the real-feature slots."""
    s = np.arange(S)[:, None]
    p = np.arange(S)[None, :]
    blocks = [p <= s - step] + [p == s - step + i for i in range(1, step + 1)]
    return mx.array(np.concatenate(blocks, axis=1))


def ttt_loss(net: EagleNet, target: Model, tokens: mx.array, mask: mx.array, steps: int,
             draft_ids: mx.array | None) -> mx.array:
    """Mean over steps (weighted 0.8^j) of the soft cross-entropy to the target's
    distributions; `draft_ids` [Vd] are the target ids of the draft vocabulary."""
    logits_t, hidden = target(tokens, capture=_capture(net, target))
    if net.version == 1:
        feats = target.final_norm(hidden[0])
    else:
        feats = mx.concatenate(hidden, axis=-1)
    feats, logits_t = mx.stop_gradient(feats), mx.stop_gradient(logits_t)
    S = tokens.shape[1] - 1  # slot s: feature of token s, embedding of token s + 1
    embedding = mx.stop_gradient(target.embed_tokens(tokens[:, 1:]))  # [B, S, H]
    # Slot s predicts token s + 2: the target's distribution at position s + 1.
    teacher = logits_t[:, 1:].astype(mx.float32)  # [B, S, V]
    if draft_ids is not None:
        teacher = teacher[..., draft_ids]
    teacher_lp = teacher - mx.logsumexp(teacher, axis=-1, keepdims=True)
    attn = net.layer().self_attn
    keys, values = [], []
    feature = feats[:, :S]
    total, weights = mx.array(0.0), 0.0
    for j in range(steps):
        residual, attn_in = net.mix(feature, embedding)
        q, k, v = attn.qkv(attn_in, 0, None)  # slot s at position s, in every step
        keys.append(k)
        values.append(v)
        out = mx.fast.scaled_dot_product_attention(
            q, mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2), scale=attn.scale, mask=ttt_mask(S, j)
        )
        x = net.finish(residual, out)  # [B, S, H]
        valid = mask[:, 1:].astype(mx.bool_) & (mx.arange(S) >= j)[None]  # slots with j real slots before
        if net.version == 1:
            student = target.unembed(x)
            feat_err = nn.losses.smooth_l1_loss(x[:, :-1], feats[:, 1 : S], reduction="none").mean(-1)
            step_loss = masked_mean(feat_err, valid[:, :-1])
        else:
            student = net.lm_head(net.norm(x))
            step_loss = mx.array(0.0)
        student_lp = student.astype(mx.float32)
        student_lp = student_lp - mx.logsumexp(student_lp, axis=-1, keepdims=True)
        ce = -(mx.exp(teacher_lp) * student_lp).sum(-1)  # [B, S]
        w = DECAY**j
        total = total + w * (masked_mean(ce, valid) + step_loss)
        weights += w
        # The next step's slot s reads this step's output at slot s - 1.
        nxt = net.next_feature(x)
        feature = mx.concatenate([mx.zeros_like(nxt[:, :1]), nxt[:, :-1]], axis=1)
    return total / weights


def _capture(net: EagleNet, target: Model) -> tuple[int, ...]:
    from mlx_spec.drafters.eagle import default_layers

    L = target.args.num_hidden_layers
    return (L,) if net.version == 1 else tuple(net.taps or default_layers(L))


def make_objective(target: Model, steps: int, draft_ids: mx.array | None):
    def objective(net: EagleNet, batch: dict) -> mx.array:
        return ttt_loss(net, target, batch["tokens"], batch["mask"], steps, draft_ids)

    return objective


def acceptance(net: EagleNet, target: Model, batches, n_batches: int) -> dict[str, float]:
    """On held-out text, at the first drafting step: how often the drafter's top
    token is the target's, and the expected acceptance sum_x min(p, q)."""
    match = accept = count = 0.0
    for i in range(n_batches):
        batch = batches(i)
        tokens, m = batch["tokens"], batch["mask"][:, 1:].astype(mx.float32)
        logits_t, hidden = target(tokens, capture=_capture(net, target))
        feats = target.final_norm(hidden[0]) if net.version == 1 else mx.concatenate(hidden, axis=-1)
        x = net(feats[:, :-1], target.embed_tokens(tokens[:, 1:]), mask="causal")
        p = mx.softmax(net.logits(x, target), axis=-1)
        q = mx.softmax(logits_t[:, 1:], axis=-1)
        match += ((mx.argmax(p, -1) == mx.argmax(q, -1)) * m).sum().item()
        accept += (mx.minimum(p, q).sum(-1) * m).sum().item()
        count += m.sum().item()
    return {"top1_agreement": match / max(count, 1), "expected_acceptance": accept / max(count, 1)}


def run(args: argparse.Namespace) -> int:
    """`mlx-spec train eagle` and `eagle3`: train on `--data` and write OUT."""

    if args.ttt_steps < 1:
        raise UserError(f"--ttt-steps must be >= 1, got {args.ttt_steps}")
    tconfig = train_config(args)
    target, train, batches, valid_batches = frozen_target_and_data(args)
    L, V = target.args.num_hidden_layers, target.args.vocab_size
    draft_ids = None
    if args.version == 3:
        layers = layer_list("--layers", args.layers, L + 1) if args.layers else default_layers(L)
        if args.draft_vocab < 1:
            raise UserError(f"--draft-vocab must be >= 1, got {args.draft_vocab}")
        size = min(args.draft_vocab, V)
        config = eagle_config(target, 3, layers, size, args.intermediate_size)
        config["eagle"]["recycle_normed"] = args.recycle_normed
        used = draft_vocabulary(train, V, size)
        net = EagleNet(config)
        net.d2t = mx.array(used - np.arange(size), dtype=mx.int32)
        # Start the drafter's head and norm from the target's: the same tokens, the same scale.
        full = target.embed_tokens.weight if target.args.tie_word_embeddings else target.lm_head.weight
        net.lm_head.weight = full[mx.array(used)]
        net.norm.weight = mx.array(target.final_norm.weight)
        net.freeze(keys=["d2t"])
        if size < V:
            draft_ids = mx.array(used)
    else:
        config = eagle_config(target, 1, intermediate_size=args.intermediate_size)
        net = EagleNet(config)
    n_eval = min(args.eval_batches, len(valid_batches))
    trainer = Trainer(
        net, make_objective(target, args.ttt_steps, draft_ids), batches, tconfig, valid=valid_batches,
        evaluate=lambda m: acceptance(m, target, valid_batches, n_eval),
    )
    result = trainer.fit(resume=args.resume)
    if trainer.group.rank() == 0:
        save_eagle(args.out, net, config)
        print(json.dumps({"out": str(args.out), **result}))
    return 0
