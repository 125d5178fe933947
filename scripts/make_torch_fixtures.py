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
  eagle1/     an EAGLE-1 drafter as yuhuili publishes Vicuna's: fp32 pytorch_model.bin with
              embed_tokens, fc.weight + fc.bias, layers.0.* (no input norm) and the
              rotary_emb.inv_freq buffer older transformers saved; a Llama config of one
              layer without "bias", num_key_value_heads or rope_theta; for checkpoints["llama"]
  eagle1-nobias/  EAGLE-1 as for LLaMA3: fp16, config "bias": false (no fc.bias), here a
              Qwen2 layer (q/k/v biases) for checkpoints["qwen2"] (tied embeddings)
  eagle3/     an EAGLE-3 drafter as yuhuili publishes them: fp16 pytorch_model.bin without
              embed_tokens, midlayer.*, norm, lm_head over a draft vocabulary of 32,
              d2t (int64) and t2d (bool); config without rope_theta or head_dim;
              for checkpoints["qwen3"]
  eagle3-specforge/  as SpecForge exports: bf16 model.safetensors with midlayer.* and
              embed_tokens, the full vocabulary (no draft_vocab_size, d2t or t2d),
              architectures LlamaForCausalLMEagle3, eagle_config's aux layer ids, and a
              wrong head_dim (32; q_proj says 16), as some published configs have
  eagle3-angelslim/  as AngelSlim's Qwen3 EAGLE-3 drafters (Qwen3-4B_eagle3): SpecForge's
              layout over a draft vocabulary (d2t, t2d), architectures LlamaForCausalLMEagle3,
              and a config head_dim of hidden / heads (16) where q_proj's heads are 32 wide
              (Qwen3-4B's says 80 where the tensors say 128); for checkpoints["qwen3"]
  eagle1-llama3/  EAGLE-1 as yuhuili publishes LLaMA3.1-Instruct-8B's: fp16 pytorch_model.bin,
              embed_tokens included, "bias": false (no fc.bias), rope_theta 500000, grouped
              KV heads; for checkpoints["llama"]
  medusa2/    a Medusa-2 model as FasterDecoding's medusa-1.0-* repos hold it: a whole
              fine-tuned Llama (the target) whose pytorch_model-0000i-of-00002.bin shards
              and index also hold 3 heads as medusa_head.{k}.0.linear.* and
              medusa_head.{k}.1.weight; config.json a Llama config with medusa_num_heads
              and medusa_num_layers; the tokenizer beside it
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

from tiny import make_config, make_tokenizer, random_weights

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "torch"

TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=64,
    vocab_size=384,  # tiny.make_tokenizer's size
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


# The targets of the EAGLE fixtures: tests/conftest.py's checkpoints[arch], made
# by make_checkpoint(..., arch, seed) (vocabulary 384, hidden 64, 2 layers).
EAGLE_TARGETS = {"llama": 0, "qwen2": 1, "qwen3": 2}


class Draw:
    """Seeded random weights, drawn in float32 as an untrained layer's would be."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def linear(self, rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=self.g) / cols**0.5

    def norm(self, size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=self.g)

    def bias(self, size: int) -> torch.Tensor:
        return 0.1 * torch.randn(size, generator=self.g)


def target_embedding(arch: str) -> torch.Tensor:
    """The embedding of checkpoints[arch], which EAGLE files ship a copy of."""
    config = make_config(arch, vocab_size=384)
    return torch.from_numpy(random_weights(config, EAGLE_TARGETS[arch])["model.embed_tokens.weight"])


def eagle_layer(draw: Draw, prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int,
                intermediate: int, attn_input: int, qkv_bias: bool) -> OrderedDict:
    """One decoder layer's attention and MLP (`attn_input`: 2H for EAGLE-3's [embedding; feature])."""
    sd = OrderedDict()
    for proj, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
        sd[f"{prefix}self_attn.{proj}_proj.weight"] = draw.linear(rows, attn_input)
        if qkv_bias:
            sd[f"{prefix}self_attn.{proj}_proj.bias"] = draw.bias(rows)
    sd[f"{prefix}self_attn.o_proj.weight"] = draw.linear(hidden, heads * head_dim)
    sd[f"{prefix}post_attention_layernorm.weight"] = draw.norm(hidden)
    sd[f"{prefix}mlp.gate_proj.weight"] = draw.linear(intermediate, hidden)
    sd[f"{prefix}mlp.up_proj.weight"] = draw.linear(intermediate, hidden)
    sd[f"{prefix}mlp.down_proj.weight"] = draw.linear(hidden, intermediate)
    return sd


def eagle1(arch: str, fc_bias: bool, qkv_bias: bool, kv_heads: int, seed: int) -> OrderedDict:
    """yuhuili's EAGLE-1 state dict (`cnets1.Model`): embedding first, as the module holds it."""
    draw = Draw(seed)
    sd = OrderedDict([("embed_tokens.weight", target_embedding(arch))])
    sd.update(eagle_layer(draw, "layers.0.", 64, 4, kv_heads, 16, 64, 64, qkv_bias))
    sd["fc.weight"] = draw.linear(64, 128)
    if fc_bias:
        sd["fc.bias"] = draw.bias(64)
    return sd


