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
from typing import Callable, Iterator, Sequence

from mlx_spec import distributed, exact, sharding
from mlx_spec.decoding import speculative_steps
from mlx_spec.drafters import Drafter, make_drafter
from mlx_spec.errors import UserError
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


def load(model: str = "demo", revision: str | None = None, *, extra_eos: Sequence[str] = (),
         adapter_path: str | Path | None = None, report: Callable[[str], None] | None = None) -> Target:
    """A target by the names `--model` takes: a folder, a Hub repo id, or a short name.
    It stops on every EOS id its generation config (or config) and tokenizer
    declare, and on `extra_eos` (`--extra-eos-token`: tokens or ids);
    `adapter_path` (`--adapter-path`) is a folder of mlx-lm LoRA adapters to apply.
    A model in `pytorch_model.bin` form is converted on first use (`report` hears it)."""
    from mlx_spec.convert.first_use import ready, stderr_line
    from mlx_spec.models import load_model
    from mlx_spec.tokenizer import add_eos_tokens, load_tokenizer, model_eos_ids

    folder = ready("target", model, revision, None, report or stderr_line)
    # Compiled layers keep the weights they were traced with: compile once the adapters are in.
    # Under --shard, read when split: a rank reads its share of the weights alone.
    loaded, path = load_model(folder, revision if folder == model else None, for_training=adapter_path is not None,
                              lazy=distributed.active())
    path = Path(path)
    if adapter_path is not None:
        load_adapters(loaded, Path(adapter_path))
        loaded.compile()
    sharding.shard(loaded, model, path, adapter_path)  # under --shard: this rank's share of it
    tokenizer = load_tokenizer(path, model_eos_ids(path))
    add_eos_tokens(tokenizer, extra_eos)
    return Target(loaded, tokenizer, path, model, revision)


def load_adapters(model, path: Path) -> None:
    """Apply the LoRA (or DoRA, or full) adapters mlx-lm's trainer saves in `path`
    (adapter_config.json and adapters.safetensors) with mlx-lm's own loader."""
    from mlx_lm.tuner.utils import load_adapters as mlx_lm_load_adapters

    from mlx_spec.models.load import read_json

    if not path.is_dir():
        raise UserError(f"--adapter-path {path}: no such folder")
    for name in ("adapter_config.json", "adapters.safetensors"):
        if not (path / name).is_file():
            raise UserError(f"--adapter-path {path}: no {name} (not a folder of mlx-lm adapters?)")
    try:
        read_json(path / "adapter_config.json")
    except UserError as e:
        raise UserError(f"--adapter-path {e}") from None
    try:
        mlx_lm_load_adapters(model, str(path))
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError, OSError) as e:
        # mlx-lm names a missing field (KeyError, AttributeError) or lists mismatched tensors over lines
        raise UserError(f"--adapter-path {path}: not adapters for this model ({' '.join(str(e).split())})") from None


def check_published(spec: str, model: str) -> None:
    """Before a model is downloaded: a `--drafter KIND` alone for `model` must name a
    published drafter (else the one-line error says none is known)."""
    from mlx_spec.drafters import published_source

    name, _, source = spec.partition("=")
    if not source and name != "medusa":  # medusa alone may be a Medusa-2 model's own
        published_source(name, model)


def split_mtp_block(source: str, revision: str | None) -> Path | None:
    """The folder of a Qwen3.5/3.6 MTP block split out of its model (`model_type: qwen3_5_mtp`, as
    mlx-community publishes them), read as it is; None for any other source."""
    from mlx_spec import hub
    from mlx_spec.models.load import read_json

    config = hub.resolve(source, revision, ["config.json"]) / "config.json"
    if not config.exists() or read_json(config).get("model_type") != "qwen3_5_mtp":
        return None
    return hub.resolve(source, revision, ["config.json", "model.safetensors"])


