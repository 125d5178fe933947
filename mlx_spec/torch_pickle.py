"""PyTorch `torch.save` files read WITHOUT torch (`pytorch_model.bin`, `*.pt`): the zip format
(PyTorch >= 1.6) and the legacy pickle stream before it.

A restricted unpickler rebuilds only tensor references and refuses every other
global before it can run (a pickle can call any function on load); each
tensor's bytes are memory-mapped and copied into an MLX array when the weight
is looked up. The file is untrusted and checked before anything is built or
allocated from it: the pickle's opcodes are walked first (nesting, expansion,
memo indices), zip records must be stored, not compressed, and a tensor must
lie within its storage without overlapping itself (so reading it takes at most
the storage's bytes). Every problem is a one-line `UserError` naming the file
(and the tensor).
"""

from __future__ import annotations

import collections
import io
import math
import mmap
import pickle
import pickletools
import struct
import zipfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Mapping

import mlx.core as mx
import numpy as np

from mlx_spec.errors import UserError


class LazyWeights(Mapping[str, mx.array]):
    """name -> MLX array; a tensor's bytes are read each time it is looked up."""

    def __init__(self, loaders: dict[str, Callable[[], mx.array]]):
        self._loaders = loaders

    def __getitem__(self, name: str) -> mx.array:
        return self._loaders[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)


@dataclass(frozen=True, slots=True)
class _Dtype:
    name: str  # torch's name, for messages
    numpy: np.dtype  # how the bytes are read: bfloat16 as its uint16 bits
    mlx: mx.Dtype


_DTYPES = {
    d.name: d
    for d in (
        _Dtype("float32", np.dtype("<f4"), mx.float32),
        _Dtype("float16", np.dtype("<f2"), mx.float16),
        _Dtype("bfloat16", np.dtype("<u2"), mx.bfloat16),
        _Dtype("float64", np.dtype("<f8"), mx.float64),
        _Dtype("int64", np.dtype("<i8"), mx.int64),
        _Dtype("int32", np.dtype("<i4"), mx.int32),
        _Dtype("int16", np.dtype("<i2"), mx.int16),
        _Dtype("int8", np.dtype("i1"), mx.int8),
        _Dtype("uint64", np.dtype("<u8"), mx.uint64),
        _Dtype("uint32", np.dtype("<u4"), mx.uint32),
        _Dtype("uint16", np.dtype("<u2"), mx.uint16),
        _Dtype("uint8", np.dtype("u1"), mx.uint8),
        _Dtype("bool", np.dtype("?"), mx.bool_),
    )
}

# What a checkpoint may name in the `torch` module: storage classes (a storage's
# element type, in `torch.save`'s persistent ids) and dtypes (`_rebuild_tensor_v3`,
# used for uint16/32/64 over an untyped byte storage). Both map to a `_Dtype`.
_TORCH_NAMES: dict[str, _Dtype] = {
    **_DTYPES,
    "FloatStorage": _DTYPES["float32"],
    "HalfStorage": _DTYPES["float16"],
    "BFloat16Storage": _DTYPES["bfloat16"],
    "DoubleStorage": _DTYPES["float64"],
    "LongStorage": _DTYPES["int64"],
    "IntStorage": _DTYPES["int32"],
    "ShortStorage": _DTYPES["int16"],
    "CharStorage": _DTYPES["int8"],
    "ByteStorage": _DTYPES["uint8"],
    "BoolStorage": _DTYPES["bool"],
    "UntypedStorage": _DTYPES["uint8"],
}


@dataclass(frozen=True, slots=True)
class _Storage:
    key: str  # zip record `data/<key>`, or the legacy stream's storage key
    dtype: _Dtype  # element type the file gives it (legacy records count elements)


@dataclass(frozen=True, slots=True)
class _TensorRef:
    storage: _Storage
    dtype: _Dtype
    offset: int  # in elements of `dtype`
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # in elements


def _tensor_ref(storage: Any, dtype: Any, offset: Any, shape: Any, stride: Any) -> _TensorRef:
    ints = isinstance(offset, int) and all(isinstance(n, int) for n in (*shape, *stride))
    if not (isinstance(storage, _Storage) and isinstance(dtype, _Dtype) and ints and len(shape) == len(stride)):
        raise ValueError("malformed tensor record")
    return _TensorRef(storage, dtype, offset, tuple(shape), tuple(stride))


def _rebuild_tensor_v2(storage, offset, shape, stride, requires_grad, hooks, metadata=None) -> _TensorRef:
    return _tensor_ref(storage, getattr(storage, "dtype", None), offset, shape, stride)


