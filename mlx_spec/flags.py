"""The flags the commands of `mlx-spec` share: the model and drafter, sampling, the chat template,
mlx-lm's flag names as aliases, and the checks of their values (one line naming the flag)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Callable

from mlx_spec import hub
from mlx_spec.errors import UserError

INT_MAX = 2**31 - 1  # MLX holds shapes and positions as 32-bit integers
SEED_MAX = 2**64 - 1  # what mx.random.seed takes


def integer(low: int, high: int = INT_MAX) -> Callable[[str], int]:
    """An argparse type: an integer in low..high."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {value}")
        return value
    return parse


def real(low: float, high: float = math.inf, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number >= low (> low where `above`) and <= high."""
    shown = (f"in {'(' if above else '['}{low:g}, {high:g}]" if high < math.inf
             else f"{'>' if above else '>='} {low:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
        if not (math.isfinite(value) and (value > low if above else value >= low) and value <= high):
            raise argparse.ArgumentTypeError(f"must be a finite number {shown}, got {text}")
        return value
    return parse


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("MLX_SPEC_MODEL", "demo"),
                   help="local directory, Hugging Face repo id, or a short name: demo (ships with mlx-spec), "
                        f"{', '.join(hub.ALIASES)} (default: $MLX_SPEC_MODEL, else demo)")
    p.add_argument("--revision", default=None, help="Hub revision of --model (branch, tag or commit)")


def add_drafter_revision(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter-revision", default=None, metavar="REVISION",
                   help="Hub revision of the drafter's repo (branch, tag or commit)")


def add_load_args(p: argparse.ArgumentParser, eos: bool = True) -> None:
    """What the target is loaded with beyond `--model`: adapters, and (`eos`) more stop tokens."""
    p.add_argument("--adapter-path", default=None, metavar="DIR",
                   help="apply the LoRA adapters mlx-lm's trainer saved in DIR to the target")
    if eos:
        p.add_argument("--extra-eos-token", action="extend", nargs="+", default=[], metavar="TOKEN",
                       help="also stop at TOKEN (a token of the vocabulary, or its id), beyond the EOS ids "
                            "of the model's generation config and tokenizer; repeatable")


def load_target(args: argparse.Namespace):
    from mlx_spec import api

    api.check_published(args.drafter, args.model)
    return api.load(args.model, args.revision, extra_eos=args.extra_eos_token, adapter_path=args.adapter_path)


@dataclass(frozen=True)
class Alias:
    """An mlx-lm flag that sets an mlx-spec one: `--draft-model PATH` is `--drafter draft=PATH`."""

    flag: str
    of: str
    default: object  # the mlx-spec flag's default: while it holds it, that flag was not given
    value: Callable[[object], object]


def dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_alias(p: argparse.ArgumentParser, flag: str, of: str, value: Callable[[object], object] = lambda v: v,
               shown: str = "", **kwargs) -> None:
    """`flag` as mlx-lm names it, for `of` (`shown`: how its value reads there)."""
    p.add_argument(flag, dest=dest(flag), default=None, help=f"mlx-lm's name for {of} {shown}".rstrip(), **kwargs)
    aliases = p.get_default("aliases") or []
    p.set_defaults(aliases=aliases + [Alias(flag, of, p.get_default(dest(of)), value)])


def resolve_aliases(args: argparse.Namespace) -> None:
    """Each mlx-lm flag given sets its mlx-spec flag, which must not say otherwise."""
    for alias in getattr(args, "aliases", ()):
        given = getattr(args, dest(alias.flag))
        if given is None:
            continue
        value, current = alias.value(given), getattr(args, dest(alias.of))
        if current != alias.default and current != value:
            raise UserError(f"{alias.flag} {given} and {alias.of} {current}: the same setting twice; give one")
        setattr(args, dest(alias.of), value)


def add_draft_aliases(p: argparse.ArgumentParser, drafter: str, num_draft: bool = True) -> None:
    add_alias(p, "--draft-model", drafter, lambda path: f"draft={path}", "draft=PATH", metavar="PATH")
    if num_draft:
        add_alias(p, "--num-draft-tokens", "--num-draft", type=integer(1), metavar="N")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "-m", type=integer(1), default=256,
                   help="at most this many tokens (the prompt and these within the model's context)")
    p.add_argument("--temp", type=real(0), default=0.0, help="temperature; 0 is greedy")
    p.add_argument("--top-p", type=real(0, 1, above=True), default=1.0)
    p.add_argument("--top-k", type=integer(0), default=0)
    p.add_argument("--min-p", type=real(0, 1), default=0.0)
    p.add_argument("--seed", type=integer(0, SEED_MAX), default=None)


def sampling_of(args: argparse.Namespace):
    import mlx.core as mx

    from mlx_spec.sampling import SamplingParams

    if args.seed is not None:
        mx.random.seed(args.seed)
    return SamplingParams(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)


def add_think_args(p: argparse.ArgumentParser) -> None:
    think = p.add_mutually_exclusive_group()
    think.add_argument("--think", dest="think", action="store_const", const=True, default=None,
                       help="let the model reason first (the chat template's enable_thinking, where it has one)")
    think.add_argument("--no-think", dest="think", action="store_const", const=False,
                       help="answer without reasoning (enable_thinking=False, where the chat template has it)")


RENDERED_BY_MLX_SPEC = ("conversation", "messages", "add_generation_prompt", "tokenize", "continue_final_message")


def add_template_args(p: argparse.ArgumentParser) -> None:
    add_think_args(p)
    p.add_argument("--chat-template-args", default=None, metavar="JSON",
                   help="a JSON object of arguments for the chat template, e.g. '{\"enable_thinking\": false}'")


def template_args_of(args: argparse.Namespace) -> dict:
    """`--chat-template-args` as a dict, checked; `--think/--no-think` must not contradict it."""
    if args.chat_template_args is None:
        return {}
    try:
        template_args = json.loads(args.chat_template_args)
    except json.JSONDecodeError as e:
        raise UserError(f"--chat-template-args: invalid JSON ({e})") from None
    if not isinstance(template_args, dict):
        raise UserError("--chat-template-args: expected a JSON object, e.g. '{\"enable_thinking\": false}'")
    for key in RENDERED_BY_MLX_SPEC:
        if key in template_args:
            raise UserError(f"--chat-template-args: '{key}' is mlx-spec's to set")
    thinking = template_args.get("enable_thinking")
    if args.think is not None and thinking is not None and thinking != args.think:
        flag = "--think" if args.think else "--no-think"
        raise UserError(f"{flag} and --chat-template-args {args.chat_template_args}: they disagree on enable_thinking")
    return template_args


def add_system_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default="", metavar="TEXT", help="the system prompt: a system message before the user's")
    add_alias(p, "--system-prompt", "--system", metavar="TEXT")


def check_think(args: argparse.Namespace, tokenizer) -> None:
    from mlx_spec.tokenizer import has_thinking_switch

    if args.think is not None and not has_thinking_switch(tokenizer):
        flag = "--think" if args.think else "--no-think"
        print(f"mlx-spec: note: {flag} changes nothing: {args.model}'s chat template has no thinking switch",
              file=sys.stderr)


def add_drafter_args(p: argparse.ArgumentParser) -> None:
    from mlx_spec.drafters import usage

    p.add_argument("--drafter", default="none", help=usage())
    add_drafter_revision(p)
    p.add_argument("--num-draft", type=integer(1), default=None,
                   help="draft K tokens a round, a tree's depth (default: adaptive)")
    p.add_argument("--ngram-min", type=integer(1), default=1, help="lookup: shortest n-gram to match")
    p.add_argument("--ngram-max", type=integer(1), default=4, help="lookup: longest n-gram to match")
    p.add_argument("--tree", default=None, metavar="PATHS_JSON",
                   help="tree drafters: a static tree as a JSON list of paths, or a file holding one "
                        "(default: Medusa's mc_sim_7b_63)")
    p.add_argument("--tree-budget", "--ddtree-budget", type=integer(1), default=None,
                   help="tree drafters: a best-first tree of N nodes (EAGLE: a dynamic EAGLE-2 tree; DFlash: DDTree)")
    p.add_argument("--block-size", type=integer(1), default=None,
                   help="DFlash: positions per block (default: the drafter's)")
    p.add_argument("--depth", type=integer(1), default=6, help="EAGLE dynamic trees: the deepest level drafted")
    p.add_argument("--topk", type=integer(1), default=8,
                   help="EAGLE dynamic trees: nodes expanded, and children each, per level")
    p.add_argument("--acceptance", default="exact", choices=("exact", "typical"),
                   help="typical: Medusa's rule, faster at temperature > 0 but NOT distribution-preserving")


def tree_paths(value: str | None) -> list[list[int]] | None:
    """`--tree`: JSON paths inline or in a file, checked."""
    from pathlib import Path

    from mlx_spec.tree import from_paths

    if value is None:
        return None
    where = "--tree"
    text = value
    if not value.lstrip().startswith("["):
        path = Path(value)
        if not path.is_file():
            raise UserError(f"--tree {value}: neither a JSON list nor a file")
        where, text = str(path), path.read_text()
    try:
        paths = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: invalid JSON ({e})") from None
    if not (isinstance(paths, list) and paths and all(
        isinstance(p, list) and p and all(isinstance(r, int) and r >= 0 for r in p) for p in paths
    )):
        raise UserError(f"{where}: expected a list of paths, each a list of ranks >= 0, e.g. [[0], [0, 0], [1]]")
    try:
        from_paths(paths)
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None
    return paths


def drafter_of(args: argparse.Namespace, target):
    """The drafter the flags ask for (None: plain decoding)."""
    from mlx_spec import api

    if args.tree is not None and args.tree_budget is not None:
        raise UserError("--tree and --tree-budget: give one of them")
    return api.drafter(args.drafter, target, revision=args.drafter_revision, ngram=(args.ngram_min, args.ngram_max),
                       tree_paths=tree_paths(args.tree), tree_budget=args.tree_budget, depth=args.depth,
                       topk=args.topk, block_size=args.block_size)


def add_exact_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--exact", action="store_true",
                   help="bit for bit: every target forward one width, plain steps too, so no drafter changes a bit of "
                        "the logits on any backend (checked at start-up; costs plain steps their width)")
