"""Next-token language-model training for `mlx_spec.models.llama.Model`.

    losses = train_lm(model, batches, steps=500, lr=3e-3)

`batches` yields token arrays `[B, S]`, or `(tokens, mask)` pairs where
`mask[B, S]` marks the tokens that count as prediction targets (padding and
prompts are False). The step (forward, backward, clip, AdamW update) is one
`mx.compile`d function, so a step costs a single graph evaluation.
"""

from __future__ import annotations

from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from mlx_spec.models.llama import Model
from mlx_spec.train.trainer import lr_schedule

Batch = mx.array | tuple[mx.array, mx.array]


def lm_loss(model: Model, tokens: mx.array, mask: mx.array | None = None) -> mx.array:
    """Mean cross-entropy of predicting `tokens[:, 1:]` from what precedes them.

    `mask[B, S]` (True = counts) selects the target tokens; its first column
    is ignored since the first token has no prediction.
    """
    logits, _ = model(tokens[:, :-1])  # [B, S-1, V]
    # float32 softmax even when a GPU computes the model in half precision
    ce = nn.losses.cross_entropy(logits.astype(mx.float32), tokens[:, 1:])  # [B, S-1]
    if mask is None:
        return ce.mean()
    m = mask[:, 1:].astype(mx.float32)
    return (ce * m).sum() / mx.maximum(m.sum(), 1.0)


def train_lm(
    model: Model,
    batches: Iterator[Batch],
    steps: int,
    lr: float,
    warmup: int = 50,
    weight_decay: float = 0.01,
    max_grad_norm: float = 1.0,
    log_every: int = 50,
    on_log: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train `model` in place for `steps` AdamW steps; return the loss of every step.

    `on_log(step, mean_loss)` is called every `log_every` steps (and after the
    last) with the mean loss since the previous call.
    """
    # Without bias correction (MLX's default) the first updates are ~3x too
    # large; with it, short runs reach a clearly lower loss.
    schedule = lr_schedule(lr, steps, warmup)
    optimizer = optim.AdamW(schedule, weight_decay=weight_decay, bias_correction=True)
    loss_and_grad = nn.value_and_grad(model, lm_loss)
    # The compiled step reads and writes the parameters and optimizer moments.
    state = [model.state, optimizer.state]

    def step(tokens: mx.array, mask: mx.array | None) -> mx.array:
        loss, grads = loss_and_grad(model, tokens, mask)
        grads, _ = optim.clip_grad_norm(grads, max_grad_norm)
        optimizer.update(model, grads)
        return loss

    step = mx.compile(step, inputs=state, outputs=state)
    losses: list[float] = []
    logged = 0
    for i in range(steps):
        batch = next(batches)
        tokens, mask = batch if isinstance(batch, tuple) else (batch, None)
        loss = step(tokens, mask)
        mx.eval(loss, state)
        losses.append(loss.item())
        if on_log is not None and (i + 1 == steps or (i + 1) % log_every == 0):
            on_log(i + 1, sum(losses[logged:]) / (len(losses) - logged))
            logged = len(losses)
    return losses
