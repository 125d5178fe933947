"""Loading a target from a local directory or a Hub repo id."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_spec import hub
from mlx_spec.weights import read_safetensors
from mlx_spec.errors import UserError
from mlx_spec.models.config import ARCHITECTURES, parse_config
from mlx_spec.models.dtypes import compute_dtype
from mlx_spec.models.llama import Model


def read_json(path: Path) -> dict:
    if not path.exists():
        raise UserError(f"{path}: missing (not a model directory?)")
    try:
        data = json.loads(path.read_text())
    except OSError as e:  # a directory, unreadable
        raise UserError(f"{path}: cannot be read ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


def _quantize(model: Model, q: dict, weights: dict, source: Path) -> None:
    try:
        group_size, bits = int(q["group_size"]), int(q["bits"])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{source}: 'quantization' needs integer 'group_size' and 'bits'") from None

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if path in q:
            return q[path]
        return hasattr(module, "to_quantized") and f"{path}.scales" in weights

    nn.quantize(model, group_size, bits, mode=q.get("mode", "affine"), class_predicate=predicate)


def _add_lora(model: Model, lora: dict, source: Path) -> None:
    from mlx_lm.tuner.utils import linear_to_lora_layers

    try:
        config = {"rank": int(lora["rank"]), "scale": float(lora["scale"]), "dropout": 0.0}
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{source}: 'lora' needs a numeric 'rank' and 'scale'") from None
    linear_to_lora_layers(model, len(model.layers), config)


def _drafters(name: str, args) -> bool:
    """A drafter's tensor that ships inside the checkpoint, not the model's own:
    multi-token-prediction modules (DeepSeek's extra layers, MiMo's `mtp_layers`,
    Qwen3-Next's `mtp.*`), read by `--drafter mtp`, and a Medusa-2 model's heads,
    read by `--drafter medusa`."""
    if name.startswith(("mtp.", "model.mtp_layers.", "medusa_head.")):
        return True
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= args.num_hidden_layers


def checked_weights(
    config: dict, config_path: Path, weights: Mapping[str, mx.array], origin: dict[str, Path], path: Path
) -> tuple[Model, dict[str, mx.array]]:
    """The model `config` describes (quantized if it says so; weights not loaded)
    and the checkpoint's weights for it, checked: every name present, none extra,
    every shape as the config implies."""
    if "quantization" not in config and "quantization_config" in config:
        method = config["quantization_config"].get("quant_method", "?")
        raise UserError(f"{config_path}: quantization_config '{method}' is not supported; use an MLX-quantized checkpoint")
    args = parse_config(config, str(config_path))
    model = Model(args)
    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq") and not _drafters(k, args)}
    if args.tie_word_embeddings:
        weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
    if args.quantization:
        _quantize(model, args.quantization, weights, config_path)
    if "lora" in config:  # LoRA adapters kept apart from the base weights (mlx-spec distill/train)
        _add_lora(model, config["lora"], config_path)
    check_weights(dict(tree_flatten(model.parameters())), weights, origin, path, f"a {args.model_type} model")
    return model, weights


def check_weights(
    expected: Mapping[str, mx.array], weights: Mapping[str, mx.array], origin: dict[str, Path], path: Path, what: str
) -> None:
    """Every expected name present, none extra, every shape as the config implies."""
    for name in expected.keys() - weights.keys():
        raise UserError(f"{path}: checkpoint lacks weight '{name}'")
    for name in weights.keys() - expected.keys():
        raise UserError(f"{origin[name]}: unexpected weight '{name}' for {what}")
    for name, value in weights.items():
        if value.shape != expected[name].shape:
            raise UserError(
                f"{origin[name]}: weight '{name}' has shape {tuple(value.shape)}, "
                f"config.json implies {tuple(expected[name].shape)}"
            )


def load_model(path_or_repo: str, revision: str | None = None, for_training: bool = False,
               lazy: bool = False) -> tuple[Model, Path]:
    """Build the target described by `config.json` and load its safetensors.

    For inference the layers are compiled; `for_training` leaves them eager
    (compiled layers hold the weights they were traced with). `lazy`: the
    weights are read when first evaluated (a rank of a sharded target reads its
    share alone), and a damaged file is found then.
    """
    path = hub.resolve(path_or_repo, revision)
    config_path = path / "config.json"
    config = read_json(config_path)
    if config.get("model_type") not in ARCHITECTURES:  # the families mlx-lm implements, through its code
        from mlx_spec.models import mlxlm, whole

        family = mlxlm if config.get("model_type") in mlxlm.FAMILIES else whole
        return family.load(path, config, compute_dtype(), lazy), path
    weights, origin = read_safetensors(path)
    model, weights = checked_weights(config, config_path, weights, origin, path)
    _load_into(model, weights, path, lazy)
    if not for_training:
        model.compile()
    return model, path


def load_module_weights(module: nn.Module, path: Path, what: str) -> None:
    """Load `path`'s safetensors into `module` (a drafter), checked against its
    parameters (after the module's `sanitize`, where it has one: mlx-lm's convention for
    published names or dtypes that are not its own); floating weights in the compute dtype."""
    weights, origin = read_safetensors(path)
    if hasattr(module, "sanitize"):
        weights = module.sanitize(dict(weights))
    check_weights(dict(tree_flatten(module.parameters())), weights, origin, path, what)
    _load_into(module, weights, path)


def _load_into(module: nn.Module, weights: Mapping[str, mx.array], path: Path, lazy: bool = False) -> None:
    """Floating weights in the compute dtype, loaded and read now (a damaged file is reported here),
    or when first evaluated (`lazy`)."""
    dtype = compute_dtype()
    if dtype is not None:
        weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    module.load_weights(list(weights.items()))
    if lazy:
        return
    try:
        mx.eval(module.parameters())
    except RuntimeError as e:
        raise UserError(f"{path}: reading weights failed ({e})".splitlines()[0]) from None


def load_folder(path_or_repo: str, revision: str | None, build: Callable[[dict, str], nn.Module],
                section: str | None = None, hint: str = "") -> tuple[nn.Module, dict, Path]:
    """A drafter folder: `build(config, where)` makes the module, its safetensors
    load into it checked; `section`, when given, must be in config.json."""
    path = hub.resolve(path_or_repo, revision)
    config_path = path / "config.json"
    config = read_json(config_path)
    if section and not isinstance(config.get(section), dict):
        raise UserError(f"{config_path}: no '{section}' section ({hint})")
    module = build(config, str(config_path))
    load_module_weights(module, path, type(module).__name__)
    return module, config, path
