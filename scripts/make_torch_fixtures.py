"""Write the PyTorch checkpoint fixtures for tests/test_convert.py with real
`torch.save` (and `safetensors.torch`), so the readers are tested on the bytes
torch writes. mlx-spec itself never imports torch. Run once:

    pip install torch==2.13.0 safetensors
    python scripts/make_torch_fixtures.py

tests/fixtures/torch/
  tensors/    every dtype, plus views (transpose, slice with storage offset, strided,
              shared storage), a scalar, an empty tensor and a Parameter:
              zip.bin (torch.save), legacy.bin (_use_new_zipfile_serialization=False),
              model.safetensors (contiguous copies, no float64), expected.npz + expected.json
  sharded/    the same tensors split over two shards with an index, in both formats
  llama/      a tiny Llama as pytorch_model.bin (bf16, as a module's state_dict)
  llama-safetensors/  the same weights as model.safetensors: the reference
  llama-sharded/      the same weights as pytorch_model-0000i-of-00002.bin + index
  qwen3-tied/ a tiny Qwen3 whose lm_head.weight shares the embedding's storage
  medusa/     Medusa-1 heads as FasterDecoding publishes them: medusa_lm_head.pt (bf16,
              5 heads of 1 layer) with a config.json that claims 2 heads; sized for
              tests/conftest.py's checkpoints["llama"] (hidden 64, vocabulary 384)
"""

from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from pathlib import Path

import numpy as np
import safetensors
import safetensors.torch
import torch

from mlx_spec.testing import make_config, random_weights

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "torch"

TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=64,
    vocab_size=384,  # mlx_spec.testing.make_tokenizer's size
    torch_dtype="bfloat16",
)


def tensor_zoo() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    bf16_base = torch.randn(3, 4, generator=g).to(torch.bfloat16)
    long_base = torch.arange(10, dtype=torch.int64) * 1_000_000_007
    return {
        "float32": torch.randn(3, 4, generator=g),
        "float32.special": torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 3.4e38]),
        "float16": torch.randn(5, generator=g).half(),
        "bfloat16": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "float64": torch.randn(3, generator=g).double(),
        "int64": torch.tensor([0, -1, 2**40, -(2**62), 7]),
        "int32": torch.tensor([[1, -2], [2**31 - 1, -(2**31)]], dtype=torch.int32),
        "int16": torch.tensor([-32768, 0, 32767], dtype=torch.int16),
        "int8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "uint8": torch.arange(7, dtype=torch.uint8) * 37,
        "uint16": torch.tensor([0, 1, 65535], dtype=torch.uint16),  # _rebuild_tensor_v3
        "bool": torch.tensor([True, False, True, True, False, False]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "param": torch.nn.Parameter(torch.randn(2, 2, generator=g)),
        # views: one storage, several tensors; offsets and strides as torch keeps them
        "shared.base": base,
        "shared.transpose": base.T,
        "shared.slice": base[1:, 2:5],
        "shared.strided": base[::2, ::3],
        "bfloat16.view": bf16_base[1:, ::2],
        "int64.offset": long_base[3:7],
    }


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Exact values; bfloat16 and uint16 as their 16 bits (numpy has no bfloat16)."""
    t = t.detach().contiguous()
    if t.dtype in (torch.bfloat16, torch.uint16):
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def save_contiguous(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors refuses shared or non-contiguous tensors: copies. (float64 is left
    out: mx.load does not read F64 safetensors.)"""
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items() if v.dtype != torch.float64}
    safetensors.torch.save_file(tensors, str(path))


