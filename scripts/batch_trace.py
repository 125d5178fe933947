"""What the policy does with a batch, round by round: B sequences decoded together as `mlx-spec serve`
decodes them (every row leaving as it finishes, nothing joining), each drafting round printed with its
batch size, the draft depth K, its time and the policy's reason, and the plain rounds summed by batch size.

    python scripts/batch_trace.py [--model demo] --drafter eagle3 [--tree-budget 16] [--rows 16] [--temp 1]
                                  [--prompts code,chat] [--num-prompts 4] [--max-tokens 96]

A batch size met after another starts from the times it borrows: this shows whether it drafts rounds
those times say do not pay.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import mlx_spec  # noqa: F401  (OpenBLAS before MLX)
import mlx.core as mx

from mlx_spec import api
from mlx_spec.bench.methods import load_prompts
from mlx_spec.decoding import Decoder
from mlx_spec.errors import UserError
from mlx_spec.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--tree-budget", type=int)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--temp", type=float, default=1.0)
    parser.add_argument("--prompts", default="code,chat")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    try:
        target = api.load(args.model)
        drafter = api.drafter(args.drafter, target, **({"tree_budget": args.tree_budget} if args.tree_budget else {}))
    except UserError as e:
        print(f"batch_trace: {e}", file=sys.stderr)
        sys.exit(2)
    suites = argparse.Namespace(prompts=args.prompts, num_prompts=args.num_prompts, think=None, context=None,
                                no_chat_template=False)
    prompts = load_prompts(suites, target.tokenizer)
    decoder, session = Decoder(target.model), drafter.new_session() if drafter is not None else None
    for i in range(args.rows):
        decoder.add(i, prompts[i % len(prompts)], SamplingParams(temp=args.temp), args.max_tokens, session)
    plain = defaultdict(lambda: [0, 0.0])  # batch size -> plain rounds, seconds
    while decoder.rows:
        rows, tic = len(decoder.rows), time.perf_counter()
        events = decoder.step()
        mx.synchronize()
        seconds = time.perf_counter() - tic
        k = max(e.depth for e in events.values())
        if k:
            print(f"{rows:3d} rows  K={k}  {seconds * 1e3:7.1f} ms  {decoder.policy.last}")
        else:
            plain[rows][0] += 1
            plain[rows][1] += seconds
    for rows, (n, seconds) in sorted(plain.items(), reverse=True):
        print(f"{rows:3d} rows  plain: {n} rounds, {seconds / n * 1e3:.1f} ms each")


if __name__ == "__main__":
    main()