def _rebuild_tensor_v3(storage, offset, shape, stride, requires_grad, hooks, dtype, metadata=None) -> _TensorRef:
    return _tensor_ref(storage, dtype, offset, shape, stride)


def _rebuild_parameter(data, requires_grad, hooks, state=None) -> _TensorRef:
    if not isinstance(data, _TensorRef):
        raise ValueError("malformed parameter record")
    return data


# The only callables a checkpoint may reach. Each returns inert data, so a
# malicious pickle can at worst build a wrong tensor reference, which is checked.
_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
}


_MAX_DEPTH = 64  # as counted below, torch.save's state dicts nest 7 to 9 deep
_MAX_NODES = 10_000_000  # objects one object may expand to, a shared one counted each time it is used
_IN_PLACE = {"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"}  # fill the object below


def _checked_pickle(stream: BinaryIO, path: Path) -> bytes:
    """The next pickle's bytes (`stream` is left just past it), its opcodes walked
    first without building anything. Each object's nesting depth and size are
    tracked as the unpickler's stack would hold them: hashing a 10**6-deep key
    overflows the C stack, hashing a memo-shared tuple of 2**100 leaves never ends,
    and a memo index of 2**32 makes the unpickler allocate its memo table for it.
    `stream.read(n)` must return at most what is there (a file's `read(n)`
    allocates n bytes first; an mmap or BytesIO does not): a declared length is
    checked by reading it."""
    start = stream.tell()
    stack: list[tuple[int, int]] = []  # (depth, objects) of each object on the unpickler's stack
    marks: list[int] = []  # where each MARK is on it (the unpickler too keeps marks apart)
    memo: dict[int, tuple[int, int]] = {}
    try:
        for count, (op, arg, _) in enumerate(pickletools.genops(stream)):
            if op.name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                index = len(memo) if op.name == "MEMOIZE" else arg
                if index > count:  # picklers number memo entries from 0, one per object
                    raise UserError(f"{path}: pickle memo index {index} is out of range")
                memo[index] = stack[-1]
                continue
            if op.name in ("GET", "BINGET", "LONG_BINGET", "DUP"):
                stack.append(stack[-1] if op.name == "DUP" else memo[arg])
                continue
            popped: list[tuple[int, int]] = []
            for kind in reversed(op.stack_before):
                if kind is pickletools.stackslice:  # the objects above the last mark
                    at = marks.pop()
                    popped += stack[at:]
                    del stack[at:]
                elif kind is not pickletools.markobject:  # (the mark of that slice)
                    popped.append(stack.pop())
            depths, sizes = zip(*popped) if popped else ((), ())
            if op.name in _IN_PLACE:  # the object filled, popped last, stays
                depth, size = max(depths[-1], 1 + max(depths[:-1], default=0)), sum(sizes)
            else:
                depth, size = 1 + max(depths, default=0), 1 + sum(sizes)
            if depth > _MAX_DEPTH:
                raise UserError(f"{path}: pickle nests deeper than {_MAX_DEPTH} levels (a state dict, under 10)")
            if size > _MAX_NODES:
                raise UserError(f"{path}: pickle expands to more than {_MAX_NODES} objects (shared references)")
            for kind in op.stack_after:
                if kind is pickletools.markobject:
                    marks.append(len(stack))
                else:
                    stack.append((depth, size))
    except (ValueError, KeyError, IndexError) as e:  # not a well-formed pickle
        raise UserError(f"{path}: not a valid PyTorch pickle ({type(e).__name__}: {e})".splitlines()[0]) from None
    end = stream.tell()
    stream.seek(start)
    return stream.read(end - start)


class _Unpickler(pickle.Unpickler):
    """Rebuilds plain containers and tensor references; refuses any other global."""

    def __init__(self, stream: BinaryIO, path: Path, legacy: bool):
        super().__init__(io.BytesIO(_checked_pickle(stream, path)))
        self.path = path
        self.legacy = legacy
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _GLOBALS:
            return _GLOBALS[module, name]
        if module == "torch" and name in _TORCH_NAMES:
            return _TORCH_NAMES[name]
        if (module, name) == ("torch.storage", "UntypedStorage"):  # its full name, in zip files
            return _DTYPES["uint8"]
        raise UserError(
            f"{self.path}: refusing to unpickle global '{module}.{name}' "
            "(only tensors are read; torch.load would have run it)"
        )

    def persistent_load(self, pid: Any) -> _Storage:
        # zip: ('storage', type, key, location, numel); legacy adds view metadata
        if not (
            isinstance(pid, tuple)
            and len(pid) == (6 if self.legacy else 5)
            and pid[0] == "storage"
            and isinstance(pid[1], _Dtype)
            and isinstance(pid[2], str)
        ):
            raise ValueError(f"unexpected persistent id {pid!r:.80}")
        if self.legacy and pid[5] is not None:
            raise UserError(f"{self.path}: storage views (PyTorch before 0.4) are not supported")
        return self.storages.setdefault(pid[2], _Storage(pid[2], pid[1]))

    def read(self) -> Any:
        try:
            return self.load()
        except UserError:
            raise
        except Exception as e:  # a damaged or hostile pickle can raise anything
            raise UserError(f"{self.path}: not a valid PyTorch pickle ({type(e).__name__}: {e})".splitlines()[0]) from None


