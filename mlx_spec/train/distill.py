"""Knowledge distillation: a student learns the teacher's distributions.

Offline (Hinton et al.): on the training text, minimise
    t^2 * KL(teacher_t || student_t) + alpha * CE(student, labels)
where `_t` are the distributions softened by temperature t (the t^2 keeps the
gradient scale independent of t), or the mean squared error between logits.
The teacher's soft labels are computed on the fly, or once, as top-k logits
cached on disk and reused every epoch.

On-policy (GKD, Agarwal et al.): the student writes the continuation itself and
the teacher scores it, with the generalised Jensen-Shannon divergence
    JSD_beta = beta KL(T || M) + (1 - beta) KL(S || M),  M = beta T + (1 - beta) S,
scaled by 1 / (beta (1 - beta)) so that it tends to KL(T || S) as beta -> 0 and
to KL(S || T) (reverse KL) as beta -> 1, which are used at the ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_spec.errors import UserError
from mlx_spec.train.data import Batches


def common_vocab(student_logits: mx.array, teacher_logits: mx.array) -> tuple[mx.array, mx.array]:
    """Cut the padded rows one model has beyond the other's vocabulary."""
    V = min(student_logits.shape[-1], teacher_logits.shape[-1])
    return student_logits[..., :V], teacher_logits[..., :V]


def masked_mean(x: mx.array, mask: mx.array) -> mx.array:
    m = mask.astype(mx.float32)
    return (x * m).sum() / mx.maximum(m.sum(), 1.0)


def kd_loss(
    student_logits: mx.array,
    teacher_logits: mx.array,
    labels: mx.array,
    mask: mx.array,
    temperature: float = 2.0,
    alpha: float = 0.5,
) -> mx.array:
    """t^2 KL(teacher_t || student_t) + alpha CE(student, labels), over masked tokens.

    Logits `[B, S, V]`, labels and mask `[B, S]`.
    """
    s, t = common_vocab(student_logits.astype(mx.float32), teacher_logits.astype(mx.float32))
    log_s = nn.log_softmax(s / temperature, axis=-1)
    log_t = nn.log_softmax(mx.stop_gradient(t) / temperature, axis=-1)
    return _softened_kl_plus_ce(log_t, log_s, student_logits, labels, mask, temperature, alpha)


def _softened_kl_plus_ce(log_t, log_s, student_logits, labels, mask, temperature, alpha) -> mx.array:
    """t^2 KL from the teacher's log-probs to the student's (same support), plus alpha CE."""
    kl = (mx.exp(log_t) * (log_t - log_s)).sum(axis=-1)  # [B, S]
    loss = temperature**2 * masked_mean(kl, mask)
    if alpha:
        loss = loss + alpha * masked_mean(nn.losses.cross_entropy(student_logits, labels), mask)
    return loss


def topk_kd_loss(
    student_logits: mx.array,
    top_values: mx.array,
    top_indices: mx.array,
    labels: mx.array,
    mask: mx.array,
    temperature: float = 2.0,
    alpha: float = 0.5,
) -> mx.array:
    """`kd_loss` with the teacher kept as its top-k logits `[B, S, k]` (renormalised)."""
    log_s = nn.log_softmax(student_logits.astype(mx.float32) / temperature, axis=-1)
    log_t = nn.log_softmax(top_values.astype(mx.float32) / temperature, axis=-1)  # [B, S, k]
    log_s_k = mx.take_along_axis(log_s, top_indices, axis=-1)
    return _softened_kl_plus_ce(log_t, log_s_k, student_logits, labels, mask, temperature, alpha)


def mse_loss(student_logits: mx.array, teacher_logits: mx.array, mask: mx.array) -> mx.array:
    """Mean squared error between the logits, over masked tokens."""
    s, t = common_vocab(student_logits.astype(mx.float32), teacher_logits.astype(mx.float32))
    return masked_mean(((s - mx.stop_gradient(t)) ** 2).mean(axis=-1), mask)


