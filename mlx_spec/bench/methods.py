"""The methods `mlx-spec bench` measures, as runners (a prompt, sampling, a length -> step events),
the prompts they decode, and the timing of one run."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable, Generator, Iterator

import mlx.core as mx

from mlx_spec import distributed, exact
from mlx_spec.bench.report import PLAIN
from mlx_spec.decoding import plain_steps, prefill, speculative_steps
from mlx_spec.errors import UserError
from mlx_spec.metrics import Metrics, StepEvent
from mlx_spec.models.dtypes import cast_floating, compute_dtype

SUITES = Path(__file__).parent.parent / "prompts"  # built-in prompt suites, NAME.jsonl

# A runner decodes one prompt: (prompt tokens, params, max tokens) -> step events. mlx-spec's also take
# `cache=`: the target's cache holding the prompt but its last token (`read_prompt`), which it goes on from.
Runner = Callable[..., Generator[StepEvent, None, None]]


def ours(name: str) -> bool:
    """mlx-spec's methods (they share one reading of each prompt); mlx-lm's read their own."""
    return name == PLAIN or name.startswith(PLAIN + " ")


def read_prompt(model, prompt: list[int]) -> tuple[list, float]:
    """The target's cache after `prompt` but its last token, read once for all of mlx-spec's methods (each goes
    on from a copy, as a turn goes on from the server's prompt cache: at 8k tokens a 0.2B model's prefill on a
    CPU takes minutes), and the seconds the reading took."""
    cache = model.make_cache()
    tic = time.perf_counter()
    prefill(model, prompt[:-1], cache)
    return cache, time.perf_counter() - tic


def time_run(events: Generator[StepEvent, None, None], n_prompt: int, max_tokens: int, metrics: Metrics | None = None,
             read: float = 0.0):
    """(prompt tok/s, decode tok/s, tokens, rounds/s) of one run; its events go into `metrics`. Decoding is
    timed from the first event on, and counts the tokens and rounds that came after it: a speculative first
    round brings several tokens at once (its drafter reading the prompt too), all at the time to the first.
    `read`: seconds the prompt's shared reading took (`read_prompt`), counted in the time to the first."""
    start = time.perf_counter() - read
    out: list[int] = []
    first, before, rounds = start, 1, -1
    for event in events:
        if metrics is not None:
            metrics.add(event)
        if not out:
            first = time.perf_counter()  # the prompt pass produced the first token(s)
            before = len(event.tokens)
        out.extend(event.tokens)
        rounds += 1
        if len(out) >= max_tokens:
            break
    end = time.perf_counter()
    settle(events)
    out = out[:max_tokens]
    decode = (len(out) - before) / (end - first) if len(out) > before else 0.0
    return n_prompt / (first - start), decode, out, rounds / (end - first) if rounds > 0 else 0.0


def settle(events: Generator) -> None:
    """End a run before the next starts: mlx-lm's generators compute a step ahead, on a stream
    of their own, and what is left in flight would slow the next method's run."""
    from mlx_lm.generate import generation_stream

    events.close()
    mx.synchronize(generation_stream)
    mx.synchronize()


def load_prompts(args: argparse.Namespace, tokenizer, template_args: dict | None = None) -> list[list[int]]:
    """Token ids of `--prompt`, or of every prompt of the `--prompts` suites and files.

    A prompts file is JSONL: `{"prompt": TEXT}` goes through the chat template
    (`"chat_template": false` feeds it as raw text), with `template_args`
    (`--chat-template-args`) and `--think/--no-think`.
    """
    from mlx_spec.tokenizer import encode_prompt, thinking_args
    from mlx_spec.train.data import read_jsonl

    template_args = thinking_args(args.think, template_args)
    if not args.prompts:
        text = with_file(tokenizer, args.prompt, args.context) if args.context else args.prompt
        return [encode_prompt(tokenizer, text, not args.no_chat_template, template_args)]
    prompts = []
    for name in args.prompts.split(","):
        path = SUITES / f"{name}.jsonl" if (SUITES / f"{name}.jsonl").is_file() else Path(name)
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in SUITES.glob("*.jsonl")))
            raise UserError(f"--prompts {name}: neither a built-in suite ({known}) nor a file")
        for n, row in read_jsonl(path)[: args.num_prompts or None]:
            if not isinstance(row.get("prompt"), str) or not row["prompt"]:
                raise UserError(f"{path}:{n}: expected an object with a non-empty 'prompt' string")
            chat = row.get("chat_template", True)
            if not isinstance(chat, bool):
                raise UserError(f"{path}:{n}: 'chat_template' must be true or false")
            text = row["prompt"]
            if args.context:
                text = with_file(tokenizer, text, args.context)
            prompts.append(encode_prompt(tokenizer, text, chat and not args.no_chat_template, template_args))
    return prompts


def with_file(tokenizer, prompt: str, context: int) -> str:
    """`prompt` after a long file to edit (Python's own standard library source, the same everywhere a
    Python of one version runs), cut so that the two come to about `context` tokens."""
    room = context - len(tokenizer.encode(prompt)) - 16  # (the frame's words and the chat template)
    if room <= 0:
        raise UserError(f"--context {context}: a prompt alone is longer")
    text = Path(argparse.__file__).read_text()  # (any long module of the standard library)
    while len(tokenizer.encode(text)) < room:
        text += "\n" + text
    file = tokenizer.decode(tokenizer.encode(text)[:room])
    return f"Here is a file of Python's standard library:\n\n{file}\n\nAbout it: {prompt}"


