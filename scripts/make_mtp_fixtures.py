"""Write tests/fixtures/mtp: one tiny sharded checkpoint per MTP layout (a
2-layer dense target in shard 1, its MTP tensors in shard 2, with the index) and
`<layout>.npz`, each MTP module's logits on fixed inputs computed here in numpy
straight from the published description (research notes, section 5), not with
mlx-spec's modules.

    python scripts/make_mtp_fixtures.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tiny import make_config, random_weights

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "mtp"
SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             intermediate_size=64, vocab_size=128, rope_theta=10000.0, rms_norm_eps=1e-6)
# layout -> (architecture, tied embeddings, number of modules, config keys naming them)
LAYOUTS = {
    "deepseek": ("llama", False, 1, {"num_nextn_predict_layers": 1}),
    "mimo": ("qwen2", False, 2, {"num_nextn_predict_layers": 2}),
    "qwen3_next": ("qwen3", True, 1, {"mtp_num_hidden_layers": 1}),
}
S = 5  # slots of the reference forward


def block_weights(arch: str, seed: int) -> dict[str, np.ndarray]:
    """One decoder layer's weights, named inside the layer (`self_attn.q_proj.weight`, ...)."""
    config = make_config(arch, **{**SHAPE, "num_hidden_layers": 1})
    prefix = "model.layers.0."
    return {k[len(prefix):]: v for k, v in random_weights(config, seed).items() if k.startswith(prefix)}


def module_tensors(layout: str, k: int, L: int, rng: np.random.Generator, target: dict) -> dict[str, np.ndarray]:
    """Module k's tensors under the layout's published names, with plain (one-centred) norms."""
    H, V = SHAPE["hidden_size"], SHAPE["vocab_size"]
    norm = lambda: (1.0 + 0.1 * rng.standard_normal(H)).astype(np.float32)  # noqa: E731
    own = {"enorm": norm(), "hnorm": norm(), "proj": (rng.standard_normal((H, 2 * H)) / np.sqrt(2 * H)).astype(np.float32),
           "norm": norm()}
    block = block_weights(LAYOUTS[layout][0], seed=100 + k)
    if layout == "deepseek":
        p = f"model.layers.{L + k}."
        out = {p + "enorm.weight": own["enorm"], p + "hnorm.weight": own["hnorm"], p + "eh_proj.weight": own["proj"],
               p + "shared_head.norm.weight": own["norm"],
               p + "shared_head.head.weight": (rng.standard_normal((V, H)) / np.sqrt(H)).astype(np.float32),
               p + "embed_tokens.weight": target["model.embed_tokens.weight"]}
    elif layout == "mimo":
        p = f"model.mtp_layers.{k}."
        out = {p + "token_layernorm.weight": own["enorm"], p + "hidden_layernorm.weight": own["hnorm"],
               p + "input_proj.weight": own["proj"], p + "final_layernorm.weight": own["norm"]}
    else:
        out = {"mtp.pre_fc_norm_embedding.weight": own["enorm"], "mtp.pre_fc_norm_hidden.weight": own["hnorm"],
               "mtp.fc.weight": own["proj"], "mtp.norm.weight": own["norm"]}
        p = "mtp.layers.0."
    out.update({p + name: w for name, w in block.items()})
    if layout == "qwen3_next":  # stored zero-centred: the model multiplies by (1 + weight)
        out = {n: (w - 1.0 if "norm" in n.rsplit(".", 2)[-2] else w) for n, w in out.items()}
    return out


