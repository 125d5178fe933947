"""DFlash configs: the settings a DFlash drafter runs with, wherever a published config keeps them,
and the layouts it is published in read as z-lab's (vllm-project/speculators' `speculators_model_type`
"dflash" / "dflash2", as RedHatAI publishes them, keeps z-lab's tensors under another config).

z-lab's own code reads a config through transformers' Qwen3Config: `sliding_window` counts only with
`use_sliding_window`, and without `layer_types` the layers from `max_window_layers` on slide.
"""

from __future__ import annotations

from pathlib import Path

from mlx_spec.errors import UserError
from mlx_spec.models.llama import Model


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default taps when a config names none: from layer 1 to L - 3, evenly
    (kept inside the target when it has fewer than 5 layers)."""
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        return [L // 2]
    return [min(max(round(1 + i * (L - 4) / (n - 1)), 0), L - 1) for i in range(n)]


def dflash_settings(config: dict, where: str) -> dict:
    """block_size, mask_token_id, target_layer_ids, layer kinds and window, wherever the config keeps them."""
    extra = config.get("dflash_config") or {}
    block = extra.get("block_size", config.get("block_size"))
    if not isinstance(block, int) or block < 2:
        raise UserError(f"{where}: 'block_size' (top level or in dflash_config) must be an integer >= 2")
    mask_id = extra.get("mask_token_id", config.get("mask_token_id"))
    if not isinstance(mask_id, int) or mask_id < 0:
        raise UserError(f"{where}: 'dflash_config.mask_token_id' must be a token id")
    n_layers = int(config.get("num_hidden_layers", 0))
    layers = extra.get("target_layer_ids") or default_target_layers(int(config.get("num_target_layers") or 0), n_layers)
    kinds = config.get("layer_types") or ["full_attention"] * n_layers
    if len(kinds) != n_layers or any(k not in ("full_attention", "sliding_attention") for k in kinds):
        raise UserError(f"{where}: 'layer_types' must list full_attention or sliding_attention for each of {n_layers} layers")
    window = config.get("sliding_window") or 0  # 0: none (a sliding layer is then causal by default, no more)
    if not isinstance(window, int) or window < 0:
        raise UserError(f"{where}: 'sliding_window' must be a number of tokens")
    causal = extra.get("causal", config.get("is_causal"))
    scaling = {k: float(extra.get(k, config.get(k)) or default) for k, default in SCALING.items()}
    vocab = extra.get("draft_vocab_size")
    if vocab is not None and not (isinstance(vocab, int) and 0 < vocab):
        raise UserError(f"{where}: 'dflash_config.draft_vocab_size' must be a positive integer")
    return {"block_size": block, "mask_token_id": mask_id, "target_layer_ids": [int(i) for i in layers],
            "layer_types": kinds, "sliding_window": window, "causal": causal, "draft_vocab_size": vocab, **scaling}


# What a DFlash 2 config adds (in dflash_config), and the scalings Gemma 4 and DFlash 2 drafts set
# (a factor on the target's embedding, one on the logits, a tanh cap on them; 0 caps nothing).
DFLASH2 = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
SCALING = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": 0.0}


def is_dflash2(config: dict) -> bool:
    extra = config.get("dflash_config") or {}
    return any("DFlash2" in str(a) for a in config.get("architectures") or []) or any(k in extra for k in DFLASH2)


def dflash_config(target: Model, num_layers: int, block_size: int, mask_token_id: int,
                  target_layers: list[int] | None = None, intermediate_size: int | None = None) -> dict:
    """The config of a new DFlash drafter for `target` (z-lab's layout)."""
    t = target.args
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": t.hidden_size,
        "num_hidden_layers": num_layers, "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads, "head_dim": t.head_dim,
        "intermediate_size": intermediate_size or t.intermediate_size, "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": t.rope_theta, "max_position_embeddings": t.max_position_embeddings,
        "vocab_size": t.vocab_size, "num_target_layers": t.num_hidden_layers, "block_size": block_size,
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "target_layer_ids": target_layers or default_target_layers(t.num_hidden_layers, num_layers),
        },
    }


def from_speculators(published: dict, where: Path | str) -> dict:
    """A speculators DFlash / DFlash 2 config as z-lab's: the draft layers' config from
    `transformer_layer_config`, the target layers as z-lab's ids (speculators' `aux_hidden_state_layer_ids`
    index transformers' `hidden_states`: z-lab's + 1), in-block attention both ways where
    `sliding_window_non_causal` says so."""
    body, ids = published.get("transformer_layer_config"), published.get("aux_hidden_state_layer_ids")
    if not isinstance(body, dict):
        raise UserError(f"{where}: transformer_layer_config must hold the draft layers' config")
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 1 for i in ids)):
        raise UserError(f"{where}: aux_hidden_state_layer_ids must list the target's hidden states it reads (>= 1)")
    for field, value in (("projector_type", "dflash"), ("shift_label", False), ("sample_from_anchor", False)):
        if published.get(field, value) not in (value, None):
            raise UserError(f"{where}: {field} {published[field]!r} drafts otherwise than DFlash; not supported")
    extra = {"block_size": published.get("block_size"), "mask_token_id": published.get("mask_token_id"),
             "target_layer_ids": [i - 1 for i in ids]}
    vocab = published.get("draft_vocab_size")
    if vocab is not None and vocab != body.get("vocab_size"):  # its own LM head over it, and d2t
        if published.get("speculators_model_type") == "dflash2":
            raise UserError(f"{where}: draft_vocab_size {vocab}: a DFlash 2 candidate selector over a draft "
                            "vocabulary of its own is not supported")
        extra["draft_vocab_size"] = vocab
    if published.get("sliding_window_non_causal"):
        extra["causal"] = False
    if published.get("speculators_model_type") == "dflash2":
        extra.update({k: published[k] for k in DFLASH2 if k in published})
    name = "DFlash2DraftModel" if published.get("speculators_model_type") == "dflash2" else "DFlashDraftModel"
    return {**body, "architectures": [name], "dflash_config": extra}


def zlab_config(published: dict, where: Path | str) -> dict:
    """A published DFlash config (z-lab's or speculators') as z-lab's code reads it, its layer kinds written
    out; what DFlashNet cannot run refused in one line."""
    if str(published.get("speculators_model_type")).startswith("dflash"):
        published = from_speculators(published, where)
    extra = published.get("dflash_config") or {}
    if "target_layer_ids" not in extra and not published.get("num_target_layers"):
        raise UserError(
            f"{where}: neither dflash_config.target_layer_ids nor num_target_layers says which target layers it reads"
        )
    config = dict(published)
    # z-lab reads the config through transformers' Qwen3Config, which keeps the window only with use_sliding_window.
    window = published.get("sliding_window") if published.get("use_sliding_window") else None
    kinds = published.get("layer_types")
    if kinds is None:
        first = published.get("max_window_layers", 28)  # Qwen3Config's default
        n = int(published.get("num_hidden_layers") or 0)
        kinds = config["layer_types"] = [
            "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n)
        ]
    if window is None:  # its sliding layers then see the whole context (causally, unless is_causal says not)
        config["sliding_window"] = None
    return config
