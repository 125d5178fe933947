"""Write a DFlash 2 drafter laid out as z-lab publishes one (z-lab/Qwen3.8-27B-DFlash2) for a tiny Qwen3
target, and what z-lab's own DFlash 2 code drafts with it (tests/test_dflash2.py).

Needs torch and transformers, which mlx-spec itself does not depend on:

    pip install torch==2.13.0 transformers safetensors
    python scripts/make_dflash2_reference.py

The drafter and loop are those of z-lab/dflash `dflash/model.py` (DFlash2DraftModel: Qwen3 layers whose
block queries read the context's keys and values, each sublayer inside a GroupedDynamicCausalConv, the
CandidateSelector walking the block from the anchor; `dflash_generate`, greedy), written again here on
transformers' Qwen3 pieces. Its caches are replaced by reading the whole context each round, which computes
the same: the context's keys and values depend on nothing the block holds.

tests/fixtures/dflash2_reference/
  target/   a Qwen3 checkpoint (tests/tiny.py's, four layers; kept as it is)
  dflash2/  `DFlash2DraftModel` as the 27B is configured: two non-causal sliding-window layers
            (`is_causal` false, `use_sliding_window` and a window of 12 that the context outgrows: z-lab's
            code reads the config through transformers' Qwen3Config, which keeps the window only then),
            `dflash_config` holding
            block_size, mask_token_id, target_layer_ids and the convolution (kernel 2, groups of 16)
            and selector (rank 8, top 4) sizes, `rope_parameters`, bfloat16 weights, the selector's
            codebooks stored bare
  reference.npz   the prompt, each round's drafts (a block of 5: 4 a round), the logits under them,
            the selector's candidates and its temperature-1 distribution over them along the chain it
            took, and the tokens decoded (checked here to be the target's own greedy tokens)
  scaled.npz      the same for dflash2/'s weights under the scalings z-lab's code reads in
            `dflash_config` (SCALED: on the target's embedding, on the logits, a tanh cap)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "dflash2_reference"
BLOCK, TOKENS, LAYERS = 5, 24, [1, 2]
SCALED = {"input_embedding_scale": 1.5, "output_multiplier": 0.5, "final_logit_softcapping": 4.0}
BOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def drafter_config(target: dict) -> dict:
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": target["hidden_size"],
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": target["vocab_size"], "num_target_layers": target["num_hidden_layers"],
        "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "tie_word_embeddings": False, "is_causal": False,
        "layer_types": ["sliding_attention"] * 2, "sliding_window": 12, "use_sliding_window": True,
        "max_window_layers": 2,
        "rope_parameters": {"rope_theta": 10000000.0, "rope_type": "default"},
        "dflash_config": {"block_size": BLOCK, "conv_group_size": 16, "conv_kernel_size": 2,
                          "mask_token_id": target["vocab_size"] - 1, "selector_rank": 8, "selector_top_k": 4,
                          "target_layer_ids": LAYERS},
    }


def value(config: dict, name: str, default=None):
    """z-lab's `_draft_value`: dflash_config first, then the top level."""
    return config["dflash_config"].get(name, config.get(name, default))


