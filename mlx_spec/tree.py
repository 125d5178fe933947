"""Draft trees: several alternatives verified in one target forward.

A tree of N draft nodes is given by `parents` (`parents[i] < i`, -1 for a
child of the root) and the nodes' tokens. The root is the pending token: the
last token of the context, whose keys and values the verification computes
first. A node's depth is its distance from the root (children of the root
have depth 1), which is also its position offset after the root.

Shapes of trees:
- static, from a list of paths (Medusa's `medusa_choices`): path `[2, 0]`
  is the node reached by taking the 3rd candidate at depth 1, then the 1st
  candidate at depth 2;
- Cartesian: every combination of the top-k at each depth;
- budgeted best-first: the `budget` paths with the highest cumulative score,
  from per-depth candidate scores (Medusa's heads, DFlash's block) or from
  per-node scores (EAGLE-2's rerank).
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

# Medusa's default tree (FasterDecoding, `mc_sim_7b_63`): 63 paths into the
# top-10 candidates of each head.
MC_SIM_7B_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5],
    [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8],
    [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0],
    [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0],
    [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1],
    [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
]


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (1 for children of the root); checks parents come first."""
    out: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents must precede children: node {i} has parent {p}")
        out.append(1 if p < 0 else out[p] + 1)
    return out


def children(parents: Sequence[int]) -> dict[int, list[int]]:
    """Children of every node in order, the root as -1."""
    kids: dict[int, list[int]] = {-1: []}
    for i, p in enumerate(parents):
        kids.setdefault(i, [])
        kids[p].append(i)
    return kids


def ancestor_matrix(parents: Sequence[int]) -> np.ndarray:
    """`[N, N]` bool: node i sees node j iff j is i or one of its ancestors."""
    depths(parents)
    seen = np.eye(len(parents), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            seen[i] |= seen[p]
    return seen


def batch_layout(parents: Sequence[Sequence[int]], starts: Sequence[int], S: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions `[B, S]` and the attention mask `[B, 1, S, max(starts) + S]` of one verification
    over several rows, each its pending token then its draft's nodes (`parents[b]`; a chain is a
    tree of one branch), padded to S: row b sees its own cache (`starts[b]` tokens) and its
    draft's ancestry."""
    positions = np.zeros((len(parents), S), dtype=np.int32)
    mask = np.zeros((len(parents), 1, S, max(starts) + S), dtype=bool)
    for b, (row, L) in enumerate(zip(parents, starts)):
        n = len(row)
        positions[b, : n + 1] = L + np.array([0] + depths(row))
        mask[b, 0, :, :L] = True
        mask[b, 0, : n + 1, L : L + n + 1] = ancestor_matrix([-1, *(p + 1 for p in row)])
        mask[b, 0, n + 1 :, L] = True  # padding queries: anything, their outputs are dropped
    return positions, mask


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node` (empty for the root, -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def truncate(parents: Sequence[int], max_depth: int) -> list[int]:
    """Indices of the nodes at depth <= `max_depth` (a subtree: ancestors kept)."""
    return [i for i, d in enumerate(depths(parents)) if d <= max_depth]


def subtree(parents: Sequence[int], keep: Sequence[int]) -> list[int]:
    """Parents of the tree restricted to `keep` (ascending, closed under ancestors)."""
    where = {old: new for new, old in enumerate(keep)}
    out = []
    for old in keep:
        p = parents[old]
        if p >= 0 and p not in where:
            raise ValueError(f"node {old} is kept but its parent {p} is not")
        out.append(where[p] if p >= 0 else -1)
    return out


def from_paths(paths: Sequence[Sequence[int]]) -> tuple[list[int], list[int], list[int]]:
    """A static tree from candidate paths: `(parents, depth, rank)` per node.

    Nodes come in order of (length, path), so parents precede children; node
    i's token is candidate `rank[i]` at depth `depth[i]`. Every prefix of a
    path must itself be a path.
    """
    ordered = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(ordered)}
    parents = []
    for p in ordered:
        if not p or min(p) < 0:
            raise ValueError(f"tree paths must be non-empty lists of ranks >= 0, got {list(p)}")
        if len(p) > 1 and p[:-1] not in index:
            raise ValueError(f"tree path {list(p)} has no parent path {list(p[:-1])}")
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
    return parents, [len(p) for p in ordered], [p[-1] for p in ordered]


def best_first(scores: np.ndarray, budget: int) -> list[list[int]]:
    """The `budget` paths with the highest cumulative score.

    `scores` `[D, k]`: at depth d + 1, the score (a log-probability) of the
    candidate of each rank, sorted in descending order, the same for every
    parent (Medusa's heads and DFlash's block predict each depth once). A
    path's score is the sum along it, so a parent always scores at least as
    much as its children and the result is a tree.
    """
    D, k = scores.shape
    heap = [(-float(scores[0, 0]), (0,))]
    paths: list[list[int]] = []
    while heap and len(paths) < budget:
        neg, path = heapq.heappop(heap)
        paths.append(list(path))
        d, r = len(path), path[-1]
        if r + 1 < k:  # the next sibling
            heapq.heappush(heap, (neg + float(scores[d - 1, r] - scores[d - 1, r + 1]), path[:-1] + (r + 1,)))
        if d < D:  # the first child
            heapq.heappush(heap, (neg - float(scores[d, 0]), path + (0,)))
    return paths


def top_nodes(parents: Sequence[int], scores: Sequence[float], budget: int) -> list[int]:
    """The `budget` nodes with the highest cumulative scores (EAGLE-2's rerank).

    `scores[i]` is node i's cumulative score, never above its parent's; ties
    go to the earlier node, so parents are chosen before their children and
    the result (ascending indices) is closed under ancestors.
    """
    order = sorted(range(len(parents)), key=lambda i: (-scores[i], i))[:budget]
    return sorted(order)
