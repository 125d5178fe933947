import mlx.core as mx
import pytest

from mlx_spec.cache import KVCache
from mlx_spec.errors import CacheError


def kv(n, start=0):
    x = mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1)
    return mx.broadcast_to(x, (1, 2, n, 3)), mx.broadcast_to(-x, (1, 2, n, 3))


def slots(cache):
    return cache.keys[0, 0, : cache.offset, 0].tolist()


def test_update_returns_all_valid_entries():
    c = KVCache()
    k, v = c.update_and_fetch(*kv(3))
    assert k.shape == (1, 2, 3, 3) and c.offset == 3
    k, v = c.update_and_fetch(*kv(2, 3))
    assert k[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4]
    assert v[0, 1, :, 2].tolist() == [0, -1, -2, -3, -4]


def test_preallocated_then_grows_keeping_contents():
    c = KVCache(capacity=4, step=4)
    c.update_and_fetch(*kv(3))
    first = c.keys
    assert first.shape[2] == 4
    c.update_and_fetch(*kv(3, 3))  # past capacity
    assert c.capacity >= 6 and c.keys.shape[2] == c.capacity
    assert slots(c) == [0, 1, 2, 3, 4, 5]


def test_trim_then_overwrite():
    c = KVCache()
    c.update_and_fetch(*kv(5))
    assert c.trim(2) == 2 and c.offset == 3
    k, _ = c.update_and_fetch(*kv(1, 10))
    assert k[0, 0, :, 0].tolist() == [0, 1, 2, 10]


def test_keep_gathers_accepted_nodes():
    c = KVCache()
    c.update_and_fetch(*kv(3))  # committed context
    c.update_and_fetch(*kv(5, 100))  # a tree of 5 nodes in slots 3..7
    c.keep([3, 5, 7], start=3)
    assert c.offset == 6
    assert slots(c) == [0, 1, 2, 100, 102, 104]
    assert c.values[0, 0, :6, 0].tolist() == [0, -1, -2, -100, -102, -104]
    c.keep([], start=6)
    assert c.offset == 6


def test_rolling_back_what_is_not_there_raises():
    c = KVCache()
    c.update_and_fetch(*kv(2))
    with pytest.raises(CacheError):
        c.trim(3)
    with pytest.raises(CacheError):
        c.trim(-1)
    with pytest.raises(CacheError):
        c.keep([1, 0], start=0)
    with pytest.raises(CacheError):
        c.keep([2], start=0)
    with pytest.raises(CacheError):
        c.keep([0], start=1)
    assert c.offset == 2
