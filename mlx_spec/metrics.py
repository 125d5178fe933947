"""What a speculative run achieved, computed from its step events."""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(alpha: float, k: float) -> float:
    """Tokens a round of k drafts yields when each is accepted with probability alpha: 1 + alpha + ... + alpha^k
    (Leviathan et al.)."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class TokenLogprob:
    """A committed token's log-probability under the target, and the most likely tokens there."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token, log-probability), most likely first


@dataclass
class StepEvent:
    tokens: list[int]  # committed this step, in order
    from_draft: list[bool]  # which of `tokens` came from the draft
    drafted: list[int] = field(default_factory=list)  # what the drafter proposed (a tree's nodes in order)
    draft_time: float = 0.0  # seconds the host spent drafting (building a model's drafts, or copying)
    verify_time: float = 0.0  # seconds from the drafts' dispatch to the verdicts read (the device's work)
    tree_depth: int | None = None  # for a tree draft: its depth
    logprobs: list[TokenLogprob] | None = None  # one per token, for a row that asked for them
    host_time: float = 0.0  # seconds of the round's host work with nothing queued on the device
    why: object = None  # the policy's `Decision` for the round

    @property
    def depth(self) -> int:
        """Draft positions verified this round: a chain's length, a tree's depth."""
        return len(self.drafted) if self.tree_depth is None else self.tree_depth

    @property
    def accepted(self) -> int:
        return sum(self.from_draft)


@dataclass
class Metrics:
    steps: int = 0  # target forwards while decoding (one per round)
    drafting_rounds: int = 0  # rounds that drafted something
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    positions: int = 0  # draft positions verified, summed over rounds (a tree counts its depth)
    draft_time: float = 0.0
    verify_time: float = 0.0
    host_time: float = 0.0
    chosen: dict[int, int] = field(default_factory=dict)  # K the policy chose -> rounds
    # reached[i]: rounds whose draft position i was verified (all before it accepted)
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def add(self, event: StepEvent) -> None:
        self.steps += 1
        self.drafting_rounds += bool(event.drafted)
        self.tokens += len(event.tokens)
        self.drafted += len(event.drafted)
        self.accepted += event.accepted
        self.positions += event.depth
        self.draft_time += event.draft_time
        self.verify_time += event.verify_time
        self.host_time += event.host_time
        if event.why is not None:
            self.chosen[event.why.k] = self.chosen.get(event.why.k, 0) + 1
        n, k = event.accepted, event.depth
        while len(self.reached) < k:
            self.reached.append(0)
            self.accepted_at.append(0)
        for i in range(min(n + 1, k)):
            self.reached[i] += 1
            self.accepted_at[i] += i < n

    def merge(self, other: "Metrics") -> None:
        """Add another run's counts (a chat session sums its answers)."""
        for name in ("steps", "drafting_rounds", "tokens", "drafted", "accepted", "positions", "draft_time",
                     "verify_time", "host_time"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for i, (r, a) in enumerate(zip(other.reached, other.accepted_at)):
            if i == len(self.reached):
                self.reached.append(0)
                self.accepted_at.append(0)
            self.reached[i] += r
            self.accepted_at[i] += a
        for k, n in other.chosen.items():
            self.chosen[k] = self.chosen.get(k, 0) + n

    @property
    def tau(self) -> float:
        """Mean tokens committed per target forward (accepted drafts + 1)."""
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(draft position i accepted | positions before it accepted)."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached)]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def alpha(self) -> float:
        """Per-position acceptance pooled over positions: P(accepted | reached)."""
        reached = sum(self.reached)
        return sum(self.accepted_at) / reached if reached else 0.0

    @property
    def draft_overhead(self) -> float:
        """c: time to draft one token (a tree: one node) over the time of one target forward."""
        if not self.drafted or not self.verify_time:
            return 0.0
        return (self.draft_time / self.drafted) / (self.verify_time / self.steps)

    def as_dict(self) -> dict:
        return {
            "tau": self.tau,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_by_position": self.acceptance_by_position,
            "target_forwards": self.steps,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "draft_overhead": self.draft_overhead,
            "draft_ms_per_round": 1e3 * self.draft_time / self.drafting_rounds if self.drafting_rounds else 0.0,
            # The host's work a round with nothing queued on the device (drafting's, then the verdicts' cuts,
            # commits and the policy), beside the time from the drafts' dispatch to the verdicts.
            "host_ms_per_round": 1e3 * self.host_time / self.steps if self.steps else 0.0,
            "verify_ms_per_round": 1e3 * self.verify_time / self.steps if self.steps else 0.0,
            "k_chosen": dict(sorted(self.chosen.items())),
        }
