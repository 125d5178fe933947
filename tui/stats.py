"""The stats panel: how the drafter did, for the last answer and the session."""

from __future__ import annotations

from mlx_spec.metrics import Metrics


def estimated_speedup(m: Metrics) -> float:
    """Over plain decoding, taking one verification as one plain step (as it is
    when decoding is memory-bound): tokens per round over the round's cost in
    verification times."""
    if not m.steps or not m.verify_time:
        return 1.0
    return m.tau * m.verify_time / (m.verify_time + m.draft_time)


def bar_chart(rates: list[float], width: int = 8) -> list[str]:
    """One line per draft position: a bar and the acceptance rate."""
    lines = []
    for i, rate in enumerate(rates[:width]):
        full = round(rate * 10)
        lines.append(f"  {i + 1:>2} {'█' * full}{'░' * (10 - full)} {rate:4.0%}")
    return lines


def block(title: str, m: Metrics, seconds: float, tokens: int) -> list[str]:
    tps = (tokens - 1) / seconds if tokens > 1 and seconds > 0 else 0.0
    lines = [f"[b]{title}[/b]", f"  {tps:7.1f} tok/s  ({tokens} tokens)"]
    if m.drafted:
        d = m.as_dict()
        lines += [
            f"  {m.tau:7.2f} tokens per target forward",
            f"  {m.steps:7d} target forwards",
            f"  {m.acceptance_rate:7.0%} of drafts accepted",
            f"  {d['draft_ms_per_round']:6.1f} ms drafting per round",
            f"  {estimated_speedup(m):7.2f}x plain (estimated)",
            "  acceptance by position",
            *bar_chart(m.acceptance_by_position),
        ]
    return lines
