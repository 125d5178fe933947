"""One target split over several processes: `mlx.launch -n N ... mlx-spec generate --shard tensor|pipeline`.

Every rank runs the same decoding loop (SPMD): the same drafter, replicated (a drafter is small, and one
that reads the target's features gets them identical on every rank), the same policy, the same random
stream; only the target's forward is split.

- tensor: each rank holds its share of every layer's attention heads (and of their KV cache) and of its
  MLP's columns; an all_sum after the output and down projections (mlx-lm's sharding, its own `shard()`
  for mlx-lm's families). The sum runs in another order than one process's matmul: logits agree with the
  unsharded run's to rounding, not bit for bit, so greedy output is the same unless two logits tie within it.
- pipeline: each rank runs a contiguous stage of the layers (and holds their cache), handing the hidden
  states on to the next; one all_gather at the end gives every rank the last stage's output and the
  states the drafter reads. No sum is reordered: logits are bit-identical to one process's.

What must agree is checked, not assumed: at the start the ranks compare what they run (mlx and mlx-spec
versions, mode), then the target's checkpoint files (config, tensor names, places and first bytes: no
weight is read before the split, after which each rank reads its share alone) and the drafter, then
each generation's request and random state, and each round's tokens; a difference is one error naming
the rank. The policy's choices (K, plain rounds) follow measured times, which differ between ranks: every
rank records rank 0's. A rank that dies ends the others' next collective at once (but where MLX's ring
backend loses the error of a forward queued ahead); one that hangs, or such a loss, is caught by a
watchdog (no forward for `--shard-timeout` seconds); either way every rank stops with one line on stderr.
Only rank 0 prints; the other ranks' stderr passes their errors alone.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import itertools
import math
import os
import re
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlx_spec import __version__
from mlx_spec.errors import UserError

MODES = ("tensor", "pipeline")
TIMEOUT = 120.0  # seconds a rank waits for the next forward (a prompt chunk of a large model takes a while)
DRAFTS_OWN_LAYERS = ("layerskip", "skip")  # drafters running the target's own layers: tensor mode only


@dataclass
class _Run:
    group: mx.distributed.Group
    mode: str
    timeout: float
    stderr: int  # the real stderr (fd 2 is the filter's pipe)
    deadline: float = math.inf  # when the watchdog gives up on the other ranks
    seed: int = 0  # the random seed the ranks agreed on
    filter: threading.Thread | None = None  # passing fd 2 on (`_filter_stderr`)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()


_RUN: _Run | None = None


def current() -> _Run | None:
    """The run under --shard (None: one process)."""
    return _RUN


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`--shard` and `--shard-timeout` for a command that runs under mlx.launch."""
    p.add_argument("--shard", choices=MODES, default=None,
                   help="under mlx.launch: split the target over the processes, by attention heads and MLP "
                        "columns (tensor) or by layers (pipeline)")
    p.add_argument("--shard-timeout", type=float, default=TIMEOUT, metavar="SECONDS",
                   help=f"with --shard: end the run when no forward has started for this long "
                        f"(another rank died or hangs; default {TIMEOUT:g})")


def active() -> bool:
    return _RUN is not None


def leading() -> bool:
    """Whether this process writes the run's output: rank 0, or a process alone."""
    return _RUN is None or _RUN.rank == 0


def start(mode: str, timeout: float = TIMEOUT) -> None:
    """Join the run mlx.launch started: the ranks agree on what they run and on a random seed; from now on
    only rank 0 prints, and a lost or silent rank ends this one with one line."""
    global _RUN
    if mode not in MODES:
        raise UserError(f"--shard must be one of {', '.join(MODES)}, got '{mode}'")
    if not (math.isfinite(timeout) and timeout > 0):
        raise UserError(f"--shard-timeout must be a positive number of seconds, got {timeout}")
    group = mx.distributed.init()
    if group.size() < 2:
        raise UserError(f"--shard {mode}: this process is alone; run it under mlx.launch -n N (N >= 2), "
                        "e.g. mlx.launch -n 2 --backend ring mlx-spec generate ... --shard " + mode)
    _RUN = _Run(group, mode, timeout, os.dup(2))
    if not os.environ.get("MLX_RING_VERBOSE"):  # (asked for the backend's own account of its sockets)
        _RUN.filter = _filter_stderr(_RUN.rank, _RUN.stderr)
        atexit.register(_close_filter)
    if _RUN.rank:
        sys.stdout = open(os.devnull, "w")
    sys.excepthook = _excepthook
    threading.Thread(target=_watch, daemon=True).start()
    differ = differing(f"{mode} mlx {mx.__version__} mlx-spec {__version__}".encode())
    if differ:
        raise UserError(f"--shard {mode}: rank {differ[0]} runs another mode or another version of mlx or mlx-spec "
                        "than rank 0: every rank must run the same command and versions")
    seed = np.frombuffer(os.urandom(4), dtype=np.int32) & 0x7FFFFFFF
    _RUN.seed = int(_from_rank0(mx.array(seed)).item())
    seed_thread()  # --seed, where given, sets it again


