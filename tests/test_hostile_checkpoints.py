"""Hostile checkpoints: small files built to take the machine or crash the reader
(stride tricks, a zip bomb, deep or exploding pickles, malformed tensors, lying
safetensors headers). Each is refused by the real `mlx-spec convert` with one
line naming the file and tensor and exit 2, run under an address-space limit so
that an unbounded allocation fails the test.

The files are written here byte by byte (pickle opcodes, zip records, safetensors
headers), without torch; each is a benign copy of the tiny Llama (which converts,
see the first test) with one thing changed.
"""

import json
import pickle
import shutil
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tiny import make_tokenizer
from mlx_spec.weights import read_torch_file

from helpers import assert_one_line_error, cli_bounded

LLAMA = Path(__file__).parent / "fixtures" / "torch" / "llama"
LLAMA_SAFETENSORS = LLAMA.with_name("llama-safetensors")
TARGET = "model.embed_tokens.weight"  # the tensor each case makes hostile
NAMED = f"'{TARGET}'"


# ---------------------------------------------------------------- writing torch.save files by hand


@dataclass(frozen=True)
class Tensor:
    data: bytes  # its storage, float32
    shape: tuple
    stride: tuple
    offset: int = 0


def llama_tensors() -> dict[str, Tensor]:
    weights = read_torch_file(LLAMA / "pytorch_model.bin")
    values = {name: np.array(weights[name].astype(mx.float32)) for name in weights}
    return {name: Tensor(v.tobytes(), v.shape, tuple(s // 4 for s in v.strides)) for name, v in values.items()}


def op_str(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b  # BINUNICODE


def op_int(n: int) -> bytes:
    enc = pickle.encode_long(n)
    return b"\x8a" + bytes([len(enc)]) + enc  # LONG1: any size, any sign


def op_tuple(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"  # MARK ... TUPLE


def state_dict_pickle(tensors: dict[str, Tensor], legacy: bool, first: bytes = b"") -> bytes:
    """What torch.save pickles: {name: _rebuild_tensor_v2(storage, offset, shape, stride, ...)};
    storages are persistent ids. `first`: raw opcodes for an extra leading key and value."""
    items = first
    for key, (name, t) in enumerate(tensors.items()):
        pid = [op_str("storage"), b"ctorch\nFloatStorage\n", op_str(str(key)), op_str("cpu"), op_int(len(t.data) // 4)]
        storage = op_tuple(*pid, *([b"N"] if legacy else [])) + b"Q"  # BINPERSID
        shape, stride = op_tuple(*map(op_int, t.shape)), op_tuple(*map(op_int, t.stride))
        args = op_tuple(storage, op_int(t.offset), shape, stride, b"\x89", b"N")  # requires_grad, hooks
        items += op_str(name) + b"ctorch._utils\n_rebuild_tensor_v2\n" + args + b"R"
    return b"\x80\x02}(" + items + b"u."  # PROTO 2, EMPTY_DICT, MARK ... SETITEMS, STOP


def write_zip(path: Path, tensors: dict[str, Tensor], pkl: bytes | None = None) -> None:
    with zipfile.ZipFile(path, "w") as z:  # records STORED, as torch.save writes them
        z.writestr("archive/data.pkl", pkl if pkl is not None else state_dict_pickle(tensors, legacy=False))
        z.writestr("archive/byteorder", "little")
        for key, t in enumerate(tensors.values()):
            z.writestr(f"archive/data/{key}", t.data)
        z.writestr("archive/version", "3\n")


def write_legacy(path: Path, tensors: dict[str, Tensor], pkl: bytes | None = None) -> None:
    """The pre-1.6 stream: magic, version, system info, state dict, storage keys, storages."""
    head = [0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}]
    out = b"".join(pickle.dumps(x, protocol=2) for x in head)
    out += pkl if pkl is not None else state_dict_pickle(tensors, legacy=True)
    out += pickle.dumps([str(k) for k in range(len(tensors))], protocol=2)
    for t in tensors.values():
        out += struct.pack("<q", len(t.data) // 4) + t.data
    path.write_bytes(out)


WRITERS = {"zip": write_zip, "legacy": write_legacy}


def torch_source(tmp_path: Path, layout: str, tensors: dict[str, Tensor], pkl: bytes | None = None) -> Path:
    """A checkpoint folder: the tiny Llama's config.json and the given pytorch_model.bin."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(LLAMA / "config.json", src)
    WRITERS[layout](src / "pytorch_model.bin", tensors, pkl)
    return src


def convert(tmp_path: Path, src: Path):
    proc = cli_bounded("convert", src, "-o", tmp_path / "out")
    assert proc.returncode == 0 or not (tmp_path / "out").exists()
    return proc


@pytest.mark.parametrize("layout", WRITERS)
def test_the_benign_files_convert_under_the_limit(tmp_path, layout):
    proc = convert(tmp_path, torch_source(tmp_path, layout, llama_tensors()))
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- tensors that lie about their size


MALFORMED = {
    # 16384 x 16384 float32 (1 GiB) read from one 4-byte element
    "broadcast strides": (Tensor(b"\0" * 4, (16384, 16384), (0, 0)), "overlap"),
    "overlapping rows": (Tensor(b"\0" * 4096, (32, 32), (1, 1)), "overlap"),
    "huge shape": (Tensor(b"\0" * 4, (1 << 40, 1 << 40), (1 << 40, 1)), "out of range"),
    # a size-1 dimension's stride is never used: read, then refused for its shape
    "huge stride": (Tensor(b"\0" * 4, (1,), (1 << 62,)), "config.json implies (384, 32)"),
    "huge empty shape": (Tensor(b"", (0, 1 << 40), (1 << 40, 1)), "out of range"),
    "negative size": (Tensor(b"\0" * 64, (-4, 4), (4, 1)), "negative"),
    "negative stride": (Tensor(b"\0" * 64, (4, 4), (-4, 1)), "negative"),
    "offset past the storage": (Tensor(b"\0" * 64, (4,), (1,), offset=1 << 63), "storage too short"),
    "too many dimensions": (Tensor(b"\0" * 4, (1,) * 100, (1,) * 100), "dimensions"),
}


@pytest.mark.parametrize("layout", WRITERS)
@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_tensors_are_refused(tmp_path, layout, case):
    hostile, needle = MALFORMED[case]
    src = torch_source(tmp_path, layout, {**llama_tensors(), TARGET: hostile})
    assert_one_line_error(convert(tmp_path, src), src / "pytorch_model.bin", NAMED, needle)


# ---------------------------------------------------------------- pickles that explode or nest


def nested(depth: int) -> bytes:
    return b")" + b"\x85" * depth  # EMPTY_TUPLE, then TUPLE1 wraps it `depth` times


def exploding(depth: int) -> bytes:
    """(x, x) with x = (x', x') ..., `depth` deep and memo-shared: 2**depth leaves in a few bytes."""
    level = b"".join(b"r" + struct.pack("<I", i) + b"j" + struct.pack("<I", i) + b"\x86" for i in range(depth))
    return b")" + level  # each level: LONG_BINPUT, LONG_BINGET, TUPLE2


# raw opcodes for a first key and value of the state dict
PICKLES = {
    "deep key": (nested(10**6) + op_int(1), "nests deeper"),  # hashing it overflowed the C stack
    "deep value": (op_str("x") + b"]" * 10**5 + b"a" * (10**5 - 1), "nests deeper"),  # nested lists
    "exploding key": (exploding(100) + op_int(1), "expands"),  # hashing it would never end
    # memo slot 2**32 - 1: the unpickler would size its memo table (64 GiB) to hold it
    "huge memo index": (op_str("x") + b"r\xff\xff\xff\xff" + op_int(1), "memo"),
    "huge string": (b"\x8e" + struct.pack("<Q", 1 << 60) + b"x" + op_int(1), "not a valid PyTorch pickle"),
}


@pytest.mark.parametrize("layout", WRITERS)
@pytest.mark.parametrize("case", PICKLES)
def test_hostile_pickles_are_refused(tmp_path, layout, case):
    first, needle = PICKLES[case]
    tensors = llama_tensors()
    src = torch_source(tmp_path, layout, tensors, state_dict_pickle(tensors, layout == "legacy", first))
    assert_one_line_error(convert(tmp_path, src), src / "pytorch_model.bin", needle)


def zip_bomb(path: Path, tensors: dict[str, Tensor], size: int = (1 << 31) - 1) -> None:
    """A torch zip whose data.pkl is DEFLATE-compressed: the state dict, then zeros up to
    `size` bytes, in about size / 1000 bytes. One compressed block of 1 MiB of zeros
    (independent after a full flush) is repeated; the headers are patched to say so."""
    pkl, chunk = state_dict_pickle(tensors, legacy=False), 1 << 20
    z = zlib.compressobj(9, zlib.DEFLATED, -15)  # raw deflate, as zip records hold it
    head = z.compress(pkl) + z.flush(zlib.Z_FULL_FLUSH)
    block = z.compress(bytes(chunk)) + z.flush(zlib.Z_FULL_FLUSH)
    count = (size - len(pkl)) // chunk
    crc = zlib.crc32(pkl)
    for _ in range(count):
        crc = zlib.crc32(bytes(chunk), crc)
    write_zip(path, tensors, head + block * count + z.flush())  # data.pkl first, STORED
    data = bytearray(path.read_bytes())
    directory = struct.unpack("<I", data[-6:-2])[0]  # end record (no comment): central directory offset
    for method, crc_at, size_at in ((8, 14, 22), (directory + 10, directory + 16, directory + 24)):
        struct.pack_into("<H", data, method, zipfile.ZIP_DEFLATED)
        struct.pack_into("<I", data, crc_at, crc)
        struct.pack_into("<I", data, size_at, len(pkl) + count * chunk)
    path.write_bytes(data)


def test_zip_bombed_pickle_is_refused(tmp_path):
    src = torch_source(tmp_path, "zip", {})
    zip_bomb(src / "pytorch_model.bin", llama_tensors())
    assert (src / "pytorch_model.bin").stat().st_size < 3 << 20
    with zipfile.ZipFile(src / "pytorch_model.bin") as z:
        assert z.getinfo("archive/data.pkl").file_size > 2_000_000_000
    assert_one_line_error(convert(tmp_path, src), src / "pytorch_model.bin", "archive/data.pkl", "compressed")


# ---------------------------------------------------------------- safetensors headers that lie


def read_raw(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_safetensors(path: Path, header: dict | bytes, data: bytes, length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def hostile_header(case: str, header: dict, data: bytes) -> tuple[dict | bytes, int | None]:
    """`header` with `TARGET`'s entry (or the whole header) made hostile, and the length to declare."""
    entry, other = header[TARGET], header["lm_head.weight"]["data_offsets"]  # as many bytes as TARGET
    begin, end = entry["data_offsets"]
    whole = {
        "header longer than the file": (header, 1 << 40),
        "deep header": (b'{"a":' + b"[" * 10**6 + b"]" * 10**6 + b"}", None),
        "not json": (b"\xff" * 64, None),
        "not an entry": ({**header, TARGET: None}, None),
    }
    changes = {
        "overlapping offsets": {"data_offsets": [other[0] + 2, other[1] + 2]},
        "offsets past the file": {"data_offsets": [len(data) + 10, len(data) + 10 + end - begin]},
        "reversed offsets": {"data_offsets": [end, begin]},
        "shape and bytes disagree": {"shape": [384, 33]},
        "huge shape": {"shape": [1 << 40, 1 << 40]},
        "negative shape": {"shape": [-384, -32]},
        "unknown dtype": {"dtype": "Q7"},
    }
    return whole[case] if case in whole else ({**header, TARGET: {**entry, **changes[case]}}, None)


SAFETENSORS = {  # case: what the error names besides the file
    "overlapping offsets": ("overlap", NAMED),
    "offsets past the file": ("past the end", NAMED),
    "reversed offsets": ("data_offsets", NAMED),
    "shape and bytes disagree": ("bytes", NAMED),
    "huge shape": ("bytes", NAMED),
    "negative shape": ("negative shape", NAMED),
    "unknown dtype": ("dtype 'Q7'", NAMED),
    "not an entry": ("not a tensor entry", NAMED),
    "header longer than the file": ("header of 1099511627776 bytes",),
    "deep header": ("header is not JSON",),
    "not json": ("header is not JSON",),
}


def safetensors_source(tmp_path: Path, case: str) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(LLAMA_SAFETENSORS / "config.json", src)
    header, data = read_raw(LLAMA_SAFETENSORS / "model.safetensors")
    raw, length = hostile_header(case, header, data)
    write_safetensors(src / "model.safetensors", raw, data, length)
    return src


@pytest.mark.parametrize("case", SAFETENSORS)
def test_lying_safetensors_headers_are_refused(tmp_path, case):
    src = safetensors_source(tmp_path, case)
    assert_one_line_error(convert(tmp_path, src), src / "model.safetensors", *SAFETENSORS[case])


def test_generate_refuses_a_model_folder_with_overlapping_tensors(tmp_path):
    src = safetensors_source(tmp_path, "overlapping offsets")
    make_tokenizer(src)
    proc = cli_bounded("generate", "--model", src, "--prompt", "hi", "--max-tokens", "2")
    assert_one_line_error(proc, src / "model.safetensors", NAMED, "overlap")
