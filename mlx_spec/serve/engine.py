"""The engine of `mlx-spec serve`: continuous batching on the one MLX thread.

Requests join the batch between rounds and leave as they finish, each row with
its own drafter session; every row of a round is one forward of the target.
The waiting queue is bounded (503 when full) and each request has a deadline,
after which it ends with what it has (`finish_reason` "length",
`mlx_spec.timed_out`); a request whose client went away ends at the next round.
A `seed` seeds the sampler when its request joins: reproducible when it runs
alone. A row that fails ends alone with an error; the batch goes on where the
decoder and drafter are left consistent, and starts anew where they are not.
Under --shard every rank runs an engine, rank 0 planning each round for all.
"""

from __future__ import annotations

import bisect
import json
import math
import queue
import sys
import threading
import time
import zlib
from dataclasses import dataclass

import mlx.core as mx

from mlx_spec import distributed
from mlx_spec.cache import RecurrentCache
from mlx_spec.metrics import Metrics, TokenLogprob
from mlx_spec.prefix import PrefixCache
from mlx_spec.sampling import SamplingParams
from mlx_spec.serve.openai import BadRequest, Request
from mlx_spec.serve.prometheus import ServerStats
from mlx_spec.worker import Worker


class InFlight:
    """A request being decoded: its text so far, stop strings, log-probabilities, stats."""

    def __init__(self, request: Request, tokenizer):
        self.request = request
        self.tokenizer = tokenizer
        self.detok = tokenizer.detokenizer
        self.text = ""
        self.sent = 0  # characters of `text` sent
        self.tokens = 0
        self.logprobs: list[tuple[int, TokenLogprob]] = []  # (where its text starts in `text`, the token's)
        self.given = 0  # entries of `logprobs` sent
        self.metrics = Metrics()
        self.cached = 0  # prompt tokens the prompt cache held
        self.started = time.perf_counter()  # when its decoding began (after its prefill)

    def feed(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> str | None:
        """Add tokens (with their log-probabilities, if asked for); the finish reason when this request is done."""
        for i, token in enumerate(tokens):
            if token in self.tokenizer.eos_token_ids:
                return "stop"
            self.tokens += 1
            if logprobs is not None:
                self.logprobs.append((len(self.text), logprobs[i]))
            self.detok.add_token(token)
            last = self.tokens >= self.request.max_tokens
            if last:
                self.detok.finalize()
            self.text += self.detok.last_segment
            hit = min((i for i in (self.text.find(s) for s in self.request.stop) if i >= 0), default=-1)
            if hit >= 0:
                self.text = self.text[:hit]
                return "stop"
            if last:
                return "length"
        return None

    def flush(self, final: bool) -> None:
        """Send the text not sent yet, with its tokens' log-probabilities; while going, hold back
        what might begin a stop string."""
        hold = 0 if final else max((len(s) - 1 for s in self.request.stop), default=0)
        end = max(self.sent, len(self.text) - hold)
        given = len(self.logprobs) if final else bisect.bisect_left(self.logprobs, end, key=lambda e: e[0])
        if end > self.sent or given > self.given:
            self.request.out.put(("text", self.text[self.sent : end], self.logprobs[self.given : given]))
            self.sent, self.given = end, given

    def finish(self, reason: str, timed_out: bool = False) -> None:
        self.flush(final=True)
        m = self.metrics
        self.request.out.put(("done", {
            "finish_reason": reason,
            "usage": {"prompt_tokens": len(self.request.prompt), "completion_tokens": self.tokens,
                      "total_tokens": len(self.request.prompt) + self.tokens,
                      "prompt_tokens_details": {"cached_tokens": self.cached}},
            "mlx_spec": {"tau": m.tau, "acceptance_by_position": m.acceptance_by_position,
                         "target_forwards": m.steps, "drafted_tokens": m.drafted, "accepted_tokens": m.accepted,
                         "timed_out": timed_out},
        }))




def log(message: str) -> None:
    print(f"mlx-spec serve: {message}", file=sys.stderr, flush=True)


def one_line(error: Exception) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0]


SHUTTING_DOWN = ("error", "the server is shutting down", 503)


class Discard:
    """Where the answers of a rank but 0 go under --shard: rank 0 sends them."""

    def put(self, message) -> None:
        pass


