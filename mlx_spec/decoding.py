"""The decoding loop: prefill, then one step event per round.

Plain decoding is the baseline every drafter is measured against, and the
reference its output must equal. Each step yields a `StepEvent`; streaming, the
CLI, the benchmark and the chat all read these.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import mlx.core as mx

from mlx_spec.cache import KVCache
from mlx_spec.models.llama import Model
from mlx_spec.sampling import SamplingParams, sample

PREFILL_STEP = 512


@dataclass
class StepEvent:
    tokens: list[int]  # committed this step, in order
    from_draft: list[bool]  # which of `tokens` came from the draft
    drafted: list[int] = field(default_factory=list)  # what the drafter proposed
    draft_time: float = 0.0  # seconds
    verify_time: float = 0.0

    @property
    def accepted(self) -> int:
        return sum(self.from_draft)


def prefill(model: Model, tokens: Sequence[int], cache: list[KVCache]) -> None:
    """Run `tokens` through the target to fill the cache; no logits are evaluated."""
    ids = mx.array(tokens)
    for start in range(0, len(tokens), PREFILL_STEP):
        model(ids[None, start : start + PREFILL_STEP], cache)
        mx.eval([c.state for c in cache])


def plain_steps(
    model: Model,
    prompt: Sequence[int],
    params: SamplingParams,
    max_tokens: int,
    cache: list[KVCache] | None = None,
) -> Iterator[StepEvent]:
    """Plain decoding, one token per event.

    The next step is queued with `mx.async_eval` before the current token is
    read, so host work overlaps the device's.
    """
    if not prompt:
        raise ValueError("the prompt is empty")
    cache = cache if cache is not None else model.make_cache(len(prompt) + max_tokens + 1)
    prefill(model, prompt[:-1], cache)

    def step(tokens: mx.array) -> mx.array:
        logits, _ = model(tokens[None], cache)  # [1, S, V]
        return sample(logits[:, -1, :], params)  # [1]

    tic = time.perf_counter()
    y = step(mx.array(prompt[-1:]))
    mx.async_eval(y)
    for n in range(max_tokens):
        if n + 1 < max_tokens:
            next_y = step(y)
            mx.async_eval(next_y)
        token = y.item()
        toc = time.perf_counter()
        yield StepEvent([token], [False], verify_time=toc - tic)
        tic = toc
        if n % 256 == 255:
            mx.clear_cache()
        if n + 1 < max_tokens:
            y = next_y
