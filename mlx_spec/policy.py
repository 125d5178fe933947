"""How many tokens each row drafts a round: one cost model for a batch of one or many.

With per-token acceptance alpha, a round of K drafts yields
E(alpha, K) = (1 - alpha^(K+1)) / (1 - alpha) tokens (Leviathan et al.); each
row's acceptance is kept per draft position, weighed against its drafter's
pooled rates (what its rows found over many rounds), and its E is the same sum
with a rate per position. A round's cost is measured whole (drafting, the
verification of B rows of K + 1 tokens, the host's work) per batch size and K,
as ratios to the plain round's at the time (a machine's speed drifts), with a
line through the measured K for the others. The seed's formula takes the
verification as flat in K and drafting as K times a step; on a CPU, or for a
small target, neither holds (a drafter has a cost per round besides its cost
per token; a verification cannot overlap the host's work as queued plain rounds
do), so nothing is assumed of the line but a small slope until two K are
measured. A round that drafts right after plain ones is a switch (the drafter
catches up on what it missed, the target's weights were pushed out of the
caches): not what drafting goes on costing, so not learned from (but a batch's
rates, which decide whether to draft at all, count it). The K with the least
time per token wins; K = 0 is plain decoding.

One row starts optimistic (K at its most) and follows the model; once drafting,
it goes on while the model weighs drafting about even with plain decoding (a
stop and a start cost a switch). After a few plain rounds it looks again: what
it knew has faded toward its drafter's pool, so the model may draft again; else
it probes (further apart while the probes lose, and the more a probe loses the
further: their cost stays a small share of plain decoding's), and an accepted
probe drafts one more round, the one that is measured. Only drafting that gained
brings the looks close again: a lucky probe followed by rounds that lost does
not. A drafter that guesses on the host (prompt lookup, suffix decoding) needs
no probe: each plain round tells the odds that its guess would have been
accepted (`observe`). A batch is where the model is least reliable (padding, rows whose
drafter finds nothing, a forward that turns compute-bound), so there the
measured throughput of whole rounds decides whether to draft at all: it first
times plain rounds and one-token drafts; while drafting (the model says how
far, up to a token past the longest draft it has measured), a short run of
plain rounds now and then keeps the comparison fresh; while plain, a short run
of drafting rounds now and then (further apart each time it loses) looks again.
"""

from __future__ import annotations

import math
import statistics
import weakref
from collections import deque
from dataclasses import dataclass, field

from mlx_spec import distributed
from mlx_spec.sampling import SamplingParams


def expected_tokens(alpha: float, k: float) -> float:
    """Tokens a round of k drafts yields when each is accepted with probability
    alpha: 1 + alpha + ... + alpha^k."""
    if alpha >= 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


DECAY = 0.9  # weight of the past in the running estimates
# The same in a drafter's pool: what its rows found over many rounds, what each row is weighed against.
POOL_DECAY = 0.97
# The same for what a probe loses: a drafter that catches up on the rounds it missed loses more the
# further apart its probes are, and the first probes, a few rounds apart, would long weigh too little.
PROBE_DECAY = 0.6
RECENT = 8  # round times kept per K (their median is the estimate: spikes are common)
# One row's plain rounds: what every drafting round is weighed against, and not measured again while it drafts.
# A slow spell of the machine's just before a long drafting run would make every K look cheap for all of it.
RECENT_PLAIN = 32


