"""Exact verification (`--exact`): the drafter never changes a bit of the target's logits.

A forward of K+1 tokens runs other kernels than a forward of one (a matrix product for a
matrix-vector product, reductions over other lengths), so a token verified among drafts gets
logits a few units in the last place away from the same token decoded alone, and a near-tie
flips. Here every decoding forward of a sequence has one width W, plain rounds included
(padded with throwaway tokens whose keys are cut at once), and each row of a W-wide matrix
product is computed on its own: a token's logits are then the same whatever row it sits in.

Attention is the other place where a token's result depends on the forward around it: a
softmax over a key length that changes with the forward's start sums in another order, and a
product over many queries tiles them (a query's bits then depend on where it sits). Here
attention reads whole blocks of BLOCK keys (those a query may not see masked: exact zeros) and
gives each query matrix-vector products of its own, summed block after block: a key adds its
term in the same place whatever the key length. In a tree each query reads its ancestors' keys
and values where its own decoding would hold them (its ancestor at depth d in the slot after
the pending token's d - 1, `ExactMask.order`): a kernel that sums a block with several
accumulators (AVX-512's) adds a key's term to the one its slot falls to. A batch's rows run one
forward each (`decoding.Decoder`): how a kernel tiles the rows of a matrix product depends on
how many there are.

Whether a backend's kernels keep rows apart at width W is measured, not assumed: `probe`
decodes a few tokens one W-wide forward at a time and checks the logits bit for bit against
one forward verifying them all, and `width` takes the first width that holds."""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from mlx_spec import tree
from mlx_spec.attention import TreeMask, scaled_dot_product_attention
from mlx_spec.cache import STEP, trim_cache
from mlx_spec.errors import UserError

BLOCK = STEP  # keys summed block by block: a KVCache's buffer holds whole blocks
WIDTHS = (4, 8, 12, 16, 24, 32)  # the widths tried, in order: multiples of the row tiles BLAS kernels use
DRAFTED = 7  # a chain's most tokens a round unless asked (a width of 8)


