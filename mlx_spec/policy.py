"""How many tokens each row drafts a round: one cost model for a batch of one or many.

With per-token acceptance alpha, a round of K drafts yields
E(alpha, K) = (1 - alpha^(K+1)) / (1 - alpha) tokens (Leviathan et al.). It
costs the drafting (a forward per step for a costly drafter, shared by all the
rows it drafts for) and one verification of B rows of S = K + 1 tokens. The
seed's formula takes the verification as flat in K (memory-bound decoding); on
a CPU, or for a small target, it is not, so a running time is kept per batch
size and verified length, with a line through the measured lengths for the
others. The K with the least time per token wins; K = 0 is plain decoding,
probed again now and then in case acceptance has changed.

A batch of many is where the model is least reliable (padding, rows whose
drafter finds nothing, a forward that turns compute-bound), so there the
measured throughput of whole rounds decides too: runs of plain rounds are
timed beside the speculative ones, and once plain rounds produce tokens faster
at that batch size, everyone decodes plainly, with a speculative run now and
then in case that changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(alpha: float, k: float) -> float:
    """Tokens a round of k drafts yields when each is accepted with probability
    alpha: 1 + alpha + ... + alpha^k."""
    if alpha >= 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def ema(old: float | None, new: float, decay: float) -> float:
    """A running mean that keeps `decay` of the past."""
    return new if old is None else decay * old + (1 - decay) * new


DECAY = 0.8  # weight of the past in the running estimates


@dataclass
class Acceptance:
    """A row's drafts: P(draft position i accepted | the ones before it were)."""

    accepted: float = 0.8  # prior alpha = 0.8, weak
    reached: float = 1.0

    @property
    def alpha(self) -> float:
        return self.accepted / self.reached

    def update(self, k: int, n: int) -> None:
        # Position i is reached when the drafts before it were all accepted.
        self.accepted = DECAY * self.accepted + n
        self.reached = DECAY * self.reached + n + (n < k)


@dataclass
class Measured:
    """What the policy has measured at one batch size."""

    verify: dict[int, float] = field(default_factory=dict)  # S -> seconds per verification of B rows x S
    seen: set[int] = field(default_factory=set)  # S verified at least once (the first also compiles)
    tokens: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})  # speculating? -> sums
    seconds: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})
    rounds: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    since_plain: int = 0  # speculative rounds since plain ones were last timed
    left: int = 0  # rounds left of a measuring run
    left_k: int = 0  # its K
    plain_rounds: int = 0

    def verify_time(self, S: int) -> float:
        """Measured, or from a line through the measured lengths (flat with one)."""
        if S in self.verify:
            return self.verify[S]
        ss, ts = list(self.verify), list(self.verify.values())
        if len(ss) == 1:
            return ts[0]
        ms, mt = sum(ss) / len(ss), sum(ts) / len(ts)
        slope = sum((a - ms) * (b - mt) for a, b in zip(ss, ts)) / sum((a - ms) ** 2 for a in ss)
        return max(mt + max(slope, 0.0) * (S - ms), min(ts))

    def rate(self, speculating: bool) -> float:
        return self.tokens[speculating] / self.seconds[speculating]


