"""The round, written once, for a batch of one or many.

    K per row      <- the policy (acceptance, measured costs)
    drafts         <- each drafter, for all its rows in one forward
    verification   <- one target forward over every row's draft (padded)
    accept         <- built with the verification; the round's one wait on the device reads every verdict
    cut            <- each row's cache keeps exactly what it accepted
    commit         <- each drafter hears its rows' accepted tokens and features
    events         <- one `StepEvent` per row (log-probabilities for the rows that asked)

`generate`, the chat and the benchmark run a batch of one (`speculative_steps`); the server
the same rounds with more rows, joining and leaving between rounds. Exact: greedy output is
plain greedy decoding's, token for token; sampled output is distributed as the target's. With
a `width` (`--exact`, `mlx_spec.exact`), every forward of a row is that many tokens wide, plain
rounds too, and a batch's rows run one forward each: bit for bit on any backend whose kernels
the probe passed."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import mlx.core as mx

from mlx_spec import exact, host, tree
from mlx_spec.attention import TreeMask
from mlx_spec.cache import KVCache, alone, cut_cache, keep_cache, rejoin, rewound, trim_cache
from mlx_spec.drafters.base import EMPTY, Draft, Drafter, draw_rows
from mlx_spec.errors import UserError
from mlx_spec.logprobs import gather, read as read_logprobs
from mlx_spec.metrics import StepEvent
from mlx_spec.policy import Policy
from mlx_spec.sampling import SamplingParams, verdict_arrays, verdicts

PREFILL_STEP = 512


def prefill(model, tokens: Sequence[int], cache: list[KVCache], capture: tuple[int, ...] = (),
            consume: Callable[[int, tuple[mx.array, ...]], None] | None = None) -> None:
    """Run `tokens` through the target to fill a one-row cache; no logits are evaluated. With `capture`,
    `consume(end, hidden)` receives each chunk's hidden states (`[1, chunk, H]` per index), `end` being
    where the chunk stops in `tokens`."""
    ids = mx.array(tokens)
    for start in range(0, len(tokens), PREFILL_STEP):
        _, hidden = model(ids[None, start : start + PREFILL_STEP], cache, capture=capture)
        mx.eval([c.state for c in cache], hidden)
        if consume is not None:
            consume(min(start + PREFILL_STEP, len(tokens)), hidden)


@dataclass
class Row:
    """One sequence of the batch."""

    key: object
    context: list[int]
    params: SamplingParams
    max_tokens: int
    drafter: Drafter | None
    slot: int = 0  # its row in the drafter
    produced: int = 0
    logprobs: int | None = None  # report each token's log-probability and this many alternatives
    cached: int = 0  # prompt tokens whose keys and values it started with (not read by its prefill)
    unread: int = 0  # tokens its drafter, one that runs a model, has not read: plain rounds' since it drafted


class Decoder:
    """Continuous batching over one target: `add` a sequence (its prompt is read alone, then it joins),
    `step` runs one round for every row and returns each row's event; a row leaves once it has produced
    `max_tokens` (with `keep_finished`, it stays, holding its cache for a next turn). `width`: every
    target forward of a row that many tokens wide (exact verification, `mlx_spec.exact`)."""

    def __init__(self, model, k_max: int | None = None, num_draft: int | None = None, acceptance: str = "exact",
                 cache: list[KVCache] | None = None, keep_finished: bool = False, policy: Policy | None = None,
                 width: int | None = None):
        if acceptance not in ("exact", "typical"):
            raise UserError(f"--acceptance must be exact or typical, got '{acceptance}'")
        k_max = exact.most(k_max, num_draft, width)
        self.model, self.acceptance, self.keep_finished, self.width = model, acceptance, keep_finished, width
        self.cache = cache if cache is not None else model.make_cache(rows=0)
        self.continues = cache is not None  # the first row continues a one-row cache it was given (a chat's)
        self.rows: list[Row] = []
        self.policy = policy or Policy(k_max, num_draft)
        self.queued: tuple | None = None  # plain rounds: the next tokens (and features), already in the works

    @property
    def done(self) -> bool:
        return all(r.produced >= r.max_tokens for r in self.rows)

    def add(self, key, prompt: list[int], params: SamplingParams, max_tokens: int,
            drafter: Drafter | None = None, logprobs: int | None = None,
            start: tuple[list, Drafter | None] | None = None) -> None:
        """A new row. With a kept cache, the first row keeps what the drafter's own state still matches (a chat's
        earlier turns), and a drafter's one row is continued; with `logprobs`, its events carry log-probabilities.
        `start`: a one-row cache holding the prompt's first tokens and the drafter's one-row session that
        followed them (`snapshot`'s, from the server's prompt cache; None: a new one), the prompt read from there."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if not 0 <= min(prompt) <= max(prompt) < self.model.args.vocab_size:  # an embedding read out of its table
            raise ValueError(f"a prompt token is outside the vocabulary (0..{self.model.args.vocab_size - 1})")
        if drafter is not None and drafter.one_row and self.rows:
            raise UserError(f"the {drafter.kind} drafter drafts into the target's own cache: one sequence at a time")
        self._unqueue()
        single, session = start if start is not None else (None, None)
        if single is None:
            single = self.cache if self.continues else self.model.make_cache()
        cached = single[0].lengths[0] if start is not None or self.continues else 0
        if cached >= len(prompt):
            raise ValueError(f"the cache holds {cached} tokens, the prompt has only {len(prompt)}")
        context = list(prompt)
        capture, consume, own = (), None, drafter
        if drafter is not None:
            users = sum(r.drafter is drafter for r in self.rows)
            if drafter.rows != users and not (users == 0 and drafter.rows == 1):
                raise ValueError("a drafter's rows belong to one decoder")
            # A drafter that runs a model reads the prompt now, with the target's prefill; a row joining others
            # does so in a drafter of its own, then joins them (in a round, every row's forward would be padded
            # to its prompt). A stored session joins as it is.
            if session is not None and drafter.rows == users:
                own = session
            else:
                own = drafter.new_session() if users and drafter.costly else drafter
                if own is not drafter or drafter.rows == users:
                    own.add()
            slot = own.rows - 1
            own.bind(single, self.width)
            kept = own.restart(slot, context, cached)
            single = rewound(single, kept, self.model.make_cache)  # anew where a linear-attention layer cannot go back
            if single[0].lengths[0] < kept:
                kept = own.restart(slot, context, 0)
            cached, capture = kept, own.capture
            if capture:  # a drafter reading the target's features gets the prompt's as they are computed
                def consume(end, hidden):
                    own.commit(slot, context[: cached + end + 1], hidden)
        prefill(self.model, prompt[cached:-1], single, capture, consume)
        if drafter is not None and drafter.costly:  # what a token read costs it (as it reads after plain rounds)
            self._catch_up(own, [context])
        if own is not drafter:
            drafter.join(own)
        if not self.rows:
            self.cache = single  # the first row's cache is the batch's
        elif single is not self.cache:
            for batch, one in zip(self.cache, single):
                batch.extend(one)
        self.continues = False
        if drafter is not None:
            drafter.bind(self.cache, self.width)
        self.rows.append(Row(key, context, params, max_tokens, drafter, drafter.rows - 1 if drafter else 0,
                             logprobs=logprobs, cached=cached))

    def snapshot(self, key) -> tuple[list[int], list, Drafter | None]:
        """Row `key` as it stands: the tokens its cache holds, a copy of that cache as one row of its own,
        and its drafter's row as a one-row session (None: no drafter, or one that cannot hand its row
        over); what `add(start=...)` takes for a later prompt that begins with those tokens."""
        self._unqueue()
        b = next(i for i, r in enumerate(self.rows) if r.key == key)
        row, drafter = self.rows[b], self.rows[b].drafter
        n = self.cache[0].lengths[b]
        if drafter is not None and drafter.costly:  # it reads the features it was sent, to hand them over read
            drafter.catch_up([r.context for r in sorted(self.rows, key=lambda r: r.slot) if r.drafter is drafter])
        session = drafter.split(row.slot) if drafter is not None else None
        return row.context[:n], [c.row(b) for c in self.cache], session

    def remove(self, key) -> None:
        self._unqueue()
        b = next(i for i, r in enumerate(self.rows) if r.key == key)
        row = self.rows.pop(b)
        for c in self.cache:
            c.remove(b)
        if row.drafter is not None:
            row.drafter.remove(row.slot)
            for r in [r for r in self.rows if r.drafter is row.drafter and r.slot > row.slot]:
                r.slot -= 1
        self.policy.forget(key)

    def step(self) -> dict[object, StepEvent]:
        """One round for every row still decoding."""
        rows = self.rows
        guesses = {b: r.drafter.guess(r.slot, r.context) for b, r in enumerate(rows) if r.drafter and r.drafter.guesses}
        empty = [guesses.get(b, 0) is None for b in range(len(rows))]  # its drafter finds nothing to draft
        if self.queued is not None:  # a round queued is taken (its forward is under way), as the choice that queued
            return self._plain_step(guesses, empty, self.policy.last)  # it said: one made on later news waits a round
        ks = self.policy.choose([r.key for r in rows], [r.drafter for r in rows],  # a round adds one token
                                [max(r.max_tokens - r.produced - 1, 0) for r in rows], empty, [r.unread for r in rows])
        why = self.policy.last
        if not any(ks):
            return self._plain_step(guesses, empty, why)
        self._unqueue()
        starts = list(self.cache[0].lengths)  # each row's pending token goes here (self-speculation drafts past it)
        groups = [(d, sorted((r.slot, b) for b, r in enumerate(rows) if r.drafter is d))  # each drafter, its rows
                  for d in {id(r.drafter): r.drafter for r in rows if r.drafter is not None}.values()]  # by slot
        groups = [(d, m) for d, m in groups if max(ks[b] for _, b in m)]  # the others: a plain round for their rows
        for drafter, members in groups:
            if any(rows[b].unread for _, b in members):  # plain rounds came before: it reads what they committed first
                self._catch_up(drafter, [rows[b].context for _, b in members])
        tic = time.perf_counter()
        drafts: list[Draft] = [EMPTY()] * len(rows)
        for drafter, members in groups:
            proposed = drafter.propose([rows[b].context for _, b in members], [ks[b] for _, b in members],
                                       [rows[b].params for _, b in members])
            for (_, b), draft in zip(members, proposed):
                drafts[b] = draft.to_depth(ks[b])  # a round never commits more than k + 1 tokens
                if self.width:
                    drafts[b] = drafts[b].only(exact.fits(drafts[b].parents, self.width))
        mx.async_eval([a for d in drafts for a in (d.tokens, d.log_probs) if a is not None])
        dispatched = time.perf_counter()  # the drafts compute while the verification and its verdicts are built
        capture = self._capture()
        logits, hidden = self._verification(rows, drafts, starts, capture)
        params = [r.params for r in rows]
        lazy = verdict_arrays(logits, drafts, params, self.acceptance)
        asked = gather(rows, lambda b: logits[b, : len(drafts[b]) + 1])
        read, drafted, asked = host.read(lazy, [d.tokens for d in drafts], asked)  # the round's one wait
        verified = time.perf_counter()
        results = verdicts(read, drafted, drafts, params, self.acceptance)
        trees = {}  # row -> where its tree starts, and the slots of its accepted path
        for b, ((path, _), draft) in enumerate(zip(results, drafts)):
            if draft.parents is None:
                cut_cache(self.cache, b, starts[b] + 1 + len(path))
            else:
                trees[b] = (starts[b] + 1, [starts[b] + 1 + i for i in path])
        if trees:  # every row's path moved into place at once
            keep_cache(self.cache, trees)
        events = {}
        for b, (r, draft, row_drafted, (path, token)) in enumerate(zip(rows, drafts, drafted, results)):
            new, at = [row_drafted[i] for i in path] + [token], [0] + [i + 1 for i in path]
            self._commit(r, new, lambda i, b=b, at=mx.array(at): hidden[capture.index(i)][b : b + 1, at])
            depth = None if draft.parents is None else max(tree.depths(draft.parents), default=0)
            events[r.key] = StepEvent(new, [True] * len(path) + [False], row_drafted, dispatched - tic,
                                      verified - dispatched, depth, read_logprobs(asked, b, at, new), why=why)
        end = time.perf_counter()  # the policy weighs whole rounds: the host's work after the verdicts too
        for e in events.values():
            e.host_time = dispatched - tic + end - verified
        self.policy.record([r.key for r in rows], ks, [e.accepted for e in events.values()], end - tic)
        self._finish()
        return events

    def _verification(self, rows: list[Row], drafts: list[Draft], starts: list[int], capture: tuple[int, ...]
                      ) -> tuple[mx.array, tuple[mx.array, ...]]:
        """The round's target forward: under exact verification a row at a time; a lone row's drafter that
        ran part of it (self-speculation) reusing that."""
        one = rows[0].drafter if len(rows) == 1 and rows[0].drafter is not None else None
        if self.width and len(rows) > 1:
            return self._forward([self._inputs([r], [d], [s]) for r, d, s in zip(rows, drafts, starts)], capture)
        if one is not None and drafts[0].parents is None:
            inputs = self._inputs(rows, drafts, starts)[0]
            return one.verify_forward(self.model, inputs, self.cache, capture, exact=bool(self.width))
        return self._forward([self._inputs(rows, drafts, starts)], capture)

    def _forward(self, inputs: list[tuple], capture: tuple[int, ...]) -> tuple[mx.array, tuple[mx.array, ...]]:
        """The target over `inputs`: (tokens, positions, mask) for the batch, or under exact verification
        with more rows, one a row, each its own forward (a kernel's rows may depend on how many share it)."""
        if len(inputs) == 1:
            tokens, positions, mask = inputs[0]
            return self.model(tokens, self.cache, positions=positions, mask=mask, capture=capture,
                              **({"exact": True} if self.width else {}))
        rows = [alone(self.cache, b) for b in range(len(inputs))]
        outs = [self.model(tokens, rows[b], positions=positions, mask=mask, capture=capture, exact=True)
                for b, (tokens, positions, mask) in enumerate(inputs)]
        rejoin(self.cache, rows)
        return mx.concatenate([o[0] for o in outs]), tuple(mx.concatenate(h) for h in zip(*(o[1] for o in outs)))

    def _inputs(self, rows: list[Row], drafts: list[Draft], starts: list[int]):
        """Tokens `[B, S]` of one verification (each row's pending token and draft, padded; S the
        width under exact verification), with positions `[B, S]` and a mask `[B, 1, S, L + S]` where a row
        drafted a tree (each row sees its own cache and its draft's ancestry); chains need neither (the
        cache's own mask and per-row offsets)."""
        S = self.width or 1 + max(len(d) for d in drafts)
        tokens = mx.concatenate([mx.concatenate([mx.array(r.context[-1:], dtype=mx.int32), d.tokens,
                                                 mx.zeros((S - 1 - len(d),), dtype=mx.int32)])[None]
                                 for r, d in zip(rows, drafts)])
        if all(d.parents is None for d in drafts):
            return tokens, None, None
        if len(drafts) == 1:  # one tree: its parents, for the tree-attention kernel (padding: the pending token's children)
            parents, pad = drafts[0].parents, S - 1 - len(drafts[0])
            positions = mx.array([0] + tree.depths(parents) + [1] * pad) + starts[0]
            return tokens, positions[None], TreeMask((-1, *(p + 1 for p in parents), *[0] * pad), starts[0])
        chains = [d.parents if d.parents is not None else list(range(-1, len(d) - 1)) for d in drafts]
        return (tokens, *map(mx.array, tree.batch_layout(chains, starts, S)))  # positions, mask

    def _plain_step(self, guesses: dict[int, int | None], empty: list[bool], why) -> dict[object, StepEvent]:
        """A plain round for every row; drafters still read the target's features, and those that guess
        (`guesses`: row -> the token its draft would start with) learn whether it would have been kept: the
        token drawn equals the guess with the probability a draft of it is accepted (the target's for it,
        sampling; 0 or 1, greedy), so the policy's odds are unbiased and cost no device work.
        The next round is queued before this one's tokens are read (the host builds it meanwhile)."""
        tic = time.perf_counter()
        rows, capture, queued = self.rows, self._capture(), self.queued is not None
        y, hidden, asked = self.queued or self._plain_forward(mx.array([[r.context[-1]] for r in rows]), capture)
        mx.async_eval(y)
        # Queued only where the next round is plain too (as far as is known now: a row whose drafter found
        # nothing this round is taken to find nothing the next); one that drafts would wait for it, then drop it.
        keys, drafters = [r.key for r in rows], [r.drafter for r in rows]
        rooms = [r.max_tokens - r.produced - 2 for r in rows]
        self.queued = None
        if min(rooms) >= 0 and not any(self.policy.choose(keys, drafters, rooms, empty, [r.unread for r in rows])):
            self.queued = self._plain_forward(y[:, None], capture)
            mx.async_eval(self.queued[0])
        tokens, asked = host.read(y, asked)  # the round's one wait
        toc = time.perf_counter()
        events = {}
        split = [mx.split(h, len(rows)) if len(rows) > 1 else [h] for h in hidden]  # each row's [1, 1, F], at once
        for b, (r, token) in enumerate(zip(rows, tokens)):
            self._commit(r, [token], lambda i, b=b: split[capture.index(i)][b], read=False)
            events[r.key] = StepEvent([token], [False], verify_time=toc - tic,
                                      logprobs=read_logprobs(asked, b, [0], [token]), why=why)
        # What drafting must beat is plain decoding going on: a round queued that queues the next (or one
        # neither queued nor queuing); the first of a run of them also queued the next, the last's ran before.
        steady = queued == (self.queued is not None)
        end = time.perf_counter()
        for e in events.values():
            e.host_time = end - toc
        if any(drafters):
            self.policy.record(keys, [0] * len(keys), [0] * len(keys), end - tic, steady,
                               {rows[b].key: float(tokens[b] == x) for b, x in guesses.items() if x is not None})
        self._finish()
        return events

    def _plain_forward(self, tokens: mx.array, capture: tuple[int, ...]) -> tuple:
        """The next token of every row `[B]` after `tokens` `[B, 1]`, the hidden states `capture` names
        there and what the rows asking for log-probabilities get, lazy."""
        if self.width:  # the rest of the width: throwaway tokens, their keys cut at once
            tokens = mx.concatenate([tokens, mx.zeros((len(self.rows), self.width - 1), mx.int32)], axis=1)
            rows = [tokens] if len(self.rows) == 1 else [tokens[b : b + 1] for b in range(len(self.rows))]
            logits, hidden = self._forward([(t, None, None) for t in rows], capture)
            trim_cache(self.cache, self.width - 1)
            logits, hidden = logits[:, :1], tuple(h[:, :1] for h in hidden)
        else:
            logits, hidden = self.model(tokens, self.cache, capture=capture)  # [B, 1, V]
        y, _ = draw_rows(logits[:, -1], [r.params for r in self.rows])
        return y, hidden, gather(self.rows, lambda b: logits[b])

    @staticmethod
    def _commit(r: Row, tokens: list[int], features: Callable[[int], mx.array], read: bool = True) -> None:
        """Row r takes its round's tokens; its drafter hears them, with the target's features at them (`features`:
        a captured layer -> the row's `[1, n, F]`); `read`: it drafted this round (else one that runs a model has
        one token more to read when it next drafts)."""
        r.context.extend(tokens)
        r.produced += len(tokens)
        r.unread = 0 if read else r.unread + (r.drafter is not None and r.drafter.costly)
        if r.drafter is not None:
            r.drafter.commit(r.slot, r.context, tuple(map(features, r.drafter.capture)))

    def _catch_up(self, drafter: Drafter, contexts: list[list[int]]) -> None:
        """The drafter reads what its rows committed and it has not (a prompt; plain rounds' tokens), timed apart:
        what a token read costs is what the policy weighs drafting after plain rounds by."""
        tic = time.perf_counter()
        if read := drafter.catch_up(contexts):
            self.policy.read(read, time.perf_counter() - tic)

    def _capture(self) -> tuple[int, ...]:
        """The target's hidden states the rows' drafters read, each index once."""
        return tuple(sorted({i for r in self.rows if r.drafter is not None for i in r.drafter.capture}))

    def _unqueue(self) -> None:
        if self.queued is not None:  # rows change: a queued plain round no longer fits the batch
            self.queued = None
            trim_cache(self.cache, 1)

    def _finish(self) -> None:
        for r in [r for r in self.rows if r.produced >= r.max_tokens and not self.keep_finished]:
            self.remove(r.key)


