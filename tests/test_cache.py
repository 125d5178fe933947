import mlx.core as mx
import numpy as np
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


def test_grows_in_steps_keeping_contents():
    c = KVCache(step=4)
    c.update_and_fetch(*kv(3))
    assert c.keys.shape[2] == 4  # one step, not the whole generation up front
    c.update_and_fetch(*kv(3, 3))  # past it
    assert c.keys.shape[2] == 8
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
    c.keep({0: (3, [3, 5, 7])})
    assert c.offset == 6
    assert slots(c) == [0, 1, 2, 100, 102, 104]
    assert c.values[0, 0, :6, 0].tolist() == [0, -1, -2, -100, -102, -104]
    c.keep({0: (6, [])})
    assert c.offset == 6


def test_rolling_back_what_is_not_there_raises():
    c = KVCache()
    c.update_and_fetch(*kv(2))
    with pytest.raises(CacheError):
        c.trim(3)
    with pytest.raises(CacheError):
        c.trim(-1)
    with pytest.raises(CacheError):
        c.keep({0: (0, [1, 0])})
    with pytest.raises(CacheError):
        c.keep({0: (0, [2])})
    with pytest.raises(CacheError):
        c.keep({0: (1, [0])})
    assert c.offset == 2


def rows_of_kv(lengths, start=0, S=None):
    """Per-row keys `[B, 2, S, 3]` numbered from `start`, row b offset by 1000 b."""
    S = S or max(lengths)
    x = mx.arange(start, start + S, dtype=mx.float32)[None, :] + 1000 * mx.arange(len(lengths))[:, None]
    x = mx.broadcast_to(x[:, None, :, None], (len(lengths), 2, S, 3))
    return x, -x


def row_slots(cache, b):
    return cache.keys[b, 0, : cache.lengths[b], 0].tolist()


def joined(*lengths) -> KVCache:
    """A batch of rows that joined one by one, each with its prompt read alone."""
    c = KVCache(rows=0)
    for n in lengths:
        one = KVCache()
        one.update_and_fetch(*kv(n))
        c.extend(one)
    return c


def test_rows_of_different_lengths_write_in_one_go_and_roll_back_alone():
    c = joined(3, 9, 2)  # a longer prompt grows every row
    assert c.keys.shape[:2] == (3, 2) and c.keys.shape[2] >= 9 and c.lengths == [3, 9, 2] and c.offset.tolist() == [3, 9, 2]
    k, v = c.update_and_fetch(*rows_of_kv([2, 2, 2], start=50))  # each row at its own length
    assert c.lengths == [5, 11, 4] and k.shape[2] == 11
    assert row_slots(c, 0) == [0, 1, 2, 50, 51] and row_slots(c, 2) == [0, 1, 2050, 2051]
    assert row_slots(c, 1)[-3:] == [8, 1050, 1051]
    c.cut(0, 4)  # row 0 accepted one of its two
    assert c.lengths == [4, 11, 4]
    with pytest.raises(CacheError):
        c.cut(1, 12)  # more than it holds
    c.remove(1)
    assert c.lengths == [4, 4] and c.aligned and c.offset == 4
    assert row_slots(c, 1) == [0, 1, 2050, 2051]


def test_a_row_keeps_its_accepted_tree_path():
    c = joined(2, 4)
    c.update_and_fetch(*rows_of_kv([3, 3], start=100))
    c.keep({0: (2, [3, 4])})  # row 0: nodes 1 and 2 of its tree
    assert row_slots(c, 0) == [0, 1, 101, 102] and row_slots(c, 1) == [0, 1, 2, 3, 1100, 1101, 1102]
    with pytest.raises(CacheError):
        c.keep({0: (4, [7])})


def test_rows_keep_their_paths_in_one_call_and_a_bad_path_changes_no_row():
    c = joined(2, 4)  # rows of 2 and 4 tokens
    c.update_and_fetch(*rows_of_kv([3, 3], start=100))
    with pytest.raises(CacheError):
        c.keep({0: (2, [3, 4]), 1: (4, [3])})
    assert c.lengths == [5, 7]
    c.keep({0: (2, [3, 4]), 1: (4, [4, 6])})  # row 0: nodes 1 and 2 of its tree; row 1: nodes 0 and 2
    assert row_slots(c, 0) == [0, 1, 101, 102] and row_slots(c, 1) == [0, 1, 2, 3, 1100, 1102]


def test_the_mask_lets_each_row_see_its_own_cache_and_its_new_tokens_causally():
    c = joined(1, 3)
    m = np.array(c.make_mask(2))[:, 0]  # [B, 2, 3 + 2]: row b's new tokens go at its own length
    assert m[0].tolist() == [[True, True, False, False, False], [True, True, True, False, False]]
    assert m[1].tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    c.cut(0, 1), c.cut(1, 1)
    assert c.make_mask(3) == "causal" and c.make_mask(1) is None  # aligned rows need no array
