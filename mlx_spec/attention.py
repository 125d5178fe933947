"""Attention masks for verification. True = attend (SDPA reads int masks as
additive, so masks here are always boolean)."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np


def ancestor_matrix(parents: Sequence[int]) -> np.ndarray:
    """`[N, N]` bool: node i sees node j iff j is i or one of its ancestors.

    `parents[i]` is the index of i's parent (-1 for a root); parents come first.
    """
    n = len(parents)
    seen = np.eye(n, dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            if p >= i:
                raise ValueError(f"parents must precede children: node {i} has parent {p}")
            seen[i] |= seen[p]
    return seen


def tree_mask(parents: Sequence[int], cached: int) -> mx.array:
    """`[N, cached + N]` bool mask for a tree of N draft nodes after `cached` tokens."""
    tree = ancestor_matrix(parents)
    return mx.array(np.concatenate([np.ones((len(parents), cached), bool), tree], axis=1))