def _tensor_refs(obj: Any, path: Path) -> dict[str, _TensorRef]:
    """The state dict a checkpoint holds: names -> tensor references."""
    if not isinstance(obj, dict):
        raise UserError(f"{path}: holds a {type(obj).__name__}, not a state dict of tensors")
    for name, value in obj.items():
        if not isinstance(name, str) or not isinstance(value, _TensorRef):
            raise UserError(f"{path}: entry {name!r:.60} is a {type(value).__name__}, not a tensor")
    return dict(obj)


_Span = tuple[int, int]  # (byte offset in the file, byte length) of a storage


def _stored_span(f: BinaryIO, size: int, info: zipfile.ZipInfo, path: Path) -> _Span:
    """Where a zip record's bytes lie in the file. torch.save stores records as they
    are, so a compressed one (a zip bomb unpacks a few MiB to GiBs) is refused unread."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise UserError(f"{path}: record '{info.filename}' is compressed; torch.save stores records as they are")
    # The data follows the local header, whose name and extra fields vary.
    f.seek(info.header_offset)
    header = f.read(30)
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        raise UserError(f"{path}: corrupt zip archive (bad local header for '{info.filename}')")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start = info.header_offset + 30 + name_len + extra_len
    if start + info.file_size > size:
        raise UserError(f"{path}: truncated (record '{info.filename}' is cut off)")
    return start, info.file_size


def _zip_spans(path: Path) -> tuple[dict[str, _TensorRef], dict[str, _Span]]:
    """`torch.save`'s zip format: `<dir>/data.pkl` plus one stored record per storage."""
    try:
        with zipfile.ZipFile(path) as zf:
            infos = {i.filename: i for i in zf.infolist()}
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError) as e:
        raise UserError(f"{path}: truncated or corrupt zip archive ({e})".splitlines()[0]) from None
    pkls = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkls) != 1:
        raise UserError(f"{path}: zip archive without one '<dir>/data.pkl': not a torch.save file")
    prefix = pkls[0][: -len("data.pkl")]
    size = path.stat().st_size
    with open(path, "rb") as f:

        def record(name: str) -> bytes:
            start, nbytes = _stored_span(f, size, infos[name], path)
            f.seek(start)
            return f.read(nbytes)

        if prefix + "byteorder" in infos and record(prefix + "byteorder") != b"little":
            raise UserError(f"{path}: big-endian checkpoint; only little-endian is supported")
        unpickler = _Unpickler(io.BytesIO(record(pkls[0])), path, legacy=False)
        refs = _tensor_refs(unpickler.read(), path)
        # a missing record is reported with the tensor that needs it
        records = {key: infos.get(f"{prefix}data/{key}") for key in unpickler.storages}
        spans = {key: _stored_span(f, size, info, path) for key, info in records.items() if info is not None}
    return refs, spans


MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # first object of a legacy torch.save stream
PROTOCOL_VERSION = 1001


