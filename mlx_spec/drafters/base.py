"""What every drafter offers the decoding loop."""

from __future__ import annotations

import argparse
import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import mlx.core as mx
import numpy as np

from mlx_spec import tree
from mlx_spec.cache import KVCache
from mlx_spec.sampling import SamplingParams, draw


@dataclass
class Options:
    """What a drafter is built from: `--drafter KIND=SOURCE` and the flags that shape drafters."""

    source: str | None = None  # a folder or Hub repo (None: the kind alone, where it has a meaning)
    revision: str | None = None  # the source repo's revision
    tokenizer: object = None  # the target's (a draft model must share it)
    ngram: tuple[int, int] = (1, 4)  # lookup: shortest and longest n-gram
    tree_paths: list[list[int]] | None = None  # a static tree (Medusa)
    tree_budget: int | None = None  # a best-first tree of this many nodes
    depth: int = 6  # EAGLE dynamic trees: the deepest level
    topk: int = 8  # EAGLE dynamic trees: nodes expanded per level
    block_size: int | None = None  # DFlash: positions per block
    spec: str = ""  # as the user wrote it, for messages
    target_source: str | None = None  # the --model given (Gemma 4's `mtp` alone is its published assistant)


# Options a kind must declare in `Kind.takes` for them to be given (flag, how to tell it was).
SHAPING = {"tree_paths": "--tree", "tree_budget": "--tree-budget", "block_size": "--block-size"}


@dataclass(frozen=True)
class Recipe:
    """How `mlx-spec train KIND` makes a drafter's folder: what the command says it does, the flags it
    adds to those every training command shares (`--data`, `-o`, `--steps`, ...; it may change their
    defaults), and the run (-> exit code): a function, or "module:function", imported when the command
    runs (a trainer imports the drafter that declares it)."""

    description: str
    add_arguments: "Callable[[argparse.ArgumentParser], None]"
    run: "Callable[[argparse.Namespace], int] | str"

    def __call__(self, args: argparse.Namespace) -> int:
        run = self.run
        if isinstance(run, str):
            module, _, name = run.partition(":")
            run = getattr(importlib.import_module(module), name)
        return run(args)


@dataclass(frozen=True)
class Conversion:
    """How a folder published for a kind becomes one its loader reads, the first time it is used
    (`convert/first_use.py`): whether the loader reads the folder as it is (given the folder and its
    config.json), else the `mlx-spec convert` family that converts it ("mtp": the target's MTP
    modules, converted against the target). `whole`: the source is a model, fetched whole."""

    family: str
    as_is: "Callable[[Path, dict], bool]" = lambda path, config: False
    whole: bool = False


@dataclass(frozen=True)
class Kind:
    """A `--drafter` kind, as its module declares it: what it drafts from, whether
    it takes a source (`"required"`, `"optional"`: `alone` says what it is
    without one, or `"none"`), the shaping options it takes, how it is built, how
    `mlx-spec train KIND` trains one (`train`; None: that command does not), how
    a published folder is converted (`convert`; None: read as given), and the
    drafters published for each target (target repo -> drafter repos, the first
    the one `--drafter KIND` alone uses)."""

    name: str
    summary: str
    build: "Callable[[object, Options], Drafter]"
    source: str = "required"
    alone: str = ""
    takes: tuple[str, ...] = ()
    train: Recipe | None = None
    convert: Conversion | None = None
    published: "Mapping[str, tuple[str, ...]]" = field(default_factory=dict)

    @property
    def usage(self) -> str:
        return {"required": f"{self.name}=PATH_OR_REPO", "optional": f"{self.name}[=SOURCE]", "none": self.name}[self.source]


