"""Drafters, one file per method, and the registry of `--drafter` kinds.

SPEC is `KIND` or `KIND=SOURCE`. Each drafter module declares its kinds
(`KINDS`: what it drafts from, whether it takes a source, the shaping options
it takes, how it is built); the CLI's help, the benchmark's settings, the
chat's `/drafter` and `mlx-spec train` read `REGISTRY`. A method from outside
the package is one `register(Kind(...))` away from all of them.
"""

from __future__ import annotations

from typing import Callable, Mapping

from mlx_spec import demo, published
from mlx_spec.drafters import (assistant, dflash, draft_model, eagle, layerskip, lookup, medusa, mtp, mtp_heads, skip,
                               suffix)
from mlx_spec.drafters.base import SHAPING, Draft, Drafter, Kind, Options
from mlx_spec.errors import UserError

REGISTRY: dict[str, Kind] = {k.name: k for module in (lookup, suffix, draft_model, medusa, eagle, dflash, layerskip,
                                                       skip, mtp_heads, mtp, assistant) for k in module.KINDS}


def register(kind: Kind) -> None:
    """Make `kind` a `--drafter` kind as the built-in ones are (and, with a `Recipe`, a `mlx-spec train` command)."""
    if kind.name == "none" or kind.name in REGISTRY or "=" in kind.name:
        raise ValueError(f"a --drafter kind cannot be named '{kind.name}': taken, or not a name")
    REGISTRY[kind.name] = kind


def tree_kinds() -> tuple[str, ...]:
    """The kinds that draft trees within a node budget (`--tree-budget`)."""
    return tuple(name for name, k in REGISTRY.items() if "tree_budget" in k.takes)


def usage() -> str:
    """The `--drafter` help: every kind, what it drafts from, and what it is alone."""
    parts = [f"{k.usage}: {k.summary}" + (f" (alone: {k.alone})" if k.alone else "") for k in REGISTRY.values()]
    return "none (plain decoding, the default) | " + " | ".join(parts)


def make_drafter(spec: str, target, *, target_source: str | None = None,
                 prepare: Callable[[str, str, str | None], str] | None = None, **flags) -> Drafter | None:
    """The drafter SPEC names for `target`; None for plain decoding. `flags` are
    `Options` fields (tokenizer, revision, ngram, tree_paths, tree_budget, depth,
    topk, block_size). Without a SOURCE, a kind that needs one is the drafter of
    that kind published for `target_source` (the `--model` given); for the demo
    target every kind it ships is its own. `prepare(kind, source, revision)`
    returns the folder the kind's loader reads for a source as published (the
    layer above converts it there on first use)."""
    name, _, source = spec.partition("=")
    if name != "none" and name not in REGISTRY:
        raise UserError(f"--drafter: unknown kind '{name}' (known: none, {', '.join(REGISTRY)})")
    options = Options(source=source or None, spec=spec, target_source=target_source, **flags)
    if name == "none":
        if source:
            raise UserError(f"--drafter none: takes no source, got '{source}'")
        return None
    kind = REGISTRY[name]
    for field, flag in SHAPING.items():
        if getattr(options, field) is not None and field not in kind.takes:
            takers = ", ".join(k.name for k in REGISTRY.values() if field in k.takes)
            raise UserError(f"{flag} needs a drafter that takes it ({takers}), not '{name}'")
    if options.block_size is not None and options.block_size < 2:
        raise UserError(f"--block-size must be >= 2, got {options.block_size}")
    if source and kind.source == "none":
        raise UserError(f"--drafter {name}: takes no source, got '{source}'")
    if not source and kind.source != "none" and target_source is not None:
        options.source = published_source(name, target_source)
    if not options.source and kind.source == "required":
        raise UserError(f"--drafter {name}: give the model as {name}=PATH_OR_REPO")
    if options.source and prepare is not None:
        options.source = prepare(name, options.source, options.revision)
    return kind.build(target, options)


def published_source(kind: str, target_source: str) -> str | None:
    """The demo's own drafter of this kind, or the one published for the target,
    as published (None where the kind alone means something else: the target's
    own MTP modules, LayerSkip's exit, Draft & Verify's search)."""
    if (kind in REGISTRY and REGISTRY[kind].published) or (kind in demo.DRAFTERS and published.is_demo(target_source)):
        return find_drafter(kind, target_source)
    return None


def find_drafter(kind: str, target: str | Mapping) -> str:
    """The published `kind` drafter for `target` (a repo id, a model directory or a config)."""
    if kind not in REGISTRY:
        raise UserError(f"drafter kind '{kind}' is unknown (known: {', '.join(REGISTRY)})")
    return published.find(kind, REGISTRY[kind].published, target)


__all__ = ["Draft", "Drafter", "Kind", "REGISTRY", "find_drafter", "make_drafter", "register", "tree_kinds", "usage"]
