"""`mlx-spec`: chat | generate | bench | serve | doctor | convert | distill | train.

Bad input ends with one line on stderr naming the file, field or flag, and exit
code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable, NoReturn

import mlx_spec  # noqa: F401  (preloads OpenBLAS before mlx.core)
from mlx_spec import distributed
from mlx_spec import hub
from mlx_spec.serve import READ_TIMEOUT
from mlx_spec.convert import cli as convert_cli
from mlx_spec.train import cli as train_cli
from mlx_spec.errors import UserError


class _Parser(argparse.ArgumentParser):
    """A bad command line is one line too (argparse would print the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


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


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("MLX_SPEC_MODEL", "demo"),
                   help="local directory, Hugging Face repo id, or a short name: demo (ships with mlx-spec), "
                        f"{', '.join(hub.ALIASES)} (default: $MLX_SPEC_MODEL, else demo)")
    p.add_argument("--revision", default=None, help="Hub revision of --model (branch, tag or commit)")


def _add_drafter_revision(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter-revision", default=None, metavar="REVISION",
                   help="Hub revision of the drafter's repo (branch, tag or commit)")


def _add_load_args(p: argparse.ArgumentParser, eos: bool = True) -> None:
    """What the target is loaded with beyond `--model`: adapters, and (`eos`) more stop tokens."""
    p.add_argument("--adapter-path", default=None, metavar="DIR",
                   help="apply the LoRA adapters mlx-lm's trainer saved in DIR to the target")
    if eos:
        p.add_argument("--extra-eos-token", action="extend", nargs="+", default=[], metavar="TOKEN",
                       help="also stop at TOKEN (a token of the vocabulary, or its id), beyond the EOS ids "
                            "of the model's generation config and tokenizer; repeatable")


def _load(args: argparse.Namespace):
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


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _add_alias(p: argparse.ArgumentParser, flag: str, of: str, value: Callable[[object], object] = lambda v: v,
               shown: str = "", **kwargs) -> None:
    """`flag` as mlx-lm names it, for `of` (`shown`: how its value reads there)."""
    p.add_argument(flag, dest=_dest(flag), default=None, help=f"mlx-lm's name for {of} {shown}".rstrip(), **kwargs)
    aliases = p.get_default("aliases") or []
    p.set_defaults(aliases=aliases + [Alias(flag, of, p.get_default(_dest(of)), value)])


def _resolve_aliases(args: argparse.Namespace) -> None:
    """Each mlx-lm flag given sets its mlx-spec flag, which must not say otherwise."""
    for alias in getattr(args, "aliases", ()):
        given = getattr(args, _dest(alias.flag))
        if given is None:
            continue
        value, current = alias.value(given), getattr(args, _dest(alias.of))
        if current != alias.default and current != value:
            raise UserError(f"{alias.flag} {given} and {alias.of} {current}: the same setting twice; give one")
        setattr(args, _dest(alias.of), value)


def _add_draft_aliases(p: argparse.ArgumentParser, drafter: str, num_draft: bool = True) -> None:
    _add_alias(p, "--draft-model", drafter, lambda path: f"draft={path}", "draft=PATH", metavar="PATH")
    if num_draft:
        _add_alias(p, "--num-draft-tokens", "--num-draft", type=integer(1), metavar="N")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "-m", type=integer(1), default=256,
                   help="at most this many tokens (the prompt and these within the model's context)")
    p.add_argument("--temp", type=real(0), default=0.0, help="temperature; 0 is greedy")
    p.add_argument("--top-p", type=real(0, 1, above=True), default=1.0)
    p.add_argument("--top-k", type=integer(0), default=0)
    p.add_argument("--min-p", type=real(0, 1), default=0.0)
    p.add_argument("--seed", type=integer(0, SEED_MAX), default=None)


def _sampling(args: argparse.Namespace):
    import mlx.core as mx

    from mlx_spec.sampling import SamplingParams

    if args.seed is not None:
        mx.random.seed(args.seed)
    return SamplingParams(temp=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)


def _add_think_args(p: argparse.ArgumentParser) -> None:
    think = p.add_mutually_exclusive_group()
    think.add_argument("--think", dest="think", action="store_const", const=True, default=None,
                       help="let the model reason first (the chat template's enable_thinking, where it has one)")
    think.add_argument("--no-think", dest="think", action="store_const", const=False,
                       help="answer without reasoning (enable_thinking=False, where the chat template has it)")


