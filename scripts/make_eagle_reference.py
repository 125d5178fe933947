"""Reference logits of the EAGLE fixtures (tests/fixtures/torch/eagle*), for
tests/test_eagle_convert.py: the drafts' forward written again in torch from
the published description (research/checkpoint-formats.md sections 2.5 and 3,
after yuhuili's cnets.py / cnets1.py), sharing no code with
mlx_spec.drafters.eagle. Run once (torch is needed here only):

    pip install torch==2.13.0 safetensors
    python scripts/make_eagle_reference.py

For each fixture, tests/fixtures/eagle_reference/<fixture>.npz holds:
  features    [4, F]  the target's features of slots 0..3 (random, fixed)
  tokens      [4]     the token after each slot's (its embedding is the slot's input)
  logits      [4, V]  logits over the target's vocabulary of one causal pass over
                      the four slots at positions 0..3
  next_token  [1]     a drafted token
  next_logits [1, V]  the next drafting step: slot 4 (position 4) reads slot 3's
                      output state as its feature and attends to slots 0..4
EAGLE-3 logits are -inf outside the draft vocabulary. The arithmetic is float64.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from tiny import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "torch"
OUT = ROOT / "tests" / "fixtures" / "eagle_reference"

# fixture -> (EAGLE version, target arch, seed): tests/conftest.py's checkpoints[arch]
# is make_checkpoint(..., arch, seed=<its index in ("llama", "qwen2", "qwen3")>).
CASES = {
    "eagle1": (1, "llama", 0),
    "eagle1-nobias": (1, "qwen2", 1),
    "eagle3": (3, "qwen3", 2),
    "eagle3-specforge": (3, "qwen3", 2),
}
SLOTS = 4


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / "model.safetensors").exists():
        tensors = safetensors.torch.load_file(str(directory / "model.safetensors"))
    else:
        tensors = torch.load(directory / "pytorch_model.bin", weights_only=True)
    return {k: v.double() if v.is_floating_point() else v for k, v in tensors.items()}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Hugging Face Llama RoPE (rotate_half) on `[heads, S, D]`."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions[:, None].double() * inv_freq[None]  # [S, D/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


class Layer:
    """The draft's decoder layer with its own KV store: attention input -> attention output."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, config: dict):
        self.w, self.p = w, prefix
        self.heads = config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads") or self.heads
        self.head_dim = w[f"{prefix}self_attn.q_proj.weight"].shape[0] // self.heads  # not config's head_dim
        self.theta = config.get("rope_theta", 10000.0)  # absent in yuhuili's EAGLE-3 configs
        self.eps = config.get("rms_norm_eps", 1e-6)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def proj(self, name: str, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w[f"{self.p}{name}.weight"].T
        bias = self.w.get(f"{self.p}{name}.bias")
        return y if bias is None else y + bias

    def attention(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Causal over every slot run so far: `x` [S, in] -> [S, H]."""
        S, D = x.shape[0], self.head_dim
        q = self.proj("self_attn.q_proj", x).view(S, self.heads, D).transpose(0, 1)
        k = self.proj("self_attn.k_proj", x).view(S, self.kv_heads, D).transpose(0, 1)
        v = self.proj("self_attn.v_proj", x).view(S, self.kv_heads, D).transpose(0, 1)
        q, k = rotate(q, positions, self.theta), rotate(k, positions, self.theta)
        self.keys.append(k)
        self.values.append(v)
        k, v = torch.cat(self.keys, 1), torch.cat(self.values, 1)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = q @ k.transpose(1, 2) / D**0.5  # [heads, S, T]
        T = k.shape[1]
        causal = torch.arange(T)[None, :] <= (T - S + torch.arange(S))[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(S, self.heads * D)
        return self.proj("self_attn.o_proj", out)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.w[f"{self.p}post_attention_layernorm.weight"], self.eps)
        gate, up = self.proj("mlp.gate_proj", h), self.proj("mlp.up_proj", h)
        return self.proj("mlp.down_proj", torch.nn.functional.silu(gate) * up)


def eagle1_step(w, layer: Layer, feature, embedding, positions) -> torch.Tensor:
    """x = fc([e; f]); x += attn(x) (no input norm); x += mlp(norm(x))."""
    x = torch.cat([embedding, feature], -1) @ w["fc.weight"].T
    if "fc.bias" in w:
        x = x + w["fc.bias"]
    x = x + layer.attention(x, positions)
    return x + layer.mlp(x)


def eagle3_step(w, layer: Layer, feature, embedding, positions) -> torch.Tensor:
    """h = fc(features) at the first step (already H wide later); the attention reads
    [input_layernorm(e); hidden_norm(h)] and adds to h; then the MLP."""
    H = w["norm.weight"].shape[0]
    h = feature @ w["fc.weight"].T if feature.shape[-1] != H else feature
    p, eps = layer.p, layer.eps
    x = torch.cat([rms_norm(embedding, w[f"{p}input_layernorm.weight"], eps),
                   rms_norm(h, w[f"{p}hidden_norm.weight"], eps)], -1)
    x = h + layer.attention(x, positions)
    return x + layer.mlp(x)


def logits(version: int, w, x: torch.Tensor, lm_head: torch.Tensor, eps: float) -> torch.Tensor:
    if version == 1:
        return x @ lm_head.T  # the target's head, no norm
    small = rms_norm(x, w["norm.weight"], eps) @ w["lm_head.weight"].T  # [S, Vd]
    V = lm_head.shape[0]
    if small.shape[-1] == V:
        return small
    full = torch.full((x.shape[0], V), float("-inf"), dtype=small.dtype)
    full[:, torch.arange(small.shape[-1]) + w["d2t"]] = small
    return full


def reference(name: str, version: int, target: Path, seed: int) -> dict[str, np.ndarray]:
    directory = FIXTURES / name
    config = json.loads((directory / "config.json").read_text())
    w = read_tensors(directory)
    tc = json.loads((target / "config.json").read_text())
    tw = {k: v.double() for k, v in safetensors.torch.load_file(str(target / "model.safetensors")).items()}
    embed = tw["model.embed_tokens.weight"]
    lm_head = embed if tc.get("tie_word_embeddings") else tw["lm_head.weight"]
    H, V = embed.shape[1], embed.shape[0]

    g = torch.Generator().manual_seed(seed)
    width = H if version == 1 else w["fc.weight"].shape[1]
    features = torch.randn(SLOTS, width, generator=g).double()  # float32 values: the test's inputs
    tokens = torch.randint(0, V, (SLOTS,), generator=g)
    next_token = torch.randint(0, V, (1,), generator=g)

    layer = Layer(w, "layers.0." if version == 1 else "midlayer.", config)
    step = eagle1_step if version == 1 else eagle3_step
    x = step(w, layer, features, embed[tokens], torch.arange(SLOTS))
    x_next = step(w, layer, x[-1:], embed[next_token], torch.tensor([SLOTS]))
    return {
        "features": features.float().numpy(),
        "tokens": tokens.int().numpy(),
        "logits": logits(version, w, x, lm_head, layer.eps).float().numpy(),
        "next_token": next_token.int().numpy(),
        "next_logits": logits(version, w, x_next, lm_head, layer.eps).float().numpy(),
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (version, arch, seed)) in enumerate(CASES.items()):
            target = make_checkpoint(Path(tmp) / name, arch, seed=seed)
            np.savez(OUT / f"{name}.npz", **reference(name, version, target, seed=100 + i))
    print(f"{OUT}: {sum(f.stat().st_size for f in OUT.iterdir()) / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
