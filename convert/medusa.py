"""FasterDecoding's Medusa-1 heads -> a Medusa folder that `load_medusa` (and so
`--drafter medusa=OUT`) reads.

A published repo holds `config.json` (`medusa_num_heads`, `medusa_num_layers`,
`base_model_name_or_path`) and `medusa_lm_head.pt` (a bf16 pickle, read here
without torch) or, from the training script, `medusa_lm_head.safetensors`. The
file is the `state_dict` of K heads of L residual blocks and an LM head:
`{k}.{j}.linear.weight` [H, H], `{k}.{j}.linear.bias` [H] (j < L) and
`{k}.{L}.weight` [V, H]; these names are kept as they are.

Medusa-2 repos (FasterDecoding's `medusa-1.0-*`) are a whole fine-tuned model
whose checkpoint also holds the heads, as `medusa_head.{k}.{j}...` beside
`model.*` and `lm_head.weight` (MedusaLlamaModel's `state_dict`); the heads are
read from its shards, the model being the target.

The configs are not to be trusted: vicuna's say 2 heads while the files hold 5
(FasterDecoding's loader hard-codes 5). So K and L come from the tensor names,
H and V from the shapes, and the config written says what the file holds.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx

from mlx_spec import hub
from mlx_spec.convert.family import Converted, Source
from mlx_spec.weights import Weights, read_safetensors_file, read_torch_file, read_weights
from mlx_spec.drafters.medusa import check_medusa_fits
from mlx_spec.drafters.medusa import MedusaHeads
from mlx_spec.errors import UserError
from mlx_spec.models.config import parse_config
from mlx_spec.models.llama import Model
from mlx_spec.models.load import read_json

NAME = "medusa"
DESCRIPTION = ("FasterDecoding's Medusa-1 heads in medusa_lm_head.safetensors or .pt, and the heads inside "
               "a Medusa-2 model")
# load_medusa reads unquantized weights only.
QUANTIZABLE = False

FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")  # the first present is read
PREFIX = "medusa_head."  # a Medusa-2 model's heads
FIELDS = ("medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size")

_BLOCK = re.compile(r"(\d+)\.(\d+)\.linear\.(?:weight|bias)")
_LM_HEAD = re.compile(r"(\d+)\.(\d+)\.weight")


def detect(source: Source) -> bool:
    return "medusa_num_heads" in source.config


def fetch(source: Source) -> Path:
    # One copy of the heads: the safetensors file when there is one; else a Medusa-2 model's shards.
    for name in FILES:
        path = hub.resolve(source.name, source.revision, ["config.json", name])
        if (path / name).exists():
            return path
    return hub.resolve(source.name, source.revision, ["*.json", "*.safetensors", "*.bin"])


def _read_heads(path: Path) -> tuple[Weights, dict[str, Path], Path]:
    """The heads' tensors under their Medusa-1 names, each one's file, and the file to name in messages."""
    for name in FILES:
        file = path / name
        if file.exists():
            weights = read_safetensors_file(file) if file.suffix == ".safetensors" else read_torch_file(file)
            return weights, {k: file for k in weights}, file
    model, origin = read_weights(path) if any(path.glob("*.safetensors")) or any(path.glob("*.bin")) else ({}, {})
    heads = {k.removeprefix(PREFIX): model[k] for k in model if k.startswith(PREFIX)}
    if not heads:
        raise UserError(f"{path}: no {' or '.join(FILES)}, and no '{PREFIX}*' tensors of a Medusa-2 model")
    return heads, {k.removeprefix(PREFIX): origin[k] for k in model if k.startswith(PREFIX)}, path


def _layout(weights: Weights, file: Path) -> tuple[int, int, int, int]:
    """(heads, layers, hidden size, vocabulary) the tensors hold; raises on any inconsistency."""
    heads: set[int] = set()
    lm_heads: dict[int, tuple[int, str]] = {}  # head -> (its LM weight's slot, that weight's name)
    for name in weights:
        if m := _BLOCK.fullmatch(name):
            heads.add(int(m[1]))
        elif m := _LM_HEAD.fullmatch(name):
            heads.add(int(m[1]))
            lm_heads[int(m[1])] = (int(m[2]), name)
        else:
            raise UserError(
                f"{file}: unexpected tensor '{name}' (Medusa heads hold "
                "'{k}.{j}.linear.weight', '{k}.{j}.linear.bias' and '{k}.{L}.weight')"
            )
    if not lm_heads:
        raise UserError(f"{file}: no head's LM weight ('{{k}}.{{L}}.weight'): not a Medusa head file")
    first = min(lm_heads)
    layers, first_name = lm_heads[first]
    for k, (slot, name) in sorted(lm_heads.items()):
        if slot != layers:
            raise UserError(
                f"{file}: head {k} has {slot} layers ('{name}'), head {first} has {layers} ('{first_name}'): "
                "every head must have the same layers"
            )
    shape = tuple(weights[first_name].shape)
    if len(shape) != 2:
        raise UserError(f"{file}: tensor '{first_name}' has shape {shape}, expected [vocabulary, hidden size]")
    vocab, hidden = shape
    num_heads = max(heads) + 1

    expected: dict[str, tuple[int, ...]] = {}
    for k in range(num_heads):
        for j in range(layers):
            expected[f"{k}.{j}.linear.weight"] = (hidden, hidden)
            expected[f"{k}.{j}.linear.bias"] = (hidden,)
        expected[f"{k}.{layers}.weight"] = (vocab, hidden)
    for name in expected:
        if name not in weights:
            raise UserError(f"{file}: lacks tensor '{name}' (it holds {num_heads} heads of {layers} layers)")
    for name in weights:
        if name not in expected:
            raise UserError(f"{file}: unexpected tensor '{name}' (it holds {num_heads} heads of {layers} layers)")
    for name, want in expected.items():
        value = weights[name]
        if tuple(value.shape) != want:
            raise UserError(
                f"{file}: tensor '{name}' has shape {tuple(value.shape)}, expected {want} "
                f"(hidden size {hidden} and vocabulary {vocab}, from '{first_name}')"
            )
        if not mx.issubdtype(value.dtype, mx.floating):
            dtype = str(value.dtype).removeprefix("mlx.core.")
            raise UserError(f"{file}: tensor '{name}' is {dtype}, not floating point")
    return num_heads, layers, hidden, vocab


def convert(path: Path, source: Source) -> Converted:
    weights, origin, file = _read_heads(path)
    layout = _layout(weights, file)
    config = {k: v for k, v in source.config.items() if k in ("base_model_name_or_path", "_name_or_path")}
    return Converted({**config, **dict(zip(FIELDS, layout))}, weights, origin)


def build(config: dict) -> MedusaHeads:
    """The heads, whose parameters are the published names under `heads.`."""
    return MedusaHeads(*(config[f] for f in FIELDS))


def check_target(converted: Converted, path: Path, target: str) -> None:
    """The heads read the target's final hidden state and predict its tokens."""
    target_path = hub.resolve(target, None, ["config.json"])  # its weights are not needed
    config = target_path / "config.json"
    args = parse_config(read_json(config), f"--target {target}: {config}")
    # Model(args) allocates nothing: MLX initialises parameters lazily and none is evaluated.
    check_medusa_fits(build(converted.config), Model(args), f"--target {target}")
