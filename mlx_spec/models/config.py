"""Reading a Hugging Face `config.json` into the arguments of our targets.

Configs written by transformers 4 (`rope_theta` at the top level, scaling in
`rope_scaling` with `type` or `rope_type`) and by transformers 5 (everything in
`rope_parameters`) are both read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlx_spec.errors import UserError

# model_type -> (bias on q/k/v, bias on o, RMSNorm on q and k heads)
ARCHITECTURES = {
    "llama": None,  # biases follow `attention_bias`
    "mistral": None,
    "qwen2": (True, False, False),
    "qwen3": (None, None, True),  # biases follow `attention_bias`
}


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    quantization: dict | None = None
    sliding_window: int | None = None  # each token attends to this many positions (itself included)
    extra: dict[str, Any] = field(default_factory=dict)


def _required(config: dict, key: str, source: str) -> Any:
    if key not in config:
        raise UserError(f"{source}: missing field '{key}'")
    return config[key]


def _rope(config: dict, source: str) -> tuple[float, dict | None]:
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and params:
        # transformers 5 may key rope_parameters by layer type; ours have one.
        first = next(iter(params.values()))
        if isinstance(first, dict):
            params = first
    scaling = dict(params) if isinstance(params, dict) else dict(config.get("rope_scaling") or {})
    theta = scaling.pop("rope_theta", None) or config.get("rope_theta", 10000.0)
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    if kind == "default":
        return float(theta), None
    scaling["rope_type"] = kind
    scaling.setdefault(
        "original_max_position_embeddings", config.get("max_position_embeddings", 2048)
    )
    needs = {"linear": ("factor",), "yarn": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
    for key in needs.get(kind, ()):
        if key not in scaling:
            raise UserError(f"{source}: rope scaling '{kind}' needs field '{key}'")
    return float(theta), scaling


def parse_config(config: dict, source: str = "config.json") -> ModelArgs:
    """Validate a config dict; errors name `source` and the field."""
    model_type = _required(config, "model_type", source)
    if model_type not in ARCHITECTURES:
        raise UserError(
            f"{source}: model_type '{model_type}' is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    if config.get("use_sliding_window"):  # Qwen2's: windows on some layers only
        raise UserError(f"{source}: use_sliding_window (windows on some layers) is not supported yet")
    window = config.get("sliding_window") if model_type == "mistral" else None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise UserError(f"{source}: 'sliding_window' must be a positive integer or null, got {window!r}")
    hidden = int(_required(config, "hidden_size", source))
    heads = int(_required(config, "num_attention_heads", source))
    attention_bias = bool(config.get("attention_bias", False))
    qkv_bias, o_bias, qk_norm = ARCHITECTURES[model_type] or (None, None, False)
    theta, scaling = _rope(config, source)
    return ModelArgs(
        model_type=model_type,
        hidden_size=hidden,
        num_hidden_layers=int(_required(config, "num_hidden_layers", source)),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        intermediate_size=int(_required(config, "intermediate_size", source)),
        vocab_size=int(_required(config, "vocab_size", source)),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
        o_bias=attention_bias if o_bias is None else o_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=qk_norm,
        max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
        quantization=config.get("quantization"),
        sliding_window=window if window and window < int(config.get("max_position_embeddings", 32768)) else None,
        extra=config,
    )
