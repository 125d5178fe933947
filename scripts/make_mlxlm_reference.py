"""Write tiny checkpoints of the families mlx-spec runs through mlx-lm's model code,
saved by transformers, with transformers' own greedy tokens (tests/test_mlxlm_targets.py).

Needs torch and transformers, which mlx-spec itself does not depend on:

    pip install torch==2.13.0 transformers
    python scripts/make_mlxlm_reference.py [NAME ...]

tests/fixtures/mlxlm_reference/
  qwen3_moe/  Qwen3MoeForCausalLM as transformers 5 saves it: `num_local_experts`,
              `rope_parameters` (rope_theta 1e6), experts as `mlp.experts.{e}.*_proj`
  mixtral/, qwen2_moe/, olmoe/  the other mixtures of experts, as transformers 5 saves them
  gpt_oss/    GptOssForCausalLM: sliding and full layers alternating (window 8, shorter than the
              text), attention sinks, YaRN with `truncate: false` as gpt-oss's config has it,
              experts fused as transformers stores them (`experts.gate_up_proj` [E, H, 2I])
  gemma3_text/ Gemma3ForCausalLM: two sliding layers (window 8) then a full one, per-layer-type
              `rope_parameters` (linear scaling 8 on the full layer), a hidden size whose
              embedding scale is not a bfloat16 number (sqrt(80)), query_pre_attn_scalar 24
  qwen3_next/ Qwen3NextForCausalLM: three Gated DeltaNet layers, then a gated full-attention
              layer with partial rotary embeddings; mixture of experts with a shared expert
  qwen3_5/    Qwen3_5ForConditionalGeneration as Qwen3.5 is published: a vision tower beside the
              text model (`model.visual.*`, `model.language_model.*`, `lm_head`), the text config
              in `text_config`, and its MTP module as `mtp.*` (research/checkpoint-formats.md 5.3);
              the reference is the same model's text-only greedy tokens
  qwen3_5_moe/ Qwen3_5MoeForConditionalGeneration likewise (Qwen3.5-35B-A3B's form): experts (as
              transformers 5 writes them, one tensor each) and a shared expert, in the MTP layer too
  deepseek_v3/ DeepseekV3ForCausalLM: multi-head latent attention (q and kv LoRA ranks, interleaved
              RoPE on its rope part), a dense first layer, then routed and shared experts; its MTP
              module as DeepSeek-V3 ships it, layer `model.layers.2.*` (a mixture-of-experts layer)
  mimo/       Xiaomi MiMo as its checkpoints are laid out: `"model_type": "mimo"`, a Qwen2
              model (q/k/v biases) with `num_nextn_predict_layers` 1 and its MTP module as
              `model.mtp_layers.0.*` (research/checkpoint-formats.md 5.2) beside the model's
              weights; the reference is transformers' Qwen2 on the same weights (MiMo's main
              model is Qwen2's; transformers has no MiMo class). rope_theta 640000, as MiMo's.
  gemma3_softcap/ gemma3_text/'s shape with `final_logit_softcapping` set (transformers applies it)
  gemma4_text/, gemma4/, gemma2/, glm4_moe/, lfm2/, lfm2_moe/, granitemoehybrid/, nemotron_h/, deepseek_v32/
              families mlx-spec runs
              through mlx-lm's forward, whole (`WHOLE`)
Each holds the tokens of a fixed prompt, transformers' logits over it and the 24 greedy tokens
transformers computed after it (reference.npz).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "mlxlm_reference"
GREEDY_TOKENS = 24
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4)
QWEN3_5_TEXT = dict(SHAPE, num_hidden_layers=4, intermediate_size=96, **LINEAR)
QWEN3_5_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                      num_position_embeddings=16)
GEMMA4_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                     position_embedding_size=64)
CASES = {
    "qwen3_moe": ("qwen3_moe", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                    num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                    norm_topk_prob=True, rope_theta=1e6)),
    "mimo": ("qwen2", dict(intermediate_size=96, rope_theta=640000.0)),
    "qwen3_5": ("qwen3_5", {}),
    "qwen3_5_moe": ("qwen3_5_moe", {}),
    "mixtral": ("mixtral", dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6,
                                sliding_window=None)),
    "qwen2_moe": ("qwen2_moe", dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                    num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                    norm_topk_prob=False, rope_theta=1e6)),
    "gpt_oss": ("gpt_oss", dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"])),
    "gemma3_text": ("gemma3_text", dict(hidden_size=80, num_hidden_layers=3, intermediate_size=96, sliding_window=8,
                                        query_pre_attn_scalar=24, layer_types=["sliding_attention"] * 2 + ["full_attention"],
                                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                            "rope_theta": 1e6}})),
    "qwen3_next": ("qwen3_next", dict(num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=40,
                                      shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2, **LINEAR)),
    "deepseek_v3": ("deepseek_v3", dict(num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
                                        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                        first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32,
                                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                        head_dim=8)),
    "olmoe": ("olmoe", dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, eos_token_id=2,
                            rope_theta=10000.0)),
    # Gemma 3 with a final logit softcap set (mlx-lm's gemma3_text ignores it; transformers applies it)
    "gemma3_softcap": ("gemma3_text", dict(hidden_size=80, num_hidden_layers=3, intermediate_size=96, sliding_window=8,
                                           query_pre_attn_scalar=24, final_logit_softcapping=3.0,
                                           layer_types=["sliding_attention"] * 2 + ["full_attention"])),
}
# Families mlx-spec runs through mlx-lm's forward whole (mlx_spec/models/whole.py; tests/test_whole_targets.py)
WHOLE = {
    # Gemma 4 text (E2B's form): sliding and full layers (a wider head on the full ones, partial "proportional"
    # RoPE), the last two layers reusing the keys and values of the last earlier layer of their type, per-layer
    # input embeddings, a final logit softcap; config.json as google/gemma-4-E2B-it's text_config says it
    # (`global_head_dim`, where transformers 5.25 writes `per_layer_config`)
    "gemma4_text": ("gemma4_text", dict(num_hidden_layers=4, intermediate_size=96, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
                                        hidden_size_per_layer_input=16, vocab_size_per_layer_input=256,
                                        global_head_dim=32, final_logit_softcapping=3.0, tie_word_embeddings=True)),
    # Gemma 4 as published (google/gemma-4-E2B-it's form): the same text model in `text_config` beside a vision
    # tower (`model.vision_tower.*`, `model.embed_vision.*`, `model.language_model.*`); text-only references
    "gemma4": ("gemma4", {}),
    # Gemma 2: attention and final logit softcaps (the window longer than the text: mlx-lm's gemma2 attends to all)
    "gemma2": ("gemma2", dict(intermediate_size=96, query_pre_attn_scalar=16, attn_logit_softcapping=5.0,
                              final_logit_softcapping=3.0, sliding_window=4096, tie_word_embeddings=True)),
    # GLM-4.5's mixture of experts: a dense first layer, routed and shared experts, partial RoPE, q/k norms
    "glm4_moe": ("glm4_moe", dict(num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=32,
                                  n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                                  norm_topk_prob=True, use_qk_norm=True, partial_rotary_factor=0.5, attention_bias=True)),
    # LFM2: short gated convolutions (a window of 2 inputs) beside full-attention layers, its MLP width cut to two
    # thirds and rounded (`block_auto_adjust_ff_dim`), tied embeddings; as transformers 5 writes it (no `block_dim`)
    "lfm2": ("lfm2", dict(num_hidden_layers=4, intermediate_size=96, block_multiple_of=32,
                          block_auto_adjust_ff_dim=True, conv_L_cache=3, norm_eps=1e-5, tie_word_embeddings=True,
                          layer_types=["conv", "full_attention", "conv", "conv"])),
    # LFM2-MoE (LFM2-8B-A1B's form): LFM2's convolutions and attention, a dense first layer, then routed experts
    # chosen with an expert bias
    "lfm2_moe": ("lfm2_moe", dict(num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                  num_experts_per_tok=2, num_dense_layers=1, use_expert_bias=True, norm_topk_prob=True,
                                  conv_L_cache=3, layer_types=["conv", "full_attention", "conv", "conv"], norm_eps=1e-5,
                                  tie_word_embeddings=True)),
    # Granite 4.0-H (granite-4.0-h-tiny's form): Mamba-2 layers (a convolution and a state space model) beside
    # attention layers without positions ("nope"), routed and shared experts, Granite's multipliers
    "granitemoehybrid": ("granitemoehybrid", dict(
        num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "mamba"], intermediate_size=32,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48, mamba_n_heads=8, mamba_d_head=16,
        mamba_expand=2, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_conv_bias=True,
        mamba_proj_bias=False, position_embedding_type="nope", embedding_multiplier=2.0, logits_scaling=3.0,
        residual_multiplier=0.5, attention_multiplier=0.25, tie_word_embeddings=True)),
    # Nemotron-H (NVIDIA-Nemotron-3-Nano's form): Mamba-2, attention (no positions), MLP and mixture-of-experts
    # blocks, each its own layer (only Mamba-2 and attention keep a cache); the backbone as `backbone.*`
    "nemotron_h": ("nemotron_h", dict(
        layers_block_type=["mamba", "moe", "attention", "mlp", "mamba", "moe"], intermediate_size=96,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, expand=2,
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=1.5, layer_norm_epsilon=1e-5, tie_word_embeddings=False)),
    # DeepSeek-V3.2: DeepSeek-V3's multi-head latent attention and experts, and its sparse attention's indexer
    # (keys of its own, a cache beside the attention's) choosing 16 keys a query: fewer than the text holds
    "deepseek_v32": ("deepseek_v32", dict(
        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8, index_n_heads=16, index_head_dim=16,
        index_topk=16)),
}


def seeded(model: torch.nn.Module, seed: int) -> None:
    """Weights an untrained model could have, large enough that greedy tokens are not ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def mtp_layer(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """MiMo's `model.mtp_layers.0.*`: a Qwen2 block between input norms, a projection and a final norm."""
    g = torch.Generator().manual_seed(seed)
    H, I, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes = {
        "token_layernorm.weight": (H,), "hidden_layernorm.weight": (H,), "input_proj.weight": (H, 2 * H),
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (q, H), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.weight": (kv, H),
        "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.weight": (kv, H), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (H, q), "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H),
        "mlp.down_proj.weight": (H, I), "final_layernorm.weight": (H,),
    }
    out = {}
    for name, shape in shapes.items():
        if "layernorm" in name:
            value = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("bias"):
            value = 0.1 * torch.randn(shape, generator=g)
        else:
            value = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        out[f"model.mtp_layers.0.{name}"] = value
    return out


def mtp_module(weights: dict[str, torch.Tensor], layout: str, prefix: str, seed: int) -> dict[str, torch.Tensor]:
    """One MTP module: the norms and projection before, and one decoder layer shaped like the
    model's own layer `prefix` (research/checkpoint-formats.md 5.1, 5.3). Qwen3.5's `mtp.*` (a
    full-attention layer, zero-centred norms as Qwen3.5 stores them); DeepSeek-V3's layer
    `model.layers.{L}.*` (a mixture-of-experts layer, its own `shared_head` and copy of the embedding)."""
    g = torch.Generator().manual_seed(seed)
    H = weights[f"{prefix}.input_layernorm.weight"].shape[0]
    if layout == "qwen3_5":
        head, block = "mtp.", "mtp.layers.0."
        shapes = {"mtp.pre_fc_norm_embedding.weight": (H,), "mtp.pre_fc_norm_hidden.weight": (H,),
                  "mtp.fc.weight": (H, 2 * H), "mtp.norm.weight": (H,)}
    else:
        L = 1 + max(int(k.split(".")[2]) for k in weights if k.startswith("model.layers."))
        head = block = f"model.layers.{L}."
        V = weights["model.embed_tokens.weight"].shape[0]
        shapes = {head + "enorm.weight": (H,), head + "hnorm.weight": (H,), head + "eh_proj.weight": (H, 2 * H),
                  head + "shared_head.norm.weight": (H,), head + "shared_head.head.weight": (V, H)}
    shapes.update({block + k[len(prefix) + 1:]: tuple(v.shape) for k, v in weights.items() if k.startswith(prefix + ".")})
    out = {}
    for name, shape in shapes.items():
        if "norm" in name:  # Qwen3.5's zero-centred: the scale is 1 + w
            out[name] = (0.0 if layout == "qwen3_5" else 1.0) + 0.1 * torch.randn(shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g) / shape[-1] ** 0.5
    if layout == "deepseek_v3":
        out[head + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    return out


def build(name: str, model_type: str, fields: dict) -> torch.nn.Module:
    if name == "gemma4":
        from transformers import Gemma4Config, Gemma4ForConditionalGeneration

        text = {**SHAPE, **WHOLE["gemma4_text"][1]}
        return Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=GEMMA4_VISION))
    if name == "qwen3_5":
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        return Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=QWEN3_5_TEXT, vision_config=QWEN3_5_VISION))
    if name == "qwen3_5_moe":
        from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

        text = dict(QWEN3_5_TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                    shared_expert_intermediate_size=48)
        return Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=QWEN3_5_VISION))
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**SHAPE, **fields}), dtype=torch.float32)