def speculative_steps(model, prompt: Sequence[int], params: SamplingParams, max_tokens: int,
                      drafter: Drafter | None = None, num_draft: int | None = None, k_max: int | None = None,
                      cache: list[KVCache] | None = None, acceptance: str = "exact",
                      width: int | None = None) -> Iterator[StepEvent]:
    """One sequence: the batch of one, an event per round. `num_draft` fixes K (a tree's depth);
    otherwise K adapts (`policy.Policy`), up to `k_max` or the drafter's own most. A `cache` given
    may already hold the prompt's first tokens (an earlier chat turn): as much is kept as the drafter's
    own state still matches. `width`: exact verification (`mlx_spec.exact`).
    `acceptance="typical"` is Medusa's lossy rule for trees at temperature > 0."""
    k_max = exact.most(k_max, num_draft, width)
    decoder = Decoder(model, k_max, num_draft, acceptance, cache, keep_finished=True,
                      policy=Policy.remembered(drafter, params, k_max, num_draft), width=width)
    decoder.add(0, list(prompt), params, max_tokens, drafter)
    while not decoder.done:
        yield decoder.step()[0]


def plain_steps(model, prompt: Sequence[int], params: SamplingParams, max_tokens: int,
                cache: list[KVCache] | None = None, width: int | None = None) -> Iterator[StepEvent]:
    """Plain decoding of one sequence (the reference every drafter must equal; with `width`, the
    reference of exact verification at that width)."""
    return speculative_steps(model, prompt, params, max_tokens, cache=cache, width=width)
