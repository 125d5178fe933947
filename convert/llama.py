"""A plain Llama / Mistral / Qwen2 / Qwen3 checkpoint -> a model directory that
`mlx_spec.models.load_model` loads, as a target or as a draft model.

Weights come from safetensors or from `pytorch_model.bin` (sharded or not; read
without torch); names already match our modules (Hugging Face names), so
conversion is reading, checking and re-writing them.
"""

from __future__ import annotations

from pathlib import Path

import mlx.nn as nn

from mlx_spec import hub
from mlx_spec.convert.family import Converted, Source
from mlx_spec.weights import read_weights
from mlx_spec.errors import UserError
from mlx_spec.models.config import ARCHITECTURES, parse_config
from mlx_spec.files import SIDE_FILES, side_files
from mlx_spec.models.llama import Model
from mlx_spec.models.load import checked_weights, read_json

NAME = "llama"
DESCRIPTION = f"{'/'.join(sorted(ARCHITECTURES))} models in safetensors or pytorch_model.bin"

SAFETENSORS = ("model*.safetensors", "model.safetensors.index.json")
TORCH = ("pytorch_model*.bin", "pytorch_model.bin.index.json")


def detect(source: Source) -> bool:
    # Drafters reuse these model types (a DFlash draft says "qwen3"); their
    # architectures are not "...ForCausalLM".
    architectures = source.config.get("architectures") or ["ForCausalLM"]
    return source.config.get("model_type") in ARCHITECTURES and all(
        isinstance(a, str) and a.endswith("ForCausalLM") for a in architectures
    )


def fetch(source: Source) -> Path:
    # Many repos hold the weights twice (safetensors and .bin): fetch one copy,
    # safetensors when there are any.
    path = hub.resolve(source.name, source.revision, ["config.json", *SIDE_FILES, *SAFETENSORS])
    if not any(path.glob("model*.safetensors")):
        path = hub.resolve(source.name, source.revision, ["config.json", *SIDE_FILES, *TORCH])
    return path


def convert(path: Path, source: Source) -> Converted:
    weights, origin = read_weights(path)
    _, weights = checked_weights(source.config, path / "config.json", weights, origin, path)
    copy = side_files(path)  # written out next to the weights, as they are
    return Converted(dict(source.config), weights, origin, copy)


def build(config: dict) -> nn.Module:
    return Model(parse_config(config))


def check_target(converted: Converted, path: Path, target: str) -> None:
    """A draft model reads no hidden states of the target, so its hidden size is
    its own; its vocabulary must be the target's: the same token -> id map (its
    embedding may be padded to a different number of rows)."""
    from mlx_spec.tokenizer import load_tokenizer  # imports transformers: only when asked

    target_path = hub.resolve(target, None, ["config.json", *SIDE_FILES])
    if any(f.name.startswith("tokenizer") for f in converted.copy):
        ours, theirs = load_tokenizer(path).get_vocab(), load_tokenizer(target_path).get_vocab()
        if ours != theirs:
            raise UserError(
                f"--target {target}: its tokenizer differs from the draft's "
                f"({len(theirs)} vs {len(ours)} tokens); a draft model must share the target's vocabulary"
            )
        return
    # No tokenizer to compare: the embedding sizes are all there is to go on.
    theirs = read_json(target_path / "config.json").get("vocab_size")
    if theirs != converted.config.get("vocab_size"):
        raise UserError(
            f"--target {target}: vocab_size {theirs} differs from the draft's {converted.config.get('vocab_size')}"
        )