def seed_thread() -> None:
    """The random state the ranks agreed on, on this thread (MLX keeps one per thread): every thread that
    samples under --shard calls it first. Nothing without --shard."""
    if _RUN is not None:
        mx.random.seed(_RUN.seed)


def check_drafter(drafter, spec: str) -> None:
    """Every rank built the same drafter (`--drafter spec`), and the mode lets it draft."""
    if _RUN is None or drafter is None:
        return
    if _RUN.mode == "pipeline" and drafter.kind in DRAFTS_OWN_LAYERS:
        raise UserError(f"--drafter {spec} drafts with the target's own layers, which --shard pipeline spreads "
                        "over the ranks: use --shard tensor")
    target = getattr(drafter, "target", None)
    modules = [m for m in vars(drafter).values() if isinstance(m, nn.Module) and m is not target]
    differ = differing(_fingerprint(f"{drafter.kind} {spec}", *modules))
    if differ:
        raise UserError(f"--drafter {spec}: rank {differ[0]} built another drafter than rank 0: "
                        "every rank must load the same one")


def lockstep(events: Iterator, request: tuple) -> Iterator:
    """A generation's events, checked on every rank: the same request and random state at the start, the
    same tokens every round (a drift would otherwise show as a hang or a wrong answer). A round's check
    is read the round after, so that it holds nothing up."""
    if _RUN is None:
        yield from events
        return
    state = np.array(mx.random.state[0]).tobytes()
    differ = differing(repr(request).encode() + state)
    if differ:
        raise UserError(f"rank {differ[0]} was asked for another generation than rank 0 (prompt, sampling, "
                        "--max-tokens or --seed): every rank must run the same command")
    seen, pending = 0, None
    for event in itertools.chain(events, [None]):
        differ = _differ(pending) if pending is not None else []
        if differ:
            raise UserError(f"rank {differ[0]}: {PARTED}")
        if event is None:
            _RUN.deadline = math.inf  # between generations (a chat's turns) a rank waits for its input at leisure
            return
        seen = zlib.crc32(np.array(event.tokens, dtype=np.int64).tobytes(), seen)
        beat()
        pending = _gathered(seen.to_bytes(4, "little"))
        mx.async_eval(pending)
        yield event


def from_rank0(data: bytes) -> bytes:
    """Rank 0's `data` on every rank (what the others pass is not read); `data` itself without --shard."""
    if _RUN is None:
        return data
    beat()
    n = int(_from_rank0(mx.array([len(data)], dtype=mx.int32)).item())
    if n == 0:
        return b""
    mine = mx.array(np.frombuffer(data, dtype=np.uint8)) if _RUN.rank == 0 else mx.zeros((n,), mx.uint8)
    return bytes(np.array(_from_rank0(mine)))


def heartbeat() -> float | None:
    """How long rank 0 may wait for work before it tells the other ranks it is still there (their watchdog
    waits `--shard-timeout`); None without --shard: as long as it takes."""
    return None if _RUN is None else _RUN.timeout / 4


def check(error: BaseException) -> None:
    """Under --shard, a lost rank met on any thread (the backend's error) ends this one with the run's line,
    as it would uncaught on the main thread."""
    if _RUN is not None and _lost(error):
        _end(LOST)


def parted() -> None:
    """This rank's tokens are not rank 0's: it stops with one line (the others, with the connection lost)."""
    _end(PARTED)


def rank0_times(*seconds: float) -> list[float]:
    """Times of a round as rank 0 measured them, on every rank (so that every rank's policy chooses the
    same K); as they are without --shard."""
    if _RUN is None:
        return list(seconds)
    beat()
    return _from_rank0(mx.array(seconds, dtype=mx.float32)).tolist()


