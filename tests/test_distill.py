"""Distillation end to end: it helps, it runs from the command line, it scales out."""

import json
import shutil
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from helpers import assert_one_line_error, cli, cli_here
from mlx_spec.models import Model, load_model, parse_config
from tiny import make_config, random_weights
from mlx_spec.train.distill import DistillConfig, agreement, make_objective
from mlx_spec.train.trainer import TrainConfig, Trainer

V = 24


def tiny(seed, hidden=32):
    config = make_config("qwen3", vocab_size=V, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=hidden // 2, intermediate_size=2 * hidden)
    model = Model(parse_config(config))
    model.load_weights([(k, mx.array(v)) for k, v in random_weights(config, seed).items()])
    return model


def markov_batches(seed, batch=8, length=24):
    """Text from a random Markov chain with a few likely successors per token."""
    rng = np.random.default_rng(100)
    transition = rng.dirichlet(np.full(V, 0.3), size=V)

    def batch_of(i):
        r = np.random.default_rng([seed, i])
        rows = np.zeros((batch, length), np.int32)
        rows[:, 0] = r.integers(0, V, batch)
        for t in range(1, length):
            u = r.random(batch)[:, None]
            rows[:, t] = (transition[rows[:, t - 1]].cumsum(-1) < u).sum(-1).clip(0, V - 1)
        return {"tokens": mx.array(rows), "mask": mx.ones((batch, length), mx.bool_)}

    return batch_of


def lm_objective(model, batch):
    logits, _ = model(batch["tokens"][:, :-1])
    return nn.losses.cross_entropy(logits, batch["tokens"][:, 1:]).mean()


def test_distillation_beats_labels_alone(tmp_path):
    teacher = tiny(0, hidden=48)
    quiet = dict(progress=False, warmup=10)
    Trainer(teacher, lm_objective, markov_batches(1), TrainConfig(out=tmp_path / "t", steps=150, lr=3e-3, **quiet)).fit()
    teacher.freeze()
    held_out = markov_batches(2)

    distilled, labelled = tiny(5), tiny(5)
    steps = dict(steps=40, lr=3e-3, **quiet)
    objective = make_objective(teacher, DistillConfig(temperature=1.0, alpha=0.0))
    Trainer(distilled, objective, markov_batches(3), TrainConfig(out=tmp_path / "d", **steps)).fit()
    Trainer(labelled, lm_objective, markov_batches(3), TrainConfig(out=tmp_path / "l", **steps)).fit()
    a = agreement(distilled, teacher, held_out, 4)["expected_acceptance"]
    b = agreement(labelled, teacher, held_out, 4)["expected_acceptance"]
    assert a > b + 0.03, (a, b)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over a lazy dog while drafts are verified".split()
    with open(folder / "train.jsonl", "w") as f:
        for _ in range(60):
            f.write(json.dumps({"text": " ".join(rng.choice(words, 20))}) + "\n")
        f.write(json.dumps({"prompt": "Say hi", "completion": "hi there"}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}) + "\n")
    return folder


def distill(checkpoints, data, out, *extra, run=cli):
    return run("distill", "--teacher", checkpoints["qwen3"], "--student", checkpoints["llama"], "--data", data,
               "-o", out, "--steps", "6", "--batch-size", "2", "--seq-len", "24", "--warmup", "1", "--quiet", *extra)


@pytest.mark.parametrize("extra", [(), ("--teacher-topk", "8"), ("--on-policy", "0.5", "--beta", "0.3"),
                                   ("--loss", "mse", "--no-pack", "--mask-prompt"), ("--lora-rank", "4"),
                                   ("--lora-rank", "4", "--fuse")])
def test_distill_command_writes_a_loadable_model(checkpoints, data, tmp_path, extra):
    out = tmp_path / "out"
    proc = distill(checkpoints, data, out, *extra)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0 <= result["expected_acceptance"] <= 1 and 0 <= result["top1_agreement"] <= 1
    model, _ = load_model(str(out))
    if "--fuse" in extra:
        assert "lora" not in json.loads((out / "config.json").read_text())
    logits, _ = model(mx.array([[1, 2, 3]]))
    assert logits.shape[-1] == 384
    gen = cli_here("generate", "--model", out, "--prompt", "hi", "--max-tokens", "3", "--json")
    assert gen.returncode == 0, gen.stderr
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 6


def test_distill_errors(checkpoints, data, tmp_path, in_process):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    assert_one_line_error(distill(checkpoints, bad, tmp_path / "o1", run=in_process), "bad.jsonl:2")
    bad.write_text('{"text": "fine"}\n{"question": "?"}\n')
    assert_one_line_error(distill(checkpoints, bad, tmp_path / "o2", run=in_process), "bad.jsonl:2", "text")
    missing = in_process("distill", "--teacher", tmp_path / "nope", "--student", checkpoints["llama"], "--data", data,
                         "-o", tmp_path / "o3")
    assert_one_line_error(missing, "nope")
    other = tmp_path / "other"
    shutil.copytree(checkpoints["llama"], other)
    from tiny import make_tokenizer

    make_tokenizer(other, vocab_size=300)
    mismatch = in_process("distill", "--teacher", checkpoints["qwen3"], "--student", other, "--data", data,
                          "-o", tmp_path / "o4")
    assert_one_line_error(mismatch, "--student", "tokenizer differs")
    assert_one_line_error(distill(checkpoints, data, tmp_path / "o5", "--on-policy", "2", run=in_process),
                          "--on-policy")
    assert_one_line_error(distill(checkpoints, data, tmp_path / "o6", "--fuse", run=in_process), "--fuse")
    assert_one_line_error(distill(checkpoints, data, tmp_path / "o7", "--resume", run=in_process), "--resume")


def test_two_processes_match_one_with_twice_the_batch(checkpoints, data, tmp_path):
    """`mlx.launch` with 2 local processes (ring backend): gradients averaged
    with all_sum; the loss curve equals one process accumulating 2 micro-batches."""
    launch = shutil.which("mlx.launch") or str(__import__("pathlib").Path(sys.executable).parent / "mlx.launch")
    args = ["distill", "--teacher", str(checkpoints["qwen3"]), "--student", str(checkpoints["llama"]),
            "--data", str(data), "--steps", "6", "--batch-size", "2", "--seq-len", "24", "--warmup", "1", "--quiet",
            "--log-every", "1"]
    two = subprocess.run([launch, "-n", "2", "--backend", "ring", sys.executable, "-m", "mlx_spec.cli", *args,
                          "-o", str(tmp_path / "two")], capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr + two.stdout
    one = cli(*args, "-o", tmp_path / "one", "--grad-accum", "2")
    assert one.returncode == 0, one.stderr
    curve = [[json.loads(line)["loss"] for line in (tmp_path / run / "train_log.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)] for run in ("two", "one")]
    assert len(curve[0]) == len(curve[1]) > 1
    assert np.allclose(curve[0], curve[1], rtol=1e-4), curve
