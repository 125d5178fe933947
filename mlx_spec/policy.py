"""How many tokens each row drafts a round: one cost model for a batch of one or many.

A row whose draft position i is accepted with probability a_i (given the ones before it were) gets

    E(K) = 1 + a_0 + a_0 a_1 + ... + a_0 ... a_{K-1}

tokens from a round of K drafts (Leviathan et al., with one alpha per position). At batch size B that round costs
T_B(K) seconds, measured whole: drafting, the verification of B rows of K + 1 tokens, the host's work. The policy
picks the K with the most tokens a second,

    K* = argmax_K  sum_rows E_row(K) / T_B(K),        K = 0: plain decoding, one token a row,

and drafts where K* promises MARGIN more than plain decoding (once drafting, while it promises more at all). T_B(K) is
the median of the last rounds at K (of two, their least: one may compile); a K run less is read linearly between the
lengths run twice (a GPU's verification steps up from one token to two, then rises little; a CPU's rises, with dips
where tiles fall: each K that pays MARGIN is run), past them on their least-squares line (SLOPE plain rounds a drafted
token before two are), or off its one round where cheaper. A batch size met first borrows the nearest one's times,
scaled as its own rounds compare. Plain rounds are timed queued, as plain decoding goes on (two at first); drafting
after them, a drafter that runs a model first reads what they committed, at its reads' cost (`read`). A plain choice
stands while deciding anew would cost more than EXPLORE of the rounds' time, to its probe (`Decision.hold`).

Exploration: a row decoding plainly learns nothing of its drafts: what it knew fades toward its drafter's pool (a bad
patch passes), and it probes at its best K measured (a line may read one never run cheaper than it is) as far apart as
keeps what probes are expected to lose at EXPLORE of plain decoding's time. Lookup and suffix decoding need none: a
plain round tells whether their guess would have been kept (`record`'s `odds`). `last` says why."""

from __future__ import annotations

import operator
import time
import weakref
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass, field
from functools import cache
from itertools import accumulate
from statistics import linear_regression, median

from mlx_spec import distributed
from mlx_spec.sampling import SamplingParams

PRIOR = 0.6  # acceptance of a position nothing is known of: a drafter is tried first (its rounds soon say)
DECAY = 0.9  # a row's acceptance: weight of the past a round (its text changes within a few dozen tokens)
POOL_DECAY = 0.99  # its drafter's, pooled over its rows and sequences: what a new row starts from
RECENT = 8  # round times kept per K: their median is the estimate (a round spikes where a shape compiles)
TRUSTED = 3  # rounds at a K before their median stands for it (one spike among them is outvoted); two: their least
SLOPE = 0.1  # what a drafted token adds to a round, in plain rounds, until two lengths are measured
MARGIN = 1.05  # more throughput drafting must promise to start (a switch costs; estimates are noisy)
EXPLORE = 0.005  # share of plain decoding's time probes may be expected to lose (deciding anew, as much)


@dataclass
class Acceptance:
    """Decayed counts per draft position: rounds that reached it, and accepted it."""

    accepted: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)

    def rates(self, k: int, prior: list[float] | None = None) -> list[float]:
        """a_0..a_{k-1}: each position's counts against a rate weighing one round: `prior` (the pool's) drawn to the
        row's rate a position before by the rounds that reached it (a text goes on as it began); else the one before."""
        out = []
        for i in range(min(k, len(self.reached) + 1)):  # past them: the pool's, or the last
            r = self.reached[i - 1] if prior and i else 0.0
            p = (prior[i] + r * out[-1]) / (1 + r) if r else (prior[i] if prior else (out[-1] if out else PRIOR))
            out.append((self.accepted[i] + p) / (self.reached[i] + 1) if i < len(self.reached) else p)
        return out + (prior[len(out):k] if prior else [out[-1] if out else PRIOR] * (k - len(out)))

    def fade(self, w: float, k: int = 0) -> None:  # counts weigh w as much, for k positions at least
        self.accepted, self.reached = ([x * w for x in v] + [0.0] * (k - len(v)) for v in (self.accepted, self.reached))

    def update(self, k: int, n: float, decay: float) -> None:  # a round of k drafts kept n (a guess: k = 1)
        self.fade(decay, k)
        for i in range(min(k, int(n) + 1)):  # position i is reached when the i before it were kept
            self.reached[i], self.accepted[i] = self.reached[i] + 1, self.accepted[i] + min(n - i, 1.0)