def _legacy_spans(path: Path) -> tuple[dict[str, _TensorRef], dict[str, _Span]]:
    """The legacy stream: pickles of the magic number, the protocol version, system
    info, the state dict and the list of storage keys; then each storage as an int64
    element count and its raw bytes, in that list's order."""
    size = path.stat().st_size
    # mapped, not read: a pickle's declared lengths are untrusted (see _checked_pickle)
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as f:
        if _Unpickler(f, path, legacy=True).read() != MAGIC_NUMBER:
            raise UserError(f"{path}: not a PyTorch checkpoint (wrong magic number)")
        version = _Unpickler(f, path, legacy=True).read()
        if version != PROTOCOL_VERSION:
            raise UserError(f"{path}: legacy PyTorch format version {version!r:.20} is not supported")
        info = _Unpickler(f, path, legacy=True).read()
        if not (isinstance(info, dict) and info.get("little_endian", True)):
            raise UserError(f"{path}: big-endian checkpoint; only little-endian is supported")
        unpickler = _Unpickler(f, path, legacy=True)
        refs = _tensor_refs(unpickler.read(), path)
        keys = _Unpickler(f, path, legacy=True).read()
        if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
            raise UserError(f"{path}: corrupt legacy checkpoint (no list of storage keys)")
        spans: dict[str, _Span] = {}
        pos = f.tell()
        for key in keys:
            if key not in unpickler.storages:
                raise UserError(f"{path}: corrupt legacy checkpoint (storage '{key}' is used by no tensor)")
            f.seek(pos)
            count = f.read(8)
            if len(count) < 8:
                raise UserError(f"{path}: truncated (storage '{key}' is cut off)")
            nbytes = struct.unpack("<q", count)[0] * unpickler.storages[key].dtype.numpy.itemsize
            if nbytes < 0 or pos + 8 + nbytes > size:
                raise UserError(f"{path}: truncated (storage '{key}' is cut off)")
            spans[key] = (pos + 8, nbytes)
            pos += 8 + nbytes
    return refs, spans


_MAX_DIM = 2**31 - 1  # MLX shapes are int32


def _check_extent(path: Path, name: str, ref: _TensorRef, nbytes: int) -> None:
    """The tensor lies within its storage and no two of its elements share one, so
    reading it allocates at most the storage's bytes (checked before anything is read)."""
    where = f"{path}: tensor '{name}'"
    if ref.offset < 0 or any(n < 0 for n in ref.shape) or any(s < 0 for s in ref.stride):
        raise UserError(f"{where} has a negative size, stride or offset")
    if any(n > _MAX_DIM for n in ref.shape):
        raise UserError(f"{where} has shape {ref.shape}, out of range (at most {_MAX_DIM} a dimension)")
    if math.prod(ref.shape) == 0:
        return
    reach = 0  # the furthest element the dimensions so far step to, from the first
    for stride, n in sorted((s, n) for n, s in zip(ref.shape, ref.stride) if n > 1):
        if stride <= reach:  # a broadcast (stride 0) or rows over one another
            raise UserError(f"{where} has overlapping strides {ref.stride} for shape {ref.shape} (elements repeat)")
        reach += (n - 1) * stride
    need = ref.offset + reach + 1
    have = nbytes // ref.dtype.numpy.itemsize
    if need > have:
        raise UserError(
            f"{where} needs {need} {ref.dtype.name} elements but its storage "
            f"'{ref.storage.key}' holds {have} (storage too short)"
        )


def _load_tensor(path: Path, name: str, span: _Span, ref: _TensorRef) -> mx.array:
    dtype = ref.dtype.numpy
    if math.prod(ref.shape) == 0:
        return mx.zeros(ref.shape, ref.dtype.mlx)
    start, nbytes = span
    try:
        flat = np.memmap(path, dtype=dtype, mode="r", offset=start, shape=(nbytes // dtype.itemsize,))
        # size/stride/offset as torch gives them: views (transposes, slices) of a
        # shared storage come out as the tensor they were, copied contiguous.
        # A dimension of size 1 is never stepped over: its stride, which may be anything, is not used.
        strides = [s * dtype.itemsize if n > 1 else 0 for n, s in zip(ref.shape, ref.stride)]
        view = np.lib.stride_tricks.as_strided(flat[ref.offset :], shape=ref.shape, strides=strides)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: reading tensor '{name}' failed ({e})".splitlines()[0]) from None
    # copied in C order, reading only the bytes the tensor covers
    if ref.dtype.mlx == mx.bfloat16:
        return mx.array(view, dtype=mx.uint16).view(mx.bfloat16)
    return mx.array(view, dtype=ref.dtype.mlx)  # as is: mx.array would make float64 float32


def read_torch_file(path: Path) -> LazyWeights:
    """One `torch.save` file (zip or legacy format) of a state dict, without torch."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    if head == b"PK\x03\x04":
        refs, spans = _zip_spans(path)
    elif head[:1] == b"\x80":  # pickle protocol opcode: the legacy stream
        refs, spans = _legacy_spans(path)
    else:
        raise UserError(f"{path}: not a PyTorch checkpoint (wrong magic: neither a zip archive nor a pickle)")
    loaders: dict[str, Callable[[], mx.array]] = {}
    for name, ref in refs.items():
        span = spans.get(ref.storage.key)
        if span is None:
            raise UserError(f"{path}: tensor '{name}' needs storage record 'data/{ref.storage.key}', which is missing")
        _check_extent(path, name, ref, span[1])
        loaders[name] = partial(_load_tensor, path, name, span, ref)
    return LazyWeights(loaders)