@dataclass
class Plan:
    """What rank 0's engine decided before a round, which every rank applies alike under --shard (the
    others decode rank 0's requests and end them where it does: a client gone and a deadline are its alone;
    the ends a row's own tokens make, every rank finds)."""
    joining: list[Request]
    ending: list[tuple[str, str, bool]]  # (request id, finish reason, timed out)
    stop: bool = False
    digest: int = 0  # of the tokens of every round so far: a rank that parted from rank 0 stops

    FIELDS = ("prompt", "max_tokens", "stop", "seed", "logprobs", "id")  # what decoding a request reads, with params

    def encode(self) -> bytes:
        joining = [{name: getattr(r, name) for name in self.FIELDS} | {"params": vars(r.params)} for r in self.joining]
        plan = {"joining": joining, "ending": self.ending, "stop": self.stop, "digest": self.digest}
        return json.dumps(plan).encode()

    @classmethod
    def decode(cls, data: bytes) -> Plan:
        plan = json.loads(data)
        joining = [Request(False, r["prompt"], SamplingParams(**r["params"]), r["max_tokens"], r["stop"], False,
                           r["seed"], math.inf, r["logprobs"], id=r["id"], out=Discard()) for r in plan["joining"]]
        return cls(joining, [tuple(e) for e in plan["ending"]], plan["stop"], plan["digest"])


