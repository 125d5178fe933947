"""Extracting the MTP modules of a base checkpoint into an MTP folder (`mlx_spec.drafters.mtp`).

Only the shards that `model.safetensors.index.json` names for MTP tensors are
read. Three layouts (research notes, section 5):

- DeepSeek-V3: `model.layers.{L+k}.{enorm,hnorm,eh_proj,shared_head.{norm,head}}`
  plus that layer's decoder block; `embed_tokens` there duplicates the target's
  and is dropped.
- MiMo: `model.mtp_layers.{k}.{token_layernorm,hidden_layernorm,input_proj,final_layernorm}`
  plus the block; hidden state first in the concatenation.
- Qwen3-Next/3.5: `mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,norm}` and
  `mtp.layers.0.*`; RMSNorms are stored zero-centred (`1 + weight`), so 1 is added.

A Qwen3.5/3.6 block split out of its model by mlx-vlm (`qwen3_5_mtp` folders, what
mlx-community publishes as `*-MTP-*`) is read from its own folder (`read_extract`).

Dense blocks only; MoE blocks and FP8 weights are refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx

from mlx_spec.weights import read_safetensors_file
from mlx_spec.errors import UserError
from mlx_spec.drafters.mtp import MLX_LM_BLOCKS
from mlx_spec.models.mlxlm import stack_experts
from mlx_spec.files import write_model_files

# Layout -> (regex of a module tensor: module index, rest), renames of the non-block names.
PATTERNS = {
    "deepseek": (r"model\.layers\.(\d+)\.(.+)", {
        "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "shared_head.norm.weight": "norm.weight", "shared_head.head.weight": "head.weight",
        "embed_tokens.weight": None,
    }),
    "mimo": (r"model\.mtp_layers\.(\d+)\.(.+)", {
        "token_layernorm.weight": "enorm.weight", "hidden_layernorm.weight": "hnorm.weight",
        "input_proj.weight": "eh_proj.weight", "final_layernorm.weight": "norm.weight",
    }),
    "qwen3_next": (r"mtp\.()(.+)", {
        "pre_fc_norm_embedding.weight": "enorm.weight", "pre_fc_norm_hidden.weight": "hnorm.weight",
        "fc.weight": "eh_proj.weight", "norm.weight": "norm.weight",
    }),
}
BLOCK = re.compile(r"(input_layernorm|post_attention_layernorm|self_attn|mlp)\.")
# Architectures whose MTP block is one of our decoder layers.
# (Qwen3-Next's, Qwen3.5's and DeepSeek-V3's are layers of the model itself: mlx-lm's, `MLX_LM_BLOCKS`.)
BLOCK_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "mimo": "qwen2",
               "qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5",
               "deepseek_v3": "deepseek_v3"}


def detect_layout(names: list[str], target_config: dict) -> str | None:
    """Which layout a checkpoint's tensor names follow; None when it has no MTP modules."""
    L = int((target_config.get("text_config") or target_config).get("num_hidden_layers", -1))
    if any(n.startswith("mtp.") for n in names):
        return "qwen3_next"
    if any(n.startswith("model.mtp_layers.") for n in names):
        return "mimo"
    if any(n.startswith(f"model.layers.{L}.eh_proj.") for n in names):
        return "deepseek"
    return None


def _module_key(layout: str, name: str, L: int) -> tuple[int, str] | None:
    """(0-based module, name inside it) of an MTP tensor; None for the target's own."""
    match = re.fullmatch(PATTERNS[layout][0], name)
    if match is None:
        return None
    if layout == "deepseek":
        k = int(match.group(1)) - L
        return (k, match.group(2)) if k >= 0 else None
    if layout == "qwen3_next":
        rest = match.group(2)
        if rest.startswith("layers."):
            index, _, rest = rest[len("layers."):].partition(".")
            if index != "0":
                raise UserError(f"{name}: more than one Qwen3-Next MTP layer is not supported")
            return 0, rest
        return 0, rest
    return int(match.group(1)), match.group(2)


