"""Drafters, one file per method, and `--drafter SPEC` parsing.

SPEC is `KIND` or `KIND=SOURCE`: `none`, `lookup`, `suffix`, `draft=PATH_OR_REPO`,
`medusa=PATH_OR_REPO`, `eagle=PATH_OR_REPO` (EAGLE-1 weights), `eagle3=PATH_OR_REPO`,
`dflash=PATH_OR_REPO`, `layerskip[=E]`, `skip[=LAYERS|FILE.json]`, `mtp-heads=PATH`,
`mtp[=PATH]` (MTP modules: the target checkpoint's own, or a folder written by
`mlx_spec.convert.mtp`).
"""

from __future__ import annotations

from pathlib import Path

from mlx_spec.drafters.base import Draft, Drafter
from mlx_spec.errors import UserError
from mlx_spec.models.llama import Model

KINDS = ("none", "lookup", "suffix", "draft", "medusa", "eagle", "eagle3", "dflash", "layerskip", "skip",
         "mtp-heads", "mtp")
TREE_KINDS = ("medusa", "eagle", "eagle3", "dflash", "mtp-heads")
PUBLISHED = ("medusa", "eagle", "eagle3", "dflash")  # kinds the registry knows for some targets
CONVERT_FIRST = ("medusa", "eagle", "eagle3")  # published in layouts `mlx-spec convert` imports


def make_drafter(
    spec: str,
    target: Model,
    target_tokenizer=None,
    revision: str | None = None,
    ngram: tuple[int, int] = (1, 4),
    tree_paths: list[list[int]] | None = None,
    tree_budget: int | None = None,
    depth: int = 6,
    topk: int = 8,
    target_source: str | None = None,
    block_size: int | None = None,
) -> Drafter | None:
    """The drafter SPEC names for `target`; None for plain decoding.

    Medusa takes `tree_paths` (a static tree; by default mc_sim_7b_63) or
    `tree_budget` (nodes of a best-first tree). EAGLE drafts a chain, or with
    `tree_budget` an EAGLE-2 dynamic tree (`depth`, `topk` per depth); DFlash
    one block, or with `tree_budget` a DDTree over the block. Without a
    SOURCE, `dflash` is the drafter published for `target_source` (the
    `--model` given); for the demo target every kind it ships is its own.
    """
    kind, _, source = spec.partition("=")
    if kind not in KINDS:
        raise UserError(f"--drafter: unknown kind '{kind}' (known: {', '.join(KINDS)})")
    if tree_budget is not None and kind not in TREE_KINDS:
        raise UserError(f"--tree-budget needs a tree drafter ({', '.join(TREE_KINDS)}), not '{kind}'")
    if block_size is not None and (block_size < 2 or kind != "dflash"):
        raise UserError(f"--block-size needs the dflash drafter and a size >= 2, got {block_size} for '{kind}'")
    if tree_paths is not None and kind != "medusa":
        raise UserError(f"--tree needs the medusa drafter, not '{kind}'")
    needs_source = kind in ("draft", "medusa", "eagle", "eagle3", "dflash", "mtp-heads", "mtp")
    if kind == "mtp" and not source and target_source is not None:
        needs_source = False  # the target's own MTP modules
    if needs_source and not source and target_source is not None:
        from mlx_spec import demo
        from mlx_spec.convert.registry import find_drafter, is_demo

        demo_kind = kind in demo.DRAFTERS and is_demo(target_source)
        if kind in PUBLISHED or demo_kind:
            source = find_drafter(kind, target_source)
        if kind in CONVERT_FIRST and not demo_kind:
            raise UserError(
                f"--drafter {kind}: the published drafter for {target_source} is {source}; convert it with "
                f"`mlx-spec convert {source} -o DIR --target {target_source}`, then use --drafter {kind}=DIR"
            )
    if needs_source and not source:
        raise UserError(f"--drafter {kind}: give the model as {kind}=PATH_OR_REPO")
    if kind == "layerskip":
        from mlx_spec.drafters.layerskip import LayerSkip

        L = target.args.num_hidden_layers
        if source and not (source.isdigit() and 0 < int(source) < L):
            raise UserError(f"--drafter layerskip={source}: the exit layer must be an integer in 1..{L - 1}")
        return LayerSkip(target, int(source) if source else None)
    if kind == "skip":
        from mlx_spec.drafters.skip import skip_drafter

        return skip_drafter(target, source or None)
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
    if kind == "medusa":
        from mlx_spec.drafters.medusa import Medusa, load_medusa

        heads, path = load_medusa(source, revision)
        check_medusa_fits(heads, target, f"--drafter {spec}")
        return Medusa(heads, target, tree_paths, tree_budget)
    if kind in ("eagle", "eagle3"):
        from mlx_spec.drafters.eagle import Eagle, check_eagle_fits, load_eagle

        net, _, _ = load_eagle(source, revision)
        if (net.version == 1) != (kind == "eagle"):
            raise UserError(f"--drafter {spec}: an EAGLE-{net.version} drafter; use eagle{'3' if net.version == 3 else ''}=")
        check_eagle_fits(net, target, f"--drafter {spec}")
        return Eagle(net, target, tree_budget, topk, depth)
    if kind == "dflash":
        from mlx_spec.drafters.dflash import DFlash, check_dflash_fits, load_dflash

        net, _, _ = load_dflash(source, revision)
        check_dflash_fits(net, target, f"--drafter {spec}")
        return DFlash(net, target, tree_budget, block_size)
    if kind == "mtp":
        from mlx_spec.drafters.mtp import MTP, check_mtp_fits, load_mtp, mtp_from_checkpoint

        if source:
            net, _, _ = load_mtp(source, revision)
        else:  # the target's own modules, from its checkpoint
            from mlx_spec import hub

            if target_source is None:
                raise UserError("--drafter mtp: give the modules as mtp=PATH")
            net = mtp_from_checkpoint(hub.resolve(target_source, revision), target)
        check_mtp_fits(net, target, f"--drafter {spec}")
        return MTP(net, target)
    if kind == "mtp-heads":
        from mlx_spec.drafters.mtp_heads import MTPHeadsDrafter, check_mtp_heads_fit, load_mtp_heads

        heads, _, _ = load_mtp_heads(source, revision)
        check_mtp_heads_fit(heads, target, f"--drafter {spec}")
        return MTPHeadsDrafter(heads, target, tree_budget)
    from mlx_spec.drafters.draft_model import DraftModel
    from mlx_spec.models import load_model
    from mlx_spec.tokenizer import check_same_vocab, load_tokenizer

    model, path = load_model(source, revision)
    if target_tokenizer is not None:
        check_same_vocab(load_tokenizer(Path(path)), target_tokenizer, f"--drafter {spec}", "the target")
    return DraftModel(model, target.args.vocab_size, Path(path))


def check_medusa_fits(heads, target: Model, what: str) -> None:
    """Medusa heads read the target's hidden state and predict its vocabulary."""
    c, a = heads.config, target.args
    if c["hidden_size"] != a.hidden_size:
        raise UserError(f"{what}: heads read hidden size {c['hidden_size']}, the target's is {a.hidden_size}")
    if c["vocab_size"] < a.vocab_size:
        raise UserError(f"{what}: heads predict {c['vocab_size']} tokens, the target has {a.vocab_size}")


__all__ = ["Draft", "Drafter", "make_drafter"]
