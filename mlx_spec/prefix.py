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

With a directory, each entry's target cache is also written there (one safetensors file: the arrays,
the tokens, what model they are of and a SHA-256 of it all), for the server's next start; a
drafter's row is not (it reads those tokens anew, or a drafter reading the target's features starts
the prompt over). A file is written beside its place and renamed into it once whole and synced, so
a kill leaves at most a temporary file, which the next start removes; a file that does not read
whole, does not match its checksum or is another model's is ignored with a warning. The directory
holds at most the same bound, oldest files out first.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_spec.cache import KVCache, RecurrentCache, parts, rewound
from mlx_spec.drafters.base import Drafter, common_prefix
from mlx_spec.errors import UserError

FORMAT = "mlx-spec prompt cache 1"


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
    """Entries by the tokens they hold, least recently used first out, under `max_bytes`; with a
    `directory`, kept there too for a model that `model` names (a digest of its checkpoint)."""

    def __init__(self, max_bytes: int, directory: str | Path | None = None, model: str = ""):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0
        self.directory, self.model = Path(directory) if directory else None, model
        self.files: dict[Path, tuple[list[int], bool]] = {}  # the directory's entries: their tokens, `whole`
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise UserError(f"--prompt-cache-dir {directory}: cannot keep entries there ({e.strerror or e})") from None
            self._scan()

    def lookup(self, prompt: list[int], fresh) -> tuple[int, list, Drafter | None] | None:
        """The longest usable prefix of `prompt` an entry holds (never the whole prompt: its last token is
        read for its logits): (its length, a copy of the cache cut to it, a copy of the drafter's session).
        `fresh()` makes an empty cache (where cutting cannot go back so far). None: no entry shares any."""
        best, best_n = max(((_usable(e.tokens, e.whole, prompt), key) for key, e in self.entries.items()),
                           default=(0, None))[::-1]
        n, path = max(((_usable(tokens, whole, prompt), path) for path, (tokens, whole) in self.files.items()
                       if hash(tuple(tokens)) not in self.entries), default=(0, None))
        if n > best_n:  # an entry only on disk (a previous start's) serves better
            key = self._load(path, fresh)
            if key is not None:
                best, best_n = key, n
        if not best_n:
            self.misses += 1
            return None
        entry = self.entries[best]
        self.entries.move_to_end(best)
        self.hits += 1
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
        self._add(key, Entry(list(tokens), cache, session, nbytes))
        if self.directory is not None:
            self._write(tokens, cache)

    def _add(self, key: int, entry: Entry) -> None:
        self.entries[key] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: int) -> None:
        self.bytes -= self.entries.pop(key).nbytes

    # On disk: one safetensors file an entry (its target cache), written whole or not at all.

    def _write(self, tokens: list[int], cache: list) -> None:
        arrays, kinds = {}, []
        for i, c in enumerate(parts(cache)):
            n = c.lengths[0]
            if isinstance(c, RecurrentCache):
                kinds.append("recurrent")
                arrays.update({f"{i}.{j}": a for j, a in enumerate(c.arrays.cache) if a is not None})
            else:
                kinds.append("kv")
                if c.keys is not None:
                    arrays[f"{i}.keys"], arrays[f"{i}.values"] = c.keys[..., :n, :], c.values[..., :n, :]
        meta = {"format": FORMAT, "model": self.model, "tokens": json.dumps(list(tokens)), "kinds": json.dumps(kinds)}
        meta["sha256"] = _digest(meta, arrays)
        name = hashlib.sha256(f"{self.model} {meta['tokens']}".encode()).hexdigest()[:32] + ".safetensors"
        try:
            fd, temp = tempfile.mkstemp(dir=self.directory, prefix=".writing-", suffix=".safetensors")
            os.close(fd)
            mx.save_safetensors(temp, arrays, metadata=meta)
            with open(temp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(temp, self.directory / name)  # the entry appears whole, or not at all
        except OSError as e:
            _warn(f"{self.directory}: an entry could not be written ({e.strerror or e})")
            return
        self.files[self.directory / name] = (list(tokens), "recurrent" in kinds)
        files = sorted(self.files, key=lambda p: p.stat().st_mtime if p.exists() else 0)
        while sum(p.stat().st_size for p in files if p.exists()) > self.max_bytes and len(files) > 1:
            oldest = files.pop(0)
            oldest.unlink(missing_ok=True)
            del self.files[oldest]

    def _scan(self) -> None:
        """The directory's entries: a temporary file left by a kill removed, a foreign or broken one ignored."""
        for path in sorted(self.directory.glob("*.safetensors")) + sorted(self.directory.glob(".writing-*")):
            if path.name.startswith(".writing-"):
                _warn(f"{path}: an entry left half written (the server stopped while writing it): removed")
                path.unlink(missing_ok=True)
                continue
            meta = _header(path)
            if meta is None or meta.get("format") != FORMAT:
                _warn(f"{path}: not a prompt cache entry this mlx-spec reads, or not whole: ignored")
            elif meta.get("model") != self.model:
                _warn(f"{path}: an entry of another model: ignored")
            else:
                self.files[path] = (json.loads(meta["tokens"]), "recurrent" in json.loads(meta["kinds"]))

    def _load(self, path: Path, fresh) -> int | None:
        """The entry in `path` into memory (its key), checked against its checksum; None: it is not good."""
        tokens, _ = self.files[path]
        try:
            arrays, meta = mx.load(str(path), return_metadata=True)
            if meta.get("sha256") != _digest({k: v for k, v in meta.items() if k != "sha256"}, arrays):
                raise ValueError("its checksum does not match")
            cache = fresh()
            if len(parts(cache)) != len(json.loads(meta["kinds"])):
                raise ValueError("its layers are not this model's")
            for i, (c, kind) in enumerate(zip(parts(cache), json.loads(meta["kinds"]))):
                if kind == "recurrent":
                    for j in range(2):
                        c.arrays[j] = arrays.get(f"{i}.{j}")
                elif f"{i}.keys" in arrays:
                    c.keys, c.values = arrays[f"{i}.keys"], arrays[f"{i}.values"]
                c.lengths = [len(tokens)]
                if not isinstance(c, (KVCache, RecurrentCache)) or (kind == "recurrent") != isinstance(c, RecurrentCache):
                    raise ValueError("its layers are not this model's")
        except Exception as e:  # a file is outside input: whatever it holds costs only itself
            _warn(f"{path}: ignored ({type(e).__name__}: {e})".splitlines()[0])
            del self.files[path]
            return None
        key, nbytes = hash(tuple(tokens)), sum(c.nbytes for c in cache)
        if nbytes > self.max_bytes:
            return None
        self._add(key, Entry(tokens, cache, None, nbytes))
        return key


def _usable(tokens: list[int], whole: bool, prompt: list[int]) -> int:
    """How much of `prompt` an entry of `tokens` serves: their common prefix, but never the prompt's last
    token (read for its logits); 0 for one that serves only prompts containing it whole and is not."""
    n = min(common_prefix(tokens, prompt), len(prompt) - 1)
    return 0 if whole and n < len(tokens) else n


def _digest(meta: dict, arrays: dict) -> str:
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(arrays):
        h.update(name.encode() + np.array(arrays[name].astype(mx.float32) if arrays[name].dtype == mx.bfloat16
                                          else arrays[name]).tobytes())
    return h.hexdigest()


def _header(path: Path) -> dict | None:
    """The metadata of a safetensors file whose size is what its header says; None: it is not whole."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return header.get("__metadata__", {}) if path.stat().st_size == 8 + n + end else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _warn(message: str) -> None:
    print(f"mlx-spec: prompt cache: {message}", file=sys.stderr, flush=True)
