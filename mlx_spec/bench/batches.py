"""`mlx-spec bench --concurrency`: throughput with B sequences in flight, every method by turns."""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx

from mlx_spec.bench.report import CONTROL, PLAIN, Progress
from mlx_spec.decoding import Decoder
from mlx_spec.errors import UserError
from mlx_spec.sampling import SamplingParams


def batch_sizes(value: str) -> list[int]:
    """`--concurrency 1,4,16`."""
    try:
        sizes = [int(x) for x in value.split(",")]
    except ValueError:
        raise UserError(f"--concurrency {value}: expected batch sizes like 1,4,16") from None
    if min(sizes) < 1:
        raise UserError(f"--concurrency {value}: batch sizes must be >= 1")
    return sizes


TURN = 8  # rounds a decoder runs before the other of its pair takes its turn
WARM = 16  # tokens a warm-up row decodes: the policy's first rounds at a batch size (a drafting round on what it
# assumes, plain rounds timed, a length's second round: its first may have compiled) fall in it


def take_turns(decoders: list[Decoder], turn: int = TURN,
               feed: Callable[[int], bool] | None = None) -> list[tuple[int, int, int, float]]:
    """Run the decoders by turns of `turn` rounds until each is done, or until `feed(i)`, called after each of
    decoder i's rounds to add the rows it takes, says it stops there (the rows it has left are dropped). Per
    decoder: (tokens, rounds, tokens drafted, seconds). A turn ends with the device idle (what it left in
    flight is its own time), so two decoders taking turns share the machine's drift at the scale of a few rounds."""
    out = [[0, 0, 0, 0.0] for _ in decoders]
    going = [bool(d.rows) for d in decoders]
    while any(going):
        for i, (decoder, tally) in enumerate(zip(decoders, out)):
            tic = time.perf_counter()
            for _ in range(turn if going[i] else 0):
                events = decoder.step()
                tally[0] += sum(len(e.tokens) for e in events.values())
                tally[1] += 1
                tally[2] += max(e.depth for e in events.values())
                going[i] = feed(i) if feed is not None else bool(decoder.rows)
                if not going[i]:
                    break
            mx.synchronize()
            tally[3] += time.perf_counter() - tic
    for decoder in decoders:
        for row in list(decoder.rows):
            decoder.remove(row.key)
    return [tuple(t) for t in out]


def measure_concurrency(model, drafters: dict, prompts: list[list[int]], sizes: list[int], n: int,
                        temps: list[float], num_draft: dict[str, int | None] | None = None,
                        progress: Progress | None = None, width: int | None = None) -> list[dict]:
    """Throughput with B sequences in flight (`Decoder`), per batch size, temperature and method, and the
    mean draft length the policy chose. Each method decodes max(prompts, B) sequences of `n` tokens (the
    prompts in turn), B at a time, a finished sequence replaced at once by the next, as a server keeps its
    batch full; it is timed while B are in flight (rows that draft finish apart: a batch left to drain runs
    at fewer rows), after a short warm-up of B rows that compiles the shapes and times what drafting costs
    at this batch size (as a server that has been running knows). All methods decode side by side, taking turns every `TURN` rounds (`take_turns`): this
    machine's speed drifts within a second, and turns a few rounds long share the drift. Plain decoding is
    measured twice (`CONTROL`): its second ratio, 1 but for the noise, is how far this run can tell a method
    from plain decoding. `num_draft` fixes a method's K (`:num-draft=K`, as in its one-sequence rows); `width`:
    exact verification. The whole costs about as much as decoding every method's tokens once."""
    out, fixed = [], num_draft or {}
    for temp, B in ((t, b) for t in temps for b in sizes):
        params = SamplingParams(temp=temp)
        methods = {name: d for name, d in {PLAIN: None, CONTROL: None, **drafters}.items()
                   if d is None or not d.one_row or B == 1}
        decoders = [Decoder(model, num_draft=fixed.get(name), width=width) for name in methods]
        # a warm-up (B prompts, a few tokens each: it compiles B's shapes and times B's rounds at the run's contexts,
        # what every K is weighed against while drafting pays), then the run
        for sequences, tokens in ((B, WARM), (max(len(prompts), B), n)):
            # a session a method and run (suffix decoding would otherwise recall the warm-up's answers)
            sessions = [d.new_session() if d is not None else None for d in methods.values()]
            started = [0] * len(methods)

            def feed(i: int) -> bool:
                while len(decoders[i].rows) < B and started[i] < sequences:
                    decoders[i].add(started[i], prompts[started[i] % len(prompts)], params, tokens, sessions[i])
                    started[i] += 1
                return len(decoders[i].rows) == B

            for i in range(len(methods)):
                mx.random.seed(0)
                feed(i)
            results = take_turns(decoders, feed=feed)
        if progress is not None:
            progress.step(f"temperature {temp:g}, {B} sequences at a time", sum(r[0] for r in results))
        plain = results[0][0] / results[0][3]
        for name, (tokens, rounds, drafted, seconds) in zip(methods, results):
            out.append({"name": name, "batch": B, "temp": temp, "tps": tokens / seconds, "mean_k": drafted / rounds,
                        "ratio_to_plain": tokens / seconds / plain})
    return out
