"""Write a tiny PARD pair and the drafts AMD's PARD inference computes on it (tests/test_pard.py).

Needs torch and transformers, which mlx-spec itself does not depend on:

    pip install torch==2.13.0 transformers
    python scripts/make_pard_reference.py

tests/fixtures/pard_reference/
  target/  a tiny Qwen3ForCausalLM as transformers saves it
  pard/    the drafter as amd/PARD-Qwen3-0.6B is laid out: a Qwen3ForCausalLM whose config.json adds
           `pard_token` and `spd_type: "pard"` (here the target's own weights, so that the first
           draft of a round is the target's token and rounds accept some)
  reference.npz  the prompt, each round's K drafts, their logits and the tokens kept, from the loop of AMD-AGI/PARD
           `pard/pard_infer.py` (its `--para` path, greedy): the draft model reads the kept tokens and
           K-1 pard tokens, the last K logits' argmax are the drafts, the K-1 mask entries leave its cache
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "pard_reference"
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=96, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6,
             tie_word_embeddings=False, eos_token_id=None)
K, TOKENS = 4, 32


def seeded(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def keep(cache: DynamicCache, n: int) -> None:
    """The cache cut to its first n positions (transformers' `crop` takes what to remove, negated)."""
    if cache.get_seq_length() > n:
        cache.crop(n - cache.get_seq_length())


def pard_rounds(target, draft, prompt: torch.Tensor, pard_token: int) -> tuple[list, list, list]:
    """AMD's loop, `--para`, greedy: (each round's K drafts, their logits, each round's kept tokens)."""
    target_cache, draft_cache = DynamicCache(), DynamicCache()
    target_input, draft_input = prompt, prompt
    tokens, drafts, logits_of, kept = prompt, [], [], []
    with torch.no_grad():
        while tokens.shape[1] - prompt.shape[1] < TOKENS:
            masks = torch.full((1, K - 1), pard_token)
            draft_logits = draft(torch.cat([draft_input, masks], 1), past_key_values=draft_cache).logits
            proposed = draft_logits[:, -K:].argmax(-1)  # [1, K]
            logits_of.append(draft_logits[0, -K:].numpy())
            keep(draft_cache, draft_cache.get_seq_length() - (K - 1))  # the mask entries leave the cache
            target_input = torch.cat([target_input, proposed], 1)
            logits = target(target_input, past_key_values=target_cache).logits
            choice = logits[:, -K - 1:].argmax(-1)  # [1, K + 1]
            n = 0
            while n < K and choice[0, n] == proposed[0, n]:
                n += 1
            accepted = choice[:, : n + 1]  # the accepted drafts and the target's own next token
            drafts.append(proposed[0].tolist())
            kept.append(accepted[0].tolist())
            tokens = torch.cat([tokens, accepted], 1)
            keep(target_cache, tokens.shape[1] - 1)
            target_input, draft_input = accepted[:, -1:], accepted
    return drafts, logits_of, kept


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    target = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **SHAPE), dtype=torch.float32).eval()
    seeded(target, 3)
    target.save_pretrained(OUT / "target", safe_serialization=True)
    target.save_pretrained(OUT / "pard", safe_serialization=True)
    config = json.loads((OUT / "pard" / "config.json").read_text())
    pard_token = SHAPE["vocab_size"] - 1
    config.update(pard_token=pard_token, spd_type="pard")
    (OUT / "pard" / "config.json").write_text(json.dumps(config, indent=2))
    draft = AutoModelForCausalLM.from_pretrained(OUT / "pard", dtype=torch.float32).eval()
    prompt = torch.from_numpy(np.random.default_rng(2).integers(3, pard_token, size=(1, 16)))
    drafts, logits, kept = pard_rounds(target, draft, prompt, pard_token)
    write_reference(OUT, prompt, drafts, logits, kept)
    print(f"{OUT}: {len(drafts)} rounds, {sum(map(len, kept))} tokens")


def write_reference(out: Path, prompt: torch.Tensor, drafts: list, logits: list, kept: list) -> None:
    """OUT/reference.npz (the prompt, each round's drafts, their logits, the kept tokens padded with -1) and
    OUT/versions.json."""
    np.savez_compressed(out / "reference.npz", prompt=prompt[0].numpy().astype(np.int32),
                        drafts=np.array(drafts, dtype=np.int32), logits=np.stack(logits).astype(np.float32),
                        kept=np.array([k + [-1] * (K + 1 - len(k)) for k in kept], dtype=np.int32))
    (out / "versions.json").write_text(
        json.dumps({"torch": torch.__version__, "transformers": transformers.__version__}) + "\n")


if __name__ == "__main__":
    main()
