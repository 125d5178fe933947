"""`mlx-spec bench`: plain decoding and every drafter, side by side, in one run.

Methods: mlx-spec's plain decoding (the baseline), mlx-lm's plain decoding,
mlx-spec speculative decoding with each `--drafters` SPEC, and mlx-lm's own
speculative decoding beside each draft model. Every method decodes the same
prompts for the same number of tokens from the same checkpoint; for each
repeat and prompt the methods run one after another, so machine noise hits all
alike, in a new order each time (a run is slowed or sped by what ran just before
it). The target reads each prompt once a temperature (the first, once in all);
mlx-spec's methods go on from a copy of that reading (their time to the first
token counts it), mlx-lm's read their own.
Per method and temperature we report the median decode tokens/s (and its
spread), the median over runs of the ratio to plain decoding on the same prompt
and repeat, tau (tokens per target forward), acceptance by draft position, the
drafting overhead c, and for greedy rows whether every output was identical to
plain decoding's. Decode tokens/s counts the tokens after the
first (which the prompt pass produces) over the time they took.
"""

from __future__ import annotations

import argparse
import random
import sys

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_spec import distributed, exact
from mlx_spec.bench.batches import batch_sizes, measure_concurrency, take_turns
from mlx_spec.bench.machine import (bandwidth_bound, copy, drafter_bytes, read_per_step, rollback_cost,
                                    round_overhead, verification_curve)
from mlx_spec.bench.methods import load_prompts, make_runners, ours, read_prompt, time_run
from mlx_spec.bench.report import PLAIN, Progress, MethodRow, format_report, median, plot_report, predict
from mlx_spec.errors import UserError
from mlx_spec.generate import context_overflow
from mlx_spec.models.dtypes import compute_dtype
from mlx_spec.sampling import SamplingParams

__all__ = ["format_report", "load_prompts", "measure_concurrency", "plot_report", "predict", "run_bench",
           "take_turns", "time_run"]


def _checked(args: argparse.Namespace, prompts: list[list[int]], context: int) -> None:
    if args.repeats < 1 or args.max_tokens < 2:
        raise UserError("--repeats must be >= 1 and --max-tokens >= 2")
    if args.num_prompts < 0:
        raise UserError(f"--num-prompts must be >= 0, got {args.num_prompts}")
    for i, prompt in enumerate(prompts):
        overflow = context_overflow(len(prompt), args.max_tokens, context)
        if overflow:
            raise UserError(f"--prompts: prompt {i + 1} of {len(prompts)}: {overflow}" if args.prompts
                            else f"--prompt: {overflow}")


def _rows_at(temp: float, runners: dict, prompts: list[list[int]], first: tuple[list, float], args: argparse.Namespace,
             warm: int, model, progress: Progress) -> list[MethodRow]:
    """Every method's row at one temperature: a warm-up each, then every prompt, its repeats one after another
    (the prompt read once for them all; `first`: the first prompt's reading)."""
    params, n = SamplingParams(temp=temp), args.max_tokens
    table = {name: MethodRow(name, temp) for name in runners}
    for name, run in runners.items():
        time_run(_run(name, run, prompts[0], params, warm, first), len(prompts[0]), warm)
        progress.step(f"temperature {temp:g}, warming up {name}", warm)
    for i, prompt in enumerate(prompts):
        held = read_prompt(model, prompt) if i else first
        for r in range(args.repeats):
            timed = {}
            # A new order each time: a run is slowed or sped by what ran just before it, and no
            # method should always follow the same one.
            order = list(runners.items())
            random.Random(r * len(prompts) + i).shuffle(order)
            for name, run in order:
                mx.random.seed(r)
                events = _run(name, run, prompt, params, n, held)
                mx.reset_peak_memory()
                timed[name] = time_run(events, len(prompt), n, table[name].metrics, held[1] if ours(name) else 0.0)
                # the prompts' readings the bench holds for the next method are not the method's
                table[name].peak = max(table[name].peak, mx.get_peak_memory() - _bytes(first, held))
                progress.step(f"temperature {temp:g}, prompt {i + 1}/{len(prompts)}: {name}", n)
            base_tps, plain_tokens = timed[PLAIN][1], timed[PLAIN][2]
            for name, (ptps, dtps, tokens, rounds) in timed.items():
                row = table[name]
                row.prompt_tps.append(ptps)
                row.decode_tps.append(dtps)
                row.rounds_per_s.append(rounds)
                row.ratios.append(dtps / base_tps)
                if temp == 0 and tokens != plain_tokens:
                    row.identical = False
                    if parting := exact.parted(model, prompt, plain_tokens, tokens):
                        row.parted.append(parting)
    progress.say(f"temperature {temp:g}: " + ", ".join(
        f"{name} {median(row.ratios):.2f}x" for name, row in table.items() if name != PLAIN))
    return list(table.values())


