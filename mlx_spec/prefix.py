"""The server's prompt cache: what a finished request left in the target's cache (and in its drafter's
row), kept for the next request that begins with the same tokens.

Chat clients and agents send the whole conversation every turn; the next turn's prompt starts with
the last one's prompt and answer. An entry holds the tokens a request's cache held when it ended, a
copy of that cache as one row, and its drafter's row as a one-row session (`Drafter.split`: a draft
model's cache, EAGLE's and DFlash's features, ...). A new request takes the entry sharing the longest
prefix with its prompt, cut to that prefix, and reads only the rest; its drafter's session keeps what
still matches it (`Drafter.restart`, as a chat's next turn does). A cache of keys and values can be
cut anywhere; a linear-attention layer's state (Qwen3.5, Qwen3-Next) is the state after all its
tokens and cannot go back, so an entry holding one serves only prompts that contain it whole: such a
target's entries are also taken where its prompts end (before the answer), which the conversation's
next turn contains whole even where the template writes the answer otherwise than it was generated.

Entries are evicted least recently used first, to stay under a bound in bytes (the arrays they hold).
Greedy output is what reading the prompt anew gives (up to the last bits of the floating-point sums
where the forward's shapes differ; bit for bit under --exact).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

from mlx_spec.cache import RecurrentCache, rewound
from mlx_spec.drafters.base import Drafter, common_prefix


@dataclass
class Entry:
    tokens: list[int]  # what the cache holds: the keys and values of each
    cache: list  # one row per layer
    session: Drafter | None  # the drafter's row that followed `tokens` (None: a new one reads them)
    nbytes: int

    @property
    def whole(self) -> bool:
        """Whether it serves only prompts that contain it whole (a linear-attention layer's state)."""
        return any(isinstance(c, RecurrentCache) for c in self.cache)


def default_bytes() -> int:
    """An eighth of the machine's memory."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    except (ValueError, OSError, AttributeError):
        return 2 << 30


class PrefixCache:
    """Entries by the tokens they hold, least recently used first out, under `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0
        self.hit_tokens = 0

    def lookup(self, prompt: list[int], fresh) -> tuple[int, list, Drafter | None] | None:
        """The longest usable prefix of `prompt` an entry holds (never the whole prompt: its last token is
        read for its logits): (its length, a copy of the cache cut to it, a copy of the drafter's session).
        `fresh()` makes an empty cache (where cutting cannot go back so far). None: no entry shares any."""
        best, best_n = None, 0
        for key, entry in self.entries.items():
            n = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
            if entry.whole and n < len(entry.tokens):
                continue
            if n > best_n:
                best, best_n = key, n
        if best is None:
            self.misses += 1
            return None
        entry = self.entries[best]
        self.entries.move_to_end(best)
        self.hits += 1
        self.hit_tokens += best_n
        cache = rewound([c.row(0) for c in entry.cache], best_n, fresh)
        session = entry.session.split(0) if entry.session is not None else None
        return best_n, cache, session

    def store(self, tokens: list[int], cache: list, session: Drafter | None) -> None:
        """Keep what a request's cache holds (`Decoder.snapshot`); an entry it extends (the same conversation's
        earlier turn) is dropped, but for one whose state serves only prompts containing it whole."""
        if not tokens or self.max_bytes <= 0:
            return
        nbytes = sum(c.nbytes for c in cache) + sum(c.nbytes for c in getattr(session, "caches", ()))
        if nbytes > self.max_bytes:
            return
        for key, entry in list(self.entries.items()):
            if len(entry.tokens) <= len(tokens) and common_prefix(entry.tokens, tokens) == len(entry.tokens) \
                    and not entry.whole:
                self._drop(key)
        key = hash(tuple(tokens))
        if key in self.entries:
            self._drop(key)
        self.entries[key] = Entry(list(tokens), cache, session, nbytes)
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: int) -> None:
        self.bytes -= self.entries.pop(key).nbytes
