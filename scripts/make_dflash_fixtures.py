"""Tiny DFlash drafters in z-lab's published layout (tests/fixtures/dflash/*), for
tests/test_dflash_convert.py. numpy only; run from the repository root:

    python scripts/make_dflash_fixtures.py

Each folder holds `config.json` as z-lab writes it (a Qwen3 body,
`"architectures": ["DFlashDraftModel"]`, `auto_map` to their remote code,
`dflash_config`) and one bf16 `model.safetensors` without a prefix, written
here byte by byte as torch's safetensors writes it (metadata {"format": "pt"}).
Weights are seeded random. All are sized for tests/conftest.py's `qwen3`
checkpoint (hidden 64, 2 layers, 4/2 heads of 16, vocabulary 384):

  b16       block_size 16 at the top level, as the Qwen3 and LLaMA drafts
  nested    block_size 8 inside dflash_config, transformers 5 rope_parameters
            (theta 1e7), one target layer for two draft layers, as Qwen3.5's
  sliding   layer_types [sliding_attention, full_attention], use_sliding_window
            with a window of 4, as Qwen3.6-27B's
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "dflash"

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 64, 4, 2, 16, 128
TARGET_LAYERS, VOCAB = 2, 384

BASE = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": HEAD_DIM,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": INTERMEDIATE,
    "max_position_embeddings": 4096,
    "max_window_layers": 2,
    "model_type": "qwen3",
    "num_attention_heads": HEADS,
    "num_hidden_layers": 2,
    "num_key_value_heads": KV_HEADS,
    "num_target_layers": TARGET_LAYERS,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": VOCAB,
}

CONFIGS = {
    "b16": {
        **BASE,
        "block_size": 16,
        "dflash_config": {"mask_token_id": 383, "target_layer_ids": [0, 1]},
        "layer_types": ["full_attention", "full_attention"],
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
        "use_sliding_window": False,
    },
    "nested": {
        **BASE,
        "dflash_config": {"block_size": 8, "mask_token_id": 200, "target_layer_ids": [1]},
        "dtype": "bfloat16",
        "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
        "sliding_window": None,
        "transformers_version": "5.0.0",
        "use_sliding_window": False,
    },
    "sliding": {
        **BASE,
        "dflash_config": {"block_size": 8, "mask_token_id": 300, "target_layer_ids": [1, 0]},
        "dtype": "bfloat16",
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
        "sliding_window": 4,
        "transformers_version": "5.0.0",
        "use_sliding_window": True,
    },
}


def shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """z-lab's tensor names and shapes (research/checkpoint-formats.md 1.3)."""
    K = len(config["dflash_config"]["target_layer_ids"])
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = {"fc.weight": (HIDDEN, K * HIDDEN), "hidden_norm.weight": (HIDDEN,), "norm.weight": (HIDDEN,)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        out |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (q, HIDDEN),
            p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.weight": (kv, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, q),
            p + "self_attn.q_norm.weight": (HEAD_DIM,),
            p + "self_attn.k_norm.weight": (HEAD_DIM,),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        }
    return out


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even (as torch rounds)."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_bf16_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        data = bf16_bits(tensors[name]).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in sorted(shapes(config).items()):
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            out[name] = rng.standard_normal(shape) / np.sqrt(shape[-1])
    return out


def main() -> None:
    for seed, (name, config) in enumerate(CONFIGS.items()):
        folder = OUT / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_bf16_safetensors(folder / "model.safetensors", weights(config, seed))
        print(folder, (folder / "model.safetensors").stat().st_size, "bytes")


if __name__ == "__main__":
    main()