def describe() -> dict | None:
    """The run's shape for a report: mode and ranks (None without --shard)."""
    return None if _RUN is None else {"mode": _RUN.mode, "ranks": _RUN.size}


def round_costs(model, metrics, drafter) -> dict:
    """What one round of a benchmark row cost in communication: its target forward's collectives over
    the mean verified length (timed alone, as the forward runs them, one after another), and with a
    drafter the policy's agreement on times; beside the whole round (drafting and verification)."""
    steps = max(metrics.steps, 1)
    S = max(1, round(1 + metrics.drafted / steps))
    comm = _forward_comm(model, S, len(drafter.capture) if drafter is not None else 0)
    if drafter is not None:
        comm += _timed(lambda: _from_rank0(mx.zeros((1,))))
    round_s = (metrics.draft_time + metrics.verify_time) / steps
    return {"verified_tokens": S, "comm_ms_per_round": 1e3 * comm, "round_ms": 1e3 * round_s,
            "comm_share": comm / round_s if round_s else 0.0}


def report_lines(report: dict) -> list[str]:
    """The benchmark table's lines on communication, where the run was sharded."""
    shard = report.get("shard")
    if not shard:
        return []
    lines = ["", f"sharded over {shard['ranks']} processes ({shard['mode']} parallel): communication a round "
                 "(the forward's collectives over the tokens verified, timed alone) beside the whole round:"]
    for r in report["rows"]:
        c = r["shard"]
        lines.append(f"{r['name']:30} {r['temp']:4.1f} {c['comm_ms_per_round']:7.2f} ms of {c['round_ms']:7.2f} ms "
                     f"({c['comm_share']:.0%}), {c['verified_tokens']} tokens verified, tau {r['tau']:.2f}")
    return lines


# The ranks agreeing.

def differing(data: bytes) -> list[int]:
    """The ranks whose `data` differs from rank 0's, with no deadline: the ranks load their weights and
    drafters at their own pace before they compare them."""
    _RUN.deadline = math.inf  # the next forward sets it again
    return _differ(_gathered(data))


def _gathered(data: bytes) -> mx.array:
    """Every rank's digest of `data`, `[N * 32]` (lazy)."""
    digest = np.frombuffer(hashlib.sha256(data).digest(), dtype=np.uint8)
    return mx.distributed.all_gather(mx.array(digest), group=_RUN.group)


def _differ(gathered: mx.array) -> list[int]:
    every = np.array(gathered).reshape(_RUN.size, -1)
    return [r for r in range(1, _RUN.size) if not np.array_equal(every[r], every[0])]


def _from_rank0(x: mx.array) -> mx.array:
    """Rank 0's `x` on every rank (the others add zeros: exact)."""
    out = mx.distributed.all_sum(x if _RUN.rank == 0 else mx.zeros_like(x), group=_RUN.group)
    mx.eval(out)
    return out


def _fingerprint(text: str, *modules) -> bytes:
    """`text` and the modules' weights (a drafter's, loaded whole): each one's name, shape, dtype and first
    values (a checkpoint of the same shapes but other weights differs there)."""
    parts = [text.encode()]
    for module in modules:
        weights = sorted(tree_flatten(module.parameters()), key=lambda kv: kv[0])
        heads = [w.reshape(-1)[:16] for _, w in weights]
        heads = [h.astype(mx.float32) if mx.issubdtype(h.dtype, mx.floating) else h for h in heads]
        mx.eval(heads)
        for (name, w), head in zip(weights, heads):
            parts.append(f"{name} {w.shape} {w.dtype}".encode() + np.array(head).tobytes())
    return b"\n".join(parts)


# Communication, timed alone (the benchmark's figures).

def _timed(run, repeats: int = 7) -> float:
    """The least seconds of `run()` evaluated, over `repeats` after one that warms up: what the link costs,
    without the waits of a rank that the operating system ran late."""
    times = []
    for _ in range(repeats + 1):
        tic = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - tic)
    return min(times[1:])


