"""Text in, streamed text out: tokenize, run the decoding loop, detokenize."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import mlx.core as mx

from mlx_spec.decoding import plain_steps
from mlx_spec.errors import UserError
from mlx_spec.metrics import StepEvent
from mlx_spec.metrics import Metrics
from mlx_spec.models.llama import Model
from mlx_spec.sampling import SamplingParams

if TYPE_CHECKING:
    from mlx_spec.tokenizer import TokenizerWrapper

Steps = Callable[[Model, list[int], SamplingParams, int], Iterator[StepEvent]]


@dataclass
class Generation:
    """What one generation produced, filled in while it streams."""

    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    from_draft: list[bool] = field(default_factory=list)  # per token: an accepted draft token
    text: str = ""
    prompt_time: float = 0.0  # seconds to the first generated token
    generation_time: float = 0.0  # seconds from the first to the last token
    finish_reason: str = "length"
    metrics: Metrics = field(default_factory=Metrics)
    rounds: list = field(default_factory=list)  # per round: (the policy's `Decision`, drafts kept)

    @property
    def prompt_tps(self) -> float:
        return len(self.prompt_tokens) / self.prompt_time if self.prompt_time else 0.0

    @property
    def generation_tps(self) -> float:
        # The first token is produced by the prompt pass, so it is not counted.
        n = len(self.tokens) - 1
        return n / self.generation_time if n > 0 and self.generation_time else 0.0


def context_overflow(prompt_tokens: int, max_tokens: int, context: int, name: str = "--max-tokens") -> str | None:
    """Why a prompt and the `max_tokens` (the flag or field `name`) asked after it do not fit a model's
    context of `context` positions (its `max_position_embeddings`), or None where they do."""
    if prompt_tokens + max_tokens <= context:
        return None
    return f"the prompt ({prompt_tokens} tokens) plus {name} ({max_tokens}) exceeds the context of {context} tokens"


def stream_generate(
    model: Model,
    tokenizer: TokenizerWrapper,
    prompt: list[int],
    params: SamplingParams,
    max_tokens: int,
    result: Generation,
    steps: Steps = plain_steps,
) -> Iterator[str]:
    """Yield text as it is decoded, token by token (a token that ends inside a
    character or word boundary yields with a later one); `result` collects
    tokens, where each came from, and timings. A prompt and `max_tokens` beyond the model's
    context are refused before anything is decoded."""
    overflow = context_overflow(len(prompt), max_tokens, model.args.max_position_embeddings)
    if overflow:
        raise UserError(overflow)
    detok = tokenizer.detokenizer
    detok.reset()
    start = time.perf_counter()
    first = None
    for event in steps(model, prompt, params, max_tokens):
        now = time.perf_counter()
        result.metrics.add(event)
        result.rounds.append((event.why, event.accepted))
        if first is None:
            first = now
            result.prompt_time = now - start
        result.generation_time = now - first
        done = False
        for token, drafted in zip(event.tokens, event.from_draft):
            if token in tokenizer.eos_token_ids:
                result.finish_reason = "stop"
                done = True
                break
            result.tokens.append(token)
            result.from_draft.append(drafted)
            detok.add_token(token)
            segment = detok.last_segment
            if segment:
                yield segment
            if len(result.tokens) == max_tokens:
                done = True
                break
        if done:
            break
    detok.finalize()
    segment = detok.last_segment
    if segment:
        yield segment
    result.text = detok.text
    mx.clear_cache()