class Policy:
    """K per row each round, from the rows' acceptance, each drafter's measured
    cost per step and the measured verification times at this batch size."""

    PROBE_EVERY = 4  # plain rounds between two probes (one row)
    PROBE_K = 2
    LEARN = 8  # speculative rounds before the first comparison with plain ones (a batch)
    RUN = 4  # rounds in a measuring run
    MEASURE_PLAIN = 32  # speculative rounds between two runs of plain ones
    PROBE_BATCH = 32  # plain rounds between two runs of speculative ones
    RATE_DECAY = 0.95  # per round, of the running sums of tokens and seconds

    def __init__(self, k_max: int, fixed: int | None = None):
        self.k_max, self.fixed = (fixed or k_max), fixed
        self.by_size: dict[int, Measured] = {}
        self.acceptance: dict[object, Acceptance] = {}  # row key -> its drafts' acceptance
        self.draft_cost: dict[int, float] = {}  # id(drafter) -> seconds per drafting step
        self.catching_up: set[int] = set()  # drafters whose next round first reads the tokens they missed

    def measured(self, B: int) -> Measured:
        return self.by_size.setdefault(B, Measured())

    def forget(self, key) -> None:
        self.acceptance.pop(key, None)

    def choose(self, keys: list, drafters: list, rooms: list[int]) -> list[int]:
        """K for each row (`rooms`: the most it may draft; `drafters[b]` None: it does not)."""
        if self.fixed is not None or all(d is None for d in drafters):
            return [min(self.k_max, room) if d is not None else 0 for d, room in zip(drafters, rooms)]
        k = self._k(keys, drafters)
        return [min(k, room) if d is not None else 0 for d, room in zip(drafters, rooms)]

    def _time_per_token(self, m: Measured, keys: list, drafters: list, k: int) -> float:
        tokens = sum(expected_tokens(self.acceptance.setdefault(key, Acceptance()).alpha, k) if d is not None and k
                     else 1.0 for key, d in zip(keys, drafters))
        drafting = sum(k * self.draft_cost.get(id(d), 0.0) for d in {id(d): d for d in drafters if d}.values()
                       if d.costly)
        return (drafting + m.verify_time(k + 1)) / tokens

    def _k(self, keys: list, drafters: list) -> int:
        B = len(keys)
        m = self.measured(B)
        if not m.verify:
            return self.k_max
        best = min(range(self.k_max + 1), key=lambda k: self._time_per_token(m, keys, drafters, k))
        if B == 1:  # the model decides; plain rounds probe now and then
            if best == 0:
                m.plain_rounds += 1
                if m.plain_rounds % self.PROBE_EVERY == 0:
                    return min(self.PROBE_K, self.k_max)
            return best
        if best and m.left:  # a measuring run goes on
            m.left -= 1
            return m.left_k
        if best and m.rounds[True] >= self.LEARN and (m.rounds[False] == 0 or m.since_plain >= self.MEASURE_PLAIN):
            m.left, m.left_k = self.RUN - 1, 0
            return 0
        if best and (m.rounds[True] < self.LEARN or m.rounds[False] == 0 or m.rate(True) >= m.rate(False)):
            return best
        m.plain_rounds += 1
        if m.plain_rounds % self.PROBE_BATCH == 0:
            k = best or min(self.PROBE_K, self.k_max)
            m.left, m.left_k = self.RUN - 1, k
            return k
        return 0

    def record(self, keys: list, ks: list[int], accepted: list[int], S: int, tokens: int, seconds: float,
               verify_time: float, draft_times: dict[int, tuple[float, int]]) -> None:
        """A round's outcome: each row's K and accepted drafts, S tokens a row
        verified in `verify_time`, `tokens` produced in `seconds`; per drafter
        (by id), its drafting time and steps."""
        m = self.measured(len(keys))
        first = S not in m.seen  # a length's first round also compiles: not a cost to learn from
        m.seen.add(S)
        if not first:
            m.verify[S] = ema(m.verify.get(S), verify_time, DECAY)
            spec = S > 1
            d = self.RATE_DECAY
            m.tokens[spec] = d * m.tokens[spec] + tokens
            m.seconds[spec] = d * m.seconds[spec] + seconds
            m.rounds[spec] += 1
        m.since_plain = m.since_plain + 1 if S > 1 else 0
        for drafter, (t, steps) in draft_times.items():
            if steps == 0:
                self.catching_up.add(drafter)  # after plain rounds, a drafter first reads what it missed
            elif first or drafter in self.catching_up:
                self.catching_up.discard(drafter)
            else:
                self.draft_cost[drafter] = ema(self.draft_cost.get(drafter), t / steps, DECAY)
        for key, k, n in zip(keys, ks, accepted):
            if k:
                self.acceptance.setdefault(key, Acceptance()).update(k, n)