def _bytes(*readings: tuple[list, float]) -> int:
    return sum(c.nbytes for held in {id(r): r for r in readings}.values() for c in held[0])


def _run(name: str, run, prompt: list[int], params: SamplingParams, n: int, held: tuple[list, float]):
    """A method's run of `prompt`; mlx-spec's go on from a copy of its shared reading `held`."""
    return run(prompt, params, n, cache=copy(held[0])) if ours(name) else run(prompt, params, n)


def run_bench(args: argparse.Namespace, template_args: dict | None = None) -> dict:
    """Measure every method at every temperature; the report as a dict (`template_args`: `load_prompts`')."""
    from mlx_spec import api

    sizes = batch_sizes(args.concurrency) if args.concurrency else []
    target = api.load(args.model, args.revision, adapter_path=args.adapter_path)
    model, n = target.model, args.max_tokens
    prompts = load_prompts(args, target.tokenizer, template_args)
    _checked(args, prompts, model.args.max_position_embeddings)
    runners, drafters, num_draft, width = make_runners(args, target)

    print(f"mlx-spec bench: {len(runners)} methods x {len(prompts)} prompts x {args.repeats} repeats x "
          f"{len(args.temps)} temperatures, {n} tokens each" + (f"; then {len(drafters) + 1} methods "
          f"decoding them {', '.join(map(str, sizes))} at a time" if sizes else ""), file=sys.stderr)
    warm = min(n, 32)  # tokens a method decodes before it is timed, at each temperature (compiles; its
    # policy learns what drafting costs here, as a chat's earlier turns teach it)
    progress = Progress(len(args.temps) * (len(runners) * (warm + args.repeats * len(prompts) * n) +
                                           sum(max(len(prompts), B) * min(n, 64) * (len(drafters) + 1) for B in sizes)))
    first = read_prompt(model, prompts[0])
    rows = [row for temp in args.temps for row in _rows_at(temp, runners, prompts, first, args, warm, model, progress)]
    # Batches decode up to 64 tokens a sequence: enough for the policy to settle, a batch of 16 in seconds.
    concurrency = (measure_concurrency(model, drafters, prompts, sizes, min(n, 64), args.temps, num_draft, progress,
                                       width) if sizes else [])
    progress.done()
    return {**_machine(args, model, rows, drafters, prompts, first[0], sizes), "exact_width": width,
            "concurrency": concurrency}


def _machine(args: argparse.Namespace, model, rows: list[MethodRow], drafters: dict, prompts: list[list[int]],
             held: list, sizes: list[int]) -> dict:
    """The report but for the batches: the rows, and what the machine and the target cost (after the first
    prompt, `held` its reading)."""
    weights = tree_flatten(model.parameters())
    step_bytes = read_per_step(model)
    bandwidth, bound = bandwidth_bound(step_bytes)
    plain = {r.temp: median(r.decode_tps) for r in rows if r.name == PLAIN}
    plain_peak = {r.temp: r.peak for r in rows if r.name == PLAIN}
    reported = [r.as_dict(plain[r.temp], bound) for r in rows]
    for row, r in zip(reported, rows):  # the peak counts all that is loaded: the drafter's share apart
        row["beyond_plain_mb"] = (r.peak - plain_peak[r.temp]) / 2**20  # its caches and activations
        row["drafter_weights_mb"] = drafter_bytes(drafters.get(r.name), model) / 2**20
        if distributed.active():
            row["shard"] = distributed.round_costs(model, r.metrics, drafters.get(r.name))
    return {
        "model": args.model,
        "dtype": str(compute_dtype() or weights[0][1].dtype).removeprefix("mlx.core."),
        "parameters": sum(v.size for _, v in weights),
        "bandwidth_gbs": bandwidth / 1e9,
        "step_bytes": step_bytes,
        "bound_tps": bound,
        "prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "rows": reported,
        # (as many samples of the machine's costs as the rows were asked to measure: 10 a repeat)
        "rollback": rollback_cost(model, prompts[0], held, repeats=10 * args.repeats),
        "verification_ms": verification_curve(model, prompts[0], held, sorted({1, *sizes}), 8,
                                              repeats=args.repeats + 2),
        "round_overhead": round_overhead(model, prompts[0], held, rounds=10 * args.repeats),
        "shard": distributed.describe(),
    }
