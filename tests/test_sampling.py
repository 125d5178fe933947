import mlx.core as mx
import numpy as np
import pytest

from mlx_spec.errors import UserError
from mlx_spec.sampling import SamplingParams, log_probs, sample

LOGITS = mx.array([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def probs(params):
    return np.exp(np.array(log_probs(LOGITS, params)))[0]


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_temperature():
    p = probs(SamplingParams(temp=0.5))
    assert np.allclose(p, softmax(np.array(LOGITS)[0] / 0.5), atol=1e-6)


def test_top_k_keeps_k_most_likely():
    p = probs(SamplingParams(temp=1.0, top_k=2))
    assert (p[2:] == 0).all()
    assert np.allclose(p[:2], softmax(np.array([2.0, 1.0])), atol=1e-6)


def test_top_p_keeps_smallest_set_reaching_mass():
    full = softmax(np.array(LOGITS)[0])
    # full ~ [0.57, 0.21, 0.13, 0.08, ...]: 0.57 < 0.7 <= 0.57 + 0.21
    p = probs(SamplingParams(temp=1.0, top_p=0.7))
    assert (p[2:] == 0).all() and np.allclose(p[:2], full[:2] / full[:2].sum(), atol=1e-6)
    p = probs(SamplingParams(temp=1.0, top_p=0.5))
    assert p[0] == pytest.approx(1.0)


def test_min_p_drops_tokens_below_fraction_of_top():
    full = softmax(np.array(LOGITS)[0])
    p = probs(SamplingParams(temp=1.0, min_p=0.2))
    keep = full >= 0.2 * full.max()
    assert ((p > 0) == keep).all()
    assert np.allclose(p[keep], full[keep] / full[keep].sum(), atol=1e-6)


def test_greedy_is_argmax():
    assert sample(LOGITS, SamplingParams()).item() == 0


def test_samples_follow_the_distribution():
    """Chi-square test of 20000 draws against the processed distribution; the
    bound (p ~ 1e-4) fails for a sampler off by a few percent on any token."""
    params = SamplingParams(temp=0.8, top_k=5)
    p = probs(params)
    mx.random.seed(0)
    n = 20000
    draws = np.array(sample(mx.broadcast_to(LOGITS, (n, 6)), params))
    counts = np.bincount(draws, minlength=6)
    assert counts[5] == 0
    keep = p > 0
    chi2 = (((counts[keep] - n * p[keep]) ** 2) / (n * p[keep])).sum()
    assert chi2 < 23.5  # chi-square, 4 degrees of freedom, p = 1e-4


@pytest.mark.parametrize(
    "kwargs, flag",
    [({"temp": -1}, "--temp"), ({"top_p": 0}, "--top-p"), ({"top_k": -2}, "--top-k"), ({"min_p": 2}, "--min-p")],
)
def test_bad_params_name_the_flag(kwargs, flag):
    with pytest.raises(UserError, match=flag):
        SamplingParams(**kwargs)