def _rename(layout: str, k: int, rest: str, source: str, experts: bool) -> str | None:
    """`experts`: the block is mlx-lm's layer, which may be a mixture of experts."""
    renames = PATTERNS[layout][1]
    if rest in renames:
        new = renames[rest]
        return None if new is None else f"layers.{k}.{new}"
    if BLOCK.match(rest):
        if not experts and rest.startswith("mlp.") and (
                rest.startswith(("mlp.experts.", "mlp.shared_expert")) or rest == "mlp.gate.weight"):
            raise UserError(f"{source}: tensor '{rest}' of MTP module {k} is a mixture-of-experts block; only dense MTP blocks are supported")
        if rest.endswith("weight_scale_inv"):
            raise UserError(f"{source}: tensor '{rest}' of MTP module {k} is FP8; convert the checkpoint to bf16 first")
        return f"layers.{k}.block.{rest}"
    raise UserError(f"{source}: unexpected MTP tensor '{rest}' in module {k} ({layout} layout)")


# A Qwen3.5/3.6 MTP block as mlx-vlm's splitter writes it (`model_type: qwen3_5_mtp`): its own names.
EXTRACT = {"pre_fc_norm_embedding.weight": "enorm.weight", "pre_fc_norm_hidden.weight": "hnorm.weight",
           "fc.weight": "eh_proj.weight", "norm.weight": "norm.weight"}


def read_extract(source_dir: Path) -> dict[str, mx.array]:
    """An MTP block split out of its model (mlx-community/Qwen3.5-4B-MTP-4bit, Qwen3.6-27B-MTP-bf16: the
    `mtp.` prefix gone, norms already plain, experts stacked as mlx-lm's, quantized or not), renamed as
    `MTPNet`'s; quantized layers dequantized (one block: what that costs in memory is small)."""
    from mlx_spec.models.load import read_json

    config = read_json(source_dir / "config.json")
    where = source_dir / "model.safetensors"
    if not where.exists():
        raise UserError(f"{source_dir}: no model.safetensors in a qwen3_5_mtp folder")
    tensors = read_safetensors_file(where)
    quantization = config.get("quantization") or {}
    out = {}
    for name, value in tensors.items():
        stem = name.removesuffix(".weight")
        if name.endswith((".scales", ".biases")):
            continue
        if f"{stem}.scales" in tensors:
            if not {"group_size", "bits"} <= set(quantization):
                raise UserError(f"{source_dir / 'config.json'}: '{name}' is quantized, and no 'quantization' says how")
            value = mx.dequantize(value, tensors[f"{stem}.scales"], tensors.get(f"{stem}.biases"),
                                  quantization["group_size"], quantization["bits"])
        if name in EXTRACT:
            out[f"layers.0.{EXTRACT[name]}"] = value
        elif name.startswith("layers.0."):
            out["layers.0.block." + name[len("layers.0."):]] = value
        else:
            raise UserError(f"{where}: tensor '{name}' is not one of a one-layer Qwen3.5 MTP block")
    return out


def read_mtp(source_dir: Path, target_config: dict) -> tuple[str, dict[str, mx.array]]:
    """(layout, MTP weights renamed as `MTPNet`'s), read from the shards that hold them."""
    from mlx_spec.models.load import read_json

    config = source_dir / "config.json"
    if config.exists() and read_json(config).get("model_type") == "qwen3_5_mtp":
        return "qwen3_next", read_extract(source_dir)
    index = source_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{index}: not a checkpoint index ({type(e).__name__}: {e})".splitlines()[0]) from None
    else:
        single = source_dir / "model.safetensors"
        if not single.exists():
            raise UserError(f"{source_dir}: no model.safetensors or model.safetensors.index.json")
        weight_map = dict.fromkeys(read_safetensors_file(single), single.name)
    layout = detect_layout(list(weight_map), target_config)
    if layout is None:
        raise UserError(f"{source_dir}: no MTP tensors (DeepSeek model.layers.L.eh_proj, MiMo model.mtp_layers, Qwen3-Next mtp.*)")
    L = int((target_config.get("text_config") or target_config)["num_hidden_layers"])
    block = BLOCK_TYPES.get(target_config.get("model_type"))
    keys = {name: key for name in weight_map if (key := _module_key(layout, name, L)) is not None}
    shards: dict[str, dict[str, mx.array]] = {}
    weights: dict[str, mx.array] = {}
    for name, (k, rest) in sorted(keys.items()):
        shard = weight_map[name]
        if shard not in shards:
            shards[shard] = read_safetensors_file(source_dir / shard)
        if name not in shards[shard]:
            raise UserError(f"{index}: lists '{name}' in {shard}, which does not hold it")
        new = _rename(layout, k, rest, f"{source_dir / shard}: '{name}'", block in MLX_LM_BLOCKS)
        if new is None:
            continue
        value = shards[shard][name]
        if layout == "qwen3_next" and new.endswith("norm.weight"):
            value = value + 1  # zero-centred RMSNorm -> plain
        weights[new] = value
    weights = stack_experts(weights)
    if block == "deepseek_v3":
        weights = _as_mlx_lm_deepseek(weights, target_config)
    return layout, weights


