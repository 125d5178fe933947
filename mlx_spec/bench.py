"""`mlx-spec bench`: plain decoding and every drafter, side by side, in one run.

Methods: mlx-spec's plain decoding (the baseline), mlx-lm's plain decoding,
mlx-spec speculative decoding with each `--drafters` SPEC, and mlx-lm's own
speculative decoding beside each draft model. Every method decodes the same
prompts for the same number of tokens from the same checkpoint; for each
repeat and prompt the methods run one after another, so machine noise hits all
alike, in a new order each time (a run is slowed or sped by what ran just before
it). Per method and temperature we report the median decode tokens/s (and its
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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Generator, Iterator

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_spec import distributed, exact
from mlx_spec.cache import trim_cache
from mlx_spec.decoding import Decoder, plain_steps, speculative_steps
from mlx_spec.drafters.base import Draft, RowStates
from mlx_spec.generate import context_overflow
from mlx_spec.metrics import Metrics, StepEvent, expected_tokens
from mlx_spec.models.dtypes import cast_floating, compute_dtype
from mlx_spec.errors import UserError
from mlx_spec.sampling import SamplingParams

PLAIN = "mlx-spec"
CONTROL = "mlx-spec, again"  # batches: plain decoding measured again, as a method is
SUITES = Path(__file__).parent / "prompts"  # built-in prompt suites, NAME.jsonl

# A runner decodes one prompt: (prompt tokens, params, max tokens) -> step events.
Runner = Callable[[list[int], SamplingParams, int], Generator[StepEvent, None, None]]


@dataclass
class Row:
    name: str
    temp: float
    metrics: Metrics = field(default_factory=Metrics)
    decode_tps: list[float] = field(default_factory=list)
    prompt_tps: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)  # to plain, same prompt and repeat
    rounds_per_s: list[float] = field(default_factory=list)  # target forwards a second while decoding
    identical: bool = True  # greedy: every output equal to plain decoding's
    parted: list[tuple[int, float]] = field(default_factory=list)  # greedy: where an output parted, the top-2 margin there
    peak: int = 0  # bytes: MLX's peak memory over the row's runs (weights, caches, drafter, activations)

    def as_dict(self, plain_tps: float, bound_tps: float | None) -> dict:
        m = self.metrics.as_dict()
        tps = sorted(self.decode_tps)
        predicted, why = predict(self.metrics, 1 / plain_tps, _median(self.ratios))
        return {
            "name": self.name,
            "temp": self.temp,
            "decode_tps": _median(tps),
            "decode_tps_min": tps[0],
            "decode_tps_max": tps[-1],
            "prompt_tps": _median(self.prompt_tps),
            "ratio_to_plain": _median(self.ratios),
            "tau": m["tau"],
            "acceptance_by_position": m["acceptance_by_position"],
            "draft_overhead": m["draft_overhead"],
            # c as the seed has it: a draft position's cost in plain decoding steps
            "c": self.metrics.draft_time / self.metrics.positions * plain_tps if self.metrics.positions else 0.0,
            "target_forwards_per_token": m["target_forwards"] / max(self.metrics.tokens, 1),
            "identical_to_plain": self.identical if self.temp == 0 else None,
            "parted": [{"token": i, "top2_margin": m} for i, m in self.parted],
            "alpha": self.metrics.alpha,
            "predicted_speedup": predicted,
            "prediction_note": why,
            # each round reads the weights once: how near the rounds came to the rate memory allows
            "of_bound": _median(self.rounds_per_s) / bound_tps if bound_tps else None,
            "peak_memory_mb": self.peak / 2**20,
            # where a round's time goes: the host's work with the device idle, and the rest (the device's)
            **{k: m[k] for k in ("host_ms_per_round", "verify_ms_per_round", "draft_ms_per_round", "k_chosen")},
        }


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
                        progress: "Progress | None" = None, width: int | None = None) -> list[dict]:
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
        # a warm-up (B prompts cut short, a few tokens: it compiles B's shapes and times B's rounds), then the run
        for sequences, tokens, cut in ((B, 8, 8), (max(len(prompts), B), n, None)):
            # a session a method and run (suffix decoding would otherwise recall the warm-up's answers)
            sessions = [d.new_session() if d is not None else None for d in methods.values()]
            started = [0] * len(methods)

            def feed(i: int) -> bool:
                while len(decoders[i].rows) < B and started[i] < sequences:
                    prompt = prompts[started[i] % len(prompts)][:cut]
                    decoders[i].add(started[i], prompt, params, tokens, sessions[i])
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


TIE = 1e-3  # logit margin within float rounding between a one-token and a many-token forward


def predict(m: Metrics, step_time: float, measured: float) -> tuple[float | None, str]:
    """The seed's speedup E(alpha, K) / (K c + 1), with E = (1 - alpha^(K+1)) / (1 - alpha),
    from the measured alpha (pooled per-position acceptance), mean K and c (a
    drafted token's cost in plain steps); and, when it misses the measured
    speedup by over 25%, why."""
    if not m.drafting_rounds:
        return None, ""
    if m.positions and m.drafted > m.positions:
        return None, "a tree: the formula is for chains"
    K = m.positions / m.drafting_rounds
    c = m.draft_time / m.positions / step_time
    predicted = expected_tokens(m.alpha, K) / (K * c + 1)
    if abs(predicted / measured - 1) <= 0.25:
        return predicted, ""
    verify = m.verify_time / m.steps / step_time  # one verification in plain steps
    if verify > 1.25:
        return predicted, f"verifying K+1 tokens costs {verify:.2f} plain steps; the formula assumes 1"
    rates = [r for r, n in zip(m.acceptance_by_position, m.reached) if n]
    if rates and max(rates) - min(rates) > 0.15:
        return predicted, "acceptance changes with the position; the formula assumes one alpha"
    return predicted, "K changes from round to round; the formula assumes one K"


def memory_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes per second decoding's products read from float32 weights of `nbytes` in all: a row times
    each of several [2048, 2048] matrices, transposed, as a linear layer computes it (`x @ W.T` takes a
    faster path than a matrix-vector product `W @ x`), evaluated together as a forward's are."""
    side = 2048 if nbytes >= 4 * 2048 * 2048 else max(int((nbytes // 4) ** 0.5), 1)
    weights = [mx.ones((side, side), dtype=mx.float32) for _ in range(max(nbytes // (4 * side * side), 1))]
    x = mx.ones((1, side), dtype=mx.float32)
    mx.eval(weights, x)
    best = float("inf")
    for _ in range(repeats + 1):
        tic = time.perf_counter()
        mx.eval([x @ w.T for w in weights])
        best = min(best, time.perf_counter() - tic)
    return sum(w.nbytes for w in weights) / best


STREAMING_BYTES = 512 * 2**20  # larger than any cache: a read from memory
# Smaller weights are taken to sit in the caches (a matrix-vector product that small is timed by
# its dispatch, not its reads).
CACHED_BYTES = 16 * 2**20


def bandwidth_bound(step_bytes: int) -> tuple[float, float | None]:
    """(streaming bandwidth, plain decoding's bound in tokens/s). The bound is None where the
    weights fit in the caches (below CACHED_BYTES, or a matrix of their size reads much faster than
    a streaming one): no memory-bandwidth bound applies then."""
    streaming = memory_bandwidth(STREAMING_BYTES)
    if step_bytes < CACHED_BYTES or (step_bytes < STREAMING_BYTES and memory_bandwidth(step_bytes) > 1.25 * streaming):
        return streaming, None
    return streaming, streaming / step_bytes


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def time_run(events: Generator[StepEvent, None, None], n_prompt: int, max_tokens: int, metrics: Metrics | None = None):
    """(prompt tok/s, decode tok/s, tokens, rounds/s) of one run; its events go into `metrics`. Decoding is
    timed from the first event on, and counts the tokens and rounds that came after it: a speculative first
    round brings several tokens at once (its drafter reading the prompt too), all at the time to the first."""
    start = time.perf_counter()
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
        return [encode_prompt(tokenizer, args.prompt, not args.no_chat_template, template_args)]
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
            prompts.append(encode_prompt(tokenizer, row["prompt"], chat and not args.no_chat_template, template_args))
    return prompts


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


def make_runners(args: argparse.Namespace, target) -> tuple[dict[str, Runner], dict, dict, int | None]:
    """The methods to measure, by row name; our drafters by row name (None: plain); the K each drafts
    where it is fixed (`--num-draft`, `:num-draft=K`; None: the policy chooses); and with `--exact`, the
    width of every forward of mlx-spec's rows (one for all: plain decoding is each drafter's reference)."""
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    from mlx_spec import api
    from mlx_spec.drafters import TREE_KINDS
    from mlx_spec.drafters.draft_model import DraftModel

    from mlx_spec.models.mlxlm import Model as MLXLMTarget

    model = target.model
    # `width` is known once every drafter is (below); the runners read it when they run
    runners: dict[str, Runner] = {PLAIN: lambda prompt, p, n: plain_steps(model, prompt, p, n, width=width)}
    # mlx-lm's rows would run the whole target where it is split; `--no-mlx-lm` leaves them out (they hold a
    # second copy of the weights)
    sharded = distributed.active() or args.no_mlx_lm
    # A target run through mlx-lm's code is its model already (the same weights, read right, in the same dtype);
    # else mlx-lm loads the checkpoint, computing in mlx-spec's dtype (float32 on the CPU, where half precision
    # is not BLAS-backed), so that its rows compare like with like
    ref_model = None if sharded else (model.inner if isinstance(model, MLXLMTarget) else
                                      cast_floating(mlx_lm_load(str(target.path), adapter_path=args.adapter_path)[0],
                                                    compute_dtype()))
    if not sharded:
        runners["mlx-lm"] = lambda prompt, p, n: _mlx_lm_events(
            (t, False) for t, _ in generate_step(mx.array(prompt), ref_model, max_tokens=n, sampler=make_sampler(p.temp))
        )
    drafters, num_draft = {PLAIN: None}, {}
    for entry in args.drafters.split(","):
        entry = entry.strip()
        if entry in ("", "none") or f"mlx-spec {entry}" in runners:
            continue
        spec, options = drafter_options(entry, args)
        budget = options["tree-budget"] if spec.partition("=")[0] in TREE_KINDS else None
        drafter = api.drafter(spec, target, revision=args.drafter_revision, tree_budget=budget, depth=options["depth"],
                              topk=options["topk"], block_size=options["block-size"])

        def spec_run(prompt, p, n, drafter=drafter, k=options["num-draft"]):
            return speculative_steps(model, prompt, p, n, drafter.new_session(), num_draft=k, width=width)

        runners[f"mlx-spec {entry}"] = spec_run
        drafters[f"mlx-spec {entry}"], num_draft[f"mlx-spec {entry}"] = drafter, options["num-draft"]
        if isinstance(drafter, DraftModel) and not sharded and \
                not any(name.startswith("mlx-lm ") for name in runners):
            ref_draft = cast_floating(mlx_lm_load(str(drafter.path))[0], compute_dtype())
            k = args.num_draft or 3

            def ref_spec_run(prompt, p, n, ref_draft=ref_draft):
                return _mlx_lm_events(
                    (t, d) for t, _, d in speculative_generate_step(
                        mx.array(prompt), ref_model, ref_draft, num_draft_tokens=k, max_tokens=n,
                        sampler=make_sampler(p.temp))
                )

            runners[f"mlx-lm {spec}"] = ref_spec_run
    width = exact.width(model, max(exact.need(drafters[name], num_draft.get(name)) for name in drafters)) \
        if args.exact else None
    return runners, drafters, num_draft, width


def rollback_cost(model, prompt: list[int], k: int = 4, repeats: int = 30) -> dict | None:
    """What rolling a hybrid target's linear-attention layers back costs a round: after a verification
    of k + 1 tokens, the next step with a cut to about half of them first (it replays the recurrence
    for the kept tokens) against the next step with no cut, a plain step; the two kinds of round
    interleaved on one cache. None for a target with no linear-attention layers."""
    from mlx_spec.cache import RecurrentCache, cut_cache

    cache = model.make_cache()
    if not any(isinstance(c, RecurrentCache) for c in cache):
        return None
    mx.eval(model(mx.array([prompt]), cache)[0])
    steps: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * repeats + 2):
        cut = i % 2 == 0
        start = cache[0].lengths[0]
        mx.eval(model(mx.array([prompt[: k + 1]]), cache)[0])  # the verification
        if cut:
            cut_cache(cache, 0, start + 1 + k // 2)
        tic = time.perf_counter()
        mx.eval(model(mx.array([prompt[:1]]), cache)[0])
        if i >= 2:  # the first two warm up
            steps[cut].append(time.perf_counter() - tic)
    with_cut, plain = _median(steps[True]), _median(steps[False])
    return {"replayed_tokens": k // 2 + 1, "rollback_ms": 1e3 * (with_cut - plain), "plain_step_ms": 1e3 * plain}


def verification_curve(model, prompt: list[int], sizes: list[int], most: int, repeats: int = 5) -> dict:
    """What a target forward of S tokens a row costs, S = 1..most + 1, at each batch size (ms, the median
    of `repeats`, after the prompt's context): the curve the policy weighs drafts against. One token to two
    is a step on a GPU (a matrix-vector product becomes a matrix product), flat after it; on a CPU it rises."""
    out = {}
    for B in sizes:
        cache = model.make_cache(rows=B)
        mx.eval(model(mx.array([prompt] * B), cache)[0])
        times = {}
        for S in range(1, most + 2):
            tokens = mx.array([prompt[-1:] * S] * B)  # [B, S]
            spent = []
            for i in range(repeats + 1):
                tic = time.perf_counter()
                mx.eval(model(tokens, cache)[0])
                trim_cache(cache, S)
                if i:  # the first compiles
                    spent.append(time.perf_counter() - tic)
            times[S] = 1e3 * _median(spent)
        out[B] = times
    return out


class _Free(RowStates):
    """Drafts k copies of token 0 and costs nothing: a round's work beside its forwards (`round_overhead`)."""

    def _session(self) -> "_Free":
        return _Free()

    def propose(self, contexts: list[list[int]], ks: list[int], params: list[SamplingParams]) -> list[Draft]:
        return Draft.rows(mx.zeros((len(ks), max(ks)), dtype=mx.int32), None, ks)


def round_overhead(model, prompt: list[int], k: int = 4, rounds: int = 30) -> dict:
    """The host's work in one speculative round of one sequence (policy, inputs, acceptance, cache cuts,
    commits, events): a round whose drafter costs nothing against the bare verification forward over
    the same k + 1 tokens, evaluated and trimmed back; the two interleaved, medians of `rounds`."""
    decoder = Decoder(model, num_draft=k)
    decoder.add(0, prompt, SamplingParams(), (k + 1) * (rounds + 2), _Free())
    cache = model.make_cache()
    mx.eval(model(mx.array([prompt]), cache)[0])
    verify = mx.array([prompt[-1:] + [0] * k])  # [1, k + 1]
    times: dict[str, list[float]] = {"round": [], "forward": []}
    for i in range(rounds + 2):
        tic = time.perf_counter()
        decoder.step()
        mid = time.perf_counter()
        mx.eval(model(verify, cache)[0])
        trim_cache(cache, k + 1)
        if i >= 2:  # the first two warm up
            times["round"].append(mid - tic)
            times["forward"].append(time.perf_counter() - mid)
    round_s, forward_s = _median(times["round"]), _median(times["forward"])
    return {"k": k, "round_ms": 1e3 * round_s, "forward_ms": 1e3 * forward_s, "overhead_ms": 1e3 * (round_s - forward_s)}


def drafter_bytes(drafter, target) -> int:
    """Bytes of a drafter's own weights (its modules but the target's; 0 for lookup, suffix, self-speculation)."""
    import mlx.nn as nn

    modules = [m for m in vars(drafter).values() if isinstance(m, nn.Module) and m is not target] if drafter else []
    return sum(v.nbytes for m in modules for _, v in tree_flatten(m.parameters()))


def read_per_step(model) -> int:
    """Bytes of weights one decoding step reads (the KV cache aside): all of them, but of a mixture of
    experts only the share a token is routed to (its experts are stacked `[E, ...]` per layer)."""
    routed = getattr(model.args, "routed", None)
    total = 0
    for name, v in tree_flatten(model.parameters()):
        expert = routed is not None and (".switch_mlp." in name or ".experts." in name) and v.shape[0] == routed[1]
        total += v.nbytes * routed[0] // routed[1] if expert else v.nbytes
    return total


class Progress:
    """What a running benchmark prints on stderr: where it is, how long it has run and about how long it has
    left (from the tokens decoded so far), on one line redrawn in a terminal, a line a step elsewhere."""

    def __init__(self, tokens: int, stream=None):
        self.total, self.decoded, self.start = tokens, 0, time.perf_counter()
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()

    def step(self, what: str, tokens: int) -> None:
        self.decoded = min(self.decoded + tokens, self.total)
        elapsed = time.perf_counter() - self.start
        left = elapsed / self.decoded * (self.total - self.decoded)
        filled = round(20 * self.decoded / self.total)
        line = (f"[{'#' * filled}{'.' * (20 - filled)}] {self.decoded / self.total:4.0%} {_clock(elapsed)} "
                f"elapsed, about {_clock(left)} left: {what}")
        print(f"\r\x1b[2K{line}" if self.tty else line, end="" if self.tty else "\n", file=self.stream, flush=True)

    def say(self, text: str) -> None:
        print(f"\r\x1b[2K{text}" if self.tty else text, file=self.stream, flush=True)

    def done(self) -> None:
        self.say(f"measured in {_clock(time.perf_counter() - self.start)}")


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def run_bench(args: argparse.Namespace, template_args: dict | None = None) -> dict:
    """Measure every method at every temperature; the report as a dict (`template_args`: `load_prompts`')."""
    from mlx_spec import api

    if args.repeats < 1 or args.max_tokens < 2:
        raise UserError("--repeats must be >= 1 and --max-tokens >= 2")
    if args.num_prompts < 0:
        raise UserError(f"--num-prompts must be >= 0, got {args.num_prompts}")
    sizes = batch_sizes(args.concurrency) if args.concurrency else []
    target = api.load(args.model, args.revision, adapter_path=args.adapter_path)
    dtype = compute_dtype()
    model = target.model
    prompts = load_prompts(args, target.tokenizer, template_args)
    n = args.max_tokens
    for i, prompt in enumerate(prompts):
        overflow = context_overflow(len(prompt), n, model.args.max_position_embeddings)
        if overflow:
            raise UserError(f"--prompts: prompt {i + 1} of {len(prompts)}: {overflow}" if args.prompts
                            else f"--prompt: {overflow}")
    runners, drafters, num_draft, width = make_runners(args, target)

    print(f"mlx-spec bench: {len(runners)} methods x {len(prompts)} prompts x {args.repeats} repeats x "
          f"{len(args.temps)} temperatures, {n} tokens each" + (f"; then {len(drafters) + 1} methods "
          f"decoding them {', '.join(map(str, sizes))} at a time" if sizes else ""), file=sys.stderr)
    warm = min(n, 32)  # tokens a method decodes before it is timed, at each temperature (compiles; its
    # policy learns what drafting costs here, as a chat's earlier turns teach it)
    progress = Progress(len(args.temps) * (len(runners) * (warm + args.repeats * len(prompts) * n) +
                                           sum(max(len(prompts), B) * min(n, 64) * (len(drafters) + 1) for B in sizes)))
    rows: list[Row] = []
    for temp in args.temps:
        params = SamplingParams(temp=temp)
        table = {name: Row(name, temp) for name in runners}
        for name, run in runners.items():
            time_run(run(prompts[0], params, warm), len(prompts[0]), warm)
            progress.step(f"temperature {temp:g}, warming up {name}", warm)
        for r in range(args.repeats):
            for i, prompt in enumerate(prompts):
                timed = {}
                # A new order each time: a run is slowed or sped by what ran just before it, and no
                # method should always follow the same one.
                order = list(runners.items())
                random.Random(r * len(prompts) + i).shuffle(order)
                for name, run in order:
                    mx.random.seed(r)
                    mx.reset_peak_memory()
                    timed[name] = time_run(run(prompt, params, n), len(prompt), n, table[name].metrics)
                    table[name].peak = max(table[name].peak, mx.get_peak_memory())
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
            f"{name} {_median(row.ratios):.2f}x" for name, row in table.items() if name != PLAIN))
        rows += table.values()
    # Batches decode up to 64 tokens a sequence: enough for the policy to settle, a batch of 16 in seconds.
    concurrency = (measure_concurrency(model, drafters, prompts, sizes, min(n, 64), args.temps, num_draft, progress,
                                       width) if sizes else [])
    progress.done()
    weights = tree_flatten(model.parameters())
    step_bytes = read_per_step(model)
    bandwidth, bound = bandwidth_bound(step_bytes)
    plain = {r.temp: _median(r.decode_tps) for r in rows if r.name == PLAIN}
    plain_peak = {r.temp: r.peak for r in rows if r.name == PLAIN}
    reported = [r.as_dict(plain[r.temp], bound) for r in rows]
    for row, r in zip(reported, rows):  # the peak counts all that is loaded: the drafter's share apart
        row["beyond_plain_mb"] = (r.peak - plain_peak[r.temp]) / 2**20  # its caches and activations
        row["drafter_weights_mb"] = drafter_bytes(drafters.get(r.name), model) / 2**20
        if distributed.active():
            row["shard"] = distributed.round_costs(model, r.metrics, drafters.get(r.name))
    return {
        "model": args.model,
        "dtype": str(dtype or weights[0][1].dtype).removeprefix("mlx.core."),
        "parameters": sum(v.size for _, v in weights),
        "bandwidth_gbs": bandwidth / 1e9,
        "step_bytes": step_bytes,
        "bound_tps": bound,
        "prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "max_tokens": n,
        "repeats": args.repeats,
        "exact_width": width,
        "rows": reported,
        "concurrency": concurrency,
        "rollback": rollback_cost(model, prompts[0]),
        "verification_ms": verification_curve(model, prompts[0], sorted({1, *sizes}), 8),
        "round_overhead": round_overhead(model, prompts[0]),
        "shard": distributed.describe(),
    }


def format_report(report: dict) -> str:
    """The report as a table for the terminal."""
    lines = [
        f"{report['model']}: {report['parameters'] / 1e6:.1f}M parameters; {report['prompts']} prompts "
        f"(mean {report['prompt_tokens']:.0f} tokens) x {report['repeats']} repeats, {report['max_tokens']} tokens each",
        f"computing in {report['dtype']}, mlx-lm's rows too; memory bandwidth {report['bandwidth_gbs']:.1f} GB/s "
        f"(a streaming read), {report['step_bytes'] / 1e6:.1f} MB read per target step: "
        + (f"plain decoding is bound by {report['bound_tps']:.0f} tok/s" if report["bound_tps"]
           else "the weights fit in this machine's caches, so no memory-bandwidth bound applies"),
        *([f"exact verification (--exact): every forward of mlx-spec's rows {report['exact_width']} tokens wide"]
          if report.get("exact_width") else []),
        f"{'':30} {'temp':>4} {'tok/s':>7} {'(min-max)':>13} {'vs plain':>8} {'predicted':>9} {'tau':>5} "
        f"{'c':>5} {'of bound':>8} {'peak MB':>8}  {'acceptance by position':24} greedy = plain",
    ]
    overhead = report.get("round_overhead")
    if overhead:
        work = "a round's host work (policy, acceptance, cache cuts, commits): "
        tokens = overhead["k"] + 1
        lines.insert(2, work + (f"{overhead['overhead_ms']:.2f} ms beside its verification forward of {tokens} tokens "
                                f"({overhead['forward_ms']:.2f} ms)" if overhead["overhead_ms"] > 0 else
                                f"hidden: the round took {overhead['round_ms']:.2f} ms, its verification forward of "
                                f"{tokens} tokens alone {overhead['forward_ms']:.2f} ms"))
    for B, times in report.get("verification_ms", {}).items():
        lines.insert(2, f"a target forward of 1, 2, ... tokens a row, {B} row{'s' * (int(B) != 1)}: " +
                     " ".join(f"{ms:.1f}" for ms in times.values()) + " ms")
    rollback = report.get("rollback")
    if rollback:
        lines.insert(2, f"linear-attention rollback: {rollback['rollback_ms']:.2f} ms a round (the recurrence replayed "
                        f"over {rollback['replayed_tokens']} kept tokens), {rollback['rollback_ms'] / rollback['plain_step_ms']:.2f}"
                        f" of a plain step ({rollback['plain_step_ms']:.2f} ms)")
    notes = []
    for r in report["rows"]:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"][:6])
        same = {None: "", True: "yes", False: "NO"}[r["identical_to_plain"]]
        if r["parted"]:  # where, and whether a near-tie the last bits of a logit decide (see --exact)
            margins = [p["top2_margin"] for p in r["parted"]]
            same += f" ({len(margins)} parted, top-2 margin {min(margins):.1g}" + \
                    (": float rounding)" if max(margins) < TIE else ")")
        pred = f"{r['predicted_speedup']:8.2f}x" if r["predicted_speedup"] is not None else f"{'':9}"
        bound = f"{r['of_bound']:.1%}" if r["of_bound"] is not None else "-"
        if r["prediction_note"]:
            notes.append(f"  {r['name']} at {r['temp']:.1f}: predicted vs measured differ: {r['prediction_note']}")
        lines.append(
            f"{r['name']:30} {r['temp']:4.1f} {r['decode_tps']:7.1f} "
            f"{r['decode_tps_min']:6.1f}-{r['decode_tps_max']:<6.1f} {r['ratio_to_plain']:7.2f}x {pred} "
            f"{r['tau']:5.2f} {r['c']:5.2f} {bound:>8} {r['peak_memory_mb']:8.1f}  {acc:24} {same}"
        )
    if report["concurrency"]:
        sizes = sorted({r["batch"] for r in report["concurrency"]})
        lines.append("")
        lines.append("throughput, tokens/s of all rows together, by batch size (every method keeping B sequences in "
                     "flight, timed while it does, all of them by turns; over plain decoding's; mean K drafted a round):")
        lines.append(f"{'':30} {'temp':>4} " + " ".join(f"{f'B={b}':>18}" for b in sizes))
        for name, temp in dict.fromkeys((r["name"], r["temp"]) for r in report["concurrency"]):
            cells = {r["batch"]: r for r in report["concurrency"] if r["name"] == name and r["temp"] == temp}
            lines.append(f"{name:30} {temp:4.1f} " + " ".join(
                f"{cells[b]['tps']:8.1f} {cells[b]['ratio_to_plain']:4.2f}x K{cells[b]['mean_k']:3.1f}" if b in cells
                else f"{'':18}" for b in sizes))
        lines.append(f"{CONTROL}: plain decoding measured twice in the same turns; its ratio is this run's noise")
    return "\n".join(lines + notes + distributed.report_lines(report))


def plot_report(report: dict, out: Path) -> None:
    """Two panels as PNG: acceptance by draft position per method, and tokens/s
    per method and temperature beside plain decoding and the bandwidth bound."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    temps = sorted({r["temp"] for r in rows})
    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, (acc, speed) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1, 1.4]})
    for r in rows:
        rates = r["acceptance_by_position"]
        if rates and r["temp"] == temps[0]:
            acc.plot(range(1, len(rates) + 1), rates, marker="o", label=r["name"].removeprefix("mlx-spec "))
    acc.set(xlabel="draft position", ylabel="P(accepted | earlier accepted)", ylim=(0, 1.02),
            title=f"Acceptance by position (temperature {temps[0]:g})")
    acc.grid(alpha=0.3)
    if acc.lines:
        acc.legend(fontsize=8)
    width = 0.8 / len(temps)
    for i, temp in enumerate(temps):
        tps = {r["name"]: r["decode_tps"] for r in rows if r["temp"] == temp}
        speed.bar([j + i * width for j in range(len(names))], [tps.get(n, 0) for n in names], width,
                  label=f"temperature {temp:g}")
    if report["bound_tps"]:
        speed.axhline(report["bound_tps"], color="black", linestyle="--", linewidth=1,
                      label=f"plain decoding's bandwidth bound ({report['bound_tps']:.0f} tok/s)")
    speed.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
    labels = ["plain" if n == PLAIN else n.removeprefix("mlx-spec ") for n in names]
    speed.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    speed.set(ylabel="decode tokens/s (median)", title=f"{report['model']}: decoding speed")
    speed.set_ylim(0, max(report["bound_tps"] or 0, *(r["decode_tps"] for r in rows)) * 1.15)
    speed.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    plt.close(fig)
