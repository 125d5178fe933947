"""Reading device values on the host: the one place a decoding round waits for the device. A round
hands everything it needs to read (verdicts, drafted tokens, log-probabilities) to one `read`, after
building all of it, so the device never waits on the host in between (tests count these waits)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def read(*trees):
    """Evaluate every array in `trees` at once and return them on the host, in the same structure
    (lists, tuples, dicts): a 0-d array as a Python number, a 1-d one as a list, a wider one as a
    NumPy array. One tree in, one out; several, a tuple."""
    trees = _map(lambda x: x.astype(mx.float32) if x.dtype == mx.bfloat16 else x, trees)  # NumPy has no bf16
    mx.eval(trees)
    out = _map(lambda x: x.tolist() if x.ndim < 2 else np.asarray(x), trees)
    return out if len(out) > 1 else out[0]


def _map(f, x):
    if isinstance(x, mx.array):
        return f(x)
    if isinstance(x, dict):
        return {k: _map(f, v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_map(f, v) for v in x)
    return x