def drafter(spec: str, target: Target, report: Callable[[str], None] | None = None, **flags) -> Drafter | None:
    """The drafter `--drafter SPEC` names for `target` (None: plain decoding); `flags`
    as `drafters.Options` (revision: of the drafter's repo, tree_budget, ...). A
    SOURCE as published is converted on first use; `report` hears that (stderr
    by default)."""
    from mlx_spec.convert.first_use import ready, stderr_line
    from mlx_spec.published import NON_THINKING
    from mlx_spec.tokenizer import has_thinking_switch

    name, _, source = spec.partition("=")
    extract = split_mtp_block(source, flags.get("revision")) if name == "mtp" and source else None
    if name == "mtp" and (not source or extract):  # the target checkpoint's own modules, or its block split out
        from mlx_spec.convert.mtp import target_mtp
        from mlx_spec.drafters.mtp import MTP, check_mtp_fits

        net = target_mtp(extract or target.path, target.model, target.path)
        check_mtp_fits(net, target.model, f"--drafter {spec}")
        own = MTP(net, target.model)
        distributed.check_drafter(own, spec)
        return own
    def prepare(kind: str, source: str, revision: str | None) -> str:
        if source in NON_THINKING and has_thinking_switch(target.tokenizer):
            (report or stderr_line)(f"{source} was trained on answers given without thinking: "
                                    "it drafts best with --no-think")
        return ready(kind, source, revision, target.path, report or stderr_line)

    built = make_drafter(spec, target.model, tokenizer=target.tokenizer, target_source=target.name, prepare=prepare,
                         **flags)
    distributed.check_drafter(built, spec)
    return built


def prompt_ids(target: Target, prompt: str | list[int], chat_template: bool = True,
               think: bool | None = None, *, system: str = "", template_args: dict | None = None) -> list[int]:
    """Token ids of a prompt: the user's message under the chat template, after
    the `system` message if any (raw text without the template); a list of ids
    is taken as it is. `template_args` go to the template (`--chat-template-args`),
    `think` sets their `enable_thinking`."""
    if isinstance(prompt, list):
        return prompt
    return encode_prompt(target.tokenizer, prompt, chat_template, thinking_args(think, template_args), system)


def stream(target: Target, prompt: str | list[int], drafter: Drafter | None = None, *,
           params: SamplingParams | None = None, max_tokens: int = 256, num_draft: int | None = None,
           chat_template: bool = True, think: bool | None = None, system: str = "",
           template_args: dict | None = None, acceptance: str = "exact",
           result: Generation | None = None, width: int | None = None) -> Iterator[str]:
    """The answer's text as it is decoded; `result` (if given) fills with the
    tokens, where each came from, timings and the drafter's metrics. `width`
    (`exact_width`): exact verification, every forward that many tokens wide."""
    ids = prompt_ids(target, prompt, chat_template, think, system=system, template_args=template_args)
    result = result if result is not None else Generation(prompt_tokens=ids)

    def steps(model, prompt, params, max_tokens):
        events = speculative_steps(model, prompt, params, max_tokens, drafter, num_draft=num_draft,
                                   acceptance=acceptance, width=width)
        return distributed.lockstep(events, (prompt, params, max_tokens, num_draft, acceptance, width))

    yield from stream_generate(target.model, target.tokenizer, ids, params or SamplingParams(), max_tokens,
                               result, steps)


def exact_width(target: Target, drafters: Sequence[Drafter | None] = (None,), num_draft: int | None = None) -> int:
    """`--exact`: the width every target forward has so that no drafter changes a bit of the output,
    wide enough for each of `drafters` (None: plain decoding) and checked on this backend (`mlx_spec.exact`)."""
    return exact.width(target.model, max(exact.need(d, num_draft) for d in drafters))


PROMPT_OPTIONS = ("chat_template", "think", "system", "template_args")  # how `stream` renders a text prompt


def generate(target: Target, prompt: str | list[int], drafter: Drafter | None = None, **options) -> Generation:
    """The whole answer (`Generation`: text, tokens, metrics with tau); options as `stream`'s."""
    rendering = {k: v for k, v in options.items() if k in PROMPT_OPTIONS}
    result = Generation(prompt_tokens=prompt_ids(target, prompt, **rendering))
    for _ in stream(target, result.prompt_tokens, drafter, result=result,
                    **{k: v for k, v in options.items() if k not in PROMPT_OPTIONS}):
        pass
    return result