def generalized_jsd(student_logits: mx.array, teacher_logits: mx.array, mask: mx.array, beta: float) -> mx.array:
    """GKD's divergence (module docstring), averaged over masked tokens."""
    s, t = common_vocab(student_logits.astype(mx.float32), teacher_logits.astype(mx.float32))
    log_s = nn.log_softmax(s, axis=-1)
    log_t = nn.log_softmax(mx.stop_gradient(t), axis=-1)
    if beta <= 0:
        div = (mx.exp(log_t) * (log_t - log_s)).sum(axis=-1)
    elif beta >= 1:
        div = (mx.exp(log_s) * (log_s - log_t)).sum(axis=-1)
    else:
        log_m = mx.logaddexp(log_t + np.log(beta), log_s + np.log(1 - beta))
        kl_t = (mx.exp(log_t) * (log_t - log_m)).sum(axis=-1)
        kl_s = (mx.exp(log_s) * (log_s - log_m)).sum(axis=-1)
        div = (beta * kl_t + (1 - beta) * kl_s) / (beta * (1 - beta))
    return masked_mean(div, mask)


@dataclass
class DistillConfig:
    loss: str = "kl"  # kl | mse
    temperature: float = 2.0
    alpha: float = 0.5
    teacher_topk: int = 0  # 0: teacher computed on the fly
    on_policy: float = 0.0  # fraction of batches the student writes itself
    beta: float = 0.5
    seed: int = 0

    def check(self) -> None:
        if self.loss not in ("kl", "mse"):
            raise UserError(f"--loss must be kl or mse, got {self.loss}")
        if self.temperature <= 0:
            raise UserError(f"--temperature must be > 0, got {self.temperature}")
        if not 0 <= self.on_policy <= 1:
            raise UserError(f"--on-policy must be in [0, 1], got {self.on_policy}")
        if not 0 <= self.beta <= 1:
            raise UserError(f"--beta must be in [0, 1], got {self.beta}")
        if self.teacher_topk < 0:
            raise UserError(f"--teacher-topk must be >= 0, got {self.teacher_topk}")


class TeacherCache:
    """Top-k teacher logits for every row of the training data, computed once
    and kept on disk (memory-mapped), so later epochs skip the teacher."""

    def __init__(self, folder: Path, teacher, batches: Batches, k: int):
        folder.mkdir(parents=True, exist_ok=True)
        n, width = len(batches.rows), max(len(t) for t, _ in batches.rows) - 1
        values_path, indices_path = folder / f"top{k}_values.npy", folder / f"top{k}_indices.npy"
        if not (values_path.exists() and indices_path.exists()):
            values = np.zeros((n, width, k), np.float32)
            indices = np.zeros((n, width, k), np.int32)
            for r, (toks, _) in enumerate(batches.rows):
                logits, _ = teacher(mx.array(toks[:-1])[None])  # [1, S, V]
                idx = mx.argpartition(-logits[0], k - 1, axis=-1)[:, :k]  # [S, k]
                vals = mx.take_along_axis(logits[0], idx, axis=-1)
                values[r, : len(toks) - 1] = np.array(vals)
                indices[r, : len(toks) - 1] = np.array(idx)
            np.save(indices_path.with_suffix(".tmp.npy"), indices)
            np.save(values_path.with_suffix(".tmp.npy"), values)
            indices_path.with_suffix(".tmp.npy").replace(indices_path)
            values_path.with_suffix(".tmp.npy").replace(values_path)
        self.values = np.load(values_path, mmap_mode="r")
        self.indices = np.load(indices_path, mmap_mode="r")

    def rows(self, rows: list[int], width: int) -> tuple[mx.array, mx.array]:
        return mx.array(self.values[rows, :width]), mx.array(self.indices[rows, :width])


