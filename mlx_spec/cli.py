"""`mlx-spec`: chat | generate | bench | serve | doctor | convert | distill | train.

Bad input ends with one line on stderr naming the file, field or flag, and exit
code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from typing import Callable, NoReturn

import mlx_spec  # noqa: F401  (preloads OpenBLAS before mlx.core)
from mlx_spec import distributed
from mlx_spec.serve import READ_TIMEOUT
from mlx_spec.convert import cli as convert_cli
from mlx_spec.train import cli as train_cli
from mlx_spec.errors import UserError
from mlx_spec.flags import (add_alias, add_draft_aliases, add_drafter_args, add_drafter_revision, add_exact_arg,
                            add_load_args, add_model_args, add_sampling_args, add_system_args, add_template_args,
                            check_think, drafter_of, integer, load_target, real, resolve_aliases, sampling_of,
                            template_args_of)


class _Parser(argparse.ArgumentParser):
    """A bad command line is one line too (argparse would print the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _report_generation(args: argparse.Namespace, result, ids: list[int], identical: bool | None, parted,
                       width: int | None) -> None:
    """What `generate` prints after the text: one JSON object (`--json`), or a line of figures on stderr."""
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


def cmd_generate(args: argparse.Namespace) -> int:
    from mlx_spec import api, exact
    from mlx_spec.generate import Generation

    params = sampling_of(args)
    if args.check and not params.greedy:
        raise UserError("--check compares with plain greedy decoding: use it with --temp 0")
    if args.system and args.no_chat_template:
        raise UserError("--system: a system prompt goes through the chat template; drop --no-chat-template")
    template_args = template_args_of(args)
    target = load_target(args)
    drafter = drafter_of(args, target)
    check_think(args, target.tokenizer)
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
    _report_generation(args, result, ids, identical, parted, width)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mlx_spec.bench import format_report, run_bench

    if args.plot is not None and not args.plot.endswith(".png"):
        raise UserError(f"--plot {args.plot}: the file must end in .png")
    report = run_bench(args, template_args_of(args))
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
    loading = dict(template_args=template_args_of(args), extra_eos=args.extra_eos_token, adapter_path=args.adapter_path,
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
              template_args=thinking_args(args.think, template_args_of(args)), read_timeout=args.read_timeout,
              exact=args.exact, prompt_cache_bytes=args.prompt_cache_bytes, prompt_cache_dir=args.prompt_cache_dir)
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
    add_model_args(g)
    add_load_args(g)
    g.add_argument("--prompt", "-p", required=True, help="the user's message ('-' reads stdin)")
    add_sampling_args(g)
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    add_alias(g, "--ignore-chat-template", "--no-chat-template", action="store_const", const=True)
    add_system_args(g)
    add_template_args(g)
    add_alias(g, "--chat-template-config", "--chat-template-args", metavar="JSON")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_drafter_args(g)
    add_draft_aliases(g, "--drafter")
    g.add_argument("--check", action="store_true", help="also decode plainly and report whether the outputs are identical")
    add_exact_arg(g)
    g.add_argument("--explain", action="store_true",
                   help="say, for each round, the K the policy chose and why (expected tokens, cost; on stderr)")
    distributed.add_arguments(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="plain decoding and drafters side by side, and mlx-lm, in one run")
    add_model_args(b)
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
    b.add_argument("--context", type=integer(0), default=0, metavar="N",
                   help="each prompt after a long file to edit, about N tokens in all (speed at long contexts)")
    b.add_argument("--repeats", "--runs", type=integer(1), default=3,
                   help="rounds over every prompt and method (the machine's costs are sampled in proportion)")
    b.add_argument("--temps", type=real(0), nargs="+", default=[0.0], help="temperatures to measure")
    b.add_argument("--no-chat-template", action="store_true", help="feed the prompts as raw text")
    add_alias(b, "--ignore-chat-template", "--no-chat-template", action="store_const", const=True)
    add_template_args(b)
    add_load_args(b, eos=False)  # every method decodes --max-tokens tokens, past any EOS
    b.add_argument("--num-draft", type=integer(1), default=None, help="draft K tokens a round (default: adaptive)")
    add_draft_aliases(b, "--drafters")
    add_drafter_revision(b)
    b.add_argument("--tree-budget", type=integer(1), default=None, help="tree drafters: a best-first tree of N nodes")
    b.add_argument("--json", nargs="?", const="-", default=None, metavar="OUT",
                   help="write the report as JSON to OUT (alone: print it instead of the table)")
    b.add_argument("--concurrency", default=None, metavar="B,B,...",
                   help="also measure B sequences decoded together, e.g. 1,4,16 (throughput with B in flight, each finished "
                        "one replaced by the next, at each temperature, every method by turns; plain decoding twice: the run's noise; a method's num-draft fixes its K there too)")
    add_exact_arg(b)
    b.add_argument("--no-mlx-lm", action="store_true",
                   help="leave out mlx-lm's rows (they hold a second copy of the target's weights)")
    b.add_argument("--plot", default=None, metavar="OUT.png",
                   help="draw acceptance by position and tokens/s per method (needs matplotlib)")
    distributed.add_arguments(b)
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("chat", help="chat in the terminal and watch the drafter at work")
    add_model_args(c)
    add_load_args(c)
    c.add_argument("--drafter", default="none", help="as for generate (switch live with /drafter)")
    add_draft_aliases(c, "--drafter", num_draft=False)
    add_drafter_revision(c)
    add_system_args(c)
    c.add_argument("--temp", type=real(0), default=0.0)
    c.add_argument("--top-p", type=real(0, 1, above=True), default=1.0)
    c.add_argument("--max-tokens", "-m", type=integer(1), default=512,
                   help="per answer (the conversation and these within the model's context)")
    c.add_argument("--load", default=None, metavar="FILE.json", help="continue a saved conversation")
    add_exact_arg(c)
    add_template_args(c)
    distributed.add_arguments(c)
    c.set_defaults(func=cmd_chat)

    sv = sub.add_parser("serve", help="an OpenAI-compatible server with batched speculative decoding")
    add_model_args(sv)
    sv.add_argument("--drafter", default="none", help="as for generate; each request gets its own session")
    add_draft_aliases(sv, "--drafter", num_draft=False)
    add_drafter_revision(sv)
    add_load_args(sv)
    add_system_args(sv)
    add_template_args(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    sv.add_argument("--port", type=integer(0, 65535), default=8080)
    sv.add_argument("--max-batch", type=integer(1), default=16, help="requests decoded together")
    add_exact_arg(sv)
    sv.add_argument("--max-queue", type=integer(1), default=64, help="requests waiting beyond the batch (then 503)")
    sv.add_argument("--max-tokens", type=integer(1), default=4096, help="the most a request may ask for")
    sv.add_argument("--prompt-cache-bytes", type=integer(0, 2**62), default=None, metavar="BYTES",
                    help="keep what requests leave in the cache, for the next that begins the same way, up to "
                         "this many bytes (default: an eighth of the machine's memory; 0: none)")
    sv.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                    help="keep the prompt cache's entries in DIR too, for the next start")
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
        resolve_aliases(args)
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