class Conv(torch.nn.Module):
    """GroupedDynamicCausalConv: out[i, c] = sum_t (base[t, c] + delta[i, t, group(c)]) x[i - t, c], in the block."""

    def __init__(self, hidden: int, kernel: int, group: int):
        super().__init__()
        self.group = group
        self.base_kernel = torch.nn.Parameter(torch.empty(2, kernel, hidden))
        self.kernel_projection = torch.nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)

    def convolve(self, x, delta, base):
        b, n, h = x.shape
        blocks = x.view(b, n, h // self.group, self.group)
        delta = delta.reshape(b, n, base.shape[0], h // self.group, 1)
        out = torch.zeros_like(blocks)
        for t in range(base.shape[0]):
            shifted = blocks if t == 0 else F.pad(blocks[:, :-t], (0, 0, 0, 0, t, 0))
            out = out + base[t].view(1, 1, h // self.group, self.group) * shifted + delta[:, :, t] * shifted
        return out.view_as(x)

    def prepare(self, x):
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.base_kernel.shape[1], -1)
        return self.convolve(x, delta[..., 0, :, :], self.base_kernel[0]), delta[..., 1, :, :]

    def finish(self, x, delta):
        return self.convolve(x, delta, self.base_kernel[1])


class Attention(torch.nn.Module):
    """Block queries over the context's keys and values and the block's own (Qwen3DFlashAttention)."""

    def __init__(self, c: Qwen3Config, kind: str):
        super().__init__()
        self.heads, self.kv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = torch.nn.Linear(c.hidden_size, self.heads * self.d, bias=False)
        self.k_proj = torch.nn.Linear(c.hidden_size, self.kv * self.d, bias=False)
        self.v_proj = torch.nn.Linear(c.hidden_size, self.kv * self.d, bias=False)
        self.o_proj = torch.nn.Linear(self.heads * self.d, c.hidden_size, bias=False)
        self.q_norm, self.k_norm = Qwen3RMSNorm(self.d, c.rms_norm_eps), Qwen3RMSNorm(self.d, c.rms_norm_eps)
        causal = getattr(c, "is_causal", None)
        self.causal = kind == "sliding_attention" if causal is None else bool(causal)
        self.window = c.sliding_window if kind == "sliding_attention" else None

    def forward(self, h, ctx, cos, sin):
        n, s = h.shape[1], ctx.shape[1]
        q = self.q_norm(self.q_proj(h).view(1, n, self.heads, self.d)).transpose(1, 2)
        k = self.k_norm(torch.cat([self.k_proj(ctx), self.k_proj(h)], 1).view(1, s + n, self.kv, self.d))
        v = torch.cat([self.v_proj(ctx), self.v_proj(h)], 1).view(1, s + n, self.kv, self.d).transpose(1, 2)
        k = k.transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos[..., -n:, :] + rotate_half(q) * sin[..., -n:, :]
        k = k * cos + rotate_half(k) * sin
        qpos, kpos = s + torch.arange(n)[:, None], torch.arange(s + n)[None, :]  # z-lab's _attention_mask
        seen = torch.ones(n, s + n, dtype=torch.bool)
        if self.causal:
            seen &= kpos <= qpos
        if self.window is not None:
            seen &= qpos - kpos < self.window
            if not self.causal:
                seen &= kpos - qpos < self.window
        groups = self.heads // self.kv
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                             attn_mask=seen, scale=self.d ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(1, n, -1))


class Layer(torch.nn.Module):
    def __init__(self, c: Qwen3Config, kind: str, kernel: int, group: int):
        super().__init__()
        self.self_attn, self.mlp = Attention(c, kind), Qwen3MLP(c)
        self.input_layernorm = Qwen3RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attention_conv, self.mlp_conv = Conv(c.hidden_size, kernel, group), Conv(c.hidden_size, kernel, group)

    def forward(self, x, ctx, cos, sin):
        h, delta = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, ctx, cos, sin), delta)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), delta)


