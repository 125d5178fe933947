"""Attention for decoding and verification: masks, tree attention, and a softmax for MLX's CPU.

Masks are boolean, True = attend (SDPA reads int masks as additive). A tree
verification passes a `TreeMask` (the parents of the new tokens) instead of a
dense mask. `tree_attention` runs it one of two ways:

- the reference, everywhere: the fast SDPA with the dense `[S, cached + S]` mask;
- a Metal kernel that walks the parent array instead, only where Metal exists,
  and only once it has matched the reference on a small random case (else one
  warning and the reference for the rest of the process).

`scaled_dot_product_attention` is MLX's fast SDPA for inference, but where MLX computes on the CPU
its softmax takes `cpu_exp`'s exp: MLX's there made the softmax over the keys most of a decoding step
at 8k tokens of context, and a third of a 16-row verification at 150.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from mlx_spec.cpu_exp import compiled_exp_factors, scaled
from mlx_spec.tree import ancestor_matrix


def causal_array(S: int, cache=None) -> mx.array:
    """The causal mask of S new tokens as a boolean array (for attention that applies its mask
    itself): the cache's (each row sees its own cache, then its new tokens causally), or `[S, S]`."""
    if cache is not None:
        return cache.make_mask(S, return_array=True)
    return mx.array(np.tril(np.ones((S, S), dtype=bool)))