def blocks(n: int) -> int:
    """Keys read for `n` keys: whole blocks."""
    return -(-n // BLOCK) * BLOCK


@dataclass(frozen=True)
class ExactMask:
    """Which keys each query sees, `[B, 1, S, L]` bool, L whole blocks of the cache's buffer; for a tree, the
    slots from `tail` on (the blocks its nodes sit in) in the order each query reads them, `[S, L - tail]`."""

    allowed: mx.array
    order: mx.array | None = None
    tail: int = 0

    @classmethod
    def of(cls, mask: mx.array, tree: TreeMask | None = None) -> "ExactMask":
        """From a boolean mask `[..., S, n]` over the first n keys: padded to whole blocks with False; with
        the `tree` it is (B = 1), each query's keys ordered as a chain of its ancestors would hold them."""
        n = mask.shape[-1]
        pad = [(0, 0)] * (mask.ndim - 1) + [(0, blocks(n) - n)]
        allowed = mx.pad(mask, pad, constant_values=False)
        if tree is None:
            return cls(allowed)
        tail = tree.cached // BLOCK * BLOCK
        return cls(allowed, chain_order(tree.parents, tree.cached - tail, blocks(n) - tail), tail)


@functools.lru_cache(maxsize=16)  # a target on mlx-lm's modules asks at every layer
def chain_order(parents: tuple[int, ...], start: int, T: int) -> mx.array:
    """`[S, T]` int32: for each node of a tree (`parents`, the pending token first, in slot `start` of T), the
    slots it reads in the order its decoding as a chain holds them: those before `start`, its ancestors and
    itself (the one at depth d in slot start + d), then those it does not see."""
    seen = np.zeros((len(parents), T), bool)
    seen[:, :start] = True
    seen[:, start : start + len(parents)] = tree.ancestor_matrix(parents)
    return mx.array(np.argsort(~seen, axis=1, kind="stable").astype(np.int32))


def products(q: mx.array, k: mx.array, L: int) -> mx.array:
    """Each query of `q` `[B, H, S, D]` dotted with the first L keys of `k` `[B, H_kv, >= L, D]` in a
    matrix-vector product of its own (one row: no kernel sees how many queries there are, or where each
    sits) -> `[B, H_kv, H / H_kv * S, L]`, a key-value head's queries together (grouped-query heads)."""
    B, H, S, D = q.shape
    Hkv = k.shape[1]
    q = q.reshape(B, Hkv, H // Hkv * S, 1, D)
    return (q @ k[:, :, None, :L].swapaxes(-1, -2))[..., 0, :]


def attention(q: mx.array, k: mx.array, v: mx.array, mask: ExactMask, scale: float,
              sinks: mx.array | None = None, softcap: float | None = None) -> mx.array:
    """Attention of queries `[B, H, S, D]` over the cache's keys and values `[B, H_kv, >= L, D]`
    (its buffer: slots past a row's length hold anything finite) as `mask` allows: `[B, H, S, D]`;
    `sinks` `[H]`: a logit per head that takes its share of the softmax and adds nothing (gpt-oss);
    `softcap`: scores capped by tanh (Gemma 2).
    Each query's result depends on its own row of the mask and the keys it sees, alone."""
    B, H, S, _ = q.shape
    Hkv, L = k.shape[1], mask.allowed.shape[-1]
    g, n = H // Hkv, L // BLOCK
    v = v[:, :, :L]
    scores = products(q * scale, k, L)  # [B, Hkv, g S, L]
    if softcap:
        scores = mx.tanh(scores / softcap) * softcap
    allowed = mx.broadcast_to(mask.allowed[:, :, None], (B, 1, g, S, L)).reshape(B, 1, g * S, L)
    scores = mx.where(allowed, scores, -mx.inf)
    top = scores.max(axis=-1, keepdims=True)  # [B, Hkv, g S, 1]
    if sinks is not None:  # a head's sink, beside each of its queries
        sink = mx.repeat(sinks.astype(scores.dtype).reshape(1, Hkv, g, 1), S, axis=2).reshape(1, Hkv, g * S, 1)
        top = mx.maximum(top, sink)
    e = mx.exp(scores - top)  # masked: exactly 0
    # The softmax's denominator as a column of the same product: both sum key after key.
    Dv = v.shape[-1]  # (a latent attention's values are narrower than its keys)
    v1 = mx.concatenate([v, mx.ones((B, Hkv, L, 1), v.dtype)], axis=-1)  # [B, Hkv, L, Dv + 1]
    parts = _blocks(e, v1, mask, g, S)  # [B, Hkv, n, g S, Dv + 1]
    total = parts[:, :, 0]
    for i in range(1, n):  # block after block, in order: a block of zeros adds nothing
        total = total + parts[:, :, i]
    denominator = total[..., Dv:] if sinks is None else total[..., Dv:] + mx.exp(sink - top)
    out = total[..., :Dv] / denominator
    return out.reshape(B, H, S, Dv)


def _blocks(e: mx.array, v1: mx.array, mask: ExactMask, g: int, S: int) -> mx.array:
    """Each query's weights `e` `[B, Hkv, g S, L]` times the values `v1` `[B, Hkv, L, Dv + 1]`, a block of keys
    at a time -> `[B, Hkv, L / BLOCK, g S, Dv + 1]`; a tree's queries each read the blocks from `mask.tail` on
    as `mask.order` says (a gather of their weights and of the values, a query at a time)."""
    B, Hkv, _, L = e.shape
    t = mask.tail if mask.order is not None else L
    e_own = e[..., :t].reshape(B, Hkv, g * S, t // BLOCK, 1, BLOCK).swapaxes(2, 3)  # [B, Hkv, t / BLOCK, g S, 1, BLOCK]
    parts = [(e_own @ v1[:, :, :t].reshape(B, Hkv, t // BLOCK, 1, BLOCK, -1))[..., 0, :]] if t else []
    if t < L:
        n = (L - t) // BLOCK
        order = mx.broadcast_to(mask.order, (B, Hkv, g, S, L - t))
        e_read = mx.take_along_axis(e[..., t:].reshape(B, Hkv, g, S, L - t), order, axis=-1)
        v_read = mx.take(v1[:, :, t:], mask.order, axis=2)  # [B, Hkv, S, L - t, Dv + 1]
        read = (e_read.reshape(B, Hkv, g, S, n, 1, BLOCK) @ v_read.reshape(B, Hkv, 1, S, n, BLOCK, -1))[..., 0, :]
        parts.append(read.reshape(B, Hkv, g * S, n, -1).swapaxes(2, 3))  # [B, Hkv, n, g S, Dv + 1]
    return mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]


# Whether the forward being run verifies exactly (set around a forward of a target on mlx-lm's modules): the
# tree it verifies, or True.
EXACTLY: contextvars.ContextVar[bool | TreeMask] = contextvars.ContextVar("exactly", default=False)


def over_keys(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask, sinks: mx.array | None = None,
              softcap: float | None = None) -> mx.array:
    """`attention` over the keys and values a cache fetched `[B, H_kv, n, D]` (padded to whole blocks), as
    mlx-lm's masks say: "causal", none (every key) or boolean `[..., S, n]`."""
    S, n = queries.shape[2], keys.shape[2]
    if isinstance(mask, str) or mask is None:
        mask = mx.arange(n)[None] <= mx.arange(n - S, n)[:, None] if mask else mx.ones((S, n), mx.bool_)
    if mask.dtype != mx.bool_:
        raise UserError("--exact: this target's attention adds a mask of scores; exact verification needs a "
                        "boolean one")
    tree = EXACTLY.get()
    mask = ExactMask.of(mask.reshape((1,) * (4 - mask.ndim) + mask.shape), tree if isinstance(tree, TreeMask) else None)
    pad = [(0, 0), (0, 0), (0, mask.allowed.shape[-1] - n), (0, 0)]
    return attention(queries, mx.pad(keys, pad), mx.pad(values, pad), mask, scale, sinks, softcap)


def sdpa(original):
    """mlx-lm's `scaled_dot_product_attention`, as its attention modules call it: `over_keys` while a
    forward verifies exactly, `attention.scaled_dot_product_attention` while one decodes (a cache of keys
    as they are, no sinks), else `original`."""

    def attend(queries, keys, values, cache, scale: float, mask, sinks=None):
        if EXACTLY.get():
            return over_keys(queries, keys, values, scale, mask, sinks)
        if cache is None or sinks is not None or hasattr(cache, "bits"):  # training, gpt-oss, quantized keys
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        return scaled_dot_product_attention(queries, keys, values, scale, mask)

    return attend


def most(k_max: int | None, num_draft: int | None, width: int | None) -> int | None:
    """The most tokens a round drafts: `k_max` (None: the drafter's own), and within `width`."""
    if not width:
        return k_max
    if num_draft is not None and num_draft > width - 1:
        raise UserError(f"--num-draft {num_draft}: exact verification here is {width} tokens wide, "
                        f"so a round drafts at most {width - 1}")
    return min(k_max or width - 1, width - 1)


def fits(parents: Sequence[int] | None, width: int) -> list[int]:
    """Which nodes of a draft (a chain: `parents` None) an exact verification of `width` takes: the first
    width - 1 (a tree's nodes come after their parents, so its first ones are a tree)."""
    return list(range(width - 1 if parents is None else min(width - 1, len(parents))))


def probe(model, width: int, contexts: Sequence[int] = (40, 301)) -> bool:
    """Whether forwards of `width` tokens give a token the same logits, bit for bit, in any row:
    `width` tokens decoded one forward at a time (each padded) against one forward verifying them all,
    after each of `contexts` random tokens (one block of keys, and two)."""
    vocab = model.args.vocab_size
    rng = np.random.default_rng(0)
    for context in contexts:
        seq = rng.integers(0, vocab, context + width).tolist()
        cache = model.make_cache()
        model(mx.array([seq[:context]]), cache)
        copy, alone = [c.row(0) for c in cache], []  # the same context, for the forwards one token at a time
        verified, _ = model(mx.array([seq[context:]]), cache, exact=True)
        cache = copy
        for t in range(width):
            logits, _ = model(mx.array([[seq[context + t]] + [0] * (width - 1)]), cache, exact=True)
            alone.append(logits[:, 0])
            trim_cache(cache, width - 1)
        if not mx.array_equal(mx.stack(alone, axis=1), verified).item():
            return False
    return True


def parted(model, prompt: list[int], plain: list[int], other: list[int]) -> tuple[int, float] | None:
    """Where two greedy outputs part (an index into the tokens generated) and plain decoding's top-2 logit
    margin there (within float rounding: a near-tie the last bits of a logit decide); None where they do not
    (or one stopped early)."""
    i = next((i for i, (a, b) in enumerate(zip(plain, other)) if a != b), None)
    if i is None:
        return None
    logits, _ = model(mx.array(prompt + plain[:i])[None])
    top = mx.sort(logits[0, -1].astype(mx.float32))[-2:]
    return i, (top[1] - top[0]).item()


def need(drafter, num_draft: int | None = None) -> int:
    """Tokens a row a round of `drafter` verifies at most: its tree's nodes, else `num_draft` or its own
    most (at most DRAFTED), and the pending token; plain decoding (None) as the drafters' default."""
    if num_draft is not None:
        return num_draft + 1
    nodes = getattr(drafter, "budget", None) or len(getattr(drafter, "paths", None) or ())  # a tree's (Medusa: static)
    if nodes:
        return nodes + 1
    return min(drafter.k_max if drafter is not None else DRAFTED, DRAFTED) + 1


def width(model, need: int) -> int:
    """The first width of `WIDTHS` at or above `need` tokens a row at which `probe` holds on `model`."""
    tried = [w for w in WIDTHS if w >= need]
    if not tried:
        raise UserError(f"--exact: a round of {need} tokens is wider than {WIDTHS[-1]}: "
                        "draft fewer (--num-draft, --tree-budget)")
    for w in tried:
        if probe(model, w):
            return w
    raise UserError(f"--exact: this backend's kernels give a token other logits in other rows at every width "
                    f"tried ({', '.join(map(str, tried))}): exact verification cannot hold here")
