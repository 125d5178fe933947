"""`mlx-spec convert SOURCE -o OUT`: the subcommand's flags and handler."""

from __future__ import annotations

import argparse
from pathlib import Path

from mlx_spec.errors import UserError

DTYPES = ("float16", "bfloat16", "float32")
Q_BITS = (4, 8)
Q_GROUP_SIZES = (32, 64, 128)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "convert",
        help="import a checkpoint (safetensors or PyTorch .bin, local or from the Hub) as an MLX model directory",
        description="Convert SOURCE into an MLX model directory OUT, written all at once. "
        "OUT must not exist (or be empty); --force replaces an earlier conversion.",
    )
    p.add_argument("source", metavar="SOURCE", help="local directory or Hugging Face repo id")
    p.add_argument("-o", "--out", required=True, type=Path, metavar="OUT", help="directory to write")
    p.add_argument("--revision", default=None, help="Hub revision of SOURCE (branch, tag or commit)")
    p.add_argument("--target", default=None, help="check that SOURCE fits this target (directory or repo id)")
    p.add_argument("--dtype", default=None, help=f"{' | '.join(DTYPES)} (default: as stored)")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize the weights (mlx-community style)")
    p.add_argument("--q-bits", type=int, default=None, help=f"{' | '.join(map(str, Q_BITS))} (default 4)")
    p.add_argument("--q-group-size", type=int, default=None, help=f"{' | '.join(map(str, Q_GROUP_SIZES))} (default 64)")
    p.add_argument("--force", action="store_true", help="replace OUT if it is an earlier conversion")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.dtype is not None and args.dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got '{args.dtype}'")
    if not args.quantize and (args.q_bits is not None or args.q_group_size is not None):
        raise UserError("--q-bits and --q-group-size need -q/--quantize")
    bits = 4 if args.q_bits is None else args.q_bits
    group_size = 64 if args.q_group_size is None else args.q_group_size
    if bits not in Q_BITS:
        raise UserError(f"--q-bits must be one of {', '.join(map(str, Q_BITS))}, got {bits}")
    if group_size not in Q_GROUP_SIZES:
        raise UserError(f"--q-group-size must be one of {', '.join(map(str, Q_GROUP_SIZES))}, got {group_size}")

    from mlx_spec.convert.pipeline import convert

    summary = convert(
        args.source,
        args.out,
        revision=args.revision,
        target=args.target,
        dtype=args.dtype,
        q_bits=bits if args.quantize else None,
        q_group_size=group_size,
        force=args.force,
    )
    print(summary)
    return 0