@dataclass
class Draft:
    """A chain or a tree of proposed tokens.

    `tokens` [K] may still be lazy (a batch's drafts are evaluated together, while
    the verification is built). `log_probs` [K, V] are the
    distributions the tokens were drawn from; None for a deterministic drafter
    (the acceptance rule then treats p as one-hot). For a tree, `parents[i]`
    is node i's parent (-1: a child of the last context token; see
    `mlx_spec.tree`) and `log_probs[i]` the distribution node i was drawn
    from given its parent and its earlier siblings.
    """

    tokens: mx.array
    log_probs: mx.array | None = None
    parents: list[int] | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def to_depth(self, k: int) -> Draft:
        """A tree cut to depth <= k (a chain as it is)."""
        return self if self.parents is None else self.only(tree.truncate(self.parents, k))

    def only(self, keep: list[int]) -> Draft:
        """The draft of nodes `keep` alone (ascending; in a tree, each node's parent kept too; in a chain, a prefix)."""
        if self.parents is None:
            n = min(len(keep), len(self))
            return self if n == len(self) else Draft(self.tokens[:n], self.log_probs[:n] if self.log_probs is not None else None)
        if len(keep) == len(self):
            return self
        idx = mx.array(keep, dtype=mx.int32)
        lp = self.log_probs[idx] if self.log_probs is not None else None
        return Draft(self.tokens[idx], lp, tree.subtree(self.parents, keep))

    @classmethod
    def steps(cls, tokens: list[mx.array], dists: list[mx.array | None], ks: list[int]) -> list[Draft]:
        """`rows` from per-step tokens `[B]` and distributions `[B, V]` (None: greedy)."""
        lp = mx.stack(dists, axis=1) if dists and dists[0] is not None else None
        return cls.rows(mx.stack(tokens, axis=1), lp, ks)

    @classmethod
    def rows(cls, tokens: mx.array, lp: mx.array | None, ks: list[int]) -> list[Draft]:
        """Each row's chain from a batch drafted together: tokens `[B, K]`, the
        distributions they were drawn from `[B, K, V]` (None: greedy); row b cut
        to `ks[b]`. Left lazy: the decoder evaluates every draft together, and
        builds the verification while they compute."""
        draft = tokens.astype(mx.int32)
        return [cls(draft[b, :k], lp[b, :k] if lp is not None else None) for b, k in enumerate(ks)]


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (binary search over C-level list compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Drafter(ABC):
    """Drafts for the rows of a batch (a batch of one, alone): row b is the b-th
    sequence added, and rows after it move up when it is removed. `propose`
    drafts for every row at once, with one forward where the method allows;
    `commit` keeps a row's state in step with what the target accepted."""

    kind = "drafter"  # its --drafter kind
    # True when drafting runs a model forward: after plain rounds it first reads what it missed.
    costly = False
    # The target's hidden states this drafter reads (indices as the target's
    # `capture`); the verification returns them to `commit`.
    capture: tuple[int, ...] = ()
    # Self-speculation drafts into the target's own cache: one row only.
    one_row = False
    # True when `guess` names, on the host and at no cost, the token a draft would start with.
    guesses = False
    # The most it drafts a round where K adapts: past it, a drafter that runs a model a step a token pays
    # more than the far positions' acceptance brings back.
    k_max = 8

    @property
    @abstractmethod
    def rows(self) -> int:
        """How many rows the drafter holds."""

    @abstractmethod
    def add(self) -> None:
        """A new last row, with no history (`restart` gives it its prompt)."""

    @abstractmethod
    def remove(self, b: int) -> None:
        """Row b leaves."""

    def restart(self, b: int, prompt: list[int], cached: int = 0) -> int:
        """Row b's next generation starts from `prompt`, and the target's cache holds
        `prompt[:cached]` for it (an earlier chat turn). Returns how many of those
        the target may keep: a drafter whose state follows the target's features
        keeps only what still matches, and the target reads the rest again."""
        return cached

    def bind(self, cache: list, width: int | None = None) -> None:
        """The target's KV cache (self-speculation drafts into it), and the width of its forwards under
        exact verification (`mlx_spec.exact`)."""

    def split(self, b: int) -> "Drafter | None":
        """Row b's state, copied into a one-row session of this drafter's (this one unchanged), for a
        later sequence that starts with the same tokens (the server's prompt cache): it joins a batch
        through `Decoder.add`. None where the drafter cannot (a new session then reads the tokens anew)."""
        return None

    def verify_forward(self, target, inputs: mx.array, cache: list, capture: tuple[int, ...],
                       exact: bool = False) -> tuple[mx.array, tuple[mx.array, ...]]:
        """The target's verification forward over a chain (`exact`: verifying exactly) -> (logits, the
        hidden states of `capture`); a drafter that already ran part of it (LayerSkip) reuses that."""
        return target(inputs, cache, capture=capture, **({"exact": True} if exact else {}))

    def new_session(self) -> "Drafter":
        """A drafter like this one (same weights, same settings) with no rows. What the decoding
        policy learned of this one (its costs, its acceptance) goes on in it, as it does from one
        turn of a chat to the next: they share a `lineage`."""
        session = self._session()
        session.lineage = self.lineage
        return session

    @abstractmethod
    def _session(self) -> "Drafter":
        """A drafter like this one (same weights, same settings) with no rows."""

    @property
    def lineage(self) -> "Drafter":
        """The drafter this one is a session of (itself, when made by `api.drafter`)."""
        return self.__dict__.get("_lineage", self)

    @lineage.setter
    def lineage(self, drafter: "Drafter") -> None:
        self.__dict__["_lineage"] = drafter

    @abstractmethod
    def propose(self, contexts: list[list[int]], ks: list[int], params: list[SamplingParams]) -> list[Draft]:
        """For each row b, up to `ks[b]` tokens to follow `contexts[b]` (its prompt and
        every committed token); k = 0 asks for nothing (an empty draft)."""

    def guess(self, b: int, context: list[int]) -> int | None:
        """The first token row b would draft after `context` (None: it would draft nothing), its state
        unchanged: a plain round then tells how likely that draft was to be accepted."""
        return None

    def catch_up(self, contexts: list[list[int]]) -> int:
        """Run what the rows have committed and not yet read (a prompt's features), so that the next
        `propose` drafts at once; returns how many tokens (positions, all rows together) it read. A row
        joining a batch does this alone, as its prompt is read: in a round, its prompt would be padded into
        every other row's forward. The decoder also calls it before drafting after plain rounds: each call,
        timed apart, tells the policy what a token read costs (what drafting again is weighed by)."""
        return 0

    def commit(self, b: int, context: list[int], features: tuple[mx.array, ...] = ()) -> None:
        """Row b's target accepted up to the end of `context`; drop stale state.

        `features` hold, per `capture` index, the target's hidden states
        `[1, n, H]` of the last n tokens of `context` but its last (which the
        target has not run yet): after a verification, the previous round's
        last token and the accepted drafts; while the prompt is read, a chunk
        of it.
        """


class RowStates(Drafter):
    """A drafter that keeps its rows in lists, one entry per row (the fields
    `new_row` names, with a new row's values), and in batched KV caches (`caches`)."""

    caches: list[KVCache] = []

    def new_row(self) -> dict:
        return {"states": None}  # `restart` fills it

    def __init__(self):
        for name in self.new_row():
            setattr(self, name, [])

    @property
    def rows(self) -> int:
        return len(getattr(self, next(iter(self.new_row()))))

    def add(self) -> None:
        for c in self.caches:
            c.extend(c.empty_row())  # a row holding nothing yet (a draft model's linear-attention layers too)
        for name, value in self.new_row().items():
            getattr(self, name).append(value)

    def remove(self, b: int) -> None:
        for c in self.caches:
            c.remove(b)
        for name in self.new_row():
            del getattr(self, name)[b]

    def split(self, b: int) -> RowStates:
        session = self.new_session()
        for mine, theirs in zip(session.caches, self.caches):
            mine.extend(theirs.row(b))
        for name in self.new_row():
            getattr(session, name).append(_copied(getattr(self, name)[b]))
        return session

    def join(self, other: RowStates) -> None:
        """`other`'s one row (a session that read its prompt alone) becomes this drafter's last row."""
        for c, o in zip(self.caches, other.caches):
            c.extend(o)
        for name in self.new_row():
            getattr(self, name).append(getattr(other, name)[0])


class HostDrafter(RowStates):
    """A drafter whose rows draft one at a time, on the host (lookup, suffix):
    `propose_row` drafts for one row from its state."""

    def propose(self, contexts: list[list[int]], ks: list[int], params: list[SamplingParams]) -> list[Draft]:
        return [self.propose_row(b, c, k, p) if k > 0 else EMPTY()
                for b, (c, k, p) in enumerate(zip(contexts, ks, params))]

    @abstractmethod
    def propose_row(self, b: int, context: list[int], k: int, params: SamplingParams) -> Draft:
        """Up to `k` tokens to follow row b's `context`."""


def _copied(value):
    """A row's state as a structure of its own: lists, tuples and dicts copied all the way down (the
    drafter changes them in place); arrays and numbers shared (never changed in place)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value


def EMPTY() -> Draft:
    """A draft of nothing: the round is plain for that row."""
    return Draft(mx.array([], dtype=mx.int32))


def spread(small: mx.array, d2t: mx.array, vocab: int) -> mx.array:
    """Logits over a draft vocabulary `[..., Vd]` at their target ids (draft id i is target id i + d2t[i], as
    EAGLE-3 and speculators map them) and -inf at the others: `[..., vocab]`."""
    if small.shape[-1] == vocab:
        return small
    full = mx.full((*small.shape[:-1], vocab), float("-inf"), small.dtype)
    full[..., mx.arange(small.shape[-1]) + d2t] = small
    return full


def draw_rows(logits: mx.array, params: list[SamplingParams]) -> tuple[mx.array, mx.array | None]:
    """Each row's token from `logits` `[B, ..., V]` under its own sampling settings
    (rows that share them are drawn together), and the log-probabilities drawn
    from (None when every row is greedy)."""
    groups: dict[SamplingParams, list[int]] = {}
    for b, p in enumerate(params):
        groups.setdefault(p, []).append(b)
    if len(groups) == 1:
        return draw(logits, params[0])
    tokens = [None] * len(params)
    lps = [None] * len(params)
    for p, rows in groups.items():
        t, lp = draw(logits[mx.array(rows)], p)
        for i, b in enumerate(rows):
            tokens[b], lps[b] = t[i], (lp[i] if lp is not None else None)
    if any(lp is not None for lp in lps):
        # A greedy row's draft is deterministic: one-hot, exactly what acceptance assumes for None.
        V = logits.shape[-1]
        lps = [lp if lp is not None else mx.log(mx.arange(V) == t[..., None]) for t, lp in zip(tokens, lps)]
        return mx.stack(tokens), mx.stack(lps)
    return mx.stack(tokens), None


def joined(pending: list[tuple[mx.array, ...]]) -> mx.array | None:
    """A row's target features since it last drafted, `[1, n, taps * H]`, from each round's taps `[1, m, H]`
    (None: none came). Joined when the drafter reads them, not as each round commits: a plain round then
    adds no work of its own."""
    if not pending:
        return None
    taps = [mx.concatenate(tap, axis=1) if len(tap) > 1 else tap[0] for tap in zip(*pending)]
    return mx.concatenate(taps, axis=-1) if len(taps) > 1 else taps[0]


READ_MAX = 512  # the most tokens a drafter's model reads in one forward (as the target's prefill chunks)


def padded_length(n: int) -> int:
    """The length a drafter's catch-up over n new tokens is padded to: n up to 8 (what follows a round
    that drafted), else the next power of two (what follows plain rounds). Each length a forward runs
    is traced (compiled) once: a few lengths, then none new however the plain runs fall."""
    return n if n <= 8 else 1 << (n - 1).bit_length()


def padded(parts: list[mx.array | None], width: int | None = None) -> tuple[mx.array, list[int]]:
    """Per-row `[1, n_b, ...]` arrays (None: nothing) right-padded with zeros to
    one `[B, n_max, ...]`, and each row's n."""
    n = [0 if p is None else p.shape[1] for p in parts]
    like = next(p for p in parts if p is not None)
    width = max(n) if width is None else width
    rows = [mx.zeros((1, width, *like.shape[2:]), like.dtype) if p is None else
            p if p.shape[1] == width else
            mx.concatenate([p, mx.zeros((1, width - p.shape[1], *p.shape[2:]), p.dtype)], axis=1)
            for p in parts]
    return mx.concatenate(rows), n