def _mlx_lm_events(tokens: Iterator[tuple[int, bool]]) -> Iterator[StepEvent]:
    """mlx-lm's (token, from draft) stream as step events: a round ends with the target's own token."""
    buf: list[tuple[int, bool]] = []
    for t, from_draft in tokens:
        buf.append((t, from_draft))
        if not from_draft:
            yield StepEvent([t for t, _ in buf], [d for _, d in buf])
            buf = []


OPTIONS = {"tree-budget": None, "num-draft": None, "block-size": None, "depth": 6, "topk": 8}


def drafter_options(entry: str, args: argparse.Namespace) -> tuple[str, dict]:
    """`SPEC[:OPTION=N...]` -> (SPEC, options): per-drafter settings, e.g.
    `dflash:tree-budget=24` (OPTION: tree-budget, num-draft, block-size, depth,
    topk); `--tree-budget` and `--num-draft` are the defaults."""
    spec, *rest = entry.split(":")
    options = dict(OPTIONS, **{"tree-budget": args.tree_budget, "num-draft": args.num_draft})
    for item in rest:
        key, _, value = item.partition("=")
        if key not in OPTIONS or not value.isdigit():
            raise UserError(f"--drafters {entry}: expected OPTION=N with OPTION one of {', '.join(OPTIONS)}, got '{item}'")
        options[key] = int(value)
    return spec, options


def _mlx_lm_plain(args: argparse.Namespace, target, runners: dict[str, Runner]):
    """mlx-lm's plain decoding, added to `runners`; its model, or None where mlx-lm's rows are left out (under
    --shard they would run the whole target; `--no-mlx-lm`: they hold a second copy of the weights). A target
    run through mlx-lm's code is its model already; else mlx-lm loads the checkpoint, computing in mlx-spec's
    dtype (float32 on the CPU, where half precision is not BLAS-backed), so its rows compare like with like."""
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from mlx_spec.models.mlxlm import MLXLMTarget

    if distributed.active() or args.no_mlx_lm:
        return None
    model = target.model
    ref = model.inner if isinstance(model, MLXLMTarget) else cast_floating(
        mlx_lm_load(str(target.path), adapter_path=args.adapter_path)[0], compute_dtype())
    runners["mlx-lm"] = lambda prompt, p, n: _mlx_lm_events(
        (t, False) for t, _ in generate_step(mx.array(prompt), ref, max_tokens=n, sampler=make_sampler(p.temp)))
    return ref


def _mlx_lm_speculative(ref_model, drafter, k: int) -> Runner:
    """mlx-lm's speculative decoding with a draft model's checkpoint, K fixed."""
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    ref_draft = cast_floating(mlx_lm_load(str(drafter.path))[0], compute_dtype())

    def run(prompt, p, n):
        return _mlx_lm_events((t, d) for t, _, d in speculative_generate_step(
            mx.array(prompt), ref_model, ref_draft, num_draft_tokens=k, max_tokens=n, sampler=make_sampler(p.temp)))

    return run


def make_runners(args: argparse.Namespace, target) -> tuple[dict[str, Runner], dict, dict, int | None]:
    """The methods to measure, by row name; our drafters by row name (None: plain); the K each drafts
    where it is fixed (`--num-draft`, `:num-draft=K`; None: the policy chooses); and with `--exact`, the
    width of every forward of mlx-spec's rows (one for all: plain decoding is each drafter's reference)."""
    from mlx_spec import api
    from mlx_spec.drafters import tree_kinds
    from mlx_spec.drafters.draft_model import DraftModel

    model = target.model
    # `width` is known once every drafter is (below); the runners read it when they run
    runners: dict[str, Runner] = {
        PLAIN: lambda prompt, p, n, cache=None: plain_steps(model, prompt, p, n, cache=cache, width=width)}
    ref_model = _mlx_lm_plain(args, target, runners)
    drafters, num_draft = {PLAIN: None}, {}
    for entry in args.drafters.split(","):
        entry = entry.strip()
        if entry in ("", "none") or f"mlx-spec {entry}" in runners:
            continue
        spec, options = drafter_options(entry, args)
        budget = options["tree-budget"] if spec.partition("=")[0] in tree_kinds() else None
        drafter = api.drafter(spec, target, revision=args.drafter_revision, tree_budget=budget, depth=options["depth"],
                              topk=options["topk"], block_size=options["block-size"])

        def spec_run(prompt, p, n, cache=None, drafter=drafter, k=options["num-draft"]):
            return speculative_steps(model, prompt, p, n, drafter.new_session(), num_draft=k, cache=cache,
                                     width=width)

        runners[f"mlx-spec {entry}"] = spec_run
        drafters[f"mlx-spec {entry}"], num_draft[f"mlx-spec {entry}"] = drafter, options["num-draft"]
        if isinstance(drafter, DraftModel) and ref_model is not None and \
                not any(name.startswith("mlx-lm ") for name in runners):
            runners[f"mlx-lm {spec}"] = _mlx_lm_speculative(ref_model, drafter, args.num_draft or 3)
    width = exact.width(model, max(exact.need(drafters[name], num_draft.get(name)) for name in drafters)) \
        if args.exact else None
    return runners, drafters, num_draft, width
