"""The training loop every objective shares.

    trainer = Trainer(model, objective, batches, config, valid=valid_batches)
    trainer.fit()

- `objective(model, batch) -> loss` is differentiated with respect to the
  model's trainable parameters; the teacher of a distillation lives in the
  closure, frozen.
- `batches(i)` returns micro-batch i. Data order is a pure function of the
  step, so a resumed run sees exactly the batches it would have seen; the same
  holds for randomness: an objective that samples derives its key from the step.
- AdamW, linear warmup then cosine decay, gradient clipping, accumulation over
  `grad_accum` micro-batches, optional gradient checkpointing per layer.
- Checkpoints (weights, optimizer moments, step) are written atomically every
  `save_every` steps and when the run is interrupted (Ctrl-C, SIGTERM);
  `resume=True` continues bit for bit from the latest, and refuses one whose
  weights' names and shapes or whose `settings` differ from this run's.
- With several processes (`mlx.launch`), gradients are averaged with
  `mx.distributed.all_sum` and only rank 0 writes.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from mlx_spec.errors import UserError
from mlx_spec.files import replace_atomically

Batch = Any
Objective = Callable[[nn.Module, Batch], mx.array]
BatchSource = Callable[[int], Batch]


@dataclass
class TrainConfig:
    out: Path
    steps: int = 1000
    lr: float = 1e-4
    warmup: int = 100
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    grad_accum: int = 1
    grad_checkpoint: bool = False
    eval_every: int = 0  # steps; 0 = only at the end
    eval_batches: int = 8
    save_every: int = 100
    log_every: int = 10
    progress: bool = True
    settings: dict[str, Any] = field(default_factory=dict)  # flag -> value: what a resumed run must keep

    def check(self) -> None:
        for name in ("steps", "grad_accum", "save_every", "log_every"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise UserError(f"--lr must be > 0, got {self.lr}")


def lr_schedule(lr: float, steps: int, warmup: int, final_fraction: float = 0.1) -> Callable[[mx.array], mx.array]:
    """Linear warmup to `lr`, then cosine decay to `final_fraction * lr` at `steps`."""
    warmup = min(warmup, steps // 2)
    decay = optim.cosine_decay(lr, max(steps - warmup, 1), end=lr * final_fraction)
    if warmup <= 0:
        return decay
    # The ramp starts one step in, so the first update is not wasted at lr 0.
    ramp = optim.linear_schedule(lr / warmup, lr, warmup)
    return optim.join_schedules([ramp, decay], [warmup])


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        objective: Objective,
        batches: BatchSource,
        config: TrainConfig,
        valid: BatchSource | None = None,
        evaluate: Callable[[nn.Module], dict[str, float]] | None = None,
    ):
        config.check()
        self.model, self.objective, self.batches, self.config = model, objective, batches, config
        self.valid, self.evaluate = valid, evaluate
        schedule = lr_schedule(config.lr, config.steps, config.warmup, config.final_lr_fraction)
        self.optimizer = optim.AdamW(schedule, weight_decay=config.weight_decay)
        self.group = mx.distributed.init()
        self.step = 0
        self.stop_requested = False
        self.log_path = config.out / "train_log.jsonl"
        self.checkpoint_dir = config.out / "checkpoint"
        if config.grad_checkpoint:
            enable = getattr(model, "enable_grad_checkpoint", None)
            if enable is None:
                raise UserError("--grad-checkpoint: this model does not support gradient checkpointing")
            enable()

    # --- the step ------------------------------------------------------------

    def _build_step(self) -> Callable[[list[Batch]], mx.array]:
        model, optimizer, config, group = self.model, self.optimizer, self.config, self.group
        loss_and_grad = nn.value_and_grad(model, self.objective)

        def step(micro_batches: list[Batch]) -> mx.array:
            total, grads = None, None
            for batch in micro_batches:
                loss, g = loss_and_grad(model, batch)
                total = loss if total is None else total + loss
                grads = g if grads is None else tree_map(mx.add, grads, g)
            scale = 1.0 / (len(micro_batches) * group.size())
            if group.size() > 1:
                grads = tree_map(lambda g: mx.distributed.all_sum(g, group=group), grads)
                total = mx.distributed.all_sum(total, group=group)
            grads = tree_map(lambda g: g * scale, grads)
            grads, _ = optim.clip_grad_norm(grads, config.max_grad_norm)
            optimizer.update(model, grads)
            return total * scale

        return step

    def _micro_batches(self, step: int) -> list[Batch]:
        # Micro-batch indices are global: rank r of n takes every n-th one.
        base = step * self.config.grad_accum * self.group.size()
        return [
            self.batches(base + a * self.group.size() + self.group.rank())
            for a in range(self.config.grad_accum)
        ]

    # --- checkpoints ---------------------------------------------------------

    def save_checkpoint(self) -> None:
        if self.group.rank() != 0:
            return
        params = dict(tree_flatten(self.model.trainable_parameters()))
        opt = dict(tree_flatten(self.optimizer.state))

        def write(folder: Path) -> None:
            mx.save_safetensors(str(folder / "weights.safetensors"), params)
            mx.save_safetensors(str(folder / "optimizer.safetensors"), opt)
            (folder / "state.json").write_text(
                json.dumps({"step": self.step, "config": asdict(self.config)}, default=str)
            )

        replace_atomically(self.checkpoint_dir, write)

    def load_checkpoint(self) -> None:
        folder = self.checkpoint_dir
        if not (folder / "state.json").exists():
            raise UserError(f"{folder}: no checkpoint to resume from (--resume)")
        try:
            state = json.loads((folder / "state.json").read_text())
            params = mx.load(str(folder / "weights.safetensors"))
            opt = mx.load(str(folder / "optimizer.safetensors"))
        except (OSError, RuntimeError, ValueError, RecursionError) as e:
            raise UserError(f"{folder}: unreadable checkpoint ({e})".splitlines()[0]) from None
        step = state.get("step") if isinstance(state, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise UserError(f"{folder / 'state.json'}: 'step' must be an integer >= 0, got {step!r}")
        self._check_resumable(state.get("config"), params, opt, step)
        self.model.load_weights(list(params.items()), strict=False)
        self.optimizer.state = tree_unflatten(list(opt.items()))
        self.step = step
        mx.eval(self.model.parameters(), self.optimizer.state)

    def _check_resumable(self, saved: Any, params: dict[str, mx.array], opt: dict[str, mx.array], step: int) -> None:
        """The checkpoint is this run's, part way: the same settings (where it recorded them),
        the same trainable weights and optimizer state for them, and a step within `--steps`."""
        folder = self.checkpoint_dir
        settings = saved.get("settings") if isinstance(saved, dict) else None
        settings = settings if isinstance(settings, dict) else {}  # (checkpoints from before settings were kept)
        for key in sorted(settings.keys() & self.config.settings.keys()):
            if settings[key] != self.config.settings[key]:
                flag = "--" + key.replace("_", "-")
                raise UserError(f"--resume: {folder} was trained with {flag} {settings[key]}, this command gives "
                                f"{flag} {self.config.settings[key]}: give the same, or another --out")
        expected = dict(tree_flatten(self.model.trainable_parameters()))
        for name in sorted(expected.keys() | params.keys()):
            have, want = params.get(name), expected.get(name)
            if have is None or want is None or have.shape != want.shape:
                raise UserError(f"--resume: {folder} holds another model: weight '{name}' is {_shape(have)} there, "
                                f"{_shape(want)} in this run")
        for key, value in sorted(opt.items()):  # a weight's moments ('NAME.m', 'NAME.v') are shaped as it is
            name = key.rpartition(".")[0]
            if name in expected and value.shape != expected[name].shape:
                raise UserError(f"--resume: {folder / 'optimizer.safetensors'}: '{key}' is {_shape(value)}, "
                                f"but weight '{name}' is {_shape(expected[name])}: the checkpoint is damaged")
        if step > self.config.steps:
            raise UserError(f"--resume: {folder} is at step {step}, beyond --steps {self.config.steps}: "
                            f"give --steps {step} or more to go on")

    # --- the loop ------------------------------------------------------------

    def _log(self, record: dict) -> None:
        if self.group.rank() == 0:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def validation_loss(self) -> float:
        if self.valid is None:
            return float("nan")
        losses = [self.objective(self.model, self.valid(i)) for i in range(self.config.eval_batches)]
        return mx.stack(losses).mean().item()

    def _run_eval(self) -> dict[str, float]:
        self.model.eval()
        loss = self.validation_loss()
        record = {"step": self.step, "valid_loss": loss, "perplexity": math.exp(min(loss, 50.0))}
        if self.evaluate is not None:
            record.update(self.evaluate(self.model))
        self.model.train()
        self._log(record)
        return record

    def _on_signal(self, signum, frame) -> None:
        self.stop_requested = True

    def fit(self, resume: bool = False) -> dict[str, float]:
        """Train to `config.steps`; returns the last evaluation."""
        config = self.config
        config.out.mkdir(parents=True, exist_ok=True)
        if resume:
            self.load_checkpoint()
        else:
            if self.log_path.exists() and self.group.rank() == 0:
                self.log_path.unlink()
            self.optimizer.init(self.model.trainable_parameters())
        state = [self.model.state, self.optimizer.state]
        step_fn = mx.compile(self._build_step(), inputs=state, outputs=state)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        progress = Progress(config.steps, self.step, enabled=config.progress and self.group.rank() == 0)
        self.model.train()
        try:
            while self.step < config.steps:
                micro = self._micro_batches(self.step)
                loss = step_fn(micro)
                mx.eval(loss, state)
                self.step += 1
                progress.update(self.step, loss.item(), sum(map(batch_tokens, micro)) * self.group.size())
                if self.step % config.log_every == 0 or self.step == config.steps:
                    self._log(
                        {
                            "step": self.step,
                            "loss": progress.mean_loss(),
                            "lr": self.optimizer.learning_rate.item(),
                            "tokens_per_s": progress.rate,
                        }
                    )
                    progress.reset_mean()
                if config.eval_every and self.step % config.eval_every == 0:
                    self._run_eval()
                if self.step % config.save_every == 0 or self.stop_requested:
                    self.save_checkpoint()
                if self.stop_requested:
                    progress.close()
                    print(
                        f"mlx-spec: interrupted at step {self.step}; the checkpoint in "
                        f"{self.checkpoint_dir} is saved: continue with --resume",
                        file=sys.stderr,
                    )
                    raise KeyboardInterrupt
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        progress.close()
        self.save_checkpoint()
        return self._run_eval()


def _shape(a: mx.array | None) -> str:
    return "absent" if a is None else f"of shape {tuple(a.shape)}"


def batch_tokens(batch: Batch) -> int:
    """Tokens in a batch: an array, or a dict holding `tokens`."""
    if isinstance(batch, dict):
        batch = batch.get("tokens")
    return batch.size if isinstance(batch, mx.array) else 0


class Progress:
    """One line, redrawn: step, loss, tokens/s, ETA (plain lines when not a terminal)."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.total, self.start, self.enabled = total, start, enabled
        self.t0 = time.perf_counter()
        self.losses: list[float] = []
        self.tokens = 0
        self.rate = 0.0  # tokens per second
        self.tty = sys.stderr.isatty()

    def update(self, step: int, loss: float, tokens: int) -> None:
        self.losses.append(loss)
        self.tokens += tokens
        elapsed = time.perf_counter() - self.t0
        self.rate = self.tokens / elapsed if elapsed > 0 else 0.0
        if not self.enabled:
            return
        steps_per_s = (step - self.start) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - step) / steps_per_s if steps_per_s else 0.0
        line = f"step {step}/{self.total}  loss {loss:.4f}  {self.rate:.0f} tok/s  eta {eta:.0f}s"
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif step % 10 == 0 or step == self.total:
            print(line, file=sys.stderr, flush=True)

    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else float("nan")

    def reset_mean(self) -> None:
        self.losses = []

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)