def eagle3(seed: int, draft_vocab: int, embedding: torch.Tensor | None, head_dim: int = 16) -> OrderedDict:
    """An EAGLE-3 state dict (`cnets.Model` / SpecForge's LlamaForCausalLMEagle3); with a
    reduced vocabulary, d2t/t2d map the `draft_vocab` ids (sorted) of 384."""
    draw = Draw(seed)
    sd = OrderedDict()
    if embedding is not None:
        sd["embed_tokens.weight"] = embedding
    sd["fc.weight"] = draw.linear(64, 3 * 64)
    sd["midlayer.hidden_norm.weight"] = draw.norm(64)
    sd["midlayer.input_layernorm.weight"] = draw.norm(64)
    sd.update(eagle_layer(draw, "midlayer.", 64, 4, 2, head_dim, 96, 128, qkv_bias=False))
    sd["norm.weight"] = draw.norm(64)
    sd["lm_head.weight"] = draw.linear(draft_vocab, 64)
    if draft_vocab < 384:
        used = torch.sort(torch.randperm(384, generator=draw.g)[:draft_vocab]).values
        sd["d2t"] = used - torch.arange(draft_vocab)  # int64, as published
        t2d = torch.zeros(384, dtype=torch.bool)
        t2d[used] = True
        sd["t2d"] = t2d
    return sd


def eagle_config(**fields) -> str:
    """A one-layer Llama-style draft config (transformers 4 keys)."""
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 384, "hidden_act": "silu",
              "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, **fields}
    return json.dumps(config, indent=2) + "\n"


def as_dtype(sd: OrderedDict, dtype: torch.dtype) -> OrderedDict:
    return OrderedDict((k, v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items())


def write_eagle_fixtures(dirs: dict[str, Path]) -> None:
    # Vicuna: fp32, fc.bias, the persistent inv_freq buffer of transformers < 4.31
    sd = eagle1("llama", fc_bias=True, qkv_bias=False, kv_heads=4, seed=10)
    sd["layers.0.self_attn.rotary_emb.inv_freq"] = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
    torch.save(sd, dirs["eagle1"] / "pytorch_model.bin")
    (dirs["eagle1"] / "config.json").write_text(
        eagle_config(intermediate_size=64, rms_norm_eps=1e-6, torch_dtype="float32", tie_word_embeddings=False)
    )

    sd = eagle1("qwen2", fc_bias=False, qkv_bias=True, kv_heads=2, seed=11)
    torch.save(as_dtype(sd, torch.float16), dirs["eagle1-nobias"] / "pytorch_model.bin")
    (dirs["eagle1-nobias"] / "config.json").write_text(eagle_config(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], intermediate_size=64, num_key_value_heads=2,
        rms_norm_eps=1e-6, rope_theta=1000000.0, torch_dtype="float16", tie_word_embeddings=True, bias=False,
    ))

    sd = eagle3(seed=12, draft_vocab=32, embedding=None)
    torch.save(as_dtype(sd, torch.float16), dirs["eagle3"] / "pytorch_model.bin")
    (dirs["eagle3"] / "config.json").write_text(eagle_config(
        intermediate_size=96, num_key_value_heads=2, rms_norm_eps=1e-5, draft_vocab_size=32,
        torch_dtype="float16", tie_word_embeddings=False,
    ))

    sd = eagle3(seed=13, draft_vocab=384, embedding=target_embedding("qwen3"))
    save_contiguous(as_dtype(sd, torch.bfloat16), dirs["eagle3-specforge"] / "model.safetensors")
    (dirs["eagle3-specforge"] / "config.json").write_text(eagle_config(
        architectures=["LlamaForCausalLMEagle3"], intermediate_size=96, num_key_value_heads=2, head_dim=32,
        rms_norm_eps=1e-6, rope_theta=1000000.0, torch_dtype="bfloat16", tie_word_embeddings=False,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 1], "use_aux_hidden_state": True},
    ))


def write_published_variants(dirs: dict[str, Path]) -> None:
    sd = eagle3(seed=15, draft_vocab=32, embedding=None, head_dim=32)
    save_contiguous(as_dtype(sd, torch.bfloat16), dirs["eagle3-angelslim"] / "model.safetensors")
    (dirs["eagle3-angelslim"] / "config.json").write_text(eagle_config(
        architectures=["LlamaForCausalLMEagle3"], intermediate_size=96, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=1000000.0, draft_vocab_size=32, torch_dtype="bfloat16",
        tie_word_embeddings=False,
    ))

    sd = eagle1("llama", fc_bias=False, qkv_bias=False, kv_heads=2, seed=14)
    torch.save(as_dtype(sd, torch.float16), dirs["eagle1-llama3"] / "pytorch_model.bin")
    (dirs["eagle1-llama3"] / "config.json").write_text(eagle_config(
        intermediate_size=64, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0, torch_dtype="float16",
        tie_word_embeddings=False, bias=False,
    ))

    config = {**make_config("llama", **TINY), "architectures": ["MedusaModelLlama"], "medusa_num_heads": 3,
              "medusa_num_layers": 1}
    weights = state_dict(config, seed=0)
    heads = medusa_heads(config, num_heads=3, seed=4)  # from this model's own LM head (seed 0)
    weights.update((f"medusa_head.{name}", w) for name, w in heads.items())
    write_sharded(dirs["medusa2"], weights, "bin")
    (dirs["medusa2"] / "config.json").write_text(json.dumps(config, indent=2))
    make_tokenizer(dirs["medusa2"])


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    names = ("tensors", "sharded", "llama", "llama-safetensors", "llama-sharded", "qwen3-tied", "medusa",
             "eagle1", "eagle1-nobias", "eagle3", "eagle3-specforge", "eagle3-angelslim", "eagle1-llama3", "medusa2")
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

    write_eagle_fixtures(dirs)
    write_published_variants(dirs)

    versions = {"torch": torch.__version__, "safetensors": safetensors.__version__}
    (OUT / "versions.json").write_text(json.dumps(versions, indent=2) + "\n")
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"{OUT}: {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