@dataclass
class Acceptance:
    """A row's drafts: P(draft position i accepted | the ones before it were), per
    position (prompt lookup's first draft is a guess, the ones after it copies)."""

    accepted: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)
    PRIOR = 0.8  # alpha where nothing is known of a position (nor of its drafter's)
    PRIOR_WEIGHT = 0.25  # in rounds: weak, so that a drafter that never hits is soon known to

    def rates(self, k: int, prior: list[float] | None = None) -> list[float]:
        """The rates of positions 0..k-1. What is known of one is weighed against `prior` (its drafter's
        pooled rates, as much as one round of its own; past the first, halfway to the rate before it where
        that is higher: what the pool knows of a far position may be stale), else against the rate before
        it (the first against `PRIOR`): a position seldom reached, or long ago, is taken as the one before."""
        out, before = [], self.PRIOR
        for i in range(k):
            p, weight = ((max(prior[i], (prior[i] + before) / 2) if i else prior[i]), 1.0) \
                if prior and i < len(prior) else (before, self.PRIOR_WEIGHT)
            if i < len(self.reached):
                p = (self.accepted[i] + p * weight) / (self.reached[i] + weight)
            out.append(p)
            before = p
        return out

    def tokens(self, k_max: int, prior: list[float] | None = None) -> list[float]:
        """Expected tokens of a round of k drafts, for k = 0..k_max: 1 + a_0 + a_0 a_1 + ..."""
        out, reach = [1.0], 1.0
        for rate in self.rates(k_max, prior):
            reach *= rate
            out.append(out[-1] + reach)
        return out

    def fade(self, decay: float) -> None:
        """What is known weighs `decay` as much: a round passed (drafting or not)."""
        self.accepted = [a * decay for a in self.accepted]
        self.reached = [r * decay for r in self.reached]

    def update(self, k: int, n: float, decay: float = DECAY) -> None:
        """A round of k drafts accepted n of them; n may be a fraction below 1 for k = 1 (a plain
        round's odds that a draft's first token would have been accepted: see `Policy.observe`)."""
        # Position i is reached when the drafts before it were all accepted. What is known of the positions
        # past k fades too: a row held to short drafts by a bad patch finds the longer ones again.
        while len(self.reached) < k:
            self.accepted.append(0.0)
            self.reached.append(0.0)
        self.fade(decay)
        for i in range(min(k, int(n) + 1)):
            self.reached[i] += 1
            self.accepted[i] += min(n - i, 1.0)


