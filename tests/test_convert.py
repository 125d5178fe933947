"""Checkpoint import: readers (safetensors, torch.save without torch), their refusals,
`mlx-spec convert` end to end, atomic output, the Hub cache, and the drafter registry.

The PyTorch files under tests/fixtures/torch/ were written by real torch.save
(scripts/make_torch_fixtures.py); hostile and damaged files are made here.
"""

import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec import files
from mlx_spec.cli import main
from mlx_spec import torch_pickle
from mlx_spec import weights as readers
from mlx_spec.convert import pipeline
from mlx_spec.weights import read_safetensors, read_safetensors_file, read_torch, read_torch_file
from mlx_spec.drafters import find_drafter
from mlx_spec.published import model_key
from mlx_spec.errors import UserError
from mlx_spec.models import load_model
from tiny import make_checkpoint, make_tokenizer

from helpers import assert_one_line_error, cli, cli_here, fake_hub_cache

FIXTURES = Path(__file__).parent / "fixtures" / "torch"
TENSORS = FIXTURES / "tensors"
EXPECTED = np.load(TENSORS / "expected.npz")
DTYPES = json.loads((TENSORS / "expected.json").read_text())


def raises_one_line(fn, *needles) -> str:
    with pytest.raises(UserError) as e:
        fn()
    message = str(e.value)
    assert "\n" not in message
    for needle in needles:
        assert str(needle) in message, message
    return message


def bits(a: mx.array) -> np.ndarray:
    """An array's exact contents (bfloat16 as its 16 bits, as expected.npz has them)."""
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def assert_as_saved(weights, names):
    for name in names:
        a = weights[name]
        assert a.dtype == getattr(mx, {"bool": "bool_"}.get(DTYPES[name], DTYPES[name])), name
        got, want = bits(a), EXPECTED[name]
        assert got.shape == want.shape and got.tobytes() == want.tobytes(), name


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("fname", ["zip.bin", "legacy.bin"])
def test_torch_save_round_trip_every_dtype_and_view(fname):
    weights = read_torch_file(TENSORS / fname)
    assert sorted(weights) == sorted(DTYPES)
    assert_as_saved(weights, DTYPES)


def test_safetensors_round_trip():
    weights = read_safetensors_file(TENSORS / "model.safetensors")
    assert sorted(weights) == sorted(n for n, d in DTYPES.items() if d != "float64")
    assert_as_saved(weights, weights)


@pytest.mark.parametrize("reader", [read_torch, read_safetensors])
def test_sharded_round_trip(reader):
    weights, origin = reader(FIXTURES / "sharded")
    assert len({f.name for f in origin.values()}) == 2
    assert_as_saved(weights, weights)


def test_torch_reading_is_lazy(monkeypatch):
    loaded = []
    real = torch_pickle._load_tensor
    monkeypatch.setattr(torch_pickle, "_load_tensor", lambda *a: loaded.append(a[1]) or real(*a))
    weights = read_torch_file(TENSORS / "zip.bin")
    assert loaded == []
    assert_as_saved(weights, ["shared.slice"])
    assert loaded == ["shared.slice"]


def rewrite_zip(src: Path, dst: Path, changes: dict, compression=zipfile.ZIP_STORED) -> None:
    """Copy a torch zip record by record (no 64-byte alignment): `changes` maps a
    record's name suffix to new bytes, or None to drop it."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", compression) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            for suffix, new in changes.items():
                if info.filename.endswith(suffix):
                    data = new
            if data is not None:
                zout.writestr(info.filename, data)


def test_zip_rewritten_without_alignment_reads_the_same(tmp_path):
    rewrite_zip(TENSORS / "zip.bin", tmp_path / "copy.bin", {})
    assert_as_saved(read_torch_file(tmp_path / "copy.bin"), DTYPES)


def test_readers_never_import_torch():
    code = (
        "import sys; from pathlib import Path; from mlx_spec import weights as readers; from mlx_spec.convert import pipeline; "
        f"w = readers.read_torch_file(Path({str(TENSORS / 'legacy.bin')!r})); [w[k] for k in w]; "
        f"w = readers.read_torch_file(Path({str(TENSORS / 'zip.bin')!r})); [w[k] for k in w]; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------- refusals


class Hostile:
    """Pickles as a call of `func(*args)`: what torch.load would run."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def hostile_payloads(marker: Path) -> dict:
    import builtins

    touch = f"open({str(marker)!r}, 'w').close()"
    return {
        "os.system": Hostile(os.system, f"touch {marker}"),
        "builtins.exec": Hostile(builtins.exec, touch),
        "builtins.eval": Hostile(builtins.eval, touch),
    }


