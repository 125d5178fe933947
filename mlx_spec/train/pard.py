"""PARD training (An et al. 2025; AMD-AGI/PARD `pard/pard_train.py`): a draft model learns to
fill K positions in one forward.

Each row of S tokens is read K times in one forward, all copies at the same
positions 0..S-1: copy 0 as it is, copy i (1 <= i < K) as mask tokens. The
mask at position j of copy i sees the real tokens up to j - i and itself, and
learns the token at j + 1: i + 1 ahead of the last token it sees, as the i-th
mask after the last real token drafts at inference. The loss is the
cross-entropy over every position of every copy that has a label (the tokens
`--mask-prompt` keeps), the copies weighted alike.
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
from mlx_spec.train.common import data_batches, train_config
from mlx_spec.train.trainer import Trainer


def copies_mask(S: int, K: int) -> mx.array:
    """Who sees whom among K copies of S positions `[1, 1, K*S, K*S]` (True: attends): the query at
    position j of copy i sees copy 0's positions 0..j-i, and itself."""
    q = np.arange(K * S)
    i, j = q // S, q % S  # [KS]: each query's copy and position
    sees = (q[None, :] < S) & (q[None, :] <= (j - i)[:, None])  # copy 0, up to j - i
    sees |= np.eye(K * S, dtype=bool)
    return mx.array(sees)[None, None]


def pard_loss(model: Model, tokens: mx.array, mask: mx.array, K: int, pard_token: int) -> mx.array:
    """Mean cross-entropy of the K copies' predictions (see the module docstring); `tokens`, `mask` `[B, S]`."""
    B, S = tokens.shape
    inputs = mx.concatenate([tokens] + [mx.full((B, S), pard_token, dtype=tokens.dtype)] * (K - 1), axis=1)
    positions = mx.tile(mx.arange(S), (K,))  # [K*S]
    logits, _ = model(inputs, positions=positions, mask=copies_mask(S, K))  # [B, K*S, V]
    logits = logits.reshape(B, K, S, -1)[:, :, :-1].astype(mx.float32)  # position j predicts token j + 1
    ce = nn.losses.cross_entropy(logits, mx.broadcast_to(tokens[:, None, 1:], (B, K, S - 1)))  # [B, K, S-1]
    # copy i at position j sees tokens up to j - i: only j >= i has anything to read
    has = mx.arange(S - 1)[None, :] >= mx.arange(K)[:, None]  # [K, S-1]
    weight = mask[:, None, 1:].astype(mx.float32) * has[None].astype(mx.float32)
    return (ce * weight).sum() / mx.maximum(weight.sum(), 1.0)


def run(args: argparse.Namespace) -> int:
    """`mlx-spec train pard`: turn `--student` into a PARD drafter on `--data` and write OUT."""
    if args.k < 2:
        raise UserError(f"--k must be >= 2 (one real position and at least one mask), got {args.k}")
    tconfig = train_config(args)
    student, path = prepare_student(args)
    V = student.args.vocab_size
    token = V - 1 if args.pard_token is None else args.pard_token
    if not 0 <= token < V:
        raise UserError(f"--pard-token must be a row of the student's embedding (0..{V - 1}), got {token}")
    batches, valid_batches = data_batches(args, load_tokenizer(path))

    def objective(model: Model, batch: dict) -> mx.array:
        return pard_loss(model, batch["tokens"], batch["mask"], args.k, token)

    trainer = Trainer(student, objective, batches, tconfig, valid=valid_batches)
    result = trainer.fit(resume=args.resume)
    if trainer.group.rank() == 0:
        export(args, student, path)  # the model (LoRA fused, or the base and its adapters), then what makes it PARD
        config = read_json(args.out / "config.json")
        (args.out / "config.json").write_text(json.dumps({**config, "pard_token": token, "spd_type": "pard"}, indent=2))
        print(json.dumps({"out": str(args.out), **result}))
    return 0