def depth_tree(logits: mx.array, k: int, paths: list[list[int]] | None = None, budget: int | None = None,
               topk: int = 10) -> Draft:
    """A deterministic tree from one distribution per depth (`logits` `[D, V]`):
    Medusa's heads, DFlash's block. Its nodes are the top candidates of each
    depth, combined along static `paths` (ranks per depth) or, with `budget`,
    the best-first tree of that many nodes by cumulative log-probability; at
    most `k` deep."""
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    topk = min(topk, lp.shape[-1])
    candidates = mx.argsort(-lp, axis=-1)[:, :topk]  # [D, topk], most likely first
    depth_max = min(k, lp.shape[0])
    if budget is not None:
        scores = np.array(mx.take_along_axis(lp, candidates, axis=-1)[:depth_max])  # [D, topk], descending
        paths = tree.best_first(scores, budget)
    else:
        paths = [p for p in paths or [] if len(p) <= depth_max and max(p) < topk]
    if not paths:
        return Draft(mx.array([], dtype=mx.int32))
    parents, depth, rank = tree.from_paths(paths)
    tokens = candidates[mx.array(depth) - 1, mx.array(rank)].astype(mx.int32)  # [N]
    return Draft(tokens, None, parents)


def grow_tree(logits: mx.array, ks: list[int], base: list[int], lengths: Callable[[], list[int]],
              step: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], mx.array], budget: int, topk: int = 8,
              depth: int = 6) -> list[Draft]:
    """EAGLE-2's dynamic tree in a drafter's cache: from each row's root distribution `logits` `[B, 1, V]`, each
    depth expands the `topk` new nodes of most cumulative log-probability; the best `budget` are kept, at most
    min(ks[b], depth) deep. Row b's context: its cache's first `base[b]` slots (`lengths()`: its rows' lengths now).
    `step(ids, positions, mask, parent_rows)` runs all rows' frontiers `[B, F]` into the cache in one forward (a row
    done or drafting nothing runs padding), node i seeing as `mask` `[B, 1, F, max(lengths) + F]` says (context,
    ancestors, itself), its parent at `parent_rows` in the last step's output -> logits `[B, F, V]`."""
    B, F = len(ks), topk
    depth_max = [min(k, depth) for k in ks]
    tokens: list[list[int]] = [[] for _ in range(B)]
    parents: list[list[int]] = [[] for _ in range(B)]
    scores: list[list[float]] = [[] for _ in range(B)]  # cumulative log-probabilities
    slot_of: list[dict[int, int]] = [{} for _ in range(B)]  # node -> its slot in the cache, once run
    frontier = [[-1] if d else [] for d in depth_max]
    parent_rows = np.zeros((B, F), dtype=np.int32)
    for level in range(1, max(depth_max) + 1):
        if level > 1:
            cached = lengths()
            mask = np.zeros((B, 1, F, max(cached) + F), dtype=bool)
            ids = np.zeros((B, F), dtype=np.int32)
            positions = np.zeros((B, F), dtype=np.int32)
            for b in range(B):
                mask[b, 0, np.arange(F), cached[b] + np.arange(F)] = True  # itself (padding too)
                for row, node in enumerate(frontier[b]):
                    mask[b, 0, row, : base[b]] = True
                    for a in tree.path_to(parents[b], node)[:-1]:
                        mask[b, 0, row, slot_of[b][a]] = True
                    slot_of[b][node] = cached[b] + row
                    ids[b, row] = tokens[b][node]
                    positions[b, row] = base[b] - 1 + level - 1
            logits = step(ids, positions, mask, parent_rows)  # [B, F, V]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        top = mx.argsort(-lp, axis=-1)[..., :topk]
        top_lp = mx.take_along_axis(lp, top, axis=-1)
        top, top_lp = np.array(top), np.array(top_lp)
        parent_rows = np.zeros((B, F), dtype=np.int32)
        for b in range(B):
            children = []
            for row, node in enumerate(frontier[b]):
                base_score = scores[b][node] if node >= 0 else 0.0
                for j in range(top.shape[2]):
                    tokens[b].append(int(top[b, row, j]))
                    parents[b].append(node)
                    scores[b].append(base_score + float(top_lp[b, row, j]))
                    children.append((len(tokens[b]) - 1, row))
            # The next frontier: the row's most confident new nodes, fed their parents' states.
            best = sorted(children, key=lambda c: -scores[b][c[0]])[:F] if level < depth_max[b] else []
            frontier[b] = [n for n, _ in best]
            parent_rows[b, : len(best)] = [row for _, row in best]
    drafts = []
    for b in range(B):
        if ks[b] == 0:
            drafts.append(EMPTY())
            continue
        keep = tree.top_nodes(parents[b], scores[b], budget)
        drafts.append(Draft(mx.array([tokens[b][i] for i in keep], dtype=mx.int32), None,
                            tree.subtree(parents[b], keep)))
    return drafts