def main(names: list[str]) -> None:
    """Write the fixtures of `names` (all of them, none given)."""
    prompt = np.random.default_rng(1).integers(3, SHAPE["vocab_size"], size=(1, 24))
    for name, (model_type, fields) in {**CASES, **WHOLE}.items():
        if names and name not in names:
            continue
        out = OUT / name
        shutil.rmtree(out, ignore_errors=True)
        model = build(name, model_type, fields).float().eval()
        seeded(model, seed=len(name))
        model.save_pretrained(out, safe_serialization=True)
        with torch.no_grad():
            logits = model(torch.from_numpy(prompt)).logits[0].numpy()  # [S, V]: the prompt's, for a closer check
            ids = torch.from_numpy(prompt)
            for _ in range(GREEDY_TOKENS):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        if name == "gemma4_text":  # as published: the full layers' head size as `global_head_dim`
            config = json.loads((out / "config.json").read_text())
            config.pop("per_layer_config")
            config["global_head_dim"] = fields["global_head_dim"]
            (out / "config.json").write_text(json.dumps(config, indent=2))
            reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            with torch.no_grad():  # the published form builds the same model
                assert torch.equal(reloaded(ids).logits, model(ids).logits)
        if name == "mimo":
            config = json.loads((out / "config.json").read_text())
            config.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
            (out / "config.json").write_text(json.dumps(config, indent=2))
            weights = safetensors.torch.load_file(out / "model.safetensors")
            weights.update(mtp_layer(config, seed=7))
            safetensors.torch.save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        if name in ("qwen3_5", "qwen3_5_moe", "deepseek_v3"):
            weights = safetensors.torch.load_file(out / "model.safetensors")
            if name == "deepseek_v3":
                weights.update(mtp_module(weights, "deepseek_v3", "model.layers.1", seed=13))
            else:
                weights.update(mtp_module(weights, "qwen3_5", "model.language_model.layers.3", seed=11))
            safetensors.torch.save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
            config = json.loads((out / "config.json").read_text())
            if name == "deepseek_v3":
                config["num_nextn_predict_layers"] = 1
            else:
                config["text_config"].update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
            (out / "config.json").write_text(json.dumps(config, indent=2))
        np.savez_compressed(out / "reference.npz", prompt=prompt[0].astype(np.int32),
                            greedy=ids[0, prompt.shape[1]:].numpy().astype(np.int32), logits=logits)
        (out / "versions.json").write_text(
            json.dumps({"torch": torch.__version__, "transformers": transformers.__version__}) + "\n")
        print(name, "->", out)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
