"""Checkpoint readers: name -> MLX array, lazily where the format allows.

* safetensors, one file or shards listed by `model.safetensors.index.json`
  (bf16 included): `mx.load`, which reads a tensor when it is evaluated.
* PyTorch `torch.save` files (`pytorch_model.bin`, `*.pt`, shards listed by
  `pytorch_model.bin.index.json`), read WITHOUT torch (`mlx_spec.torch_pickle`).

Files are untrusted: a safetensors header's ranges must lie apart within the
file, each as long as its dtype and shape need. Every problem is a one-line
`UserError` naming the file (and the tensor).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import ChainMap
from pathlib import Path
from typing import Any, Callable, Mapping

import mlx.core as mx

from mlx_spec.errors import UserError
from mlx_spec.torch_pickle import read_torch_file

Weights = Mapping[str, mx.array]


def read_weights(directory: Path) -> tuple[Weights, dict[str, Path]]:
    """A checkpoint directory's weights: safetensors if it has them, else `pytorch_model*.bin`."""
    if any(directory.glob("model*.safetensors")) or (directory / "model.safetensors.index.json").exists():
        return read_safetensors(directory)
    if any(directory.glob("pytorch_model*.bin")) or (directory / "pytorch_model.bin.index.json").exists():
        return read_torch(directory)
    raise UserError(f"{directory}: no weights (model*.safetensors or pytorch_model*.bin)")


def _read_sharded(
    directory: Path, index_name: str, pattern: str, read_file: Callable[[Path], Weights]
) -> tuple[Weights, dict[str, Path]]:
    """All shards of a checkpoint: those its index lists, else every file matching `pattern`.

    Returns the weights (a lazy view over the shards) and, for error messages,
    the file each one came from.
    """
    index = directory / index_name
    weight_map: dict[str, str] = {}
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({directory / name for name in weight_map.values()})
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{index}: not a checkpoint index ({type(e).__name__}: {e})".splitlines()[0]) from None
        for f in files:
            if not f.exists():
                raise UserError(f"{f}: shard listed in {index.name} is missing")
    else:
        files = sorted(directory.glob(pattern))
    if not files:
        raise UserError(f"{directory}: no {pattern} files")
    parts: list[Weights] = []
    origin: dict[str, Path] = {}
    for f in files:
        part = read_file(f)
        for name in part:
            if name in origin:
                raise UserError(f"{f}: weight '{name}' is also in {origin[name].name}")
            origin[name] = f
        parts.append(part)
    for name, shard in weight_map.items():
        if origin.get(name) != directory / shard:
            raise UserError(f"{index}: lists weight '{name}' in {shard}, which does not hold it")
    return (parts[0] if len(parts) == 1 else ChainMap(*parts)), origin


# ---------------------------------------------------------------- safetensors


# Bytes per element of each dtype `mx.load` reads from safetensors.
_SAFETENSORS_ITEMSIZE = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E4M3", "F8_E8M0"), 1),
    **dict.fromkeys(("U16", "I16", "F16", "BF16"), 2),
    **dict.fromkeys(("U32", "I32", "F32"), 4),
    **dict.fromkeys(("U64", "I64", "C64"), 8),
}
_MAX_HEADER = 100 << 20  # the safetensors library's own limit


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:  # which of the two mx.load would use is not ours to guess
            raise ValueError(f"key '{key:.60}' appears twice")
        out[key] = value
    return out


def _check_safetensors(path: Path) -> list[tuple[int, int, str]]:
    """The header, read with a bounded read, must describe tensors that lie apart
    inside the file, each with as many bytes as its dtype and shape need (mx.load
    accepts overlapping ranges). Returns each tensor's (start, end, name), the
    start and end counted from the file's beginning, in the order they lie."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little")
            if len(head) < 8 or length > min(size - 8, _MAX_HEADER):
                raise UserError(f"{path}: not a safetensors file (a header of {length} bytes in a file of {size})")
            raw = f.read(length)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as e:  # JSON and UTF-8 errors are ValueErrors
        raise UserError(f"{path}: not a safetensors file (its header is not JSON: {e})".splitlines()[0]) from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: not a safetensors file (its header is not a JSON object)")
    metadata = header.pop("__metadata__", None)
    if not (metadata is None or isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise UserError(f"{path}: header '__metadata__' is not a map of strings")
    data = size - 8 - length
    spans = sorted((*_safetensors_span(f"{path}: tensor '{name:.100}'", entry, data), name) for name, entry in header.items())
    spans = [span for span in spans if span[0] < span[1]]  # empty tensors take no bytes
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise UserError(f"{path}: tensor '{second:.100}' overlaps tensor '{first:.100}' (data_offsets)")
    return [(8 + length + begin, 8 + length + end, name) for begin, end, name in spans]


def checkpoint_digest(directory: Path, config: str = "config.json", sample: int = 16) -> bytes:
    """What tells one checkpoint folder from another without reading its weights: its `config` file and,
    per safetensors file, every tensor's name, place and first `sample` bytes (a few reads a tensor)."""
    digest = hashlib.sha256((directory / config).read_bytes())
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as f:
            for start, end, name in _check_safetensors(path):
                f.seek(start)
                digest.update(f"{path.name} {name} {start} {end}".encode() + f.read(min(sample, end - start)))
    return digest.digest()


def _safetensors_span(where: str, entry: Any, data: int) -> tuple[int, int]:
    """A header entry's byte range in the data (`data` bytes after the header), checked."""
    entry = entry if isinstance(entry, dict) else {}
    dtype, shape, offsets = (entry.get(k) for k in ("dtype", "shape", "data_offsets"))
    if not (
        isinstance(dtype, str)
        and isinstance(shape, list)
        and all(type(n) is int for n in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(n) is int for n in offsets)
    ):
        raise UserError(f"{where}: not a tensor entry (dtype, shape, data_offsets)")
    if dtype not in _SAFETENSORS_ITEMSIZE:
        raise UserError(f"{where}: dtype '{dtype:.20}' is not supported")
    if any(n < 0 for n in shape):
        raise UserError(f"{where}: negative shape {shape}")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise UserError(f"{where}: data_offsets {offsets} are not a range")
    if end > data:
        raise UserError(f"{where}: data_offsets {offsets} run past the end of the data ({data} bytes)")
    need = math.prod(shape) * _SAFETENSORS_ITEMSIZE[dtype]
    if end - begin != need:
        raise UserError(f"{where}: holds {end - begin} bytes, but {dtype} {shape} needs {need}")
    return begin, end


def read_safetensors_file(path: Path) -> dict[str, mx.array]:
    """One `.safetensors` file (bf16 included); loading is lazy."""
    _check_safetensors(path)
    try:
        return mx.load(str(path), format="safetensors")
    except (RuntimeError, ValueError, OSError) as e:
        raise UserError(f"{path}: not a readable safetensors file ({e})".splitlines()[0]) from None


def read_safetensors(directory: Path, prefix: str = "model") -> tuple[Weights, dict[str, Path]]:
    """All safetensors weights of a checkpoint directory, sharded (`*.index.json`) or not."""
    return _read_sharded(
        directory, f"{prefix}.safetensors.index.json", f"{prefix}*.safetensors", read_safetensors_file
    )


# ---------------------------------------------------------------- PyTorch


def read_torch(directory: Path, prefix: str = "pytorch_model") -> tuple[Weights, dict[str, Path]]:
    """All `torch.save` weights of a checkpoint directory, sharded (`*.bin.index.json`) or not."""
    return _read_sharded(directory, f"{prefix}.bin.index.json", f"{prefix}*.bin", read_torch_file)
