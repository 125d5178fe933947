"""Write Gemma 4 assistants laid out as Google publishes them, for the Gemma 4 text fixture
(tests/fixtures/mlxlm_reference/gemma4_text), and what transformers' Gemma4AssistantForCausalLM
drafts with them (tests/test_assistant.py).

Needs torch and transformers, which mlx-spec itself does not depend on:

    pip install torch==2.13.0 transformers
    python scripts/make_assistant_reference.py

tests/fixtures/assistant_reference/
  e2b/  as google/gemma-4-E2B-it-assistant: `Gemma4AssistantForCausalLM`, a centroid head
        (`use_ordered_embeddings`, `masked_embedding.centroids` and an int64
        `masked_embedding.token_ordering`), three sliding layers then a full one
        (`global_head_dim`), bfloat16 weights, the tied head not stored
  31b/  as google/gemma-4-31B-it-assistant: the same without the centroid head (the tied
        embedding is the head)
Each holds reference.npz: the prompt, and for each of a greedy speculative decoding's rounds
(3 drafts a round) the drafted tokens and the assistant's logits for them, and the tokens
decoded (which the script checks equal the target's plain greedy tokens).

The rounds are transformers' `SinglePositionMultiTokenCandidateGenerator` (the target's
embedding of the last token beside a hidden state, the assistant run once a token, its
`last_hidden_state` the next step's hidden state) with the target read anew each round, its
state after the final norm at the token before the last, and its shared keys and values up to
that token. Two differences, as vLLM and mlx-vlm draft: the query sits at that state's position
(transformers' generator places it one further, at the last token's), and a sliding layer sees
the `sliding_window` keys up to it, as the target's own sliding layers do (transformers' mask for
the assistant, bidirectional, sees one more).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from make_mlxlm_reference import seeded as seeded_parameters
from transformers import AutoModelForCausalLM, Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
TARGET = ROOT / "mlxlm_reference" / "gemma4_text"
OUT = ROOT / "assistant_reference"
K, ROUNDS = 3, 8
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, global_head_dim=32, sliding_window=8, vocab_size=256, max_position_embeddings=512,
            layer_types=["sliding_attention"] * 3 + ["full_attention"], num_kv_shared_layers=4,
            hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, rms_norm_eps=1e-6,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                "rope_theta": 1000000.0}},
            final_logit_softcapping=30.0, tie_word_embeddings=True)
CASES = {"e2b": dict(use_ordered_embeddings=True, num_centroids=16, centroid_intermediate_top_k=4),
         "31b": dict(use_ordered_embeddings=False)}


def seeded(model: torch.nn.Module, seed: int) -> None:
    """Weights as the other fixtures' (`make_mlxlm_reference.seeded`), and the buffers an assistant stores:
    each layer's `layer_scalar` and the centroid head's token order (a permutation of the vocabulary)."""
    seeded_parameters(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(1.0 + 0.1 * torch.randn(b.shape, generator=g))
        elif name.endswith("token_ordering"):
            b.copy_(torch.randperm(b.shape[0], generator=g))


def window_masks(self, inputs_embeds, attention_mask, shared_kv_states):
    """The assistant's masks as vLLM and mlx-vlm draw them: every key up to the query's position (the
    last), the sliding layers' the last `sliding_window` of them."""
    L = shared_kv_states["sliding_attention"][0].shape[2]
    near = torch.arange(L) >= L - self.config.get_text_config().sliding_window
    return {"full_attention": None, "sliding_attention": near[None, None, None, :]}


def rounds(target, assistant, prompt: list[int], tokens: int) -> tuple[list, list, list[int]]:
    """Greedy speculative decoding of `tokens` tokens: each round's drafts and their logits, and the tokens."""
    embed = target.get_input_embeddings()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ids = torch.cat([ids, target(ids).logits[:, -1:].argmax(-1)], dim=1)
        drafts, logits = [], []
        while ids.shape[1] - len(prompt) < tokens:
            n = ids.shape[1]
            out = target(ids[:, :-1], output_hidden_states=True, return_shared_kv_states=True)
            hidden = out.hidden_states[-1][:, -1:]  # after the final norm, at token n - 2
            kv = out.shared_kv_states
            tok, step_tokens, step_logits = ids[:, -1:], [], []
            for _ in range(K):
                o = assistant(inputs_embeds=torch.cat([embed(tok), hidden], dim=-1), attention_mask=torch.ones(1, n),
                              position_ids=torch.tensor([[n - 2]]), shared_kv_states=kv, use_cache=False)
                tok, hidden = o.logits.argmax(-1), o.last_hidden_state
                step_tokens.append(int(tok))
                step_logits.append(o.logits[0, 0].float().numpy())
            verify = target(torch.cat([ids, torch.tensor([step_tokens])], dim=1)).logits[0, n - 1:].argmax(-1)
            a = 0
            while a < K and step_tokens[a] == int(verify[a]):
                a += 1
            ids = torch.cat([ids, torch.tensor([step_tokens[:a] + [int(verify[a])]])], dim=1)
            drafts.append(step_tokens)
            logits.append(np.stack(step_logits))
        return drafts, logits, ids[0, len(prompt):].tolist()


def main() -> None:
    Gemma4AssistantForCausalLM.create_attention_masks = window_masks
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    prompt = np.load(TARGET / "reference.npz")["prompt"].tolist()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        for _ in range(K * ROUNDS):
            ids = torch.cat([ids, target(ids).logits[:, -1:].argmax(-1)], dim=1)
    plain = ids[0, len(prompt):].tolist()
    for seed, (name, fields) in enumerate(CASES.items()):
        out = OUT / name
        out.mkdir(parents=True, exist_ok=True)
        config = Gemma4AssistantConfig(text_config=Gemma4TextConfig(**TEXT), backbone_hidden_size=64,
                                       tie_word_embeddings=True, **fields)
        config.architectures = ["Gemma4AssistantForCausalLM"]
        model = Gemma4AssistantForCausalLM(config).eval()
        seeded(model, 100 + seed)
        model.to(torch.bfloat16).save_pretrained(out)  # as published: bfloat16, the tied head not stored
        written = json.loads((out / "config.json").read_text())
        text = written["text_config"]
        text.pop("per_layer_config", None)  # as published: the full layer's head size as `global_head_dim`
        text["global_head_dim"] = TEXT["global_head_dim"]
        (out / "config.json").write_text(json.dumps(written, indent=2))
        assistant = Gemma4AssistantForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        drafts, logits, tokens = rounds(target, assistant, prompt, K * ROUNDS)
        assert tokens[: len(plain)] == plain, "speculative greedy tokens differ from plain"
        np.savez_compressed(out / "reference.npz", prompt=np.array(prompt, np.int32), drafts=np.array(drafts, np.int32),
                            logits=np.stack(logits).astype(np.float32), tokens=np.array(tokens, np.int32))
        (out / "versions.json").write_text(
            json.dumps({"torch": torch.__version__, "transformers": transformers.__version__}) + "\n")
        accepted = len(tokens) - 1 - len(drafts)  # each round: its accepted drafts and one token of its own
        print(name, "->", out, f"{len(drafts)} rounds, {accepted} drafts accepted of {K * len(drafts)}")


if __name__ == "__main__":
    main()
