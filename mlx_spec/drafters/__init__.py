"""Drafters, one file per method, and `--drafter SPEC` parsing.

SPEC is `KIND` or `KIND=SOURCE`: `none`, `lookup`, `suffix`, `draft=PATH_OR_REPO`.
"""

from __future__ import annotations

from pathlib import Path

from mlx_spec.drafters.base import Draft, Drafter
from mlx_spec.errors import UserError

KINDS = ("none", "lookup", "suffix", "draft")


def make_drafter(
    spec: str,
    target_vocab: int,
    target_tokenizer=None,
    revision: str | None = None,
    ngram: tuple[int, int] = (1, 4),
) -> Drafter | None:
    """The drafter SPEC names, for a target with `target_vocab` logits; None for plain decoding."""
    kind, _, source = spec.partition("=")
    if kind not in KINDS:
        raise UserError(f"--drafter: unknown kind '{kind}' (known: {', '.join(KINDS)})")
    needs_source = kind == "draft"
    if needs_source and not source:
        raise UserError(f"--drafter {kind}: give the model as {kind}=PATH_OR_REPO")
    if source and not needs_source:
        raise UserError(f"--drafter {kind}: takes no source, got '{source}'")
    if kind == "none":
        return None
    if kind == "lookup":
        from mlx_spec.drafters.lookup import PromptLookup

        return PromptLookup(*ngram)
    if kind == "suffix":
        from mlx_spec.drafters.suffix import SuffixDecoding

        return SuffixDecoding()
    from mlx_spec.drafters.draft_model import DraftModel
    from mlx_spec.models import load_model
    from mlx_spec.tokenizer import check_same_vocab, load_tokenizer

    model, path = load_model(source, revision)
    if target_tokenizer is not None:
        check_same_vocab(load_tokenizer(Path(path)), target_tokenizer, f"--drafter {spec}", "the target")
    return DraftModel(model, target_vocab)


__all__ = ["Draft", "Drafter", "make_drafter"]
