"""What `mlx-spec bench` measures of the machine and the target: memory bandwidth and plain
decoding's bound, the verification cost curve, a round's host work, a hybrid's rollback, bytes read."""

from __future__ import annotations

import time

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_spec.bench.report import median
from mlx_spec.cache import trim_cache
from mlx_spec.decoding import Decoder
from mlx_spec.drafters.base import Draft, RowStates
from mlx_spec.sampling import SamplingParams


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


def copy(held: list) -> list:
    """A one-row cache's copy (`read_prompt`'s reading of a prompt, which every measurement goes on from)."""
    return [c.row(0) for c in held]


def rollback_cost(model, prompt: list[int], held: list, k: int = 4, repeats: int = 30) -> dict | None:
    """What rolling a hybrid target's linear-attention layers back costs a round: after a verification
    of k + 1 tokens, the next step with a cut to about half of them first (it replays the recurrence
    for the kept tokens) against the next step with no cut, a plain step; the two kinds of round
    interleaved on one cache (after `held`, the prompt read). None for a target with no linear-attention layers."""
    from mlx_spec.cache import RecurrentCache, cut_cache

    if not any(isinstance(c, RecurrentCache) for c in held):
        return None
    cache = copy(held)
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
    with_cut, plain = median(steps[True]), median(steps[False])
    return {"replayed_tokens": k // 2 + 1, "rollback_ms": 1e3 * (with_cut - plain), "plain_step_ms": 1e3 * plain}


def verification_curve(model, prompt: list[int], held: list, sizes: list[int], most: int, repeats: int = 5) -> dict:
    """What a target forward of S tokens a row costs, S = 1..most + 1, at each batch size (ms, the median
    of `repeats`, after the prompt's context `held`, each row a copy): the curve the policy weighs drafts
    against. One token to two is a step on a GPU (a matrix-vector product becomes a matrix product), flat
    after it; on a CPU it rises."""
    out = {}
    for B in sizes:
        cache = copy(held)
        for _ in range(B - 1):
            for c, row in zip(cache, copy(held)):
                c.extend(row)
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
            times[S] = 1e3 * median(spent)
        out[B] = times
    return out


class FreeDrafter(RowStates):
    """Drafts k copies of token 0 and costs nothing: a round's work beside its forwards (`round_overhead`)."""

    def _session(self) -> "FreeDrafter":
        return FreeDrafter()

    def propose(self, contexts: list[list[int]], ks: list[int], params: list[SamplingParams]) -> list[Draft]:
        return Draft.rows(mx.zeros((len(ks), max(ks)), dtype=mx.int32), None, ks)


def round_overhead(model, prompt: list[int], held: list, k: int = 4, rounds: int = 30) -> dict:
    """The host's work in one speculative round of one sequence (policy, inputs, acceptance, cache cuts,
    commits, events): a round whose drafter costs nothing against the bare verification forward over
    the same k + 1 tokens, evaluated and trimmed back; the two interleaved, medians of `rounds` (each
    going on from `held`, the prompt read)."""
    decoder = Decoder(model, num_draft=k, cache=copy(held))
    decoder.add(0, prompt, SamplingParams(), (k + 1) * (rounds + 2), FreeDrafter())
    cache = copy(held)
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
    round_s, forward_s = median(times["round"]), median(times["forward"])
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