@dataclass
class Measured:
    """What the policy has measured at one batch size, and where a batch stands."""

    SLOPE = 0.1  # what a drafted token adds to a round, in plain steps, until two K are measured (soon known)
    RUN_FIRST = 3  # a batch, drafting: rounds before its first run of plain ones (then further apart)
    TRUSTED = 4  # rounds measured at a length before their median stands for it alone

    times: dict[int, deque] = field(default_factory=dict)  # K + 1 -> recent seconds of a whole round
    # K + 1 > 1 -> the same, over the plain round's median then: this machine's speed drifts by more
    # than the differences weighed, and drafting rounds, rarer than plain ones, would be weighed stale.
    ratios: dict[int, deque] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)  # shapes verified at least once (the first also compiles)
    tokens: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})  # drafting? -> sums
    seconds: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})
    mode: str = "explore"  # a batch: explore, drafting or plain
    run: int = 0  # rounds left of a run of the other kind (plain while drafting, drafting while plain)
    since: int = 0  # rounds since the last such run
    every: int = 0  # rounds between two runs of the other kind (one row: between probes)
    plain_rounds: int = 0  # one row: plain rounds since the last probe
    best: tuple | None = None  # (rows, drafters) -> K: the model's choice since the last record
    look: tuple | None = None  # one row: (K, probe?) of the round that looks again, as the round before found
    probing: bool = False  # one row: the round now recorded is a probe
    kept: bool = False  # one row: the last probe was accepted, so the next round drafts too (and is measured)
    earned: bool = False  # one row: the round now recorded is the one a kept probe earned
    # One row: what the drafting rounds since the last plain one gained, in plain steps (their tokens less their
    # time over a plain round's), and whether a probe began them. Where a probe's run lost (a lucky probe, then
    # rounds that did not pay), probes stay as far apart; else, once plain again, the row looks again soon.
    gain: float = 0.0
    probed: bool = False
    drafted: int = 0  # one row: drafting rounds since the last plain one
    # One row: what a probe loses, in plain steps (its round's time over a plain round's, less its tokens; with
    # the round a kept probe earns): a drafter whose catching up is dear probes further apart.
    probe_loss: float | None = None
    # Whether a costly drafter's last round was plain, or a row joined: the next drafting round is a switch
    # (the drafter catches up on what it missed, a prompt or plain rounds, and pushes the target's weights
    # out of the caches; the queue of plain rounds is broken), not what drafting goes on costing: its times
    # are not learned from.
    cold: bool = True
    medians: dict | None = None  # S -> the median of `times[S]`, since the last record
    rounds: dict = field(default_factory=dict)  # S -> the rounds behind that median

    def verify_time(self, S: int) -> float:
        """Measured (`TRUSTED` rounds at least), or from a line through the measured rounds that drafted,
        each length weighed by its rounds (not through a plain round: queued, it overlaps the host's work
        with the device's, and a drafting round cannot); through one, or from a plain round, a token costs
        `SLOPE` plain steps, but a shorter draft than the one measured lies between it and a plain round (a
        costly drafter's cost grows with K: held to the longer draft's cost less `SLOPE` a token, a model
        that drafts one token well and two badly would wait for a probe to try one). A K seldom chosen is
        thus not held to a few rounds that went badly, and a K unmeasured is guessed as cheap as it may be:
        its first rounds say."""
        if self.medians is None:  # once a round: the model asks for every K
            self.medians = {s: statistics.median(t) for s, t in self.times.items()}
            if 1 in self.medians:
                self.medians.update({s: statistics.median(r) * self.medians[1] for s, r in self.ratios.items()})
            self.rounds = {s: len(self.ratios.get(s) or self.times.get(s, ())) for s in self.medians}
        medians, rounds = self.medians, self.rounds
        if S in medians and (S == 1 or rounds[S] >= self.TRUSTED):
            return medians[S]
        plain = medians[1]  # (the model is asked once plain rounds are measured)
        drafts = {s: t for s, t in medians.items() if s > 1}
        if len(drafts) < 2:
            s0, t0 = next(iter(drafts.items()), (1, plain))
            if S < s0:
                return plain + max(t0 - plain, 0.0) * (S - 1) / (s0 - 1)
            return max(t0 + self.SLOPE * plain * (S - s0), plain)
        w = [rounds[s] for s in drafts]
        ms = sum(n * s for n, s in zip(w, drafts)) / sum(w)
        mt = sum(n * t for n, t in zip(w, drafts.values())) / sum(w)
        spread = sum(n * (s - ms) ** 2 for n, s in zip(w, drafts))
        slope = sum(n * (s - ms) * (t - mt) for n, (s, t) in zip(w, drafts.items())) / spread
        return max(mt + max(slope, 0.0) * (S - ms), plain)

    def samples(self, S: int) -> int:
        return len(self.times.get(S, ()))

    def longest(self) -> int:
        """The longest K measured `TRUSTED` rounds or more (0: none)."""
        return max((s - 1 for s in {*self.times, *self.ratios}
                    if len(self.ratios.get(s) or self.times[s]) >= self.TRUSTED), default=0)

    def like(self) -> Measured:
        """What another batch size starts from: this one's costs of K over a plain round, and whether drafting
        paid (its own rounds soon replace them; its plain rounds are measured first)."""
        return Measured(ratios={s: deque(r, maxlen=RECENT) for s, r in self.ratios.items()},
                        mode=self.mode, every=self.every if self.mode == "plain" else self.RUN_FIRST)

    def rate(self, drafting: bool) -> float:
        return self.tokens[drafting] / self.seconds[drafting] if self.seconds[drafting] else 0.0


