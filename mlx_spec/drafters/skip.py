"""Draft & Verify (Zhang et al. 2023): the target drafts with some of its
intermediate layers skipped, then verifies with all of them.

The skipped model is a draft model like any other (`DraftModel`), only its
weights are the target's: its hidden states, hence its keys and values,
differ from the full model's after the first skipped layer, so it keeps its
own KV cache (one per kept layer) rather than drafting into the target's.

Which layers to skip: given ("3,5,7"), read from a JSON file saved earlier,
or searched on the first prompt (`search_skip`). The paper searches with
Bayesian optimisation over many calibration generations; here a greedy search
adds one layer at a time, scoring each candidate by one teacher-forced forward
over the prompt. That costs O(L^2) forwards of the prompt at most (far fewer
when the score stops improving early), against the hundreds of full
generations a Bayesian optimisation would run, and it can happen at the
start of a generation. A set is written to disk only where a path is given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import mlx.core as mx

from mlx_spec.cache import KVCache
from mlx_spec.drafters.base import Kind
from mlx_spec.drafters.draft_model import DraftModel
from mlx_spec.errors import UserError
from mlx_spec.metrics import expected_tokens
from mlx_spec.models.llama import Model

# Calibration tokens per prompt: the search's forwards cost grows with them,
# and a long prompt's tail says as much about agreement as all of it.
CALIBRATION_TOKENS = 512


class SkipView:
    """The target with layers `skip` left out: the kept layers in order, the
    final norm and the LM head, each kept layer with its own cache slot."""

    def __init__(self, target: Model, skip: Sequence[int]):
        self.target = target
        self.args = target.args
        self.skip = sorted(set(skip))
        self.kept = [i for i in range(target.args.num_hidden_layers) if i not in self.skip]

    def make_cache(self, rows: int = 1) -> list[KVCache]:
        full = self.target.make_cache(rows)
        return [full[i] for i in self.kept]

    def __call__(self, tokens: mx.array, cache: Sequence[KVCache] | None = None) -> tuple[mx.array, tuple]:
        """`tokens` [B, S] -> (logits [B, S, V], no hidden states)."""
        h = self.target.embed(tokens)  # [B, S, H]
        masks = self.target.masks(tokens.shape[1], cache[0] if cache else None, range(self.args.num_hidden_layers))
        for j, i in enumerate(self.kept):
            h = self.target.layer(i, h, masks[i], cache[j] if cache is not None else None, None)
        return self.target.head(h), ()


def search_skip(target: Model, prompts: Sequence[Sequence[int]], k: int = 4) -> list[int]:
    """Layers to skip, chosen greedily on calibration `prompts` (token lists).

    From nothing skipped, each round adds the layer whose removal keeps the
    highest teacher-forced agreement alpha with the full model's argmax; a set
    scores tokens(alpha, k) / (k * kept / L + 1), the expected tokens per
    verification over the cost of k drafts and one verification. The search
    stops when the best score stops improving. The first and last layers are
    never skipped. An empty result means no set is expected to pay.
    """
    L = target.args.num_hidden_layers
    calib = [mx.array(list(p)[-CALIBRATION_TOKENS:])[None] for p in prompts if len(p) > 0]  # each [1, S]
    if L < 3 or not calib:
        return []
    full = [mx.argmax(target(ids)[0][0], axis=-1) for ids in calib]  # each [S]
    total = sum(ids.shape[1] for ids in calib)

    def agreement(skip: list[int]) -> float:
        view = SkipView(target, skip)
        matches = sum((mx.argmax(view(ids)[0][0], axis=-1) == ref).sum() for ids, ref in zip(calib, full))
        return matches.item() / total

    skip: list[int] = []
    best = expected_tokens(1.0, k) / (k + 1)  # nothing skipped: the target drafting for itself, 1.0
    while True:
        kept = L - len(skip) - 1
        scored = [
            (expected_tokens(agreement(skip + [i]), k) / (k * kept / L + 1), i)
            for i in range(1, L - 1)
            if i not in skip
        ]
        if not scored:
            return sorted(skip)
        score, layer = max(scored)
        if score <= best:
            return sorted(skip)
        best = score
        skip.append(layer)


def check_skip(skip: Sequence[int], L: int, what: str) -> list[int]:
    """`skip` as a sorted list, if every layer is an intermediate one (1..L-2), once."""
    if skip and L < 3:
        raise UserError(f"{what}: a {L}-layer model has no intermediate layer to skip")
    if len(set(skip)) != len(skip) or any(not 0 < i < L - 1 for i in skip):
        raise UserError(f"{what}: layers to skip must be distinct integers in 1..{L - 2}, got {list(skip)}")
    return sorted(skip)


def save_skip_set(path: str | Path, skip: Sequence[int], target: Model) -> None:
    Path(path).write_text(json.dumps({"skip": sorted(skip), "num_hidden_layers": target.args.num_hidden_layers}))


def load_skip_set(path: str | Path, target: Model) -> list[int]:
    """The set `save_skip_set` wrote, if it was searched on a target of this depth."""
    L = target.args.num_hidden_layers
    try:
        data = json.loads(Path(path).read_text())
        skip, depth = data["skip"], data["num_hidden_layers"]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise UserError(f"{path}: not a skip-set file ({type(e).__name__}: {e})") from None
    if depth != L:
        raise UserError(f"{path}: a skip set for {depth} layers, the target has {L}")
    if not isinstance(skip, list) or not all(isinstance(i, int) for i in skip):
        raise UserError(f"{path}: 'skip' must be a list of layer indices")
    return check_skip(skip, L, str(path))


class SkipDrafter(DraftModel):
    """A `DraftModel` over `SkipView(target, skip)`. Without `skip`, the set is
    searched on the first prompt `reset` sees (and written to `save_to`, if
    given), then kept for every later generation and session."""

    kind = "skip"

    def __init__(self, target: Model, skip: Sequence[int] | None = None, save_to: Path | None = None):
        self.target, self.save_to = target, save_to
        self.searched = skip is not None
        # Until the search, a view that skips nothing: `reset` replaces it before any draft.
        super().__init__(SkipView(target, skip or ()), target.args.vocab_size)

    @property
    def skip(self) -> list[int] | None:
        return self.model.skip if self.searched else None

    def _session(self) -> SkipDrafter:
        return SkipDrafter(self.target, self.skip, self.save_to)

    def restart(self, b: int, prompt: list[int], cached: int = 0) -> int:
        if not self.searched:
            skip = search_skip(self.target, [prompt])
            if self.save_to is not None:
                save_skip_set(self.save_to, skip, self.target)
            self.model, self.searched = SkipView(self.target, skip), True
            self.cache = self.model.make_cache(self.rows)
            self.cached, self.drafted = [[] for _ in range(self.rows)], [None] * self.rows
        return super().restart(b, prompt, cached)


def skip_drafter(target: Model, spec: str | None = None) -> SkipDrafter:
    """The drafter `--drafter skip[=SPEC]` names. SPEC: layers to skip ("3,5,7");
    a `.json` file (its set, or, if it does not exist yet, the set searched on
    the first prompt, saved there); none: searched on the first prompt."""
    what = f"--drafter skip={spec}"
    L = target.args.num_hidden_layers
    if not target.runs_apart:
        raise UserError(f"--drafter skip: a {target.model_type} target runs whole (on mlx-lm's forward); "
                        "Draft & Verify runs its layers apart")
    if not spec:
        return SkipDrafter(target)
    if spec.endswith(".json"):
        path = Path(spec)
        return SkipDrafter(target, load_skip_set(path, target)) if path.exists() else SkipDrafter(target, save_to=path)
    try:
        layers = [int(s) for s in spec.split(",")]
    except ValueError:
        raise UserError(f"{what}: give layer indices like 3,5,7 or a .json skip-set file") from None
    return SkipDrafter(target, check_skip(layers, L, what))


KINDS = (Kind("skip", "Draft & Verify: the target itself with some middle layers skipped (skip=3,5,7 or skip=FILE.json)",
              lambda target, o: skip_drafter(target, o.source or None), source="optional",
              alone="the set searched on the prompt"),)
