"""The Python API: what `mlx-spec generate` does, as functions the CLI itself uses.

    from mlx_spec import api

    target = api.load("demo")
    drafter = api.drafter("eagle3", target)
    out = api.generate(target, "Write a Python function `is_prime`: Return True if n is prime.",
                       drafter=drafter, max_tokens=64)
    print(out.text, out.metrics.tau)

`load` and `drafter` take the specs the CLI takes (`--model`, `--drafter`);
`stream` yields the text as it is decoded. This module and the CLI are the
layer above `mlx_spec.convert`: a target's own MTP modules are read through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from mlx_spec.decoding import speculative_steps
from mlx_spec.drafters import Drafter, make_drafter
from mlx_spec.generate import Generation, stream_generate
from mlx_spec.sampling import SamplingParams
from mlx_spec.tokenizer import encode_prompt, thinking_args


@dataclass
class Target:
    """A loaded target: its model, tokenizer, the folder it came from and the name it was asked by."""

    model: object
    tokenizer: object
    path: Path
    name: str
    revision: str | None = None


def load(model: str = "demo", revision: str | None = None) -> Target:
    """A target by the names `--model` takes: a folder, a Hub repo id, or a short name."""
    from mlx_spec.models import load_model
    from mlx_spec.tokenizer import load_tokenizer

    loaded, path = load_model(model, revision)
    return Target(loaded, load_tokenizer(path), Path(path), model, revision)


def drafter(spec: str, target: Target, **flags) -> Drafter | None:
    """The drafter `--drafter SPEC` names for `target` (None: plain decoding); `flags`
    as `drafters.Options` (revision of the drafter's repo, tree_budget, ...)."""
    name, _, source = spec.partition("=")
    if name == "mtp" and not source:  # the target checkpoint's own modules
        from mlx_spec.convert.mtp import target_mtp
        from mlx_spec.drafters.mtp import MTP, check_mtp_fits

        net = target_mtp(target.path, target.model)
        check_mtp_fits(net, target.model, f"--drafter {spec}")
        return MTP(net, target.model)
    return make_drafter(spec, target.model, tokenizer=target.tokenizer, target_source=target.name, **flags)


def prompt_ids(target: Target, prompt: str | list[int], chat_template: bool = True,
               think: bool | None = None) -> list[int]:
    """Token ids of a prompt: the user's message under the chat template (raw
    text without it); a list of ids is taken as it is."""
    if isinstance(prompt, list):
        return prompt
    return encode_prompt(target.tokenizer, prompt, chat_template, thinking_args(think))


def stream(target: Target, prompt: str | list[int], drafter: Drafter | None = None, *,
           params: SamplingParams | None = None, max_tokens: int = 256, num_draft: int | None = None,
           chat_template: bool = True, think: bool | None = None, acceptance: str = "exact",
           result: Generation | None = None) -> Iterator[str]:
    """The answer's text as it is decoded; `result` (if given) fills with the
    tokens, where each came from, timings and the drafter's metrics."""
    ids = prompt_ids(target, prompt, chat_template, think)
    result = result if result is not None else Generation(prompt_tokens=ids)

    def steps(model, prompt, params, max_tokens):
        return speculative_steps(model, prompt, params, max_tokens, drafter, num_draft=num_draft,
                                 acceptance=acceptance)

    yield from stream_generate(target.model, target.tokenizer, ids, params or SamplingParams(), max_tokens,
                               result, steps)


def generate(target: Target, prompt: str | list[int], drafter: Drafter | None = None, **options) -> Generation:
    """The whole answer (`Generation`: text, tokens, metrics with tau); options as `stream`'s."""
    result = Generation(prompt_tokens=prompt_ids(target, prompt, options.get("chat_template", True),
                                                 options.get("think")))
    for _ in stream(target, result.prompt_tokens, drafter, result=result,
                    **{k: v for k, v in options.items() if k not in ("chat_template", "think")}):
        pass
    return result
