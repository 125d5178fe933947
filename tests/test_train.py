"""The trainer and the distillation losses."""

import os
import signal

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_spec.models import Model, parse_config
from tiny import make_config, random_weights
from mlx_spec.train.distill import DistillConfig, generalized_jsd, kd_loss, make_objective, mse_loss, topk_kd_loss
from mlx_spec.train.trainer import TrainConfig, Trainer


def tiny(seed, vocab=32, layers=1):
    config = make_config("qwen3", vocab_size=vocab, hidden_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64)
    model = Model(parse_config(config))
    model.load_weights([(k, mx.array(v)) for k, v in random_weights(config, seed).items()])
    return model


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_kd_loss_is_the_formula():
    rng = np.random.default_rng(0)
    s = rng.standard_normal((2, 5, 11)).astype(np.float32)
    t = rng.standard_normal((2, 5, 13)).astype(np.float32)  # padded teacher vocabulary: cut
    labels = rng.integers(0, 11, (2, 5))
    mask = rng.random((2, 5)) < 0.7
    for temp, alpha in ((1.0, 0.0), (2.0, 0.0), (4.0, 0.3)):
        ls, lt = np_log_softmax(s / temp), np_log_softmax(t[..., :11] / temp)
        kl = (np.exp(lt) * (lt - ls)).sum(-1)
        ce = -np.take_along_axis(np_log_softmax(s), labels[..., None], -1)[..., 0]
        want = temp**2 * kl[mask].mean() + alpha * ce[mask].mean()
        got = kd_loss(mx.array(s), mx.array(t), mx.array(labels), mx.array(mask), temp, alpha).item()
        assert got == pytest.approx(want, rel=1e-5)
    # t^2 scaling: the gradient's size does not shrink with the temperature
    mse = mse_loss(mx.array(s), mx.array(t), mx.array(mask)).item()
    assert mse == pytest.approx(((s - t[..., :11]) ** 2).mean(-1)[mask].mean(), rel=1e-5)


def test_topk_loss_with_all_k_equals_full_loss():
    rng = np.random.default_rng(1)
    s, t = mx.array(rng.standard_normal((1, 4, 9))), mx.array(rng.standard_normal((1, 4, 9)))
    labels, mask = mx.zeros((1, 4), mx.int32), mx.ones((1, 4), mx.bool_)
    idx = mx.broadcast_to(mx.arange(9), (1, 4, 9))
    full = kd_loss(s, t, labels, mask, 2.0, 0.1).item()
    assert topk_kd_loss(s, t, idx, labels, mask, 2.0, 0.1).item() == pytest.approx(full, rel=1e-5)


def test_generalized_jsd_limits():
    rng = np.random.default_rng(2)
    s, t = mx.array(rng.standard_normal((1, 3, 7))), mx.array(rng.standard_normal((1, 3, 7)))
    mask = mx.ones((1, 3), mx.bool_)
    forward = kd_loss(s, t, mx.zeros((1, 3), mx.int32), mask, 1.0, 0.0).item()
    reverse = kd_loss(t, s, mx.zeros((1, 3), mx.int32), mask, 1.0, 0.0).item()
    assert generalized_jsd(s, t, mask, 0.0).item() == pytest.approx(forward, rel=1e-5)
    assert generalized_jsd(s, t, mask, 1.0).item() == pytest.approx(reverse, rel=1e-5)
    assert generalized_jsd(s, t, mask, 1e-4).item() == pytest.approx(forward, rel=1e-2)
    assert generalized_jsd(s, t, mask, 1 - 1e-4).item() == pytest.approx(reverse, rel=1e-2)
    assert generalized_jsd(t, t, mask, 0.5).item() == pytest.approx(0.0, abs=1e-6)


def test_gradients_flow_only_into_the_student():
    teacher, student = tiny(0), tiny(1)
    objective = make_objective(teacher, DistillConfig())
    tokens = mx.array(np.random.default_rng(0).integers(0, 32, (2, 9)))
    batch = {"tokens": tokens, "mask": mx.ones(tokens.shape, mx.bool_)}
    _, grads = nn.value_and_grad(student, objective)(student, batch)
    assert all(mx.abs(g).sum().item() > 0 for _, g in tree_flatten(grads) if g.ndim > 1)
    _, teacher_grads = nn.value_and_grad(teacher, lambda t, b: objective(student, b))(teacher, batch)
    assert all(mx.abs(g).max().item() == 0 for _, g in tree_flatten(teacher_grads))


