"""`mlx-spec bench`: decode speed of mlx-spec against mlx-lm, in the same run.

Both decode the same prompt greedily for the same number of tokens from the same
checkpoint, alternating for `--runs` rounds; we report the best tokens/s of each
and the median of the per-round ratios. Decode tokens/s counts the tokens after
the first (which the prompt pass produces) over the time they took.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_spec.decoding import plain_steps
from mlx_spec.sampling import SamplingParams


@dataclass
class Timing:
    name: str
    prompt_tps: float
    decode_tps: float
    tokens: list[int]


def time_tokens(name: str, tokens: Iterator[int], n_prompt: int, max_tokens: int) -> Timing:
    start = time.perf_counter()
    out, first = [], 0.0
    for t in tokens:
        out.append(t)
        if len(out) == 1:
            first = time.perf_counter()
        if len(out) == max_tokens:
            break
    end = time.perf_counter()
    decode = (len(out) - 1) / (end - first) if len(out) > 1 else 0.0
    return Timing(name, n_prompt / (first - start), decode, out)


def run_bench(args: argparse.Namespace) -> str:
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.generate import generate_step

    from mlx_spec.models import load_model
    from mlx_spec.tokenizer import encode_prompt, load_tokenizer

    model, path = load_model(args.model, args.revision)
    tokenizer = load_tokenizer(path)
    ref_model, _ = mlx_lm_load(str(path))
    prompt = encode_prompt(tokenizer, args.prompt)
    n = args.max_tokens
    greedy = SamplingParams()

    def ours() -> Iterator[int]:
        for event in plain_steps(model, prompt, greedy, n):
            yield from event.tokens

    def theirs() -> Iterator[int]:
        for token, _ in generate_step(mx.array(prompt), ref_model, max_tokens=n):
            yield token

    runners: dict[str, Callable[[], Iterator[int]]] = {"mlx-spec": ours, "mlx-lm": theirs}
    best: dict[str, Timing] = {}
    ratios = []
    for name, run in runners.items():  # warm-up: compile, allocate
        time_tokens(name, run(), len(prompt), min(n, 8))
    for _ in range(args.runs):
        round_ = {name: time_tokens(name, run(), len(prompt), n) for name, run in runners.items()}
        ratios.append(round_["mlx-spec"].decode_tps / round_["mlx-lm"].decode_tps)
        for name, t in round_.items():
            if name not in best or t.decode_tps > best[name].decode_tps:
                best[name] = t
    same = best["mlx-spec"].tokens == best["mlx-lm"].tokens
    ratio = sorted(ratios)[len(ratios) // 2]  # median over rounds: robust to a noisy machine
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    if args.json:
        return json.dumps(
            {
                "model": args.model,
                "parameters": params,
                "prompt_tokens": len(prompt),
                "max_tokens": n,
                "results": [{k: v for k, v in asdict(t).items() if k != "tokens"} for t in best.values()],
                "decode_ratio": ratio,
                "identical_tokens": same,
            }
        )
    lines = [f"{args.model}: {params / 1e6:.1f}M parameters, {len(prompt)} prompt tokens, {n} generated"]
    lines.append(f"{'':10} {'prompt tok/s':>13} {'decode tok/s':>13}")
    lines += [f"{t.name:10} {t.prompt_tps:13.1f} {t.decode_tps:13.1f}" for t in best.values()]
    lines.append(
        f"decode speed mlx-spec / mlx-lm: {ratio:.2f}x (median of {args.runs} rounds); "
        f"greedy tokens identical: {same}"
    )
    return "\n".join(lines)