def hostile_zip(path: Path, payload) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": payload}, protocol=2))
        z.writestr("archive/version", "3\n")


@pytest.mark.parametrize("layout", ["zip", "legacy"])
@pytest.mark.parametrize("payload", ["os.system", "builtins.exec", "builtins.eval"])
def test_hostile_pickle_is_refused_and_nothing_runs(tmp_path, layout, payload):
    marker = tmp_path / "pwned"
    evil = hostile_payloads(marker)[payload]
    path = tmp_path / "pytorch_model.bin"
    if layout == "zip":
        hostile_zip(path, evil)
    else:  # a bare pickle stream: read as the legacy format, whose first object runs
        path.write_bytes(pickle.dumps(evil, protocol=2))
    # (protocol 2 spells the module as Python 2 did: posix.system, __builtin__.exec)
    raises_one_line(lambda: read_torch_file(path), path, f".{evil.func.__name__}'", "refusing")
    assert not marker.exists()


def test_torch_globals_outside_the_allowlist_are_refused(tmp_path):
    path = tmp_path / "x.pt"
    data = pickle.dumps({"w": 1}, protocol=2).replace(b"}", b"ctorch\nload\n)R", 1)  # calls torch.load()
    path.write_bytes(data)
    raises_one_line(lambda: read_torch_file(path), "'torch.load'")


