"""What `mlx-spec bench` reports: a method's row, the seed's predicted speedup, the progress line on
stderr, the table for the terminal and the plot."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mlx_spec import distributed
from mlx_spec.errors import UserError
from mlx_spec.metrics import Metrics, expected_tokens

PLAIN = "mlx-spec"
CONTROL = "mlx-spec, again"  # batches: plain decoding measured again, as a method is


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


@dataclass
class MethodRow:
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
        predicted, why = predict(self.metrics, 1 / plain_tps, median(self.ratios))
        return {
            "name": self.name,
            "temp": self.temp,
            "decode_tps": median(tps),
            "decode_tps_min": tps[0],
            "decode_tps_max": tps[-1],
            "prompt_tps": median(self.prompt_tps),
            "ratio_to_plain": median(self.ratios),
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
            "of_bound": median(self.rounds_per_s) / bound_tps if bound_tps else None,
            "peak_memory_mb": self.peak / 2**20,
            # where a round's time goes: the host's work with the device idle, and the rest (the device's)
            **{k: m[k] for k in ("host_ms_per_round", "verify_ms_per_round", "draft_ms_per_round", "k_chosen")},
        }


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



def _header(report: dict) -> list[str]:
    """What was run, and what the machine and the target cost: the lines above the table."""
    mlx_lm = ", mlx-lm's rows too" if any(r["name"].startswith("mlx-lm") for r in report["rows"]) else ""
    lines = [
        f"{report['model']}: {report['parameters'] / 1e6:.1f}M parameters; {report['prompts']} prompts "
        f"(mean {report['prompt_tokens']:.0f} tokens) x {report['repeats']} repeats, {report['max_tokens']} tokens each",
        f"computing in {report['dtype']}{mlx_lm}; memory bandwidth {report['bandwidth_gbs']:.1f} GB/s "
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
    return lines


def format_report(report: dict) -> str:
    """The report as a table for the terminal."""
    lines = _header(report)
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
