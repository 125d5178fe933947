"""Writing model files and folders, all or nothing.

A folder is built in a hidden temporary sibling and renamed into place only
when complete, so an interruption (an error, Ctrl-C, a full disk) never leaves
a half-written one; an earlier folder of the same name is replaced only once
the new one is whole.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable, Mapping

import mlx.core as mx

# What a model folder holds besides config and weights: tokenizer and generation settings.
SIDE_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "*.tiktoken",
    "chat_template.*",
    "generation_config.json",
)


def data_dir() -> Path:
    """mlx-spec's own folder: saved conversations, drafters converted on first use
    (`$MLX_SPEC_HOME` when set)."""
    home = os.environ.get("MLX_SPEC_HOME")
    if home:
        return Path(home)
    from platformdirs import user_data_dir

    return Path(user_data_dir("mlx-spec"))


def side_files(directory: Path) -> list[Path]:
    return sorted({f for pattern in SIDE_FILES for f in directory.glob(pattern) if f.is_file()})


MAX_SHARD_BYTES = 5 << 30  # as mlx-lm: shards of at most 5 GiB


def save_weights(directory: Path, weights: Mapping[str, mx.array]) -> None:
    """`model.safetensors`, or `model-0000i-of-0000n.safetensors` shards plus an index."""
    shards: list[dict[str, mx.array]] = [{}]
    size = 0
    for name in sorted(weights):
        value = weights[name]
        if shards[-1] and size + value.nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    if len(shards) == 1:
        mx.save_safetensors(str(directory / "model.safetensors"), shards[0], metadata={"format": "mlx"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(directory / fname), shard, metadata={"format": "mlx"})
        weight_map.update({name: fname for name in shard})
    total = sum(v.nbytes for v in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_text_atomic(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a temporary file beside it, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.partial"
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def replace_atomically(out: Path, fill: Callable[[Path], None]) -> None:
    """Make the folder `out` with `fill(directory)`, replacing any earlier one, all or nothing."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{secrets.token_hex(4)}.partial"
    old = tmp.with_suffix(".old")
    tmp.mkdir()
    try:
        fill(tmp)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
    except BaseException:
        if old.exists() and not out.exists():
            os.replace(old, out)  # interrupted between the two renames: put the old one back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_model_files(out: Path, config: dict, weights: Mapping[str, mx.array], source: Path | None = None) -> None:
    """Config, weights and `source`'s tokenizer files (if any) into the folder `out`, which
    may hold other things (a training run's checkpoint): each file is written
    whole and renamed into place, config.json last."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".export.{secrets.token_hex(4)}.partial"
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_weights(tmp, weights)
        for f in side_files(source) if source is not None else []:
            shutil.copyfile(f, tmp / f.name)
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