RENDERED_BY_MLX_SPEC = ("conversation", "messages", "add_generation_prompt", "tokenize", "continue_final_message")


def _add_template_args(p: argparse.ArgumentParser) -> None:
    _add_think_args(p)
    p.add_argument("--chat-template-args", default=None, metavar="JSON",
                   help="a JSON object of arguments for the chat template, e.g. '{\"enable_thinking\": false}'")


def _template_args(args: argparse.Namespace) -> dict:
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


def _add_system_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default="", metavar="TEXT", help="the system prompt: a system message before the user's")
    _add_alias(p, "--system-prompt", "--system", metavar="TEXT")


def _check_think(args: argparse.Namespace, tokenizer) -> None:
    from mlx_spec.tokenizer import has_thinking_switch

    if args.think is not None and not has_thinking_switch(tokenizer):
        flag = "--think" if args.think else "--no-think"
        print(f"mlx-spec: note: {flag} changes nothing: {args.model}'s chat template has no thinking switch",
              file=sys.stderr)


def _add_drafter_args(p: argparse.ArgumentParser) -> None:
    from mlx_spec.drafters import usage

    p.add_argument("--drafter", default="none", help=usage())
    _add_drafter_revision(p)
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


def _tree_paths(value: str | None) -> list[list[int]] | None:
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


def _drafter(args: argparse.Namespace, target):
    """The drafter the flags ask for (None: plain decoding)."""
    from mlx_spec import api

    if args.tree is not None and args.tree_budget is not None:
        raise UserError("--tree and --tree-budget: give one of them")
    return api.drafter(args.drafter, target, revision=args.drafter_revision, ngram=(args.ngram_min, args.ngram_max),
                       tree_paths=_tree_paths(args.tree), tree_budget=args.tree_budget, depth=args.depth,
                       topk=args.topk, block_size=args.block_size)


def _add_exact_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--exact", action="store_true",
                   help="bit for bit: every target forward one width, plain steps too, so no drafter changes a bit of "
                        "the logits on any backend (checked at start-up; costs plain steps their width)")