def scaled_dot_product_attention(q: mx.array, k: mx.array, v: mx.array, scale: float,
                                 mask: mx.array | str | None = None) -> mx.array:
    """`mx.fast.scaled_dot_product_attention` (q `[B, H, S, D]`, k/v `[B, H_kv, n, D]`, mask None, "causal" or
    boolean, broadcasting to `[B, H, S, n]`), with the softmax above where MLX computes on the CPU. Inference only:
    `view` has no gradient."""
    B, H, S, D = q.shape
    H_kv, n = k.shape[1], k.shape[2]
    if mx.default_device() != mx.cpu or q.dtype != mx.float32 or isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    if isinstance(mask, str):  # "causal": the S queries are the last S of the n keys
        mask = mx.arange(n)[None] <= mx.arange(n - S, n)[:, None]
    if mask is not None and mask.ndim > 2:  # its head axis (1 or H) split as the queries' is
        heads = (H_kv, H // H_kv) if mask.shape[-3] == H else (1, 1)
        mask = mask.reshape(mask.shape[0] if mask.ndim == 4 else 1, *heads, *mask.shape[-2:])
    g = H // H_kv  # a key-value head's g S queries in one product: its keys read once, not g times
    scores = (q * scale).reshape(B, H_kv, g * S, D) @ k.swapaxes(-1, -2)  # [B, H_kv, g S, n]
    if mask is not None:  # a row with no key unmasked averages the values, as MLX's SDPA does
        scores = mx.where(mask, scores.reshape(B, H_kv, g, S, n), -3e38).reshape(B, H_kv, g * S, n)
    # exp(scores - max); a masked key's is 2^-126, float32's least normal
    weights = scaled(*compiled_exp_factors(scores - scores.max(-1, keepdims=True)))
    out = (weights @ v) / weights.sum(-1, keepdims=True)  # [B, H_kv, g S, Dv]
    return out.reshape(B, H, S, -1)


def tree_mask(parents: Sequence[int], cached: int) -> mx.array:
    """`[N, cached + N]` bool mask for a tree of N new tokens after `cached` tokens."""
    tree = ancestor_matrix(parents)
    return mx.array(np.concatenate([np.ones((len(parents), cached), bool), tree], axis=1))


@dataclass(frozen=True)
class TreeMask:
    """The S new tokens form a tree after `cached` tokens: token i attends to
    the cache, itself and its ancestors (`parents[i] < i`, -1 for none)."""

    parents: tuple[int, ...]
    cached: int

    @cached_property
    def dense(self) -> mx.array:
        return tree_mask(self.parents, self.cached)  # [S, cached + S]

    @cached_property
    def parent_array(self) -> mx.array:
        return mx.array(self.parents, dtype=mx.int32)  # [S]


# (q [B, H, S, D], k/v [B, H_kv, cached + S, D], mask, scale) -> [B, H, S, D]
TreeKernel = Callable[[mx.array, mx.array, mx.array, TreeMask, float], mx.array]

REFERENCE = "reference (SDPA + dense mask)"
KERNEL = "metal kernel"


def reference_tree_attention(q: mx.array, k: mx.array, v: mx.array, mask: TreeMask, scale: float) -> mx.array:
    """Tree attention as the fast SDPA with the dense mask: `[B, H, S, D]`."""
    return scaled_dot_product_attention(q, k, v, scale, mask.dense)


# Body of the Metal kernel (MLX generates the signature). Layout: one thread
# per (query i, head h, batch b), grid (S, H, B); each thread runs an online
# softmax over its row's keys in float32: the `cached` cache slots, then
# `cached + j` for j = i, parents[i], ... up the tree. Inputs are row
# contiguous; template: T (output dtype), D (head dim, sizes the registers).
TREE_ATTENTION_SOURCE = """
    int i = int(thread_position_in_grid.x);
    int h = int(thread_position_in_grid.y);
    int b = int(thread_position_in_grid.z);
    int H = q_shape[1];
    int S = q_shape[2];
    int H_kv = k_shape[1];
    int L = k_shape[2];  // cached + S
    int cached = L - S;
    size_t q_row = ((size_t(b) * H + h) * S + i) * D;
    size_t kv_base = (size_t(b) * H_kv + h / (H / H_kv)) * size_t(L) * D;

    float qs[D];
    float acc[D];
    for (int d = 0; d < D; ++d) {
        qs[d] = float(q[q_row + d]) * scale;
        acc[d] = 0.0f;
    }
    float m = -1e30f;  // running max; finite because fast math may not honour -inf
    float l = 0.0f;    // running sum of exp(score - m)

    int node = i;
    for (int t = 0; t < cached || node >= 0; ++t) {
        int slot;
        if (t < cached) {
            slot = t;
        } else {
            slot = cached + node;
            node = parents[node];
        }
        size_t kv_row = kv_base + size_t(slot) * D;
        float s = 0.0f;
        for (int d = 0; d < D; ++d) {
            s += qs[d] * float(k[kv_row + d]);
        }
        float m_new = metal::max(m, s);
        float correction = metal::exp(m - m_new);
        float p = metal::exp(s - m_new);
        l = l * correction + p;
        for (int d = 0; d < D; ++d) {
            acc[d] = acc[d] * correction + p * float(v[kv_row + d]);
        }
        m = m_new;
    }
    // l >= 1: every query attends at least to itself.
    for (int d = 0; d < D; ++d) {
        out[q_row + d] = T(acc[d] / l);
    }
"""


def metal_tree_kernel() -> TreeKernel:
    """Build the Metal tree-attention kernel (needs Metal to run)."""
    kernel = mx.fast.metal_kernel(
        name="mlx_spec_tree_attention",
        input_names=["q", "k", "v", "parents", "scale"],
        output_names=["out"],
        source=TREE_ATTENTION_SOURCE,
    )

    def run(q: mx.array, k: mx.array, v: mx.array, mask: TreeMask, scale: float) -> mx.array:
        B, H, S, D = q.shape
        if k.shape[2] != mask.cached + S or H % k.shape[1]:
            raise ValueError(f"tree attention: q {q.shape} and k {k.shape} do not fit a tree after {mask.cached}")
        (out,) = kernel(
            inputs=[q, k, v, mask.parent_array, mx.array(scale, dtype=mx.float32)],
            template=[("T", q.dtype), ("D", D)],
            grid=(S, H, B),
            threadgroup=(min(S, 32), 1, 1),
            output_shapes=[q.shape],
            output_dtypes=[q.dtype],
        )
        return out

    return run


SELF_CHECK_TOL = 1e-4


def self_check_error(kernel: TreeKernel) -> float:
    """Max abs difference between `kernel` and the reference on a small float32
    case: a branching tree of two roots, grouped-query heads, a few cached tokens."""
    parents = (-1, 0, 0, 1, 1, 2, 4, -1, 7)
    mask = TreeMask(parents, cached=3)
    B, H, H_kv, S, D = 2, 4, 2, len(parents), 16
    # Explicit keys: the check must not move the global RNG (seeded sampling).
    kq, kk, kv = mx.random.split(mx.random.key(0), 3)
    q = mx.random.normal((B, H, S, D), key=kq)
    k = mx.random.normal((B, H_kv, mask.cached + S, D), key=kk)
    v = mx.random.normal((B, H_kv, mask.cached + S, D), key=kv)
    scale = D**-0.5
    got = kernel(q, k, v, mask, scale)
    want = reference_tree_attention(q, k, v, mask, scale)
    if got.shape != want.shape:
        raise ValueError(f"output shape {got.shape}, expected {want.shape}")
    return mx.abs(got.astype(mx.float32) - want).max().item()


class TreeAttentionBackend:
    """Decides once how tree attention runs: `kernel` (the Metal kernel when
    None) if Metal exists (or `needs_metal` is False, for tests) and the kernel
    passes its self-check; otherwise the reference."""

    def __init__(self, kernel: TreeKernel | None = None, needs_metal: bool = True) -> None:
        self.kernel = kernel
        self.needs_metal = needs_metal
        self.reason = "not checked yet"  # the kernel's status, for `describe`
        self._selected = False
        self._chosen: TreeKernel | None = None

    def select(self) -> TreeKernel | None:
        """The kernel to use, or None for the reference; the first call checks."""
        if not self._selected:
            self._selected = True
            self._chosen = self._check()
        return self._chosen

    def _check(self) -> TreeKernel | None:
        if self.needs_metal and not mx.metal.is_available():
            self.reason = "not available (no Metal)"
            return None
        try:
            kernel = self.kernel or metal_tree_kernel()
            err = self_check_error(kernel)
        except Exception as e:  # a compile or launch error must not break decoding
            self.reason = f"failed to build or run ({type(e).__name__}: {e})"
        else:
            if err <= SELF_CHECK_TOL:  # False for NaN too
                self.reason = f"passed its self-check (max abs diff {err:.1e})"
                return kernel
            self.reason = f"failed its self-check (max abs diff {err:.3g} > {SELF_CHECK_TOL:g})"
        warnings.warn(f"tree attention: the Metal kernel {self.reason}; using the {REFERENCE}", RuntimeWarning)
        return None

    @property
    def active(self) -> str:
        return KERNEL if self.select() is not None else REFERENCE

    def describe(self) -> str:
        """One line: the path in use and why, e.g. for `mlx-spec doctor`."""
        return f"{self.active}; Metal kernel: {self.reason}"  # `active` first: it sets `reason`

    def __call__(self, q: mx.array, k: mx.array, v: mx.array, mask: TreeMask, scale: float) -> mx.array:
        kernel = self.select()
        if kernel is None:
            return reference_tree_attention(q, k, v, mask, scale)
        return kernel(q, k, v, mask, scale)


# The process-wide choice; tests swap in a fresh one.
default_backend = TreeAttentionBackend()


def tree_attention(q: mx.array, k: mx.array, v: mx.array, mask: TreeMask, scale: float) -> mx.array:
    """Attention of the tree's queries `[B, H, S, D]` over keys/values
    `[B, H_kv, cached + S, D]` (the cache, then the tree's own): `[B, H, S, D]`."""
    return default_backend(q, k, v, mask, scale)