def tokens_by_k(rates: list[float]) -> list[float]:
    """E(K) for K = 0..len(rates): one, and the running sum of the running products of the rates."""
    return list(accumulate(accumulate(rates, operator.mul), initial=1.0))


@dataclass
class Costs:
    """Measured whole-round times at one batch size, by K, and where its decoding stands."""

    times: dict[int, deque] = field(default_factory=dict)  # K -> the last RECENT rounds' seconds
    drafting: bool = False  # the last round drafted
    plain_rounds: int = 0  # plain rounds since the last that drafted
    borrowed: dict[int, float] = field(default_factory=dict)  # K -> the nearest batch size's T(K), when this met first
    first: dict[int, deque] = field(default_factory=dict)  # K -> its last two switch rounds (its drafter catching up)

    def known(self) -> dict[int, tuple[float, int]]:
        """K -> (T(K), rounds) as measured here; else borrowed (one round), scaled by the median ratio of this
        size's rounds to them at the drafting K run here (a CPU's 16 rows cost many times 2 rows'), else plain."""
        own = {**{k: (min(t), len(t)) for k, t in self.first.items()},
               **{k: (median(t) if len(t) >= TRUSTED else min(t), len(t)) for k, t in self.times.items()}}
        ratios = [own[k][0] / t for k, t in self.borrowed.items() if k and k in own] or [
            own[k][0] / t for k, t in self.borrowed.items() if k in own] or [1.0]
        return {**{k: (t * median(ratios), 1) for k, t in self.borrowed.items()}, **own}

    def curve(self, most: int, known: dict | None = None, late: float = 0.0) -> list[float]:
        """T(K) for K = 0..most in seconds (plain rounds before any is timed), K > 0 `late` more: as its rounds say once
        two ran, switch rounds too; else off the lengths `known` (K = 0: plain; those run twice) or its round, less."""
        known = known or {0: (1.0, 1), **self.known()}
        ran, points = self.times | self.first, known  # its one round says where it is cheaper (a first may compile)
        if any(j and p[1] > 1 for j, p in known.items()):  # than the lengths run twice and those borrowed, if any
            points = {j: p for j, p in known.items() if not j or p[1] > 1 or j not in ran}
        slope = cache(lambda drop: max(linear_regression(*zip(*[(j, t) for j, (t, c) in points.items() if j != drop
                                                                 and j for _ in range(c)])).slope, 0.0))  # c: weights
        out, at = [known[0][0]], sorted(points)
        for k in range(1, most + 1):
            below, above = at[bisect_left(at, k) - 1], at[bisect_right(at, k)] if k < at[-1] else None
            if len(self.times.get(k, ())) + len(self.first.get(k, ())) > 1:
                line = known[k][0]
            elif above is not None:
                line = points[below][0] + (points[above][0] - points[below][0]) * (k - below) / (above - below)
            elif len(points) - (k in points) < 3:  # an assumed slope, unless borrowed (a tree verifies its nodes)
                line = known[k][0] if k in self.borrowed else points[below][0] + SLOPE * points[0][0] * (k - below)
            else:  # the least-squares slope of the lengths measured but K, each weighed by its rounds
                line = points[below][0] + slope(k if k in points else None) * (k - below)
            out.append(min(known.get(k, (float("inf"), 0))[0], max(line, points[0][0])) + late)
        return out


@dataclass
class Decision:
    """One round's choice, as `explain` tells it: K, why, and the figures of the K it weighed."""

    k: int
    reason: str
    weighed: int = 0  # the K whose figures say why (the best drafting one, where the round is plain)
    tokens: list[float] = field(default_factory=list)  # E(K) summed over the rows, K = 0..most
    seconds: list[float] = field(default_factory=list)  # T(K)
    hold: float = 0  # rounds it may stand, plain (to its probe): as many as keep deciding at EXPLORE of their time
    sure: bool = False  # all of them: nothing but its probe could change it

    def __str__(self) -> str:
        k, e, t = self.weighed, self.tokens, self.seconds
        return f"K={self.k}: {self.reason}" + (f" (K={k} expects {e[k]:.2f} tokens in {t[k] / t[0]:.2f} plain rounds: "
                                               f"{e[k] / t[k] / (e[0] / t[0]):.2f}x plain decoding)" if t else "")


