"""Checkpoint readers: name -> MLX array, lazily where the format allows."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from mlx_spec.errors import UserError


def read_safetensors_file(path: Path) -> dict[str, mx.array]:
    """One `.safetensors` file (bf16 included); loading is lazy."""
    try:
        return mx.load(str(path), format="safetensors")
    except (RuntimeError, ValueError, OSError) as e:
        raise UserError(f"{path}: not a readable safetensors file ({e})".splitlines()[0]) from None


def read_safetensors(directory: Path, prefix: str = "model") -> tuple[dict[str, mx.array], dict[str, Path]]:
    """All weights of a checkpoint directory, sharded (`*.index.json`) or not.

    Returns the weights and, for error messages, the file each one came from.
    """
    index = directory / f"{prefix}.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{index}: not a safetensors index ({e})") from None
        files = sorted({directory / name for name in weight_map.values()})
        missing = [f for f in files if not f.exists()]
        if missing:
            raise UserError(f"{missing[0]}: shard listed in {index.name} is missing")
    else:
        files = sorted(directory.glob(f"{prefix}*.safetensors"))
    if not files:
        raise UserError(f"{directory}: no {prefix}*.safetensors files")
    weights: dict[str, mx.array] = {}
    origin: dict[str, Path] = {}
    for f in files:
        for name, value in read_safetensors_file(f).items():
            weights[name] = value
            origin[name] = f
    return weights, origin