def corrupt(kind: str, src: Path, dst: Path) -> str:
    """Write a damaged copy of the torch file `src` to `dst`; return what the error must name."""
    data = src.read_bytes()
    if kind == "truncated zip":
        dst.write_bytes(data[: len(data) // 2])
        return "truncated or corrupt zip"
    if kind == "truncated legacy":
        dst.write_bytes(data[:-10])
        return "truncated"
    if kind == "wrong magic":
        dst.write_bytes(b"GGUF" + data[4:])
        return "wrong magic"
    if kind == "wrong legacy magic":
        dst.write_bytes(pickle.dumps(12345, protocol=2) + data)
        return "wrong magic number"
    if kind == "storage too short":
        rewrite_zip(src, dst, {"data/0": b"\0" * 4})
        return "storage too short"
    if kind == "missing record":
        rewrite_zip(src, dst, {"data/0": None})
        return "missing"
    if kind == "compressed record":
        rewrite_zip(src, dst, {}, zipfile.ZIP_DEFLATED)
        return "compressed"
    raise ValueError(kind)


KINDS = {
    "truncated zip": "zip.bin",
    "truncated legacy": "legacy.bin",
    "wrong magic": "zip.bin",
    "wrong legacy magic": "legacy.bin",
    "storage too short": "zip.bin",
    "missing record": "zip.bin",
    "compressed record": "zip.bin",
}


@pytest.mark.parametrize("kind", KINDS)
def test_damaged_torch_files_are_one_line_errors(tmp_path, kind):
    path = tmp_path / "bad.bin"
    needle = corrupt(kind, TENSORS / KINDS[kind], path)

    def read_all():
        weights = read_torch_file(path)
        return [weights[k] for k in weights]

    raises_one_line(read_all, path, needle)


def test_storage_too_short_names_the_tensor(tmp_path):
    path = tmp_path / "bad.bin"
    corrupt("storage too short", TENSORS / "zip.bin", path)
    message = raises_one_line(lambda: read_torch_file(path), "tensor '")
    assert "needs" in message and "holds 1" in message


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_index_naming_a_missing_shard(tmp_path, fmt):
    shutil.copytree(FIXTURES / "sharded", tmp_path / "s")
    gone = sorted((tmp_path / "s").glob(f"*-00002-of-00002.{fmt}"))[0]
    gone.unlink()
    reader = read_torch if fmt == "bin" else read_safetensors
    raises_one_line(lambda: reader(tmp_path / "s"), gone.name, "missing")


@pytest.fixture
def llama_src(tmp_path):
    """The tiny Llama as pytorch_model.bin, with a tokenizer."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "llama", src)
    make_tokenizer(src)
    return src


@pytest.mark.parametrize("kind", ["hostile", "truncated zip", "wrong magic", "storage too short", "missing shard"])
def test_cli_refusals_exit_2_with_one_line(tmp_path, kind, in_process):
    src = tmp_path / "src"
    marker = tmp_path / "pwned"
    if kind == "missing shard":
        shutil.copytree(FIXTURES / "llama-sharded", src)
        (src / "pytorch_model-00002-of-00002.bin").unlink()
        needle = (src / "pytorch_model-00002-of-00002.bin", "missing")
    else:
        src.mkdir()
        shutil.copy(FIXTURES / "llama" / "config.json", src)
        bad = src / "pytorch_model.bin"
        if kind == "hostile":
            hostile_zip(bad, hostile_payloads(marker)["os.system"])
            needle = "refusing to unpickle global 'posix.system'"
        else:
            needle = corrupt(kind, FIXTURES / "llama" / "pytorch_model.bin", bad)
        needle = (bad, needle)
    proc = in_process("convert", src, "-o", tmp_path / "out")
    assert_one_line_error(proc, *needle)
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- convert


def logits(path) -> mx.array:
    model, _ = load_model(str(path))
    out, _ = model(mx.array([[1, 5, 9, 200, 383, 42, 7]]))
    return out


@pytest.fixture(scope="module")
def reference_logits():
    return logits(FIXTURES / "llama-safetensors")


def test_cli_convert_bin_then_generate(tmp_path, llama_src, reference_logits):
    out = tmp_path / "out"
    proc = cli_here("convert", llama_src, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert "llama" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["mlx_spec"] == {"family": "llama", "source": str(llama_src)}
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {f.name for f in out.iterdir()}
    assert mx.array_equal(logits(out), reference_logits)
    gen = cli_here("generate", "--model", out, "--prompt", "the fox", "--max-tokens", "6", "--json")
    assert gen.returncode == 0, gen.stderr
    assert len(json.loads(gen.stdout)["tokens"]) > 0


@pytest.mark.parametrize("name", ["llama-sharded", "llama-safetensors"])
def test_convert_sharded_bin_and_safetensors(tmp_path, name, reference_logits):
    out = tmp_path / "out"
    assert main(["convert", str(FIXTURES / name), "-o", str(out)]) == 0
    assert mx.array_equal(logits(out), reference_logits)


def test_convert_tied_embeddings_sharing_storage(tmp_path):
    out = tmp_path / "out"
    assert main(["convert", str(FIXTURES / "qwen3-tied"), "-o", str(out)]) == 0
    written = mx.load(str(out / "model.safetensors"))
    source = read_torch_file(FIXTURES / "qwen3-tied" / "pytorch_model.bin")
    assert "lm_head.weight" in source and "lm_head.weight" not in written
    assert sorted(written) == sorted(k for k in source if k != "lm_head.weight")
    assert all(mx.array_equal(written[k], source[k]) and written[k].dtype == source[k].dtype for k in written)
    load_model(str(out))


def test_dtype_and_quantize(tmp_path, reference_logits):
    out = tmp_path / "out"
    args = ["convert", str(FIXTURES / "llama"), "-o", str(out), "--dtype", "float32"]
    assert main([*args, "-q", "--q-bits", "8", "--q-group-size", "32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8}
    assert config["torch_dtype"] == "float32"
    written = mx.load(str(out / "model.safetensors"))
    assert written["model.layers.0.mlp.up_proj.weight"].dtype == mx.uint32
    assert written["model.layers.0.mlp.up_proj.scales"].dtype == mx.float32
    got = logits(out)
    assert mx.abs(got - reference_logits).max().item() < 0.1 * mx.abs(reference_logits).max().item()

    plain = tmp_path / "plain"
    assert main(["convert", str(FIXTURES / "llama"), "-o", str(plain), "--dtype", "float16"]) == 0
    assert {v.dtype for v in mx.load(str(plain / "model.safetensors")).values()} == {mx.float16}


def test_convert_writes_shards_past_the_size_limit(tmp_path, monkeypatch, reference_logits):
    monkeypatch.setattr(files, "MAX_SHARD_BYTES", 30_000)
    out = tmp_path / "out"
    assert main(["convert", str(FIXTURES / "llama"), "-o", str(out)]) == 0
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert (out / "model.safetensors.index.json").exists()
    assert mx.array_equal(logits(out), reference_logits)


def test_target_must_share_the_vocabulary(tmp_path, llama_src, capsys):
    same = make_checkpoint(tmp_path / "same", "qwen3")  # same tokenizer, other architecture and sizes
    other = tmp_path / "other"
    make_checkpoint(other, "qwen3")
    make_tokenizer(other, vocab_size=300)
    assert main(["convert", str(llama_src), "-o", str(tmp_path / "a"), "--target", str(same)]) == 0
    assert json.loads((tmp_path / "a" / "config.json").read_text())["mlx_spec"]["target"] == str(same)
    assert main(["convert", str(llama_src), "-o", str(tmp_path / "b"), "--target", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--target" in err and "tokenizer" in err
    assert not (tmp_path / "b").exists()
    # no tokenizer in the source: the vocab sizes must agree
    assert main(["convert", str(FIXTURES / "llama"), "-o", str(tmp_path / "c"), "--target", str(same)]) == 0
    small = make_checkpoint(tmp_path / "small", "qwen3", vocab_size=512)
    assert main(["convert", str(FIXTURES / "llama"), "-o", str(tmp_path / "d"), "--target", str(small)]) == 2
    assert "vocab_size" in capsys.readouterr().err


def siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name and p.name.startswith(f".{out.name}"))


def test_converting_twice_needs_force_and_replaces_cleanly(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", str(FIXTURES / "llama"), "-o", str(out), "--dtype", "float32"]) == 0
    before = (out / "model.safetensors").read_bytes()
    assert main(["convert", str(FIXTURES / "llama"), "-o", str(out), "--dtype", "float16"]) == 2
    assert "--force" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == before
    assert main(["convert", str(FIXTURES / "llama"), "-o", str(out), "--dtype", "float16", "--force"]) == 0
    assert mx.load(str(out / "model.safetensors"))["model.norm.weight"].dtype == mx.float16
    assert siblings(out) == []


def test_force_never_replaces_what_is_not_a_conversion(tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "llama", src)
    before = sorted(p.name for p in src.iterdir())
    assert main(["convert", str(src), "-o", str(src), "--force"]) == 2
    assert "not an mlx-spec conversion" in capsys.readouterr().err
    assert sorted(p.name for p in src.iterdir()) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["convert", str(src), "-o", str(empty)]) == 0  # an empty directory is filled


def interrupt_midway(monkeypatch):
    """Make the weights write stop halfway, as Ctrl-C would."""

    def save(directory, weights):
        (directory / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "save_weights", save)


def test_interrupted_conversion_leaves_no_out(tmp_path, monkeypatch):
    out = tmp_path / "out"
    interrupt_midway(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        pipeline.convert(str(FIXTURES / "llama"), out)
    assert not out.exists() and siblings(out) == []


def test_interrupted_replacement_keeps_the_old_out(tmp_path, monkeypatch):
    out = tmp_path / "out"
    pipeline.convert(str(FIXTURES / "llama"), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    interrupt_midway(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        pipeline.convert(str(FIXTURES / "llama"), out, dtype="float16", force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert siblings(out) == []


def test_interrupted_between_renames_puts_the_old_out_back(tmp_path, monkeypatch):
    out = tmp_path / "out"
    pipeline.convert(str(FIXTURES / "llama"), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_replace = os.replace
    calls = []

    def replace(a, b):
        calls.append(b)
        if len(calls) == 2:  # OUT already moved aside, the new one not yet in place
            raise KeyboardInterrupt
        real_replace(a, b)

    monkeypatch.setattr(files.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        pipeline.convert(str(FIXTURES / "llama"), out, dtype="float16", force=True)
    monkeypatch.setattr(files.os, "replace", real_replace)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# ---------------------------------------------------------------- the Hub


def test_hub_repo_from_the_cache_offline(tmp_path, llama_src, reference_logits):
    cache = tmp_path / "hub"
    fake_hub_cache(cache, "tiny/llama", llama_src, revisions=("main", "v1"))
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    out = tmp_path / "out"
    proc = cli("convert", "tiny/llama", "--revision", "v1", "-o", out, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "config.json").read_text())["mlx_spec"] == {
        "family": "llama", "source": "tiny/llama", "revision": "v1",
    }
    assert mx.array_equal(logits(out), reference_logits)
    assert_one_line_error(cli("convert", "tiny/llama", "--revision", "v2", "-o", tmp_path / "x", env=env), "'v2'", "offline")
    assert_one_line_error(cli("convert", "Qwen/Qwen3-0.6B", "-o", tmp_path / "y", env=env), "Qwen/Qwen3-0.6B", "offline")


# ---------------------------------------------------------------- families, flags


def test_unrecognised_sources(tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "llama", src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    assert main(["convert", str(src), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gpt_neox" in err and "not a checkpoint mlx-spec can convert" in err
    dflash = {**config, "model_type": "qwen3", "architectures": ["DFlashDraftModel"]}  # no DFlash fields
    (src / "config.json").write_text(json.dumps(dflash))
    assert main(["convert", str(src), "-o", str(tmp_path / "out")]) == 2
    assert "num_target_layers" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["convert", str(empty), "-o", str(tmp_path / "out")]) == 2
    assert "no config.json" in capsys.readouterr().err
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(FIXTURES / "llama" / "config.json", no_weights)
    assert main(["convert", str(no_weights), "-o", str(tmp_path / "out")]) == 2
    assert "no weights" in capsys.readouterr().err


def test_family_detection_is_a_registry():
    assert [f.NAME for f in pipeline.FAMILIES][-1] == "llama"  # the catch-all goes last
    for family in pipeline.FAMILIES:
        for attr in ("DESCRIPTION", "detect", "fetch", "convert", "build", "check_target"):
            assert hasattr(family, attr), (family.NAME, attr)
    source = pipeline.read_source(str(FIXTURES / "qwen3-tied"))
    assert pipeline.detect(source).NAME == "llama"


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--dtype", "float8"], "--dtype"),
        (["-q", "--q-bits", "3"], "--q-bits"),
        (["-q", "--q-group-size", "48"], "--q-group-size"),
        (["--q-bits", "8"], "-q/--quantize"),
    ],
)
def test_flag_errors(tmp_path, capsys, flags, needle):
    assert main(["convert", str(FIXTURES / "llama"), "-o", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err


def test_quantizing_a_quantized_source_is_refused(tmp_path, capsys):
    q = make_checkpoint(tmp_path / "q", "qwen3", quantize_bits=4, group_size=32)
    assert main(["convert", str(q), "-o", str(tmp_path / "out"), "-q"]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert main(["convert", str(q), "-o", str(tmp_path / "out")]) == 0  # as it is: fine
    load_model(str(tmp_path / "out"))


# ---------------------------------------------------------------- drafter registry


def test_find_drafter():
    assert find_drafter("dflash", "Qwen/Qwen3-8B") == "z-lab/Qwen3-8B-DFlash-b16"
    assert find_drafter("eagle3", "meta-llama/Llama-3.1-8B-Instruct") == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert find_drafter("eagle", "lmsys/vicuna-7b-v1.3") == "yuhuili/EAGLE-Vicuna-7B-v1.3"
    assert find_drafter("medusa", "lmsys/vicuna-7b-v1.3") == "FasterDecoding/medusa-vicuna-7b-v1.3"
    # mirrors and MLX conversions of a target match it
    assert find_drafter("dflash", "mlx-community/Qwen3-8B-4bit") == "z-lab/Qwen3-8B-DFlash-b16"
    assert find_drafter("eagle3", "mlx-community/Meta-Llama-3.1-8B-Instruct-8bit") == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert model_key("mlx-community/Qwen3-30B-A3B-4bit-DWQ") == "qwen3-30b-a3b"
    # a config (or a directory) names its target by what it was converted from
    assert find_drafter("dflash", {"mlx_spec": {"source": "Qwen/Qwen3-4B"}}) == "z-lab/Qwen3-4B-DFlash-b16"
    assert find_drafter("eagle3", {"_name_or_path": "Qwen/Qwen3-8B"}) == "AngelSlim/Qwen3-8B_eagle3"


def test_find_drafter_errors(tmp_path):
    raises_one_line(lambda: find_drafter("dflash", "Qwen/Qwen3-0.6B"), "Qwen/Qwen3-0.6B", "no published dflash drafter")
    raises_one_line(lambda: find_drafter("lookahead", "Qwen/Qwen3-8B"), "lookahead", "dflash")
    raises_one_line(lambda: find_drafter("dflash", {"model_type": "qwen3"}), "cannot tell which model")
    folder = tmp_path / "my-model"  # a folder whose config does not say what it is: known by its name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    raises_one_line(lambda: find_drafter("dflash", str(folder)), "my-model", "no published dflash drafter")
