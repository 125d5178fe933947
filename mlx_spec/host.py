"""Reading device values on the host: with `mx.eval`, the only places a decoding round waits for
the device. The round reads each row's verdict and drafted tokens once, after one evaluation for
the whole batch (tests count these, so that a round's host syncs do not creep up)."""

from __future__ import annotations

import mlx.core as mx


def read(x: mx.array):
    """`x` as Python numbers (a list, or a scalar for a 0-d array)."""
    return x.tolist()
