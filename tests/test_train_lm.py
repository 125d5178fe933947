"""Language-model training: the loss, the loop, and a model that learns to copy."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec.decoding import plain_steps
from mlx_spec.models import load_model
from mlx_spec.models.config import parse_config
from mlx_spec.models.llama import Model
from mlx_spec.sampling import SamplingParams
from tiny import copy_segment, copy_token_ids, make_config
from mlx_spec.train.lm import lm_loss, train_lm


def tiny_model(vocab: int = 32) -> Model:
    mx.random.seed(0)
    return Model(parse_config(make_config("qwen3", vocab_size=vocab)))


def test_lm_loss_is_next_token_cross_entropy_over_the_mask():
    model = tiny_model()
    tokens = mx.array([[1, 5, 7, 2, 9], [3, 3, 4, 8, 6]])
    logits, _ = model(tokens[:, :-1])  # [2, 4, V]
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]  # [2, 4]
    assert lm_loss(model, tokens).item() == pytest.approx(nll.mean().item(), rel=1e-5)
    # The mask's first column has no prediction; the rest select targets.
    mask = mx.array([[True, False, True, True, False], [False, True, False, False, False]])
    expected = (nll[0, 1] + nll[0, 2] + nll[1, 0]) / 3
    assert lm_loss(model, tokens, mask).item() == pytest.approx(expected.item(), rel=1e-5)


def test_train_lm_lowers_the_loss_on_a_toy_task():
    # Each row counts up modulo 16 from a random start: next token = token + 1.
    rng = np.random.default_rng(0)

    def batches():
        while True:
            starts = rng.integers(0, 16, (8, 1))
            yield mx.array((starts + np.arange(24)) % 16 + 3)

    model = tiny_model()
    logged = []
    losses = train_lm(model, batches(), steps=60, lr=1e-2, warmup=10, log_every=20,
                      on_log=lambda step, loss: logged.append(step))
    assert len(losses) == 60 and logged == [20, 40, 60]
    assert np.mean(losses[-10:]) < 0.2 * np.mean(losses[:3])
    assert lm_loss(model, next(batches())).item() < 0.5


def test_trained_model_copies_an_unseen_segment(copy_model):
    """The copy model the tests share (`tiny.train_copy_model`'s 400 steps, shipped in tests/fixtures)."""
    model, _ = load_model(str(copy_model))
    ids = copy_token_ids(copy_model)
    rng = np.random.default_rng(1234)  # segments the training never drew
    right = total = 0
    for _ in range(20):
        segment = copy_segment(rng, ids, (12, 16))
        prompt = segment + segment[:3]
        rest = segment[3:]
        out = [t for e in plain_steps(model, prompt, SamplingParams(), len(rest)) for t in e.tokens]
        right += sum(a == b for a, b in zip(out, rest))
        total += len(rest)
    assert right / total >= 0.9
