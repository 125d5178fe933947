"""Write three random checkpoints of the families mlx-spec runs on mlx-lm's model code, big enough
that a decoding step reads its weights from memory (100-230 MB in float32), with a tokenizer, to
measure plain decoding through mlx-spec's wrapper beside mlx-lm's own on the same modules:

    pip install torch==2.13.0 transformers
    python scripts/make_bench_targets.py OUT
    mlx-spec bench --model OUT/qwen3_5 --prompts code --num-prompts 4 --max-tokens 64 --repeats 3 --temps 0 --no-chat-template

OUT/qwen3_5    Qwen3_5ForConditionalGeneration (its text model: 8 layers, 6 Gated DeltaNet, hidden 512)
OUT/gpt_oss    GptOssForCausalLM (8 layers, sliding and full alternating, 8 experts, 2 a token)
OUT/qwen3_moe  Qwen3MoeForCausalLM (8 layers, 8 experts, 2 a token)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3_5Config, Qwen3_5ForConditionalGeneration

from tiny import make_tokenizer

SHAPE = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=1024,
             max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False, num_hidden_layers=8)
LINEAR = dict(linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=512, patch_size=4,
              num_position_embeddings=16)


def main(out: Path) -> None:
    torch.manual_seed(0)
    models = {
        "qwen3_5": Qwen3_5ForConditionalGeneration(Qwen3_5Config(
            text_config=dict(SHAPE, intermediate_size=1536, **LINEAR), vision_config=VISION)),
        "gpt_oss": AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "gpt_oss", **SHAPE, intermediate_size=512, num_local_experts=8, num_experts_per_tok=2, sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * 4)),
        "qwen3_moe": AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "qwen3_moe", **SHAPE, intermediate_size=1536, moe_intermediate_size=384, num_experts=8,
            num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)),
    }
    for name, model in models.items():
        model.save_pretrained(out / name)
        make_tokenizer(out / name, 1000)
        print(name, "->", out / name)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
