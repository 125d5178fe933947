"""Suffix decoding (Oliaro et al., 2024): draft from a frequency-counting suffix
trie over everything this session has seen (prompts and outputs).

The trie holds every substring of up to `max_depth` tokens with how often it
occurred. To draft, take the longest suffix of the context that has occurred
before with a continuation, then follow the most frequent continuation while
the estimated probability that the whole draft is right stays above
`min_prob`, and for at most `alpha` times the match length: a long match
is strong evidence, a one-token match is weak.

New text makes a node for each of its suffixes (about 4 KB of Python objects
a token): a session that has counted `max_nodes` (a server's, over many
requests) starts again from the rows it has in flight, each counting its own
context anew at its next commit.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_spec.drafters.base import Draft, HostDrafter, Kind
from mlx_spec.errors import UserError
from mlx_spec.sampling import SamplingParams


class SuffixTrie:
    """Substring counts, stored flat: node ids index the lists."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.child: dict[tuple[int, int], int] = {}  # (node, token) -> node
        self.count = [0]  # occurrences of the node's substring
        self.continuations = [0]  # occurrences that were followed by a token
        self.best = [-1]  # most frequent child node, -1 if none
        self.best_token = [-1]

    def append(self, active: list[int], token: int) -> list[int]:
        """Count `token` after a document's suffixes (`active`: their nodes, `active[i]` the suffix of i tokens;
        `[0]` for a new document); returns the suffixes it ends with. (Every token of new text makes a node for
        each of its suffixes: this runs a round for every row, its lists bound to locals.)"""
        child_of, count, continuations, best, best_token = (self.child, self.count, self.continuations, self.best,
                                                              self.best_token)
        grown = [0]
        for node in active[: self.max_depth]:  # a suffix of max_depth tokens grows no longer
            child = child_of.get((node, token))
            if child is None:
                child = child_of[(node, token)] = len(count)
                count.append(1), continuations.append(0), best.append(-1), best_token.append(-1)
            else:
                count[child] += 1
            continuations[node] += 1
            if best[node] < 0 or count[child] > count[best[node]]:
                best[node], best_token[node] = child, token
            grown.append(child)
        return grown

    def longest_match(self, active: list[int]) -> tuple[int, int]:
        """The deepest of a document's suffix nodes that has a continuation, and its depth ((0, 0) if none)."""
        for depth in range(len(active) - 1, 0, -1):
            if self.best[active[depth]] >= 0:
                return active[depth], depth
        return 0, 0

    def match(self, seq: list[int]) -> int:
        """The deepest node for a suffix of `seq` that has a continuation (0 if none)."""
        for start in range(max(0, len(seq) - self.max_depth + 1), len(seq)):
            node = 0
            for token in seq[start:]:
                node = self.child.get((node, token), -1)
                if node < 0:
                    break
            if node > 0 and self.best[node] >= 0:
                return node
        return 0


class SuffixDecoding(HostDrafter):
    """Rows share the trie (everything the session has seen); each has its own suffixes."""

    kind = "suffix"
    guesses = True
    k_max = 16  # a copy costs nothing to draft: only the verification grows with it

    def __init__(self, max_depth: int = 24, alpha: float = 2.0, min_prob: float = 0.1, max_nodes: int = 1 << 20):
        super().__init__()
        if max_depth < 2 or alpha <= 0 or not 0 <= min_prob < 1:
            raise UserError("--drafter suffix: need max_depth >= 2, alpha > 0, 0 <= min_prob < 1")
        self.trie = SuffixTrie(max_depth)
        self.alpha, self.min_prob, self.max_nodes = alpha, min_prob, max_nodes  # (about 160 MB at the default)
        self.counted = 0  # tokens the trie has counted

    def _session(self) -> SuffixDecoding:
        return SuffixDecoding(self.trie.max_depth, self.alpha, self.min_prob, self.max_nodes)

    def split(self, b: int) -> None:
        # A row's suffixes are nodes of this session's trie, which a session of its own would not hold; and a row
        # that starts again counts its prompt anew (`restart`): the server's prompt cache keeps no session of it.
        return None

    def restart(self, b: int, prompt: list[int], cached: int = 0) -> int:
        # Earlier generations of the session stay in the trie: a new document starts.
        self.states[b] = ([0], 0)  # (the row's suffix nodes, tokens of its context counted)
        self.commit(b, prompt)
        return cached

    def commit(self, b: int, context: list[int], features: tuple[mx.array, ...] = ()) -> None:
        active, seen = self.states[b]
        for token in context[seen:]:
            active = self.trie.append(active, token)
        self.states[b], self.counted = (active, len(context)), self.counted + len(context) - seen
        if len(self.trie.count) > self.max_nodes and self.counted > sum(n for _, n in self.states):  # (more than
            self.trie, self.counted = SuffixTrie(self.trie.max_depth), 0  # the rows in flight): they count their
            self.states = [([0], 0) for _ in self.states]  # contexts anew, in a new trie, at their next commits

    def propose_row(self, b: int, context: list[int], k: int, params: SamplingParams) -> Draft:
        return Draft(mx.array(self._draft(b, context, k), dtype=mx.int32))

    def guess(self, b: int, context: list[int]) -> int | None:
        return next(iter(self._draft(b, context, 1)), None)

    def _draft(self, b: int, context: list[int], k: int) -> list[int]:
        trie = self.trie
        node, depth = trie.longest_match(self.states[b][0])
        limit = min(k, int(self.alpha * depth))
        tail = context[-trie.max_depth :]
        tokens: list[int] = []
        prob = 1.0
        while len(tokens) < limit and node > 0:
            if trie.best[node] < 0:  # past the trie's depth: match a shorter suffix
                node = trie.match(tail + tokens)
                continue
            child = trie.best[node]
            prob *= trie.count[child] / trie.continuations[node]
            if prob < self.min_prob:
                break
            tokens.append(trie.best_token[node])
            node = child
        return tokens


KINDS = (Kind("suffix", "a suffix trie of everything this session has seen, most frequent continuation first",
              lambda target, o: SuffixDecoding(), source="none"),)