def cmd_generate(args: argparse.Namespace) -> int:
    from mlx_spec import api, exact
    from mlx_spec.generate import Generation

    params = _sampling(args)
    if args.check and not params.greedy:
        raise UserError("--check compares with plain greedy decoding: use it with --temp 0")
    if args.system and args.no_chat_template:
        raise UserError("--system: a system prompt goes through the chat template; drop --no-chat-template")
    template_args = _template_args(args)
    target = _load(args)
    drafter = _drafter(args, target)
    _check_think(args, target.tokenizer)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    ids = api.prompt_ids(target, prompt, not args.no_chat_template, args.think, system=args.system,
                         template_args=template_args)
    if not ids:
        raise UserError("--prompt: the prompt is empty")
    width = api.exact_width(target, [drafter], args.num_draft) if args.exact else None
    result = Generation(prompt_tokens=ids)
    for segment in api.stream(target, ids, drafter, params=params, max_tokens=args.max_tokens,
                              num_draft=args.num_draft, acceptance=args.acceptance, result=result, width=width):
        if not args.json:
            print(segment, end="", flush=True)
    identical = parted = None
    if args.check:  # plain decoding the same way: with --exact, as wide
        plain = api.generate(target, ids, params=params, max_tokens=args.max_tokens, width=width).tokens
        identical, parted = plain == result.tokens, exact.parted(target.model, ids, plain, result.tokens)
    m = result.metrics
    if args.json:
        out = {
            "text": result.text,
            "tokens": result.tokens,
            "prompt_tokens": len(ids),
            "generation_tokens": len(result.tokens),
            "prompt_tps": result.prompt_tps,
            "generation_tps": result.generation_tps,
            "finish_reason": result.finish_reason,
            "drafter": args.drafter,
            **m.as_dict(),
        }
        if args.explain:
            out["rounds"] = [f"{why}; kept {kept}" for why, kept in result.rounds]
        if identical is not None:
            out["identical_to_plain"] = identical
            out["parted_from_plain"] = parted and {"token": parted[0], "top2_margin": parted[1]}
        if width:
            out["exact_width"] = width
        print(json.dumps(out))
    else:
        print()
        if args.explain:
            for i, (why, kept) in enumerate(result.rounds, 1):
                print(f"round {i}: {why}; kept {kept}", file=sys.stderr)
        stats = (
            f"[{len(ids)} prompt tokens, {result.prompt_tps:.1f} tok/s; "
            f"{len(result.tokens)} generated, {result.generation_tps:.1f} tok/s"
        )
        if args.drafter != "none":
            stats += f"; {m.tau:.2f} tokens per target forward, {m.acceptance_rate:.0%} of drafts accepted"
        if identical is not None:
            stats += f"; identical to plain{' (both exact)' if width else ''}: {identical}"
            if parted:
                stats += (f" (parted at token {parted[0] + 1}, where plain decoding's two best logits were "
                          f"{parted[1]:.2g} apart)")
        print(stats + "]", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mlx_spec.bench import format_report, run_bench

    if args.plot is not None and not args.plot.endswith(".png"):
        raise UserError(f"--plot {args.plot}: the file must end in .png")
    report = run_bench(args, _template_args(args))
    if not distributed.leading():
        return 0  # under --shard, rank 0 alone writes the report
    if args.plot is not None:
        from mlx_spec.bench import plot_report

        plot_report(report, Path(args.plot))
    if args.json == "-":
        print(json.dumps(report))
        return 0
    print(format_report(report))
    if args.json:
        from mlx_spec.files import write_text_atomic

        write_text_atomic(Path(args.json), json.dumps(report, indent=2))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mlx_spec.tui import store

    load = Path(args.load) if args.load is not None else None
    if load is not None:
        store.load(load)  # a damaged file is refused here, in one line, before the model loads
    loading = dict(template_args=_template_args(args), extra_eos=args.extra_eos_token, adapter_path=args.adapter_path,
                   revision=args.revision, drafter_revision=args.drafter_revision, exact=args.exact)
    if not sys.stdin.isatty():
        from mlx_spec.tui.lines import run_lines

        return run_lines(args.model, args.drafter, args.system, args.temp, args.top_p, args.max_tokens, args.think,
                         saved=load, **loading)
    from mlx_spec.tui.app import ChatApp

    app = ChatApp(args.model, args.drafter, args.system, args.temp, args.top_p, args.max_tokens, load, args.think,
                  **loading)
    app.run()
    return app.return_code or 0


def cmd_serve(args: argparse.Namespace) -> int:
    from mlx_spec.serve import serve
    from mlx_spec.tokenizer import thinking_args

    try:
        serve(args.model, args.drafter, args.host, args.port, args.revision, args.max_batch, args.max_queue,
              args.max_tokens, args.timeout, drafter_revision=args.drafter_revision, extra_eos=args.extra_eos_token,
              adapter_path=args.adapter_path, system=args.system,
              template_args=thinking_args(args.think, _template_args(args)), read_timeout=args.read_timeout,
              exact=args.exact)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from mlx_spec.doctor import report

    print(report())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mlx-spec", description="Speculative decoding and distillation for MLX.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (streamed)")
    _add_model_args(g)
    _add_load_args(g)
    g.add_argument("--prompt", "-p", required=True, help="the user's message ('-' reads stdin)")
    _add_sampling_args(g)
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    _add_alias(g, "--ignore-chat-template", "--no-chat-template", action="store_const", const=True)
    _add_system_args(g)
    _add_template_args(g)
    _add_alias(g, "--chat-template-config", "--chat-template-args", metavar="JSON")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    _add_drafter_args(g)
    _add_draft_aliases(g, "--drafter")
    g.add_argument("--check", action="store_true", help="also decode plainly and report whether the outputs are identical")
    _add_exact_arg(g)
    g.add_argument("--explain", action="store_true",
                   help="say, for each round, the K the policy chose and why (expected tokens, cost; on stderr)")
    distributed.add_arguments(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="plain decoding and drafters side by side, and mlx-lm, in one run")
    _add_model_args(b)
    b.add_argument("--drafters", "--drafter", default="none",
                   help="comma-separated --drafter SPECs to measure beside plain decoding, each with "
                        "optional settings, e.g. dflash:tree-budget=24 (tree-budget, num-draft, block-size, depth, topk); "
                        "the first draft model is also run with mlx-lm's speculative decoding")
    b.add_argument("--prompt", default="Write a short story about a fox.", help="one prompt (without --prompts)")
    b.add_argument("--prompts", default=None,
                   help="comma-separated built-in suites (code, chat, copy) or JSONL files of {\"prompt\": TEXT}")
    b.add_argument("--num-prompts", type=integer(0), default=0, metavar="N",
                   help="the first N prompts of each suite or file")
    b.add_argument("--max-tokens", type=integer(2), default=128)
    b.add_argument("--repeats", "--runs", type=integer(1), default=3, help="rounds over every prompt and method")
    b.add_argument("--temps", type=real(0), nargs="+", default=[0.0], help="temperatures to measure")
    b.add_argument("--no-chat-template", action="store_true", help="feed the prompts as raw text")
    _add_alias(b, "--ignore-chat-template", "--no-chat-template", action="store_const", const=True)
    _add_template_args(b)
    _add_load_args(b, eos=False)  # every method decodes --max-tokens tokens, past any EOS
    b.add_argument("--num-draft", type=integer(1), default=None, help="draft K tokens a round (default: adaptive)")
    _add_draft_aliases(b, "--drafters")
    _add_drafter_revision(b)
    b.add_argument("--tree-budget", type=integer(1), default=None, help="tree drafters: a best-first tree of N nodes")
    b.add_argument("--json", nargs="?", const="-", default=None, metavar="OUT",
                   help="write the report as JSON to OUT (alone: print it instead of the table)")
    b.add_argument("--concurrency", default=None, metavar="B,B,...",
                   help="also measure B sequences decoded together, e.g. 1,4,16 (throughput with B in flight, each finished "
                        "one replaced by the next, at each temperature, every method by turns; plain decoding twice: the run's noise; a method's num-draft fixes its K there too)")
    _add_exact_arg(b)
    b.add_argument("--no-mlx-lm", action="store_true",
                   help="leave out mlx-lm's rows (they hold a second copy of the target's weights)")
    b.add_argument("--plot", default=None, metavar="OUT.png",
                   help="draw acceptance by position and tokens/s per method (needs matplotlib)")
    distributed.add_arguments(b)
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("chat", help="chat in the terminal and watch the drafter at work")
    _add_model_args(c)
    _add_load_args(c)
    c.add_argument("--drafter", default="none", help="as for generate (switch live with /drafter)")
    _add_draft_aliases(c, "--drafter", num_draft=False)
    _add_drafter_revision(c)
    _add_system_args(c)
    c.add_argument("--temp", type=real(0), default=0.0)
    c.add_argument("--top-p", type=real(0, 1, above=True), default=1.0)
    c.add_argument("--max-tokens", "-m", type=integer(1), default=512,
                   help="per answer (the conversation and these within the model's context)")
    c.add_argument("--load", default=None, metavar="FILE.json", help="continue a saved conversation")
    _add_exact_arg(c)
    _add_template_args(c)
    distributed.add_arguments(c)
    c.set_defaults(func=cmd_chat)

    sv = sub.add_parser("serve", help="an OpenAI-compatible server with batched speculative decoding")
    _add_model_args(sv)
    sv.add_argument("--drafter", default="none", help="as for generate; each request gets its own session")
    _add_draft_aliases(sv, "--drafter", num_draft=False)
    _add_drafter_revision(sv)
    _add_load_args(sv)
    _add_system_args(sv)
    _add_template_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    sv.add_argument("--port", type=integer(0, 65535), default=8080)
    sv.add_argument("--max-batch", type=integer(1), default=16, help="requests decoded together")
    _add_exact_arg(sv)
    sv.add_argument("--max-queue", type=integer(1), default=64, help="requests waiting beyond the batch (then 503)")
    sv.add_argument("--max-tokens", type=integer(1), default=4096, help="the most a request may ask for")
    sv.add_argument("--timeout", type=real(0, threading.TIMEOUT_MAX, above=True), default=600.0,
                    help="seconds a request may take")
    sv.add_argument("--read-timeout", type=real(0, threading.TIMEOUT_MAX, above=True), default=READ_TIMEOUT,
                    metavar="SECONDS",
                    help=f"seconds a connection may keep the server waiting for its next bytes "
                         f"(then it is closed; default {READ_TIMEOUT:g})")
    distributed.add_arguments(sv)
    sv.set_defaults(func=cmd_serve)

    d = sub.add_parser("doctor", help="MLX version, backend, BLAS, and how to speed things up")
    d.set_defaults(func=cmd_doctor)

    convert_cli.add_parser(sub)
    train_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        _resolve_aliases(args)
        if getattr(args, "shard", None):
            distributed.start(args.shard, args.shard_timeout)
        return func(args)
    except UserError as e:
        print(f"mlx-spec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mlx-spec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
