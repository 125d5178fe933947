"""The target contract beyond plain decoding: a tree of draft tokens in one
forward, `capture`, and `exit_layer`."""

import mlx.core as mx
import pytest

from mlx_spec.attention import tree_mask
from mlx_spec.tree import ancestor_matrix
from mlx_spec.models import load_model

PROMPT = [5, 6, 7, 8, 9, 10, 11]
# A tree of 7 draft nodes: parents precede children, two branches at depth 1.
TOKENS = [20, 21, 22, 23, 24, 25, 26]
PARENTS = [-1, 0, 0, 1, 1, 2, 4]


def depths(parents):
    d = []
    for p in parents:
        d.append(0 if p < 0 else d[p] + 1)
    return d


def path_to(i):
    path = []
    while i >= 0:
        path.append(TOKENS[i])
        i = PARENTS[i]
    return path[::-1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tree_forward_equals_sequential_decoding(checkpoints, arch):
    model, _ = load_model(str(checkpoints[arch]))
    cache = model.make_cache()
    model(mx.array([PROMPT]), cache)
    positions = mx.array([len(PROMPT) + d for d in depths(PARENTS)])
    tree_logits, _ = model(
        mx.array([TOKENS]), cache, positions=positions, mask=tree_mask(PARENTS, len(PROMPT))
    )
    for i in range(len(TOKENS)):
        seq_cache = model.make_cache()
        model(mx.array([PROMPT]), seq_cache)
        for t in path_to(i):
            logits, _ = model(mx.array([[t]]), seq_cache)
        # Bit-identical: same kernels, masked keys contribute exactly zero.
        assert mx.array_equal(logits[0, -1], tree_logits[0, i]), f"node {i}"


def test_tree_commit_with_keep_continues_exactly(checkpoints):
    """After verifying the tree, keeping the accepted path's K/V gives the same
    next-token logits as having decoded that path alone."""
    model, _ = load_model(str(checkpoints["qwen3"]))
    cache = model.make_cache()
    model(mx.array([PROMPT]), cache)
    start = cache[0].offset
    positions = mx.array([start + d for d in depths(PARENTS)])
    model(mx.array([TOKENS]), cache, positions=positions, mask=tree_mask(PARENTS, start))
    accepted = [0, 1, 4, 6]  # a root-to-leaf path
    for c in cache:
        c.keep({0: (start, [start + i for i in accepted])})
    after, _ = model(mx.array([[30]]), cache)
    ref_cache = model.make_cache()
    ref, _ = model(mx.array([PROMPT + [TOKENS[i] for i in accepted] + [30]]), ref_cache)
    assert mx.abs(after[0, -1] - ref[0, -1]).max().item() < 1e-5


def test_ancestor_matrix():
    m = ancestor_matrix(PARENTS)
    assert m[6].tolist() == [True, True, False, False, True, False, True]
    assert m[5].tolist() == [True, False, True, False, False, True, False]
    with pytest.raises(ValueError):
        ancestor_matrix([1, -1])


def test_capture_returns_layer_inputs(checkpoints):
    model, _ = load_model(str(checkpoints["llama"]))
    ids = mx.array([PROMPT])
    L = len(model.layers)
    logits, hidden = model(ids, capture=(0, 1, L))
    h = model.model.embed_tokens(ids)
    assert mx.array_equal(hidden[0], h)
    outs = []
    for layer in model.layers:
        h = layer(h, "causal", None, None)
        outs.append(h)
    assert mx.array_equal(hidden[1], outs[0])
    assert mx.array_equal(hidden[2], outs[-1])
    assert mx.array_equal(logits, model.head(outs[-1]))
    with pytest.raises(ValueError):
        model(ids, capture=(L + 1,))


def test_exit_layer_runs_the_first_layers_only(checkpoints):
    model, _ = load_model(str(checkpoints["qwen3"]))
    ids = mx.array([PROMPT])
    cache = model.make_cache()
    early, hidden = model(ids, cache, capture=(1,), exit_layer=1)
    assert mx.array_equal(early, model.head(hidden[0]))
    full, _ = model(ids)
    assert not mx.allclose(early, full)
    assert cache[0].offset == len(PROMPT) and cache[1].offset == 0
    with pytest.raises(ValueError):
        model(ids, exit_layer=len(model.layers) + 1)