def write_sharded(directory: Path, tensors: dict[str, torch.Tensor], fmt: str) -> None:
    names = sorted(k for k, v in tensors.items() if fmt == "bin" or v.dtype != torch.float64)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for i, part in enumerate(halves):
        if fmt == "bin":
            fname = f"pytorch_model-{i + 1:05d}-of-00002.bin"
            torch.save({n: tensors[n] for n in part}, directory / fname)
        else:
            fname = f"model-{i + 1:05d}-of-00002.safetensors"
            save_contiguous({n: tensors[n] for n in part}, directory / fname)
        weight_map.update({n: fname for n in part})
    index = "pytorch_model.bin.index.json" if fmt == "bin" else "model.safetensors.index.json"
    (directory / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def state_dict(config: dict, seed: int) -> OrderedDict:
    """A module-like state dict (with `_metadata`, as nn.Module.state_dict makes it)."""
    sd = OrderedDict(
        (name, torch.from_numpy(w).to(torch.bfloat16)) for name, w in random_weights(config, seed).items()
    )
    sd._metadata = OrderedDict({"": {"version": 1}})
    return sd


def medusa_heads(target: dict, num_heads: int = 5, seed: int = 2) -> OrderedDict:
    """The state_dict of FasterDecoding's `nn.ModuleList([Sequential(ResBlock, Linear(H, V,
    bias=False))] * K)`: each head starts as `target`'s LM head with a perturbed block,
    so its drafts are sometimes accepted."""
    g = torch.Generator().manual_seed(seed)
    lm_head = torch.from_numpy(random_weights(target, seed=0)["lm_head.weight"])
    hidden = target["hidden_size"]
    sd = OrderedDict()
    for k in range(num_heads):
        sd[f"{k}.0.linear.weight"] = 0.05 * torch.randn(hidden, hidden, generator=g)
        sd[f"{k}.0.linear.bias"] = 0.01 * torch.randn(hidden, generator=g)
        sd[f"{k}.1.weight"] = lm_head.clone()
    return OrderedDict((name, w.to(torch.bfloat16)) for name, w in sd.items())


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    names = ("tensors", "sharded", "llama", "llama-safetensors", "llama-sharded", "qwen3-tied", "medusa")
    dirs = {name: OUT / name for name in names}
    for d in dirs.values():
        d.mkdir(parents=True)

    zoo = tensor_zoo()
    torch.save(zoo, dirs["tensors"] / "zip.bin")
    torch.save(zoo, dirs["tensors"] / "legacy.bin", _use_new_zipfile_serialization=False)
    save_contiguous(zoo, dirs["tensors"] / "model.safetensors")
    np.savez(dirs["tensors"] / "expected.npz", **{k: to_numpy(v) for k, v in zoo.items()})
    dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in zoo.items()}
    (dirs["tensors"] / "expected.json").write_text(json.dumps(dtypes, indent=2))
    write_sharded(dirs["sharded"], zoo, "bin")
    write_sharded(dirs["sharded"], zoo, "safetensors")

    llama = make_config("llama", **TINY)
    weights = state_dict(llama, seed=0)
    for d in ("llama", "llama-safetensors", "llama-sharded"):
        (dirs[d] / "config.json").write_text(json.dumps(llama, indent=2))
    torch.save(weights, dirs["llama"] / "pytorch_model.bin")
    save_contiguous(weights, dirs["llama-safetensors"] / "model.safetensors")
    write_sharded(dirs["llama-sharded"], weights, "bin")

    qwen3 = make_config("qwen3", **TINY)
    weights = state_dict(qwen3, seed=1)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # tied: one storage, two names
    (dirs["qwen3-tied"] / "config.json").write_text(json.dumps(qwen3, indent=2))
    torch.save(weights, dirs["qwen3-tied"] / "pytorch_model.bin")

    # conftest's checkpoints["llama"]: make_checkpoint(..., "llama", seed=0), vocabulary 384
    torch.save(medusa_heads(make_config("llama", vocab_size=384)), dirs["medusa"] / "medusa_lm_head.pt")
    medusa_config = {"base_model_name_or_path": "tiny-llama", "medusa_num_heads": 2, "medusa_num_layers": 1}
    (dirs["medusa"] / "config.json").write_text(json.dumps(medusa_config, indent=2) + "\n")

    versions = {"torch": torch.__version__, "safetensors": safetensors.__version__}
    (OUT / "versions.json").write_text(json.dumps(versions, indent=2) + "\n")
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"{OUT}: {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
