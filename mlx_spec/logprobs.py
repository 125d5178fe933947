"""Log-probabilities of committed tokens, read from the logits a round already computed.

Only rows that ask (`logprobs` set when they were added to the `Decoder`) are
gathered: their arrays are evaluated with the round's own, and the committed
tokens are picked out on the host once the verdicts are known."""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from mlx_spec.metrics import TokenLogprob

Gathered = dict[int, tuple[mx.array, mx.array]]


def gather(rows: Sequence, scores: Callable[[int], mx.array]) -> Gathered:
    """For each row b that asked: the target's log-probabilities `[S, V]` at `scores(b)`
    (its logits `[S, V]`) and the indices `[S, N]` of its N most likely tokens at each
    position (unordered), their evaluation started. Logits are divided by the
    temperature when sampling and taken raw when greedy; top-k/top-p/min-p cuts are
    not applied (every token keeps a finite log-probability)."""
    out = {}
    for b, row in enumerate(rows):
        if row.logprobs is None:
            continue
        x = scores(b).astype(mx.float32)
        if not row.params.greedy:
            x = x / row.params.temp
        lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
        n = min(row.logprobs, lp.shape[-1])
        out[b] = lp, mx.argpartition(-lp, max(n, 1) - 1, axis=-1)[:, :n]
    if out:  # alongside the round's own evaluation, which computes the same logits
        mx.async_eval(out)
    return out


def read(gathered: Gathered, b: int, at: Sequence[int], tokens: Sequence[int]) -> list[TokenLogprob] | None:
    """Row b's committed `tokens`, token i scored at position `at[i]` (None if the row did not ask).
    The arrays are evaluated by now: this reads host memory."""
    if b not in gathered:
        return None
    lp, top = (np.asarray(a) for a in gathered[b])
    out = []
    for j, token in zip(at, tokens):
        alternatives = sorted(((int(i), float(lp[j, i])) for i in top[j]), key=lambda pair: -pair[1])
        out.append(TokenLogprob(token, float(lp[j, token]), alternatives))
    return out