def make_objective(teacher, config: DistillConfig):
    """`objective(student, batch)` for the trainer. A batch holds `tokens` and
    `mask`; with cached soft labels also `top_values` and `top_indices`; an
    on-policy batch holds `written` (the tokens the student sampled) instead of
    `mask`."""
    config.check()

    def objective(student, batch: dict) -> mx.array:
        tokens = batch["tokens"]
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        logits, _ = student(inputs)
        if "written" in batch:
            teacher_logits = mx.stop_gradient(teacher(inputs)[0])
            return generalized_jsd(logits, teacher_logits, batch["written"][:, 1:], config.beta)
        m = batch["mask"][:, 1:]
        if "top_values" in batch:
            return topk_kd_loss(
                logits, batch["top_values"], batch["top_indices"], labels, m, config.temperature, config.alpha
            )
        teacher_logits = mx.stop_gradient(teacher(inputs)[0])
        if config.loss == "mse":
            return mse_loss(logits, teacher_logits, m)
        return kd_loss(logits, teacher_logits, labels, m, config.temperature, config.alpha)

    return objective


def student_continuations(student, tokens: mx.array, prompt_len: int, key: mx.array) -> mx.array:
    """Keep `tokens[:, :prompt_len]`, sample the rest from the student at temperature 1.

    `[B, S] -> [B, S]`; batched decoding with a KV cache, no gradients.
    """
    B, S = tokens.shape
    cache = student.make_cache(rows=B)
    logits, _ = student(tokens[:, :prompt_len], cache)
    out = [tokens[:, :prompt_len]]
    keys = mx.random.split(key, S - prompt_len)
    for i in range(S - prompt_len):
        nxt = mx.random.categorical(logits[:, -1, :], key=keys[i])[:, None]  # [B, 1]
        out.append(nxt)
        if i + 1 < S - prompt_len:
            logits, _ = student(nxt, cache)
    return mx.stop_gradient(mx.concatenate(out, axis=1))


class DistillBatches:
    """Offline batches, with cached teacher top-k when asked, and a fraction of
    on-policy batches whose second half the student writes."""

    def __init__(self, batches: Batches, student, config: DistillConfig, cache: TeacherCache | None = None):
        self.batches, self.student, self.config, self.cache = batches, student, config, cache

    def __call__(self, i: int) -> dict[str, mx.array]:
        batch = self.batches(i)
        rng = np.random.default_rng([self.config.seed, i, 1])
        if self.config.on_policy and rng.random() < self.config.on_policy:
            tokens = batch["tokens"]
            prompt_len = max(1, tokens.shape[1] // 2)
            key = mx.random.key(int(rng.integers(2**31)))
            tokens = student_continuations(self.student, tokens, prompt_len, key)
            written = mx.arange(tokens.shape[1])[None, :] >= prompt_len
            return {"tokens": tokens, "written": mx.broadcast_to(written, tokens.shape)}
        if self.cache is not None:
            width = batch["tokens"].shape[1] - 1
            batch["top_values"], batch["top_indices"] = self.cache.rows(self.batches.row_ids(i), width)
        return batch


def agreement(student, teacher, batches, n_batches: int) -> dict[str, float]:
    """How good a draft model the student is for the teacher, on held-out text:
    top-1 match rate and expected acceptance sum_x min(p, q) at temperature 1."""
    match = accept = count = 0.0
    for i in range(n_batches):
        batch = batches(i)
        inputs, m = batch["tokens"][:, :-1], batch["mask"][:, 1:].astype(mx.float32)
        s, t = common_vocab(student(inputs)[0], teacher(inputs)[0])
        p, q = mx.softmax(s, axis=-1), mx.softmax(t, axis=-1)
        match += ((mx.argmax(s, -1) == mx.argmax(t, -1)) * m).sum().item()
        accept += (mx.minimum(p, q).sum(-1) * m).sum().item()
        count += m.sum().item()
    return {"top1_agreement": match / max(count, 1), "expected_acceptance": accept / max(count, 1)}