def lm_objective(model, batch):
    logits, _ = model(batch["tokens"][:, :-1])
    return nn.losses.cross_entropy(logits, batch["tokens"][:, 1:]).mean()


def batches_for(n_kill=None):
    def batch(i):
        if i == n_kill:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, mid-run
        rng = np.random.default_rng(i)
        return {"tokens": mx.array(rng.integers(0, 32, (4, 12)))}

    return batch


def test_interrupted_run_resumes_bit_for_bit(tmp_path):
    config = dict(steps=8, lr=1e-2, warmup=2, save_every=100, log_every=2, progress=False)
    full = tiny(3)
    Trainer(full, lm_objective, batches_for(), TrainConfig(out=tmp_path / "a", **config)).fit()

    interrupted = tiny(3)
    trainer = Trainer(interrupted, lm_objective, batches_for(n_kill=5), TrainConfig(out=tmp_path / "b", **config))
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert trainer.step == 6  # the step in flight (micro-batch 5) finished, then the checkpoint was written
    resumed = tiny(99)  # weights come from the checkpoint, not from here
    Trainer(resumed, lm_objective, batches_for(), TrainConfig(out=tmp_path / "b", **config)).fit(resume=True)
    a, b = dict(tree_flatten(full.parameters())), dict(tree_flatten(resumed.parameters()))
    assert all(mx.array_equal(a[k], b[k]) for k in a)
    assert not mx.array_equal(a["model.norm.weight"], tiny(3).model.norm.weight)


def test_grad_accumulation_equals_bigger_batch(tmp_path):
    def halves(i):
        tokens = mx.array(np.random.default_rng(i // 2).integers(0, 32, (4, 12)))
        return {"tokens": tokens[:2] if i % 2 == 0 else tokens[2:]}

    def whole(i):
        return {"tokens": mx.array(np.random.default_rng(i).integers(0, 32, (4, 12)))}

    config = dict(steps=4, lr=1e-2, warmup=1, progress=False)
    a, b = tiny(4), tiny(4)
    Trainer(a, lm_objective, whole, TrainConfig(out=tmp_path / "a", **config)).fit()
    Trainer(b, lm_objective, halves, TrainConfig(out=tmp_path / "b", grad_accum=2, **config)).fit()
    pa, pb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    assert max(mx.abs(pa[k] - pb[k]).max().item() for k in pa) < 1e-4  # float rounding only


def test_grad_checkpoint_gives_the_same_gradients():
    model = tiny(5, layers=2)
    batch = {"tokens": mx.array(np.random.default_rng(0).integers(0, 32, (2, 10)))}
    _, plain = nn.value_and_grad(model, lm_objective)(model, batch)
    model.enable_grad_checkpoint()
    _, ckpt = nn.value_and_grad(model, lm_objective)(model, batch)
    a, b = dict(tree_flatten(plain)), dict(tree_flatten(ckpt))
    assert max(mx.abs(a[k] - b[k]).max().item() for k in a) < 1e-6


def test_packing_keeps_long_examples_whole():
    """Packed rows cut an example longer than a row into several rows; padded
    rows keep only its start."""
    from mlx_spec.train.data import Batches, Example

    long, short = Example(list(range(1, 40)), 0), Example([50, 51, 52], 0)
    packed = Batches([long, short], batch_size=1, seq_len=9, eos=0)
    flat = [t for toks, _ in packed.rows for t in toks]
    assert flat == list(range(1, 40)) + [0, 50, 51, 52, 0][: len(flat) - 39]
    assert len(packed.rows) == (39 + 1 + 3 + 1) // 10
    padded = Batches([long, short], batch_size=1, seq_len=9, eos=0, pack=False)
    assert sorted(len(toks) for toks, _ in padded.rows) == [3, 10]


def test_pre_tokenized_rows():
    from mlx_spec.errors import UserError
    from mlx_spec.train.data import encode_example

    assert encode_example(None, {"tokens": [5, 6, 7]}, "d.jsonl:1").tokens == [5, 6, 7]
    for bad in ([], [1, -2], ["a"], "123"):
        with pytest.raises(UserError, match="d.jsonl:2: 'tokens'"):
            encode_example(None, {"tokens": bad}, "d.jsonl:2")