class BatchEngine(Worker):
    """The MLX thread of the server: admits requests, steps the batch, answers. Under --shard every rank
    runs one, rank 0's planning each round for all (`Plan`)."""

    def __init__(self, model, tokenizer, drafter, max_batch: int, max_queue: int, width: int | None = None,
                 prompt_cache: PrefixCache | None = None, drafter_name: str = "none"):
        from mlx_spec.decoding import Decoder

        self.model, self.tokenizer, self.drafter = model, tokenizer, drafter  # one drafter: a row per request
        self.prompt_cache = prompt_cache
        self.stats = ServerStats(drafter_name)
        self.max_batch = max_batch
        self.waiting: queue.Queue = queue.Queue(max_queue)
        self.width = width  # exact verification: each row a forward of its own, this wide
        self.decoder = Decoder(model, width=width, keep_finished=True)  # a row leaves at `_end` (its cache kept)
        self.running: dict[str, InFlight] = {}
        self.stopping = False
        self.digest = 0  # `Plan.digest`
        self.lock = threading.Lock()  # no request is queued once the engine has stopped taking them
        super().__init__("mlx-serve")
        self.start()

    def submit(self, request: Request) -> None:
        with self.lock:
            if self.stopping:
                raise BadRequest("the server is shutting down", 503)
            try:
                self.waiting.put_nowait(request)
            except queue.Full:
                raise BadRequest("the server is busy: too many requests waiting, try again", 503) from None

    def stop(self) -> None:
        """End every request with a 503 and wait for the engine thread, which stops between rounds:
        a thread killed inside an MLX call at interpreter exit aborts the process."""
        with self.lock:
            self.stopping = True
        try:
            self.waiting.put_nowait(None)  # wakes an idle engine (a full queue: it is not waiting)
        except queue.Full:
            pass
        self.thread.join()

    def _plan(self) -> Plan:
        """The requests that join the batch now and the rows that end; rank 0's, under --shard."""
        if not distributed.leading():
            plan = Plan.decode(distributed.from_rank0(b""))
            if plan.digest != self.digest:
                distributed.parted()
            return plan
        joining = []
        while len(self.running) + len(joining) < self.max_batch and not self.stopping:
            try:  # (an idle engine under --shard says it is there now and then)
                request = self.waiting.get(block=not (self.running or joining), timeout=distributed.heartbeat())
            except queue.Empty:
                break
            if request is not None and not request.cancelled:
                joining.append(request)
        now = time.monotonic()
        ending = [(key, "cancelled", False) if flight.request.cancelled else (key, "length", True)
                  for key, flight in self.running.items() if flight.request.cancelled or now > flight.request.deadline]
        plan = Plan(joining, ending, self.stopping, self.digest)
        if distributed.active():
            distributed.from_rank0(plan.encode())
        return plan

    def _join(self, request: Request) -> None:
        try:
            if request.seed is not None:
                mx.random.seed(request.seed)
            flight = InFlight(request, self.tokenizer)
            tic = time.perf_counter()
            found = self.prompt_cache.lookup(request.prompt, self.model.make_cache) if self.prompt_cache else None
            self.decoder.add(request.id, request.prompt, request.params, request.max_tokens, self.drafter,
                             logprobs=request.logprobs, start=found[1:] if found else None)
            flight.cached = self.decoder.rows[-1].cached
            flight.started = time.perf_counter()
            self.stats.joined(len(request.prompt), flight.cached, flight.started - tic)
            self.running[request.id] = flight
            if self.prompt_cache and any(isinstance(c, RecurrentCache) for c in self.decoder.cache):
                self._keep(request.id)  # where the prompt ends: what the next turn contains whole
        except Exception as e:
            self._fail(request, e)

    def _keep(self, key: str) -> None:
        """Row `key`'s cache and drafter row into the prompt cache (a failure there costs only the entry)."""
        try:
            self.prompt_cache.store(*self.decoder.snapshot(key))
        except Exception as e:
            log(f"request {key}: its prompt cache entry was not kept ({one_line(e)})")

    def _end(self, key: str, reason: str, timed_out: bool = False) -> None:
        flight = self.running.pop(key)
        if any(r.key == key for r in self.decoder.rows):
            if self.prompt_cache is not None:
                self._keep(key)
            self.decoder.remove(key)
        self.stats.ended_with(reason, flight.tokens, time.perf_counter() - flight.started, flight.metrics)
        flight.finish(reason, timed_out)

    def _answer(self, key: str, event) -> None:
        flight = self.running[key]
        flight.metrics.add(event)
        reason = flight.feed(event.tokens, event.logprobs)
        if reason is not None:
            self._end(key, reason)
        else:
            flight.flush(final=False)

    def failed(self, error: Exception) -> None:
        # The batched step: one forward for every row, one cache, the drafters' shared state.
        # Whose fault it was cannot be told, nor what it left behind: every row fails, the batch starts anew.
        self._reset(error)

    def finished(self) -> None:
        for key in list(self.running):
            self.running.pop(key).request.out.put(SHUTTING_DOWN)
        while not self.waiting.empty():
            request = self.waiting.get_nowait()
            if request is not None:
                request.out.put(SHUTTING_DOWN)

    def turn(self) -> bool:
        """One round; whether the engine stops instead."""
        plan = self._plan()
        if plan.stop:
            for request in plan.joining:
                request.out.put(SHUTTING_DOWN)
            return True
        for request in plan.joining:
            self._join(request)
        for key, reason, timed_out in plan.ending:
            if key in self.running:
                self._guarded(key, self._end, reason, timed_out)
        if self.running:
            for key, event in self.decoder.step().items():
                if distributed.active():
                    self.digest = zlib.crc32(f"{key} {event.tokens}".encode(), self.digest)
                self._guarded(key, self._answer, event)
        return False

    def _guarded(self, key: str, work, *args) -> None:
        """`work(key, *args)`: what it raises ends that row alone."""
        request = self.running[key].request
        try:
            work(key, *args)
        except Exception as e:
            self._fail(request, e)

    def _fail(self, request: Request, error: Exception) -> None:
        """`request` ends with a 500 error; the batch goes on without its row where the decoder
        and drafter are left consistent, and starts anew where they are not."""
        log(f"request {request.id} failed: {one_line(error)}")
        self.running.pop(request.id, None)
        self.stats.ended_with("error")
        request.out.put(("error", f"the server failed on this request ({one_line(error)})", 500))
        try:
            if any(r.key == request.id for r in self.decoder.rows):
                self.decoder.remove(request.id)
            intact = self._intact()
        except Exception:
            intact = False
        if not intact:
            self._reset(error)

    def _intact(self) -> bool:
        """Whether the decoder's rows, its cache's and the drafter's agree; a row that failed to
        join may have left the drafter a last row of its own, dropped here."""
        n, drafter = len(self.decoder.rows), self.drafter
        if drafter is not None:
            if drafter.rows > max(n, 1):
                drafter.remove(drafter.rows - 1)
            drafter.bind(self.decoder.cache, self.decoder.width)
        return ((n == 0 or all(c.rows == n for c in self.decoder.cache))
                and (drafter is None or drafter.rows == n or (n == 0 and drafter.rows <= 1)))

    def _reset(self, error: Exception) -> None:
        """Every request in flight fails; a new batch and drafter session serve the next ones."""
        log(f"the batch failed, {len(self.running)} requests with it: {one_line(error)}")
        for key in list(self.running):
            message = f"the server failed on this batch ({one_line(error)})"
            self.running.pop(key).request.out.put(("error", message, 500))
            self.stats.ended_with("error")
        self.decoder = type(self.decoder)(self.model, width=self.width, keep_finished=True)
        self.drafter = self.drafter.new_session() if self.drafter is not None else None