class Policy:
    """K per row each round, from the rows' acceptance and the measured times of
    whole rounds at this batch size."""

    PROBE_EVERY, PROBE_EVERY_LAST = 4, 64  # one row: plain rounds between two probes, doubling
    # ... and further, until what probes lose is at most this share of plain decoding's time (a tree, or a
    # drafter catching up on many rounds of features, may lose several plain steps a probe), up to:
    PROBE_SHARE, PROBE_EVERY_MOST = 0.01, 1024
    PROBE_K = 2
    RUN = 3  # a batch: rounds in a run of the other kind
    MEASURE_EVERY = 32  # a batch, drafting: rounds between two plain runs, at most
    # A batch, plain: rounds between two drafting runs, doubling. A drafter that reads the target's
    # features catches up on every token it missed when it next drafts: with many rows that costs.
    PROBE_FIRST, PROBE_LAST = 256, 4096
    MARGIN = 1.03  # a batch changes mode only for at least this much more throughput
    # and starts drafting again only for this much (near break-even, this machine's noise would switch it
    # back and forth: each switch costs a drafter's catching up)
    RETURN_MARGIN = 1.1
    # One row, drafting: it goes on while the model weighs drafting within this of plain decoding (its own
    # acceptance, a few rounds' worth, dips by chance, and each return to drafting costs a switch).
    STAY_MARGIN = 0.97
    OBSERVED_DECAY = 0.95  # weight of the past in a row's acceptance, for the odds plain rounds tell
    # A drafter that often finds nothing to draft (its rounds then verify one token, whatever K) has
    # verification times that mix two costs: its model must promise this much before it drafts.
    GUESSING_MARGIN = 1.15
    RATE_DECAY = 0.95  # per round, of the running sums of tokens and seconds
    # Per plain round, of what a row knows of its drafts (a drafter that guesses learns in plain rounds):
    # after a bad patch, its drafter's pooled rates come back to the fore, and it drafts again.
    FADE = 0.9

    def __init__(self, k_max: int | None = None, fixed: int | None = None):
        # The most a row drafts: `fixed` (K does not adapt), else `k_max` where given, else its drafter's
        # own (`Drafter.k_max`); `most` is this round's, for its rows' drafters.
        self.k_max, self.fixed = (fixed or k_max), fixed
        self.most = self.k_max or 0
        self.by_size: dict[int, Measured] = {}
        self.acceptance: dict[object, Acceptance] = {}  # row key -> its drafts' acceptance
        # Per drafter, by the id of its `lineage` (its sessions share what is learned of it): its rows'
        # acceptance pooled over many rounds, what a row's own is weighed against (a drafter that rarely
        # hits at this temperature starts its next sequence knowing it).
        self.pooled: dict[int, Acceptance] = {}
        self.owner: dict[object, int] = {}  # row key -> id(its drafter's lineage)

    @classmethod
    def remembered(cls, drafter, params: SamplingParams, k_max: int | None = None, fixed: int | None = None) -> Policy:
        """One sequence's policy, as the drafter's earlier sequences at these sampling settings left it (a
        chat's turns, a benchmark's prompts): the costs and the drafter's pooled acceptance are known from
        the first round, so a drafter that does not pay is not tried at its most K again, and probes that
        kept losing stay as far apart: the plain rounds since the last one count on (sequences shorter than
        the probes' spacing would never see one). What one sequence measured of itself (its rows' acceptance)
        starts anew, and the rates of whole rounds count half: a prompt lookup that found nothing to copy in
        one prompt may find much in the next."""
        if drafter is None:
            return cls(k_max, fixed)
        policy = _REMEMBERED.setdefault(drafter.lineage, {}).setdefault((params, k_max, fixed), cls(k_max, fixed))
        policy.acceptance.clear()
        policy.owner.clear()
        for B, m in policy.by_size.items():  # the rates of whole rounds go on, at half weight
            policy.by_size[B] = Measured(m.times, m.ratios, m.seen, {d: t / 2 for d, t in m.tokens.items()},
                                         {d: t / 2 for d, t in m.seconds.items()},
                                         every=m.every if B == 1 else 0,  # probes as far apart as they were
                                         plain_rounds=m.plain_rounds if B == 1 else 0, probe_loss=m.probe_loss)
        return policy

    def measured(self, B: int) -> Measured:
        m = self.by_size.get(B)  # asked several times a round: no `Measured` built to be dropped
        if m is None:  # rows joined or left: a batch size met first starts from the nearest one measured
            near = min(self.by_size, key=lambda b: abs(math.log(b / B)), default=None)
            m = self.by_size[B] = Measured() if near is None else self.by_size[near].like()
        return m

    def forget(self, key) -> None:
        self.acceptance.pop(key, None)
        self.owner.pop(key, None)

    def _acceptance(self, key, drafter) -> Acceptance:
        if key not in self.acceptance:
            self.owner[key] = id(drafter.lineage)
            self.acceptance[key] = Acceptance()
        return self.acceptance[key]

    def _tokens(self, key, drafter) -> list[float]:
        """A row's expected tokens for each K, from its own drafts against its drafter's pool."""
        pooled = self.pooled.get(id(drafter.lineage))
        return self._acceptance(key, drafter).tokens(self.most, pooled.rates(self.most) if pooled else None)

    def observe(self, key, odds: float) -> None:
        """A plain round's news of a row whose drafter guessed a token (`Drafter.guess`): a draft
        starting with it would have been accepted with probability `odds`. Its acceptance follows the
        text without a probe, and the model may start drafting again when the text turns repetitive.
        (A row with nothing to draft decodes plainly, whatever its K: it has nothing to learn.)"""
        for acceptance, decay in ((self.acceptance.get(key), self.OBSERVED_DECAY),
                                  (self.pooled.get(self.owner.get(key)), POOL_DECAY)):
            if acceptance is not None:  # one a round: their mean decides, not a lucky run of a few
                acceptance.update(1, odds, decay)
        for m in self.by_size.values():
            m.best = None  # the model's answer may change

    def choose(self, keys: list, drafters: list, rooms: list[int], empty: list[bool] | None = None) -> list[int]:
        """K for each row (`rooms`: the most it may draft; `drafters[b]` None: it does not; `empty[b]`:
        its drafter has nothing to draft this round, so it decodes plainly whatever its K)."""
        self._set_most(drafters)
        joined = any(d is not None and key not in self.acceptance for key, d in zip(keys, drafters))
        for key, d in zip(keys, drafters):
            if d is not None:
                self._acceptance(key, d)  # a row's drafts count in its drafter's pool from its first round
        if self.fixed is not None or all(d is None for d in drafters):
            k = self.most
        else:
            k = self._one(keys, drafters) if len(keys) == 1 else self._batch(keys, drafters)
        ks = [min(k, room, self.k_max or d.k_max) if d is not None and not (empty and empty[b]) else 0
              for b, (d, room) in enumerate(zip(drafters, rooms))]
        if (joined or not any(ks)) and any(d is not None and d.costly for d in drafters):
            self.measured(len(keys)).cold = True  # (a row that joined: its drafter first reads its prompt)
        for key, d, row_k in zip(keys, drafters, ks):  # a row that drafts nothing learns nothing: what it knew fades
            if d is not None and not row_k and not d.guesses:
                self.acceptance[key].fade(self.FADE)
        return ks

    def plain_next(self, keys: list, drafters: list, empty: list[bool] | None = None) -> bool:
        """Whether the next round will decode plainly, as far as is known now (so
        it may be queued before this one's tokens are read). A row whose drafter
        found nothing to draft this round (`empty`) is taken to find nothing the
        next round either: new text comes in runs, and an unqueued plain round
        costs more than drafting a round later."""
        if all(d is None or (empty and empty[b]) for b, d in enumerate(drafters)):
            return True
        self._set_most(drafters)
        if self.fixed is not None:
            return False
        m = self.measured(len(keys))
        if len(keys) == 1 and not (m.times or m.ratios):
            return False  # the first round drafts
        if m.samples(1) < 2:
            return True  # plain rounds, queued, measure what plain decoding costs
        if len(keys) == 1:
            if not (m.plain_rounds > 0 or self._best(m, keys, drafters) == 0):
                return False
            if m.plain_rounds + 1 < (m.every or self.PROBE_EVERY):
                return True
            m.look = self._look(m, keys, drafters)  # the next round would ask the same: it is kept
            return not m.look[0]
        if m.mode == "explore":
            return False
        if m.mode == "plain":
            return m.run == 0 and m.since + 1 < m.every
        return m.mode == "drafting" and m.run > 1

    def _set_most(self, drafters: list) -> None:
        """This round's `most`: the rows' drafters' own, where neither `fixed` nor `k_max` is given."""
        if not self.k_max:
            self.most = max((d.k_max for d in drafters if d is not None), default=0)

    def _times_per_token(self, m: Measured, keys: list, drafters: list) -> list[float]:
        """Seconds a token for each K = 0..most: a round's time over the rows' expected tokens."""
        rows = [self._tokens(key, d) for key, d in zip(keys, drafters) if d is not None]
        times = []
        for k in range(self.most + 1):
            tokens = len(keys) - len(rows) + sum(r[k] for r in rows)
            times.append(m.verify_time(k + 1) / tokens)
        return times

    def _best(self, m: Measured, keys: list, drafters: list) -> int:
        """The K with the least time per token; drafting only where it promises `MARGIN` over plain
        (`GUESSING_MARGIN` for drafters that guess: lookup, suffix).
        Kept until the next `record` (a round asks twice: its K, and whether the next is plain)."""
        if m.best is not None and m.best[0] == (keys, [id(d) for d in drafters]):
            return m.best[1]
        times = self._times_per_token(m, keys, drafters)
        # A batch climbs: at most one token past the longest K measured. A longer one is guessed cheap until
        # measured, and a batch's first rounds at a new length compile it and catch its drafter up: runs of
        # them would read as drafting's cost, and stop it.
        top = self.most if len(keys) == 1 else min(self.most, m.longest() + 1)
        best = min(range(top + 1), key=times.__getitem__)
        margin = self.GUESSING_MARGIN if any(d is not None and d.guesses for d in drafters) else self.MARGIN
        if len(keys) == 1 and not m.plain_rounds and not m.cold:
            margin = self.STAY_MARGIN  # the row drafts now: stopping, then starting again, costs a switch
        best = best if times[best] * margin < times[0] else 0
        m.best = ((list(keys), [id(d) for d in drafters]), best)
        return best

    def _one(self, keys: list, drafters: list) -> int:
        """One row: the model decides while drafting; after a few plain rounds it looks again."""
        m = self.measured(1)
        if not (m.times or m.ratios):
            return self.most  # nothing known: start optimistic, the measured costs soon say
        if m.samples(1) < 2:  # and measure a plain round's cost: without it, every K looks as cheap
            return 0
        if not m.plain_rounds:
            best = self._best(m, keys, drafters)
            if best:
                m.kept = False
                return best
            # A probe's round is a switch, never measured: an accepted one goes on a round (probes stay as far
            # apart: what the model weighs against is the cost, measured now).
            if m.kept:
                m.kept, m.earned = False, True
                return min(self.PROBE_K, self.most)
            if m.drafted and (m.gain > 0 or not m.probed):
                m.every = 0
            m.gain, m.probed, m.drafted = 0.0, False, 0
        m.plain_rounds += 1
        if m.plain_rounds < (m.every or self.PROBE_EVERY):
            return 0
        (k, m.probing), m.look = (m.look or self._look(m, keys, drafters)), None
        if m.probing:  # further apart while they lose
            m.probed = True
            last = min(max(self.PROBE_EVERY_LAST, (m.probe_loss or 0.0) / self.PROBE_SHARE), self.PROBE_EVERY_MOST)
            m.every = min(2 * (m.every or self.PROBE_EVERY), int(last))
        m.plain_rounds = 0 if k else 1  # (the model was just asked)
        return k

    def _look(self, m: Measured, keys: list, drafters: list) -> tuple[int, bool]:
        """After plain rounds, the next round's K and whether it probes: the model's K, as what the row
        knew fades toward its drafter's pool; else a probe, unless the drafter guesses (plain rounds weigh
        its guesses at no cost)."""
        best = self._best(m, keys, drafters)
        if best or drafters[0].guesses:
            return best, False
        return min(self.PROBE_K, self.most), True

    def _batch(self, keys: list, drafters: list) -> int:
        """A batch: the measured rates of whole rounds decide whether to draft, the model how far."""
        m = self.measured(len(keys))
        if m.samples(1) < 2:  # plain rounds first, what drafting is weighed against
            return 0
        if m.mode == "explore":  # then one-token drafts, as many measured as stand for their cost
            if m.samples(2) < Measured.TRUSTED:
                return min(1, self.most)
            # Drafting starts where the model says it pays and the one-token drafts measured clearly more
            # throughput than plain rounds, as it starts again: near break-even a batch loses what its
            # rates do not see (its last rounds, once the rows that finished early have left the rest).
            pays = self._best(m, keys, drafters) and m.rate(True) > m.rate(False) * self.RETURN_MARGIN
            m.mode, m.every = ("drafting", Measured.RUN_FIRST) if pays else ("plain", self.PROBE_FIRST)
        m.since += 1
        if m.run:  # a run of the other kind goes on
            m.run -= 1
            if m.run:
                return 0 if m.mode == "drafting" else max(self._best(m, keys, drafters), 1)
            self._settle(m)  # the run is over: compare
        if m.mode == "drafting":  # until plain rounds measure faster: the model only says how far
            if m.since < m.every:
                return max(self._best(m, keys, drafters), 1)
            m.run, m.since = self.RUN, 0  # time plain rounds again
            return 0
        if m.since >= m.every:
            m.run, m.since = self.RUN, 0
            return max(self._best(m, keys, drafters), 1)
        return 0

    def _settle(self, m: Measured) -> None:
        """After a run of the other kind: switch where it gave clearly more tokens a second."""
        drafting, plain = m.rate(True), m.rate(False)
        if not (drafting and plain):  # a batch size just met, its shapes' first rounds (compiling) not counted:
            m.since = 0  # nothing to compare yet, the other kind goes on as long again
            return
        if m.mode == "drafting":
            m.mode, m.every = ("plain", self.PROBE_FIRST) if drafting * self.MARGIN < plain else \
                ("drafting", min(2 * m.every, self.MEASURE_EVERY))  # (soon after it started, then less often)
        elif m.mode == "plain":
            if drafting > plain * self.RETURN_MARGIN:
                m.mode, m.every = "drafting", Measured.RUN_FIRST
            else:
                m.every = min(2 * m.every, self.PROBE_LAST)

    def record(self, keys: list, ks: list[int], accepted: list[int], S: int, tokens: int, seconds: float) -> None:
        """A round's outcome: each row's K as chosen (a tree: its depth) and accepted drafts,
        S tokens a row verified (a tree's nodes), `tokens` produced in `seconds`
        (drafting, verification and the host's work). A round's cost is kept by
        the K it was chosen for: a tree of that depth costs what its width costs.
        A draft shorter than its K (a prompt lookup that found nothing to copy)
        counts as the attempt it was: its yield and its round's cost are what
        choosing that K gives."""
        seconds = distributed.rank0_times(seconds)  # K alike on every rank
        m = self.measured(len(keys))
        m.best = m.medians = None
        first = S not in m.seen  # a shape's first round also compiles: not a cost to learn from
        m.seen.add(S)
        drafting = any(ks)
        steps = seconds / statistics.median(m.times[1]) if m.times.get(1) else None  # in plain rounds
        if len(keys) == 1:
            m.drafted += drafting
            if drafting and steps is not None and not first:
                m.gain += tokens - steps
            if (m.probing or m.earned) and steps is not None:  # a probe's loss, the round it earned added
                loss = steps - tokens
                if m.probe_loss is None:
                    m.probe_loss = loss
                else:
                    past = PROBE_DECAY * m.probe_loss if m.probing else m.probe_loss
                    m.probe_loss = past + (1 - PROBE_DECAY) * loss
            m.kept, m.probing, m.earned = m.probing and accepted[0] > 0, False, False
        switch = drafting and m.cold
        m.cold = m.cold and not drafting
        if not (first or switch):
            chosen = max(ks) + 1
            if drafting and steps is not None:
                m.ratios.setdefault(chosen, deque(maxlen=RECENT)).append(steps)
            kept = RECENT_PLAIN if chosen == 1 and len(keys) == 1 else RECENT
            m.times.setdefault(chosen, deque(maxlen=kept)).append(seconds)
        # A batch's rates weigh whether to draft at all: there a switch costs what it costs (every row's
        # drafter catching up; its prompts, for rows that joined), and drafting must pay for it too.
        if not first and (not switch or len(keys) > 1):
            d = self.RATE_DECAY
            m.tokens[drafting] = d * m.tokens[drafting] + tokens
            m.seconds[drafting] = d * m.seconds[drafting] + seconds
        for key, k, n in zip(keys, ks, accepted):
            if k:
                self.acceptance.setdefault(key, Acceptance()).update(k, n)
                if key in self.owner:  # (`choose` names every row's drafter before its first round)
                    self.pooled.setdefault(self.owner[key], Acceptance()).update(k, n, POOL_DECAY)


_REMEMBERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # lineage -> {settings: Policy}
