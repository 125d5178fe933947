"""`mlx-spec bench`: decoding speed, side by side, in the same run.

Rows: mlx-spec plain decoding, mlx-lm plain decoding, and with `--drafter`,
mlx-spec speculative decoding (and mlx-lm's own speculative decoding when the
drafter is a draft model). Every row decodes the same prompt for the same number
of tokens from the same checkpoint; rows alternate for `--runs` rounds and we
report each row's median tokens/s (and tau) over the rounds, and the median over
rounds of each row's ratio to mlx-spec's plain decoding (at temperature > 0
each round samples a different text, so one lucky round says little). Decode tokens/s counts the tokens after the first
(which the prompt pass produces) over the time they took.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_spec.decoding import plain_steps, speculative_steps
from mlx_spec.errors import UserError
from mlx_spec.sampling import SamplingParams

# A runner yields (token, from_draft, round_ended) triples.
Runner = Callable[[SamplingParams], Iterator[tuple[int, bool, bool]]]


@dataclass
class Row:
    name: str
    temp: float
    decode_tps: float = 0.0
    prompt_tps: float = 0.0
    tau: float = 1.0  # tokens per target forward
    ratio: float = 0.0  # to plain mlx-spec
    runs: list[tuple[float, float, float, float]] = field(default_factory=list)  # (ratio, decode, prompt, tau)
    tokens: list[int] = field(default_factory=list)

    def add(self, ratio: float, decode_tps: float, prompt_tps: float, tau: float) -> None:
        self.runs.append((ratio, decode_tps, prompt_tps, tau))
        self.ratio, self.decode_tps, self.prompt_tps, self.tau = (
            _median([r[i] for r in self.runs]) for i in range(4)
        )


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def time_run(tokens: Iterator[tuple[int, bool, bool]], n_prompt: int, max_tokens: int):
    """(prompt tok/s, decode tok/s, tau, tokens) of one run."""
    start = time.perf_counter()
    out, rounds, first = [], 0, 0.0
    for token, _, round_ended in tokens:
        out.append(token)
        rounds += round_ended
        if len(out) == 1:
            first = time.perf_counter()
        if len(out) == max_tokens:
            break
    end = time.perf_counter()
    decode = (len(out) - 1) / (end - first) if len(out) > 1 else 0.0
    return n_prompt / (first - start), decode, len(out) / max(rounds, 1), out


def _events(events) -> Iterator[tuple[int, bool, bool]]:
    for e in events:
        for i, (t, d) in enumerate(zip(e.tokens, e.from_draft)):
            yield t, d, i == len(e.tokens) - 1


def run_bench(args: argparse.Namespace) -> str:
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    from mlx_spec.drafters import make_drafter
    from mlx_spec.drafters.draft_model import DraftModel
    from mlx_spec.models import load_model
    from mlx_spec.tokenizer import encode_prompt, load_tokenizer

    if args.runs < 1 or args.max_tokens < 2:
        raise UserError("--runs must be >= 1 and --max-tokens >= 2")
    model, path = load_model(args.model, args.revision)
    tokenizer = load_tokenizer(path)
    ref_model, _ = mlx_lm_load(str(path))
    prompt = encode_prompt(tokenizer, args.prompt, chat_template=not args.no_chat_template)
    n = args.max_tokens
    spec = args.drafter
    drafter = make_drafter(spec, model, tokenizer, args.revision) if spec != "none" else None

    runners: dict[str, Runner] = {
        "mlx-spec": lambda p: _events(plain_steps(model, prompt, p, n)),
        "mlx-lm": lambda p: (
            (t, False, True) for t, _ in generate_step(mx.array(prompt), ref_model, max_tokens=n, sampler=make_sampler(p.temp))
        ),
    }
    if drafter is not None:
        runners[f"mlx-spec {spec}"] = lambda p: _events(
            speculative_steps(model, prompt, p, n, drafter.new_session(), num_draft=args.num_draft)
        )
    if isinstance(drafter, DraftModel):
        ref_draft, _ = mlx_lm_load(spec.partition("=")[2])
        k = args.num_draft or 3
        runners[f"mlx-lm {spec}"] = lambda p: (
            (t, d, not d)
            for t, _, d in speculative_generate_step(
                mx.array(prompt), ref_model, ref_draft, num_draft_tokens=k, max_tokens=n, sampler=make_sampler(p.temp)
            )
        )

    rows: list[Row] = []
    for temp in args.temps:
        params = SamplingParams(temp=temp)
        table = {name: Row(name, temp) for name in runners}
        for name, run in runners.items():  # warm-up: compile, allocate
            time_run(run(params), len(prompt), min(n, 8))
        for r in range(args.runs):
            mx.random.seed(r)
            timed = {name: time_run(run(params), len(prompt), n) for name, run in runners.items()}
            base = timed["mlx-spec"][1]
            for name, (ptps, dtps, tau, tokens) in timed.items():
                table[name].add(dtps / base, dtps, ptps, tau)
                table[name].tokens = tokens
        rows += table.values()

    params_count = sum(v.size for _, v in tree_flatten(model.parameters()))
    if args.json:
        return json.dumps(
            {
                "model": args.model,
                "parameters": params_count,
                "prompt_tokens": len(prompt),
                "max_tokens": n,
                "rows": [
                    {"name": r.name, "temp": r.temp, "decode_tps": r.decode_tps, "prompt_tps": r.prompt_tps,
                     "tau": r.tau, "ratio_to_plain": r.ratio}
                    for r in rows
                ],
            }
        )
    lines = [f"{args.model}: {params_count / 1e6:.1f}M parameters, {len(prompt)} prompt tokens, {n} generated"]
    lines.append(f"{'':32} {'temp':>5} {'decode tok/s':>13} {'tau':>6} {'vs plain':>9}")
    for r in rows:
        lines.append(f"{r.name:32} {r.temp:5.1f} {r.decode_tps:13.1f} {r.tau:6.2f} {r.ratio:8.2f}x")
    greedy = {r.name: r.tokens for r in rows if r.temp == 0}
    if greedy:
        same = len({tuple(t) for t in greedy.values()}) == 1
        lines.append(f"greedy tokens identical across rows: {same}")
    return "\n".join(lines)