class Policy:
    """K per row each round, from the rows' acceptance and this batch size's measured round times."""

    def __init__(self, k_max: int | None = None, num_draft: int | None = None):
        self.k_max, self.num_draft = (num_draft or k_max), num_draft  # num_draft: K fixed, it does not adapt
        self.costs: dict[int, Costs] = {}  # batch size -> its round times
        self.rows: dict[object, Acceptance] = {}  # row key -> its drafts' acceptance
        self.owner: dict[object, int] = {}  # row key -> id of its drafter's lineage
        self.pooled: dict[int, Acceptance] = {}  # id of a drafter's lineage -> its rows' acceptance pooled
        self.last: Decision | None = None
        self.decided: tuple = (None, None)  # (what was asked, the decision): the decoder asks twice, a plain one holds
        self.spent: float | None = None  # seconds deciding this round (None: what stood was taken)
        self.reads = [0.0, 0.0]  # tokens its drafters read (prompts, what plain rounds committed) and seconds, decayed

    @classmethod
    def remembered(cls, drafter, params: SamplingParams, k_max: int | None = None,
                   num_draft: int | None = None) -> Policy:
        """One sequence's policy as the drafter's earlier sequences at these settings left it (a chat's turns,
        a benchmark's prompts): round times and the drafter's pooled acceptance go on; each row starts anew."""
        policy = cls(k_max, num_draft) if drafter is None else _REMEMBERED.setdefault(drafter.lineage, {}).setdefault(
            (params, k_max, num_draft), cls(k_max, num_draft))
        policy.rows, policy.owner = {}, {}
        return policy

    def forget(self, key) -> None:
        self.rows.pop(key, None), self.owner.pop(key, None)

    def read(self, tokens: int, seconds: float) -> None:  # a drafter read a prompt, or what plain rounds committed
        self.reads = [DECAY * self.reads[0] + tokens, DECAY * self.reads[1] + distributed.rank0_times(seconds)[0]]

    def choose(self, keys: list, drafters: list, rooms: list[int], empty: list[bool] | None = None,
               unread: list[int] | None = None) -> list[int]:
        """K for each row (`rooms`: the most it may draft; `drafters[b]` None: it does not; `empty[b]`: its drafter has
        nothing this round; `unread[b]`: tokens it reads first). Asking again gives the same; a plain choice stands."""
        drafts = [max(rooms[b], 0) if d is not None and not (empty and empty[b]) else 0 for b, d in enumerate(drafters)]
        most = self.k_max or max((d.k_max for d in drafters if d is not None), default=0)
        if self.decided[0] != (asked := (tuple(keys), most)):
            tic, fixed = time.perf_counter(), self.num_draft is not None
            self.decided = (asked, Decision(0, "nothing to draft") if not any(drafts) else Decision(
                self.num_draft, "K fixed") if fixed else self._decide(keys, drafters, drafts, most, sum(unread or ())))
            self.spent = (self.spent or 0.0) + time.perf_counter() - tic
        self.last = self.decided[1]
        return [min(self.last.k, rooms[b], self.k_max or d.k_max) if drafts[b] else 0 for b, d in enumerate(drafters)]

    def _decide(self, keys: list, drafters: list, drafts: list[int], most: int, unread: int) -> Decision:
        c = self._costs(len(keys))
        if (c.times or c.first) and len(c.times.get(0, ())) < 2:  # a first round drafts on what is assumed; then two
            return Decision(0, "timing plain rounds")  # plain rounds are timed, queued (their least: one may compile)
        tokens = high = [float(drafts.count(0))] * (most + 1)  # a row not drafting: a token; `high`: E(K) as
        pool = cache(lambda owner: self.pooled.setdefault(owner, Acceptance()).rates(most))  # high as rows' rates may
        for key, d, room in ((key, d, on) for key, d, on in zip(keys, drafters, drafts) if on):  # fade to, toward
            prior = pool(self.owner.setdefault(key, id(d.lineage)))  # their pools (a position's: at most its, the
            rates = self.rows.setdefault(key, Acceptance()).rates(most, prior)  # pool's or the one before's)
            tokens = [a + b for a, b in zip(tokens, tokens_by_k(rates[:room] + [0.0] * (most - room)))]  # to its room
            high = [a + b for a, b in zip(high, tokens_by_k(accumulate(map(max, rates, prior), max)))]
        late = unread * self.reads[1] / self.reads[0] if self.reads[0] else 0.0  # its drafters reading, first
        seconds = c.curve(most, known := {0: (1.0, 1), **c.known()}, late)
        rate = [e / t for e, t in zip(tokens, seconds)]
        best = max(range(most + 1), key=rate.__getitem__)
        if rate[best] > rate[0] * (1.0 if c.drafting else MARGIN):  # (a K never run is tried once where it promises
            untried = [j for j in range(1, most + 1) if j not in c.times | c.first and rate[j] > rate[0] * MARGIN]
            k = max(untried * c.drafting, key=rate.__getitem__, default=best)  # MARGIN more: a dip the line misses)
            return Decision(k, "drafting pays" + "; trying a length not run yet" * (k != best), k, tokens, seconds)
        best = max([j for j in known if 0 < j <= most] or range(1, most + 1), key=rate.__getitem__)  # K measured
        if all(guessing := [d.guesses for d, on in zip(drafters, drafts) if on]):
            return Decision(0, "drafting does not pay; plain rounds weigh guesses", best, tokens, seconds, float("inf"))
        dear = max(seconds[best], known.get(best, (0.0, 0))[0] + late)  # a probe loses its round's time, reading
        loss = max(dear - tokens[best] / tokens[0] * seconds[0], 0.0)  # first, beyond its tokens (as its K's rounds
        why = f"a probe every {(every := max(1, round(loss / (EXPLORE * seconds[0]))))} plain rounds"  # read if dearer
        if c.plain_rounds >= every:
            return Decision(best, why, best, tokens, seconds)
        sure = not any(guessing) and max(e / t for e, t in zip(high, seconds)) <= rate[0] * MARGIN  # (a guess: news)
        return Decision(0, "drafting does not pay; " + why, best, tokens, seconds, every - c.plain_rounds, sure)

    def _costs(self, B: int) -> Costs:  # batch size B's; one met first borrows the nearest's (`Costs.known` scales)
        if B not in self.costs and self.costs:
            near = self.costs[min(self.costs, key=lambda b: abs(b - B) / b)]
            self.costs[B] = Costs(borrowed={k: t for k, (t, _) in near.known().items()})
        return self.costs.setdefault(B, Costs())

    def record(self, keys: list, ks: list[int], accepted: list[int], seconds: float, steady: bool = True,
               odds: dict | None = None) -> None:
        """A round's outcome: each row's K and drafts kept (a tree: its depth and path), in `seconds` (all of it);
        `steady`: a plain round costing what plain decoding does; `odds`: row -> the odds of its drafter's guess."""
        c, k, stood = self._costs(len(keys)), max(ks), self.decided[1]
        seconds, spent = distributed.rank0_times(seconds, self.spent or 0.0)  # the same choices on every rank
        if stood:  # a plain choice stands for rounds while deciding anew would cost more than EXPLORE of them
            rounds = stood.hold if self.spent is None or stood.sure else max(1, round(spent / EXPLORE / seconds))
            stood.hold = min(stood.hold, rounds) - 1
        self.decided, self.spent = self.decided if stood and not k and stood.hold > 0 else (None, None), None
        if k and not c.drafting:  # a switch (rows joined, or plain rounds came before): they stand for K until rounds
            c.first.setdefault(k, deque(maxlen=2)).append(seconds)  # going on are timed
        elif k or steady:  # (a plain round's own time is not its cost but where plain rounds go on: the
            c.times.setdefault(k, deque(maxlen=RECENT)).append(seconds)  # first of a run also queued the next)
        c.drafting, c.plain_rounds = k > 0, 0 if k else c.plain_rounds + 1
        for key, k, n in zip(keys, ks, accepted):
            if k or key in (odds or {}):  # drafts, or a guess (one draft: kept or not)
                k, n = (k, n) if k else (1, odds[key])
                self.rows.setdefault(key, Acceptance()).update(k, n, DECAY)
                if key in self.owner:
                    self.pooled[self.owner[key]].update(k, n, POOL_DECAY)
            elif key in self.rows:  # what a plainly decoding row knew of its drafts goes stale: it
                self.rows[key].fade(DECAY)  # comes back to its drafter's pool, which may draft again


_REMEMBERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # lineage -> {settings: Policy}