# ---------------------------------------------------------------- numpy reference


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, theta: float) -> np.ndarray:
    """Half-split (Hugging Face) rotary embedding of `[S, heads, D]` at positions 0..S-1."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    ang = np.arange(x.shape[0])[:, None] * inv[None]  # [S, D/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def reference(layout: str, t: dict, hidden: np.ndarray, tokens: np.ndarray, target: dict, k: int, L: int) -> np.ndarray:
    """Module k's logits `[S, V]` from its published tensors `t`, in float64."""
    c = {**SHAPE}
    eps, nh, nkv, hd = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    g = {n: w.astype(np.float64) for n, w in t.items()}
    shift = 1.0 if layout == "qwen3_next" else 0.0  # zero-centred norms
    if layout == "deepseek":
        p = f"model.layers.{L + k}."
        en, hn, proj, fn, blk = g[p + "enorm.weight"], g[p + "hnorm.weight"], g[p + "eh_proj.weight"], g[p + "shared_head.norm.weight"], p
        head = g[p + "shared_head.head.weight"]
    elif layout == "mimo":
        p = f"model.mtp_layers.{k}."
        en, hn, proj, fn, blk = g[p + "token_layernorm.weight"], g[p + "hidden_layernorm.weight"], g[p + "input_proj.weight"], g[p + "final_layernorm.weight"], p
        head = target["lm_head.weight"].astype(np.float64)
    else:
        en, hn, proj, fn, blk = g["mtp.pre_fc_norm_embedding.weight"], g["mtp.pre_fc_norm_hidden.weight"], g["mtp.fc.weight"], g["mtp.norm.weight"], "mtp.layers.0."
        head = target["model.embed_tokens.weight"].astype(np.float64)  # tied
    e = target["model.embed_tokens.weight"].astype(np.float64)[tokens]
    h = hidden.astype(np.float64)
    e_n, h_n = rms(e, en + shift, eps), rms(h, hn + shift, eps)
    cat = np.concatenate([h_n, e_n] if layout == "mimo" else [e_n, h_n], axis=-1)  # MiMo: hidden first
    x = cat @ proj.T
    w = lambda n: g[blk + n]  # noqa: E731
    b = lambda n: g.get(blk + n, 0.0)  # noqa: E731
    a = rms(x, w("input_layernorm.weight") + shift, eps)
    q = (a @ w("self_attn.q_proj.weight").T + b("self_attn.q_proj.bias")).reshape(S, nh, hd)
    kk = (a @ w("self_attn.k_proj.weight").T + b("self_attn.k_proj.bias")).reshape(S, nkv, hd)
    v = (a @ w("self_attn.v_proj.weight").T + b("self_attn.v_proj.bias")).reshape(S, nkv, hd)
    if blk + "self_attn.q_norm.weight" in g:
        q, kk = rms(q, w("self_attn.q_norm.weight") + shift, eps), rms(kk, w("self_attn.k_norm.weight") + shift, eps)
    q, kk = rope(q, c["rope_theta"]), rope(kk, c["rope_theta"])
    kk, v = np.repeat(kk, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, kk) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((S, S), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x = x + np.einsum("hqk,khd->qhd", probs, v).reshape(S, nh * hd) @ w("self_attn.o_proj.weight").T
    m = rms(x, w("post_attention_layernorm.weight") + shift, eps)
    gate, up = m @ w("mlp.gate_proj.weight").T, m @ w("mlp.up_proj.weight").T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ w("mlp.down_proj.weight").T
    return rms(x, fn + shift, eps) @ head.T


def main() -> None:
    for seed, (layout, (arch, tied, D, keys)) in enumerate(LAYOUTS.items()):
        folder = OUT / layout
        folder.mkdir(parents=True, exist_ok=True)
        config = make_config(arch, **SHAPE, tie_word_embeddings=tied, **keys)
        target = random_weights(config, seed)
        rng = np.random.default_rng(seed + 10)
        mtp: dict[str, np.ndarray] = {}
        for k in range(D):
            mtp.update(module_tensors(layout, k, SHAPE["num_hidden_layers"], rng, target))
        shards = {"model-00001-of-00002.safetensors": target, "model-00002-of-00002.safetensors": mtp}
        for name, tensors in shards.items():
            save_file(tensors, str(folder / name), metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {n: f for f, ts in shards.items() for n in sorted(ts)}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        hidden = rng.standard_normal((S, SHAPE["hidden_size"])).astype(np.float32)
        tokens = rng.integers(0, SHAPE["vocab_size"], S)
        logits = np.stack([reference(layout, mtp, hidden, tokens, target, k, SHAPE["num_hidden_layers"]) for k in range(D)])
        np.savez(OUT / f"{layout}.npz", hidden=hidden, tokens=tokens, logits=logits.astype(np.float32))


if __name__ == "__main__":
    main()
