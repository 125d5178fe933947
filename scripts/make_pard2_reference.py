"""Write a tiny PARD-2 pair and the drafts AMD's PARD-2 inference computes on it (tests/test_pard.py).

With torch and transformers installed (mlx-spec needs neither): `python scripts/make_pard2_reference.py`
writes tests/fixtures/pard2_reference/: `target/`, a tiny Qwen3ForCausalLM as transformers saves it;
`pard2/`, the drafter as amd/PARD2-Qwen3-8B is laid out, a Qwen3ForCausalLM (the target's own layers, so that
rounds accept some) whose config.json adds `pard_token`, `spd_type: "pard2"`, `pard2_target_layers` (indices
into transformers' `hidden_states`, the last being the final norm's output), `pard2_target_dim`, `pard2_scale`
and `pard2_proj_bias`, beside `warp_model.bin` (torch.save of {"target_proj.weight": [H, target_dim]}, bfloat16); and
`reference.npz`: the prompt, each round's K drafts, the draft logits they came from and the tokens kept, from
the loop of AMD-AGI/PARD `pard/pard2_infer.py` (its `--para` path with a PARD-2 drafter, greedy). The drafter's
input there is embed(token) + scale * target_proj(the target's features of the position before), the first
position's features zero and the K-1 mask slots' those of the last real token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from make_pard_reference import SHAPE, keep, seeded, write_reference

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "pard2_reference"
LAYERS = [-1, -2, -4]  # amd/PARD2-Qwen3-8B reads [-1, -8, -16, -24] of its 36 layers
SCALE = 0.02  # PARD-2's default
K, TOKENS = 4, 32


class Warp(torch.nn.Module):
    """AMD's TargetFeatEmbedWarp: the draft model's input embeddings plus its projected target features."""

    def __init__(self, model, target_dim: int):
        super().__init__()
        self.model = model
        self.target_proj = torch.nn.Linear(target_dim, model.config.hidden_size, bias=False)

    def forward(self, input_ids, target_feat, past_key_values):
        embeds = self.model.get_input_embeddings()(input_ids) + self.target_proj(target_feat) * SCALE
        return self.model(inputs_embeds=embeds, past_key_values=past_key_values).logits


def features(out) -> torch.Tensor:
    """The target's `hidden_states` at LAYERS, side by side: `[1, S, len(LAYERS) * H]`."""
    return torch.cat([out.hidden_states[i] for i in LAYERS], dim=-1)


def pard2_rounds(target, draft: Warp, prompt: torch.Tensor, pard_token: int) -> tuple[list, list, list]:
    """AMD's loop, `--para` with a PARD-2 drafter, greedy: (each round's K drafts, their logits, the kept tokens)."""
    target_cache, draft_cache = DynamicCache(), DynamicCache()
    with torch.no_grad():
        feat = features(target(prompt, output_hidden_states=True))  # the prompt's, from a pass of its own
        feat = torch.cat([feat[:, :1] * 0, feat[:, :-1]], 1)  # position t reads the features of t - 1
        target_input, draft_input, draft_feat, all_feat = prompt, prompt, feat, feat
        tokens, drafts, logits_of, kept = prompt, [], [], []
        while tokens.shape[1] - prompt.shape[1] < TOKENS:
            ids = torch.cat([draft_input, torch.full((1, K - 1), pard_token)], 1)
            f = torch.cat([draft_feat] + [draft_feat[:, -1:]] * (K - 1), 1)  # masks reuse the last features
            draft_logits = draft(ids, f, draft_cache)[:, -K:]  # [1, K, V]
            proposed = draft_logits.argmax(-1)
            keep(draft_cache, draft_cache.get_seq_length() - (K - 1))  # the mask entries leave the cache
            target_input = torch.cat([target_input, proposed], 1)
            out = target(target_input, past_key_values=target_cache, output_hidden_states=True)
            choice = out.logits[:, -K - 1:].argmax(-1)  # [1, K + 1]
            n = 0
            while n < K and choice[0, n] == proposed[0, n]:
                n += 1
            accepted = choice[:, : n + 1]
            all_feat = torch.cat([all_feat, features(out)[:, -K - 1:][:, : n + 1]], 1)
            drafts.append(proposed[0].tolist())
            logits_of.append(draft_logits[0].numpy())
            kept.append(accepted[0].tolist())
            tokens = torch.cat([tokens, accepted], 1)
            keep(target_cache, tokens.shape[1] - 1)
            target_input, draft_input, draft_feat = accepted[:, -1:], accepted, all_feat[:, -(n + 1):]
    return drafts, logits_of, kept


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    shape = dict(SHAPE, num_hidden_layers=4)
    target = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **shape), dtype=torch.float32).eval()
    seeded(target, 3)
    target.save_pretrained(OUT / "target", safe_serialization=True)
    target.save_pretrained(OUT / "pard2", safe_serialization=True)
    pard_token, target_dim = shape["vocab_size"] - 1, len(LAYERS) * shape["hidden_size"]
    config = json.loads((OUT / "pard2" / "config.json").read_text())
    config.update(pard_token=pard_token, spd_type="pard2", pard2_target_layers=LAYERS, pard2_target_dim=target_dim,
                  pard2_scale=SCALE, pard2_proj_bias=False)
    (OUT / "pard2" / "config.json").write_text(json.dumps(config, indent=2))
    draft = Warp(AutoModelForCausalLM.from_pretrained(OUT / "pard2", dtype=torch.float32).eval(), target_dim)
    g = torch.Generator().manual_seed(5)
    # The features change drafts, and rounds still accept some. Written in bfloat16, as AMD trains (the loop
    # computes in float32 with the weights as written).
    weight = (torch.randn(draft.target_proj.weight.shape, generator=g) * 0.15).to(torch.bfloat16)
    with torch.no_grad():
        draft.target_proj.weight.copy_(weight.float())
    torch.save({"target_proj.weight": weight}, OUT / "pard2" / "warp_model.bin")
    prompt = torch.from_numpy(np.random.default_rng(2).integers(3, pard_token, size=(1, 16)))
    drafts, logits, kept = pard2_rounds(target, draft, prompt, pard_token)
    write_reference(OUT, prompt, drafts, logits, kept)
    print(f"{OUT}: {len(drafts)} rounds, {sum(map(len, kept))} tokens, "
          f"{sum(len(k) - 1 for k in kept)} drafts accepted")


if __name__ == "__main__":
    main()
