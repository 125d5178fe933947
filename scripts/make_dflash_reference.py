"""Reference block logits of the DFlash fixtures (tests/fixtures/dflash/*), for
tests/test_dflash_convert.py: the drafting forward written again in numpy
float64 from the published description (research/checkpoint-formats.md 1.4-1.6,
after z-lab's dflash/model.py), sharing no code with mlx_spec.drafters.dflash.
The fixture's bf16 safetensors are read here too. Run from the repository root:

    python scripts/make_dflash_reference.py

The target is tests/conftest.py's `qwen3` checkpoint, made again here with
tiny.make_checkpoint (same arch and seed) for its embedding and
(tied) LM head. For each fixture, tests/fixtures/dflash_reference/<fixture>.npz holds:
  features [9, F]     the target's features of context positions 0..8 (random, fixed)
  split    []         6: the first round reads positions 0..5, the second 6..8
  anchors  [2]        each round's anchor (the token at position 6, then 9)
  logits   [2, B-1, V] each round's block logits at block positions 1..B-1
Each round is recomputed from the whole context so far: no cache here.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import numpy as np

from tiny import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "dflash"
OUT = ROOT / "tests" / "fixtures" / "dflash_reference"

TARGET_ARCH, TARGET_SEED = "qwen3", 2  # conftest: the seed is the arch's index in ("llama", "qwen2", "qwen3")
CONTEXT, SPLIT = 9, 6
ANCHORS = (17, 42)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """float32/bf16 tensors of one file, as float64."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        if info["dtype"] == "BF16":
            bits = np.frombuffer(data[a:b], dtype="<u2").astype(np.uint32) << 16
            value = bits.view(np.float32)
        elif info["dtype"] == "F32":
            value = np.frombuffer(data[a:b], dtype="<f4")
        else:
            raise ValueError(f"{path}: {name} is {info['dtype']}")
        out[name] = value.reshape(info["shape"]).astype(np.float64)
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return weight * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Hugging Face rotate_half RoPE on `[S, heads, D]`."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
    angles = positions[:, None] * inv_freq[None]  # [S, D/2]
    cos = np.concatenate([np.cos(angles)] * 2, -1)[:, None]
    sin = np.concatenate([np.sin(angles)] * 2, -1)[:, None]
    half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def layer_kinds(config: dict) -> tuple[list[str], int | None]:
    """Per-layer kinds and the window, as transformers' Qwen3Config gives them to
    z-lab's loader: the window only with use_sliding_window; without layer_types,
    sliding from max_window_layers on."""
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    kinds = config.get("layer_types") or [
        "sliding_attention" if window is not None and i >= config.get("max_window_layers", 28) else "full_attention"
        for i in range(config["num_hidden_layers"])
    ]
    return kinds, window


def visible(kind: str, window: int | None, q_pos: np.ndarray, k_pos: np.ndarray, causal: bool | None) -> np.ndarray:
    """z-lab's `_attention_mask`: causal in sliding layers (unless is_causal says
    otherwise), the window on both sides when not causal."""
    causal = kind == "sliding_attention" if causal is None else causal
    window = window if kind == "sliding_attention" else None
    q, k = q_pos[:, None], k_pos[None, :]
    ok = np.ones((len(q_pos), len(k_pos)), dtype=bool)
    if causal:
        ok &= k <= q
    if window is not None:
        ok &= q - k < window
        if not causal:
            ok &= k - q < window
    return ok


def draft_logits(config: dict, w: dict, embed: np.ndarray, head: np.ndarray, features: np.ndarray, anchor: int) -> np.ndarray:
    """One block: `features` of context positions 0..S-1, the block at S..S+B-1 -> logits [B-1, V]."""
    extra = config["dflash_config"]
    B = extra.get("block_size", config.get("block_size"))
    eps = config["rms_norm_eps"]
    theta = (config.get("rope_parameters") or {}).get("rope_theta") or config["rope_theta"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    kinds, window = layer_kinds(config)
    S = features.shape[0]
    ctx = rms_norm(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [S, H]
    x = embed[[anchor] + [extra["mask_token_id"]] * (B - 1)]  # [B, H]
    q_pos, k_pos = np.arange(S, S + B), np.arange(S + B)
    for i, kind in enumerate(kinds):
        p = f"layers.{i}."
        a = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = rms_norm((a @ w[p + "self_attn.q_proj.weight"].T).reshape(B, nh, hd), w[p + "self_attn.q_norm.weight"], eps)
        q = rope(q, q_pos, theta)
        # The context enters as keys and values only, without the input norm.
        kv_in = np.concatenate([ctx, a])
        k = rms_norm((kv_in @ w[p + "self_attn.k_proj.weight"].T).reshape(S + B, nkv, hd), w[p + "self_attn.k_norm.weight"], eps)
        k = rope(k, k_pos, theta)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).reshape(S + B, nkv, hd)
        group = nh // nkv  # query head h reads key/value head h // group
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) * hd**-0.5
        scores = np.where(visible(kind, window, q_pos, k_pos, config.get("is_causal"))[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("hqk,khd->qhd", probs, v).reshape(B, nh * hd)
        x = x + out @ w[p + "self_attn.o_proj.weight"].T
        m = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        x = x + (silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    h = rms_norm(x, w["norm.weight"], eps)
    return h[1:] @ head.T


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        target_dir = make_checkpoint(Path(tmp) / "target", TARGET_ARCH, seed=TARGET_SEED)
        target_config = json.loads((target_dir / "config.json").read_text())
        target = read_safetensors(target_dir / "model.safetensors")
    embed = target["model.embed_tokens.weight"]
    head = embed if target_config["tie_word_embeddings"] else target["lm_head.weight"]
    OUT.mkdir(parents=True, exist_ok=True)
    for seed, folder in enumerate(sorted(FIXTURES.iterdir())):
        config = json.loads((folder / "config.json").read_text())
        w = read_safetensors(folder / "model.safetensors")
        taps = len(config["dflash_config"]["target_layer_ids"])
        features = np.random.default_rng(100 + seed).standard_normal((CONTEXT, taps * target_config["hidden_size"]))
        features = features.astype(np.float32)  # as the test feeds them
        rounds = [(features[:SPLIT], ANCHORS[0]), (features, ANCHORS[1])]
        logits = np.stack([draft_logits(config, w, embed, head, f.astype(np.float64), a) for f, a in rounds])
        np.savez_compressed(OUT / f"{folder.name}.npz", features=features, split=np.array(SPLIT),
                            anchors=np.array(ANCHORS), logits=logits.astype(np.float32))
        print(folder.name, logits.shape)


if __name__ == "__main__":
    main()
