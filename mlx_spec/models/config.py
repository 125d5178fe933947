"""Reading a Hugging Face `config.json` into the arguments of our targets.

Configs written by transformers 4 (`rope_theta` at the top level, scaling in
`rope_scaling` with `type` or `rope_type`) and by transformers 5 (everything in
`rope_parameters`) are both read.

mlx-lm does not read every config as transformers writes it: transformers 5
puts RoPE in `rope_parameters`, names the experts' count `num_local_experts`,
writes infinities as `{"__float__": "Infinity"}` and renames some families'
layer types, which mlx-lm's argument classes miss (falling back to a RoPE base
of 10000, for one), so `mlx_lm_config` rewrites them first.
"""

from __future__ import annotations

import math
import numbers
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


# Shapes MLX holds as 32-bit integers; a size beyond this is no model's.
MAX_SIZE = 2**31 - 1
SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
         "vocab_size", "head_dim", "max_position_embeddings", "moe_intermediate_size")
POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta")
FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
SCALING_POSITIVE = ("rope_theta", "factor", "original_max_position_embeddings")
SCALING_NUMBERS = ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                   "partial_rotary_factor")


def _size(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and 1 <= value <= MAX_SIZE


def _finite(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: Any) -> bool:
    return _finite(value) and value > 0


def _check(params: dict, keys, ok, what: str, source: str, prefix: str = "") -> None:
    """Each of `keys` that `params` sets (not null) passes `ok`, else a one-line error naming it."""
    for key in keys:
        if params.get(key) is not None and not ok(params[key]):
            raise UserError(f"{source}: '{prefix}{key}' must be {what}, got {params[key]!r}")


def check_fields(config: dict, source: str) -> None:
    """The shape fields `config` has (and a `text_config` inside it), each of the right type and range:
    a wrong one is named here, not met later as a traceback or a model of another shape.
    A null optional field (`head_dim`, `num_key_value_heads`, ...) means its default."""
    _check(config, SIZES, _size, f"an integer in 1..{MAX_SIZE}", source)
    _check(config, POSITIVE_NUMBERS, _positive, "a finite number > 0", source)
    _check(config, FLAGS, lambda v: isinstance(v, bool), "true or false", source)
    for section in ("rope_scaling", "rope_parameters"):
        scaling = config.get(section)
        if scaling is not None and not isinstance(scaling, dict):
            raise UserError(f"{source}: '{section}' must be an object or null, got {scaling!r}")
        layered = [v for v in (scaling or {}).values() if isinstance(v, dict)]  # keyed by layer type
        for params in [scaling or {}, *layered]:
            _check(params, SCALING_POSITIVE, _positive, "a finite number > 0", source, f"{section}.")
            _check(params, SCALING_NUMBERS, _finite, "a finite number", source, f"{section}.")
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise UserError(f"{source}: 'num_attention_heads' ({heads}) must be a multiple of "
                        f"'num_key_value_heads' ({kv_heads})")
    if isinstance(config.get("text_config"), dict):
        check_fields(config["text_config"], f"{source}: text_config")


def _required(config: dict, key: str, source: str) -> Any:
    if config.get(key) is None:
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
    theta = scaling.pop("rope_theta", None) or config.get("rope_theta") or 10000.0
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
    if not isinstance(config, dict):
        raise UserError(f"{source}: expected a JSON object")
    model_type = _required(config, "model_type", source)
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise UserError(
            f"{source}: model_type '{model_type}' is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    check_fields(config, source)
    if config.get("use_sliding_window"):  # Qwen2's: windows on some layers only
        raise UserError(f"{source}: use_sliding_window (windows on some layers) is not supported yet")
    window = config.get("sliding_window") if model_type == "mistral" else None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise UserError(f"{source}: 'sliding_window' must be a positive integer or null, got {window!r}")
    hidden = int(_required(config, "hidden_size", source))
    heads = int(_required(config, "num_attention_heads", source))
    head_dim = int(config.get("head_dim") or hidden // heads)
    if head_dim < 1:
        raise UserError(f"{source}: 'hidden_size' ({hidden}) is less than 'num_attention_heads' ({heads}) "
                        "and no 'head_dim' is given")
    context = int(config.get("max_position_embeddings") or 32768)
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
        head_dim=head_dim,
        rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
        o_bias=attention_bias if o_bias is None else o_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=qk_norm,
        max_position_embeddings=context,
        quantization=config.get("quantization"),
        sliding_window=window if window and window < context else None,
        extra=config,
    )


# The family's whole config names layers that mlx-lm builds from a period (`sliding_window_pattern`,
# `full_attention_interval`): the layer type every period-th layer has.
PERIODIC = {"gemma3_text": ("sliding_window_pattern", "full_attention"),
            "qwen3_next": ("full_attention_interval", "full_attention"),
            "qwen3_5": ("full_attention_interval", "full_attention"),
            "qwen3_5_moe": ("full_attention_interval", "full_attention")}


def mlx_lm_config(config: dict) -> dict:
    """`config` as mlx-lm's argument classes read it (see the module docstring); a
    `text_config` inside (Qwen3.5's published form) likewise."""
    out = {k: _number(v) for k, v in config.items()}
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = mlx_lm_config({"model_type": out["model_type"], **out["text_config"]})
        if "vocab_size" in out["text_config"]:  # mlx-lm's gemma4 gives its text model the top level's (or its own)
            out.setdefault("vocab_size", out["text_config"]["vocab_size"])
    rope = out.get("rope_parameters")
    if isinstance(rope, dict):
        if "full_attention" in rope:  # per layer type (Gemma 3): the local layers' base apart
            out.setdefault("rope_local_base_freq", rope.get("sliding_attention", {}).get("rope_theta"))
            rope = rope["full_attention"]
        rope = dict(rope)
        out.setdefault("rope_theta", rope.pop("rope_theta", 10000.0))
        if "partial_rotary_factor" in rope:
            out.setdefault("partial_rotary_factor", rope.pop("partial_rotary_factor"))
        kind = rope.pop("rope_type", rope.pop("type", "default"))
        if kind != "default" and out.get("rope_scaling") is None:
            out["rope_scaling"] = {"type": kind, "rope_type": kind, **rope}
        out.setdefault("rope_scaling", None)  # (transformers 5 keeps none apart; some mlx-lm families require it)
    per_layer = out.get("per_layer_config")  # newer transformers write Gemma 4's global_head_dim so
    if isinstance(per_layer, dict) and "global_head_dim" not in out and isinstance(out.get("layer_types"), list):
        full = [v.get("head_dim") for i, v in per_layer.items() if out["layer_types"][int(i)] == "full_attention"]
        if full and full[0]:
            out["global_head_dim"] = full[0]
    if "num_local_experts" in out:
        out.setdefault("num_experts", out["num_local_experts"])
    if out.get("model_type") == "granitemoehybrid":
        out.setdefault("time_step_limit", (0.0, float("inf")))  # transformers' default (mlx-lm's is narrower)
        if isinstance(out.get("layer_types"), list):  # transformers 5's names for the published "mamba", "attention"
            names = {"linear_attention": "mamba", "full_attention": "attention"}
            out["layer_types"] = [names.get(t, t) for t in out["layer_types"]]
    if out.get("model_type") == "lfm2":  # transformers 5 writes no `block_dim` (the hidden size), which mlx-lm needs
        out.setdefault("block_dim", out.get("hidden_size"))
    period = PERIODIC.get(out.get("model_type"))
    if period and isinstance(out.get("layer_types"), list):
        field, kind = period
        types_ = out["layer_types"]
        every = next((p for p in range(1, len(types_) + 1)
                      if all((t == kind) == ((i + 1) % p == 0) for i, t in enumerate(types_))), None)
        if every is None:
            raise UserError(f"config.json: layer_types {types_}: mlx-lm builds {out['model_type']} with a "
                            f"'{kind}' layer every {field} layers, which these are not")
        out[field] = every
    return out


def _number(value):
    """A config value with the non-finite numbers transformers 5 writes as `{"__float__": "Infinity"}` read."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        return float(value["__float__"])
    if isinstance(value, list):
        return [_number(v) for v in value]
    return value
