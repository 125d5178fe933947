"""`GET /metrics`: the server's counters in Prometheus' text format (version 0.0.4).

Requests by how they ended; prompt tokens, those the prompt cache held (not read again) and
completion tokens; prefill and decode speed over the server's life; the drafter's tokens per target
forward (tau), acceptance and acceptance by draft position; the prompt cache's hits, misses, entries
and bytes; the requests running and waiting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_spec.metrics import Metrics


@dataclass
class ServerStats:
    drafter: str
    ended: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decoding: Metrics = field(default_factory=Metrics)

    def joined(self, prompt: int, cached: int, seconds: float) -> None:
        """A request read its prompt: `prompt` tokens, `cached` of them from the prompt cache, in `seconds`."""
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.prefill_seconds += seconds

    def ended_with(self, reason: str, tokens: int = 0, seconds: float = 0.0, metrics: Metrics | None = None) -> None:
        self.ended[reason] = self.ended.get(reason, 0) + 1
        self.completion_tokens += tokens
        self.decode_seconds += seconds
        if metrics is not None:
            self.decoding.merge(metrics)

    def render(self, running: int, waiting: int, cache=None) -> str:
        m, d = self.decoding, f'drafter="{_label(self.drafter)}"'
        read = self.prompt_tokens - self.cached_tokens
        lines = [
            *_metric("mlx_spec_requests_total", "counter", "requests ended, by finish reason",
                     [(f'reason="{_label(r)}"', n) for r, n in sorted(self.ended.items())]),
            *_metric("mlx_spec_prompt_tokens_total", "counter", "prompt tokens of the requests admitted",
                     [("", self.prompt_tokens)]),
            *_metric("mlx_spec_prompt_tokens_cached_total", "counter",
                     "prompt tokens the prompt cache held (not read again)", [("", self.cached_tokens)]),
            *_metric("mlx_spec_completion_tokens_total", "counter", "tokens answered", [("", self.completion_tokens)]),
            *_metric("mlx_spec_prefill_tokens_per_second", "gauge", "prompt tokens read per second of prefill",
                     [("", read / self.prefill_seconds if self.prefill_seconds else 0.0)]),
            *_metric("mlx_spec_decode_tokens_per_second", "gauge", "tokens answered per second of a request's decoding",
                     [("", self.completion_tokens / self.decode_seconds if self.decode_seconds else 0.0)]),
            *_metric("mlx_spec_tau", "gauge", "tokens committed per target forward", [(d, m.tau)]),
            *_metric("mlx_spec_drafted_tokens_total", "counter", "tokens drafted", [(d, m.drafted)]),
            *_metric("mlx_spec_accepted_tokens_total", "counter", "drafted tokens accepted", [(d, m.accepted)]),
            *_metric("mlx_spec_acceptance_by_position", "gauge",
                     "P(draft position accepted | the positions before it accepted)",
                     [(f'{d},position="{i}"', a) for i, a in enumerate(m.acceptance_by_position)]),
            *_metric("mlx_spec_requests_running", "gauge", "requests in the batch", [("", running)]),
            *_metric("mlx_spec_requests_waiting", "gauge", "requests waiting to join the batch", [("", waiting)]),
        ]
        if cache is not None:
            lines += [
                *_metric("mlx_spec_prompt_cache_hits_total", "counter", "requests that started from a cached prefix",
                         [("", cache.hits)]),
                *_metric("mlx_spec_prompt_cache_misses_total", "counter", "requests that found none",
                         [("", cache.misses)]),
                *_metric("mlx_spec_prompt_cache_entries", "gauge", "entries held", [("", len(cache.entries))]),
                *_metric("mlx_spec_prompt_cache_bytes", "gauge", "bytes the entries hold", [("", cache.bytes)]),
                *_metric("mlx_spec_prompt_cache_max_bytes", "gauge", "the bound", [("", cache.max_bytes)]),
            ]
        return "\n".join(lines) + "\n"


def _metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> list[str]:
    out = [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
    return out + [f"{name}{{{labels}}} {value}" if labels else f"{name} {value}" for labels, value in samples]


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