def _as_mlx_lm_deepseek(weights: dict[str, mx.array], target_config: dict) -> dict[str, mx.array]:
    """DeepSeek-V3 MTP blocks as mlx-lm's layer holds them: each module's block put through mlx-lm's own
    `sanitize` as a one-layer model's (it splits the latent attention's `kv_b_proj`)."""
    from types import SimpleNamespace

    from mlx_lm.models import deepseek_v3

    from mlx_spec.models.config import mlx_lm_config

    args = deepseek_v3.ModelArgs.from_dict({**mlx_lm_config(target_config), "num_hidden_layers": 1})
    out = {k: v for k, v in weights.items() if ".block." not in k}
    for k in sorted({name.split(".")[1] for name in weights if ".block." in name}):
        inside = f"layers.{k}.block."
        block = {"model.layers.0." + n[len(inside):]: v for n, v in weights.items() if n.startswith(inside)}
        block = deepseek_v3.Model.sanitize(SimpleNamespace(args=args), block)
        out.update({inside + n[len("model.layers.0."):]: v for n, v in block.items()})
    return out


def mtp_config(layout: str, weights: dict[str, mx.array], target_config: dict) -> dict:
    """The MTP folder's config: the target's block shape, one layer, the `mtp` section."""
    config = dict(target_config.get("text_config") or target_config)
    model_type = target_config.get("model_type")
    if model_type not in BLOCK_TYPES:
        raise UserError(f"config.json: MTP blocks of model_type '{model_type}' are not supported "
                        f"(supported: {', '.join(sorted(BLOCK_TYPES))})")
    config["model_type"] = BLOCK_TYPES[model_type]
    config["num_hidden_layers"] = 1
    config["tie_word_embeddings"] = False
    config.pop("quantization_config", None)
    n = 1 + max(int(name.split(".")[1]) for name in weights)
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    q = weights.get("layers.0.block.self_attn.q_proj.weight")
    if q is not None and q.shape[0] == 2 * heads * head_dim and config["model_type"] not in MLX_LM_BLOCKS:
        raise UserError("config.json: the MTP block uses gated attention (q_proj gives queries and gates); not supported")
    config["mtp"] = {"layout": layout, "num_modules": n, "hidden_first": layout == "mimo",
                     "has_head": "layers.0.head.weight" in weights}
    return config


def convert_mtp(source_dir: str | Path, out_dir: str | Path, target_config: dict | None = None) -> dict:
    """Write the MTP folder `out_dir` from the checkpoint `source_dir`; returns its config.
    `target_config` defaults to the checkpoint's own config.json."""
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    if target_config is None:
        from mlx_spec.models.load import read_json

        target_config = read_json(source_dir / "config.json")
    layout, weights = read_mtp(source_dir, target_config)
    config = mtp_config(layout, weights, target_config)
    write_model_files(out_dir, config, weights)
    return config


def target_mtp(path: Path, target, target_path: Path) -> "MTPNet":
    """The MTP modules in `path`, read from the shards that hold them: the target's own checkpoint (the
    folder `target_path`) or a block split out of it (`qwen3_5_mtp`), shaped by the target's config."""
    from mlx.utils import tree_flatten

    from mlx_spec.drafters.mtp import MTPNet
    from mlx_spec.models.load import check_weights, read_json

    target_config = read_json(target_path / "config.json")
    layout, weights = read_mtp(path, target_config)
    net = MTPNet(mtp_config(layout, weights, target_config), str(path / "config.json"))
    check_weights(dict(tree_flatten(net.parameters())), weights, {k: path for k in weights}, path, "MTP modules")
    dtype = mx.float32 if target.model.embed_tokens.weight.dtype == mx.float32 else None
    net.load_weights([(k, v.astype(dtype) if dtype else v) for k, v in weights.items()])
    mx.eval(net.parameters())
    return net