class Selector(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = torch.nn.Embedding(vocab, rank)
        self.successor_codebook = torch.nn.Embedding(vocab, rank)
        self.hidden_projection = torch.nn.Linear(hidden, rank, bias=False)

    def select(self, h, logits, anchor):
        """CandidateSelector.select, greedy: the chain [1, K], the candidates [1, K, k], and along the chain each
        step's temperature-1 distribution over its candidates [1, K, k]."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        h = self.hidden_projection(h)
        previous, path, q = anchor, [], []
        for i in range(h.shape[1]):
            scores = unary[:, i] + torch.einsum("br,bkr->bk", self.predecessor_codebook(previous) * h[:, i],
                                                self.successor_codebook(candidates[:, i]))
            q.append(torch.softmax(scores, -1))
            previous = candidates[:, i].gather(-1, scores.argmax(-1)[:, None])[:, 0]
            path.append(previous)
        return torch.stack(path, 1), candidates, torch.stack(q, 1)


class DFlash2(torch.nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        c = self.qwen3 = Qwen3Config(**{k: v for k, v in config.items() if k != "dflash_config"})
        c.is_causal = config["is_causal"]
        kernel, group = value(config, "conv_kernel_size"), value(config, "conv_group_size")
        self.layers = torch.nn.ModuleList([Layer(c, kind, kernel, group) for kind in config["layer_types"]])
        self.fc = torch.nn.Linear(len(LAYERS) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = Qwen3RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(c)
        self.candidate_selector = Selector(c.vocab_size, c.hidden_size, value(config, "selector_rank"),
                                           value(config, "selector_top_k"))

    def forward(self, block_embedding, features):
        """The block's states after the context's features (positions 0.. of the context, then the block's)."""
        ctx = self.hidden_norm(self.fc(features))
        positions = torch.arange(features.shape[1] + block_embedding.shape[1])[None]
        cos, sin = self.rotary(block_embedding, positions)
        x = block_embedding
        for layer in self.layers:
            x = layer(x, ctx, cos, sin)
        return self.norm(x)

    def logits(self, h, head):
        """compute_logits: the target's LM head, times output_multiplier, capped by final_logit_softcapping."""
        logits = head(h) * float(value(self.config, "output_multiplier", 1.0))
        cap = value(self.config, "final_logit_softcapping")
        return torch.tanh(logits / cap) * cap if cap else logits


def random_weights(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        if name.endswith("base_kernel"):  # the identity on the token itself, and a little of the one before
            w = 0.2 * torch.randn(p.shape, generator=g)
            w[:, 0] += 1.0
        elif "norm" in name:
            w = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            w = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
        out[name] = w.to(torch.bfloat16)
    return out


def rounds(target, draft: DFlash2, prompt: list[int]) -> dict[str, np.ndarray]:
    """dflash_generate, greedy: each round's drafts, logits, candidates and q along the chain; the tokens."""
    mask_id, scale = value(draft.config, "mask_token_id"), float(value(draft.config, "input_embedding_scale", 1.0))
    embed, head = target.get_input_embeddings(), target.lm_head
    with torch.no_grad():
        ids = prompt + [int(target(torch.tensor([prompt])).logits[0, -1].argmax())]
        out = {"drafts": [], "logits": [], "candidates": [], "q": []}
        while len(ids) - len(prompt) < TOKENS:
            start = len(ids) - 1  # the anchor's position
            hidden = target(torch.tensor([ids[:start]]), output_hidden_states=True).hidden_states
            features = torch.cat([hidden[i + 1] for i in LAYERS], -1)  # extract_context_feature
            block = torch.tensor([[ids[-1]] + [mask_id] * (BLOCK - 1)])
            h = draft(embed(block) * scale, features)[:, 1:]
            logits = draft.logits(h, head)
            chain, candidates, q = draft.candidate_selector.select(h, logits, block[:, 0])
            verify = target(torch.tensor([ids + chain[0].tolist()])).logits[0, start:].argmax(-1).tolist()
            a = next((i for i, (d, t) in enumerate(zip(chain[0].tolist(), verify)) if d != t), BLOCK - 1)
            ids += chain[0].tolist()[:a] + [verify[a]]
            for key, v in zip(out, (chain, logits, candidates, q)):
                out[key].append(v[0].numpy())
        plain = list(prompt)
        while len(plain) < len(ids):
            plain.append(int(target(torch.tensor([plain])).logits[0, -1].argmax()))
    assert ids == plain, "speculative greedy tokens differ from plain"
    result = {k: np.stack(v) for k, v in out.items()}
    result["drafts"], result["candidates"] = result["drafts"].astype(np.int32), result["candidates"].astype(np.int32)
    return {"prompt": np.array(prompt, np.int32), "tokens": np.array(ids[len(prompt):], np.int32), **result}


def main() -> None:
    target = AutoModelForCausalLM.from_pretrained(OUT / "target", dtype=torch.float32).eval()
    config = drafter_config(target.config.to_dict())
    shutil.rmtree(OUT / "dflash2", ignore_errors=True)
    (OUT / "dflash2").mkdir()
    weights = random_weights(DFlash2(config), seed=9)
    published = {k.removesuffix(".weight") if k.removesuffix(".weight") in BOOKS else k: v for k, v in weights.items()}
    save_file(published, OUT / "dflash2" / "model.safetensors", metadata={"format": "pt"})
    (OUT / "dflash2" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    stored = load_file(OUT / "dflash2" / "model.safetensors")
    read = {k + ".weight" if k in BOOKS else k: v.float() for k, v in stored.items()}
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, config["vocab_size"] - 1, 20)]
    for name, extra in (("reference", {}), ("scaled", SCALED)):
        draft = DFlash2({**config, "dflash_config": {**config["dflash_config"], **extra}}).eval()
        draft.load_state_dict(read)
        ref = rounds(target, draft, prompt)
        np.savez_compressed(OUT / f"{name}.npz", **ref)
        accepted = len(ref["tokens"]) - 1 - len(ref["drafts"])
        n = len(ref["drafts"])
        print(OUT / f"{name}.npz", f"{n} rounds, {accepted} drafts accepted of {(BLOCK - 1) * n}")
    (OUT / "versions.json").write_text(
        json.dumps({"torch": torch.__version__, "transformers": transformers.__version__}) + "\n")


if __name__ == "__main__":
    main()