def _forward_comm(model, S: int, captured: int) -> float:
    """Seconds the collectives of one forward over S tokens take, one after another as the forward runs them:
    tensor, an all_sum of `[1, S, H]` per sharded projection; pipeline, the hand-over from stage to stage,
    then the all_gather of the last output and the `captured` states."""
    from mlx.nn.layers.distributed import QuantizedShardedToAllLinear, ShardedToAllLinear

    g, rank, size = _RUN.group, _RUN.rank, _RUN.size
    x = mx.zeros((1, S, model.args.hidden_size))
    if _RUN.mode == "tensor":
        sums = sum(isinstance(m, (ShardedToAllLinear, QuantizedShardedToAllLinear)) or
                   getattr(m, "sharding_group", None) is not None for _, m in model.named_modules())

        def run():
            y = x
            for _ in range(sums):
                y = mx.distributed.all_sum(y, group=g)
            return y
    else:
        def run():
            y = mx.distributed.recv_like(x, rank - 1, group=g) if rank > 0 else x
            y = mx.distributed.send(y, rank + 1, group=g) if rank < size - 1 else y
            return mx.distributed.all_gather(mx.stack([y] * (captured + 1)), group=g)
    beat()
    return _timed(run)


# Faults: a watchdog, and one line on stderr.

def beat() -> None:
    """The run goes on: the watchdog waits `timeout` seconds from now."""
    _RUN.deadline = time.monotonic() + _RUN.timeout


def _watch() -> None:
    while True:
        time.sleep(min(_RUN.timeout / 4, 1.0))
        if time.monotonic() > _RUN.deadline:
            _end(f"no word from the other ranks for {_RUN.timeout:g} s (one died or hangs; --shard-timeout): "
                 "the run stops")


LOST = "lost the connection to another rank (it ended, or the link between them went down): the run stops"
PARTED = "its tokens parted from rank 0's: the ranks no longer decode alike"


def _lost(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and str(error).startswith("[ring]")


def _excepthook(kind, error, tb) -> None:
    if _lost(error):
        _end(LOST)
    sys.__excepthook__(kind, error, tb)  # (rank 0 shows it; the others' stderr passes errors alone)
    _end(f"{kind.__name__}: {error}" if _RUN.rank else None)


def _end(message: str | None) -> None:
    """Stop this rank now, with `message` as its one line (the collectives of a run that lost a rank
    never return, and neither would the interpreter's exit)."""
    sys.stdout.flush()
    sys.stderr.flush()
    _close_filter()
    if message is not None:
        os.write(_RUN.stderr, f"mlx-spec: error: rank {_RUN.rank}: {message}\n".encode())
    os._exit(1)


_LINE_END = re.compile(rb"(?<=[\r\n])")  # (a progress bar's \r too)
_ERROR = b"mlx-spec: error: "
# What MLX's ring backend writes of a failed socket call. It writes a message in pieces ("[ring]", " Sending to
# socket", " 4", " failed with errno", " 104") from several threads, so a line can hold pieces of two of them,
# or the last number of one alone.
_RING = re.compile(rb"\[ring\]|failed with errno|^ \d+\s*$")


def passed(line: bytes, rank: int) -> bytes | None:
    """What rank `rank`'s filtered stderr passes of `line`: none of the ring backend's words, on ranks but 0
    only error lines, each naming its rank."""
    at = line.find(_ERROR)
    if at > 0 and _RING.search(line[:at]):  # the ring's pieces ahead of an error line
        line, at = line[at:], 0
    if at < 0 and _RING.search(line):
        return None
    if rank:
        return _ERROR + f"rank {rank}: ".encode() + line[len(_ERROR):] if at == 0 else None
    return line


def _filter_stderr(rank: int, real: int) -> threading.Thread:
    """fd 2 through a filter to `real`: the ring backend's lines about each failed socket call go (the
    run's own line says what happened), and on the ranks but 0 only error lines pass, each naming its rank."""
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)

    def forward() -> None:
        rest = b""
        while chunk := os.read(read, 1 << 16):
            *lines, rest = _LINE_END.split(rest + chunk)
            for line in filter(None, (passed(line, rank) for line in lines)):
                os.write(real, line)
        os.close(read)

    thread = threading.Thread(target=forward, daemon=True)
    thread.start()
    return thread


def _close_filter() -> None:
    """fd 2 is the real stderr again, once the filter has passed on what it holds."""
    thread, _RUN.filter = _RUN.filter, None
    if thread is None:
        return
    sys.stderr.flush()
    os.dup2(_RUN.stderr, 2)  # the pipe's last writer closes: the filter reads to its end
    thread.join(timeout=2.0)
