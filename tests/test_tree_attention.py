"""Tree attention: the reference path against per-node attention, the Metal
kernel's self-check and fallback, and the kernel's guard where Metal is absent;
the CPU's attention (its own exp) against MLX's SDPA."""

import warnings

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec import attention
from mlx_spec.attention import (
    KERNEL,
    REFERENCE,
    TreeAttentionBackend,
    TreeMask,
    reference_tree_attention,
    tree_attention,
)

TREES = {
    "single": (-1,),
    "chain": tuple(range(-1, 9)),  # -1, 0, 1, ..., 8
    "star": (-1,) + (0,) * 8,
    "roots": (-1,) * 6,  # every node a child of the pending token
    "mixed": (-1, 0, 0, 1, 1, 2, 4, -1, 7, 3, 3, 9),
}


def random_qkv(parents, cached, heads, kv_heads, seed=0, B=2, D=16, dtype=mx.float32):
    kq, kk, kv = mx.random.split(mx.random.key(seed), 3)
    S, L = len(parents), cached + len(parents)
    q = mx.random.normal((B, heads, S, D), key=kq).astype(dtype)  # [B, H, S, D]
    k = mx.random.normal((B, kv_heads, L, D), key=kk).astype(dtype)  # [B, H_kv, L, D]
    v = mx.random.normal((B, kv_heads, L, D), key=kv).astype(dtype)
    return q, k, v


def attention_by_walking(q, k, v, parents, cached, scale):
    """Plain softmax attention of each query over exactly the cache, its
    ancestors and itself, in float64 numpy: `[B, H, S, D]`."""
    q, k, v = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v))
    B, H, S, D = q.shape
    group = H // k.shape[1]
    out = np.zeros_like(q)
    for i in range(S):
        slots, node = list(range(cached)), i
        while node >= 0:
            slots.append(cached + node)
            node = parents[node]
        for h in range(H):
            keys, values = k[:, h // group, slots], v[:, h // group, slots]  # [B, n, D]
            scores = np.einsum("bd,bnd->bn", q[:, h, i], keys) * scale
            w = np.exp(scores - scores.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[:, h, i] = np.einsum("bn,bnd->bd", w, values)
    return out


def walking_kernel(q, k, v, mask, scale):
    """A correct stand-in for the Metal kernel (same signature)."""
    return mx.array(attention_by_walking(q, k, v, mask.parents, mask.cached, scale).astype(np.float32))


@pytest.fixture
def no_metal(monkeypatch):
    """Metal reported absent, and a fresh process-wide backend."""
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    monkeypatch.setattr(attention, "default_backend", TreeAttentionBackend())


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("cached", [0, 5])
@pytest.mark.parametrize("tree", sorted(TREES))
def test_reference_equals_attention_over_each_nodes_path(no_metal, tree, cached, heads, kv_heads):
    parents = TREES[tree]
    q, k, v = random_qkv(parents, cached, heads, kv_heads, seed=len(parents) + cached)
    scale = q.shape[-1] ** -0.5
    got = tree_attention(q, k, v, TreeMask(parents, cached), scale)
    want = attention_by_walking(q, k, v, parents, cached, scale)
    assert got.shape == q.shape
    assert np.abs(np.array(got) - want).max() < 1e-5
    assert attention.default_backend.active == REFERENCE


def test_the_cpus_attention_is_mlxs_sdpa_over_every_mask_and_shape():
    """Shapes in turn as decoding meets them (its compiled exp holds no shape: a key length of one after
    longer ones, queries one and many, a batch's masks, every head's), a row that sees no key (the values'
    mean, as MLX's), scores far apart (weights under float32's least normal): MLX's SDPA within float rounding."""
    assert mx.default_device() == mx.cpu
    rng = np.random.default_rng(0)
    for B, H, H_kv, S, n, mask in [(1, 4, 2, 1, 300, None), (2, 4, 2, 5, 300, "causal"), (1, 4, 2, 1, 1, None),
                                   (2, 6, 3, 3, 40, "rows"), (1, 4, 4, 4, 9, "heads"), (3, 4, 1, 2, 17, "plain"),
                                   (1, 4, 2, 2, 6, "blind"), (1, 2, 2, 3, 64, "far")]:
        q, k, v = (mx.array(rng.standard_normal(shape).astype(np.float32))
                   for shape in ((B, H, S, 16), (B, H_kv, n, 16), (B, H_kv, n, 16)))
        causal = np.arange(n)[None] <= np.arange(n - S, n)[:, None]  # [S, n]
        m = {None: None, "causal": "causal", "plain": mx.array(causal),
             "blind": mx.array(causal & (np.arange(S) > 0)[:, None]),
             "rows": mx.array(causal & (rng.random((B, 1, S, n)) < 0.7) | (np.arange(n) == n - S)),
             "heads": mx.array(causal & (rng.random((1, H, S, n)) < 0.7) | (np.arange(n) == n - S)),
             "far": mx.array(causal)}[mask]
        if mask == "far":
            q = q * 40.0
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m)
        got = attention.scaled_dot_product_attention(q, k, v, 0.25, m)
        assert got.shape == want.shape and mx.allclose(got, want, atol=1e-5, rtol=1e-5).item(), (B, H, S, n, mask)
    additive = mx.zeros((S, n))  # a mask of scores: MLX's SDPA, as given
    assert mx.allclose(attention.scaled_dot_product_attention(q, k, v, 0.25, additive),
                       mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=additive)).item()


