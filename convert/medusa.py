"""FasterDecoding's Medusa-1 heads -> a Medusa folder that `load_medusa` (and so
`--drafter medusa=OUT`) reads.

A published repo holds `config.json` (`medusa_num_heads`, `medusa_num_layers`,
`base_model_name_or_path`) and `medusa_lm_head.pt` (a bf16 pickle, read here
without torch) or, from the training script, `medusa_lm_head.safetensors`. The
file is the `state_dict` of K heads of L residual blocks and an LM head:
`{k}.{j}.linear.weight` [H, H], `{k}.{j}.linear.bias` [H] (j < L) and
`{k}.{L}.weight` [V, H]; these names are kept as they are.

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
from mlx_spec.weights import Weights, read_safetensors_file, read_torch_file
from mlx_spec.drafters.medusa import check_medusa_fits
from mlx_spec.drafters.medusa import MedusaHeads
from mlx_spec.errors import UserError
from mlx_spec.models.config import parse_config
from mlx_spec.models.llama import Model
from mlx_spec.models.load import read_json

NAME = "medusa"
DESCRIPTION = "FasterDecoding's Medusa-1 heads in medusa_lm_head.safetensors or .pt"
# load_medusa reads unquantized weights only.
QUANTIZABLE = False

FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")  # the first present is read
FIELDS = ("medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size")

_BLOCK = re.compile(r"(\d+)\.(\d+)\.linear\.(?:weight|bias)")
_LM_HEAD = re.compile(r"(\d+)\.(\d+)\.weight")


def detect(source: Source) -> bool:
    return "medusa_num_heads" in source.config


def fetch(source: Source) -> Path:
    # One copy of the heads: the safetensors file when there is one.
    for name in FILES:
        path = hub.resolve(source.name, source.revision, ["config.json", name])
        if (path / name).exists():
            return path
    return path  # holds neither: `convert` says so


def _heads_file(path: Path) -> Path:
    for name in FILES:
        if (path / name).exists():
            return path / name
    raise UserError(
        f"{path}: no {' or '.join(FILES)} (Medusa-2 models, whose heads sit inside the base "
        "model's checkpoint, are not supported)"
    )


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
    file = _heads_file(path)
    weights = read_safetensors_file(file) if file.suffix == ".safetensors" else read_torch_file(file)
    layout = _layout(weights, file)
    config = {**source.config, **dict(zip(FIELDS, layout))}
    return Converted(config, weights, {name: file for name in weights})


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