def case(parents=TREES["mixed"], cached=3):
    q, k, v = random_qkv(parents, cached, 4, 2, seed=1)
    return q, k, v, TreeMask(parents, cached), q.shape[-1] ** -0.5


class Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def off_by_a_bit(q, k, v, mask, scale):
    return reference_tree_attention(q, k, v, mask, scale) + 1e-2


def raises(q, k, v, mask, scale):
    raise RuntimeError("cannot compile tree_attention")


@pytest.mark.parametrize(
    "bad,reason",
    [(off_by_a_bit, "failed its self-check"), (raises, "RuntimeError: cannot compile tree_attention")],
)
def test_a_failing_kernel_falls_back_to_the_reference_with_one_warning(bad, reason):
    kernel = Counting(bad)
    backend = TreeAttentionBackend(kernel, needs_metal=False)
    q, k, v, mask, scale = case()
    with pytest.warns(RuntimeWarning) as record:
        first = backend(q, k, v, mask, scale)
        second = backend(q, k, v, mask, scale)
    assert len(record) == 1 and reason in str(record[0].message)
    want = reference_tree_attention(q, k, v, mask, scale)
    assert mx.array_equal(first, want) and mx.array_equal(second, want)
    assert kernel.calls == 1  # the self-check only
    assert backend.active == REFERENCE and reason in backend.describe()


def test_a_correct_kernel_passes_the_self_check_and_is_used():
    kernel = Counting(walking_kernel)
    backend = TreeAttentionBackend(kernel, needs_metal=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend.active == KERNEL
        assert kernel.calls == 1  # the self-check
        for parents in TREES.values():
            q, k, v, mask, scale = case(parents)
            got = backend(q, k, v, mask, scale)
            assert mx.allclose(got, reference_tree_attention(q, k, v, mask, scale), atol=1e-5)
    assert kernel.calls == 1 + len(TREES)
    assert backend.describe().startswith("metal kernel; Metal kernel: passed its self-check")


def test_an_injected_kernel_is_not_used_without_metal(no_metal):
    kernel = Counting(walking_kernel)
    backend = TreeAttentionBackend(kernel)
    q, k, v, mask, scale = case()
    assert mx.array_equal(backend(q, k, v, mask, scale), reference_tree_attention(q, k, v, mask, scale))
    assert kernel.calls == 0 and backend.describe() == f"{REFERENCE}; Metal kernel: not available (no Metal)"


def test_without_metal_the_kernel_is_never_built(no_metal, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("mx.fast.metal_kernel called without Metal")

    monkeypatch.setattr(mx.fast, "metal_kernel", no_build)
    q, k, v, mask, scale = case()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = tree_attention(q, k, v, mask, scale)
    assert mx.array_equal(got, reference_tree_attention(q, k, v, mask, scale))
    assert attention.default_backend.active == REFERENCE


@pytest.mark.skipif(mx.metal.is_available(), reason="checks the failure path where Metal is absent")
def test_forcing_the_real_kernel_without_metal_falls_back():
    backend = TreeAttentionBackend(needs_metal=False)
    q, k, v, mask, scale = case()
    with pytest.warns(RuntimeWarning, match="failed to build or run"):
        got = backend(q, k, v, mask, scale)
    assert mx.array_equal(got, reference_tree_attention(q, k, v, mask, scale))
    assert backend.active == REFERENCE


@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal")
@pytest.mark.parametrize("dtype,atol", [(mx.float32, 1e-4), (mx.float16, 1e-2), (mx.bfloat16, 5e-2)])
def test_metal_kernel_matches_the_reference(dtype, atol):
    backend = TreeAttentionBackend()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend.active == KERNEL, backend.reason
    for tree, parents in TREES.items():
        for cached in (0, 7):
            for heads, kv_heads, D in ((4, 4, 64), (8, 2, 128)):
                q, k, v = random_qkv(parents, cached, heads, kv_heads, D=D, dtype=dtype)
                mask, scale = TreeMask(parents, cached), D**-0.5
                got = backend(q, k, v, mask, scale)
                want = reference_tree_attention(q, k, v, mask, scale)
                assert got.dtype == dtype
                err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
                assert err < atol, (tree, cached, heads, kv_heads, err)
