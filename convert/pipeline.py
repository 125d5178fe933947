"""`mlx-spec convert`: SOURCE (a directory or a Hub repo id) -> an MLX model directory.

SOURCE's config.json is fetched first; the first family in `FAMILIES` that
recognises them fetches just the files it needs and converts the weights; then
the dtype is set, the weights are quantized if asked, and OUT is written (MLX
safetensors, config.json with an "mlx_spec" section naming the family, and the
tokenizer files) all at once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_spec import hub
from mlx_spec.convert import dflash, eagle, llama, medusa
from mlx_spec.convert.family import Family, Source
from mlx_spec.convert.output import check_out, write_atomically
from mlx_spec.files import save_weights
from mlx_spec.errors import UserError
from mlx_spec.models.load import read_json

# Tried in order, the first match wins: drafter families whose configs also say
# "llama" or "qwen3" go before `llama`; DFlash, which its config names, before
# EAGLE, which reads tensor names to tell a one-layer Llama from a drafter.
FAMILIES: tuple[Family, ...] = (medusa, dflash, eagle.eagle3, eagle.eagle1, llama)

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def read_source(name: str, revision: str | None = None) -> Source:
    path = hub.resolve(name, revision, ["config.json"])
    config = read_json(path / "config.json") if (path / "config.json").exists() else {}
    return Source(name, revision, config)


def detect(source: Source) -> Family:
    for family in FAMILIES:
        if family.detect(source):
            return family
    model_type = source.config.get("model_type")
    found = f"config.json model_type '{model_type}'" if model_type else "no config.json with a model_type"
    known = "; ".join(f.DESCRIPTION for f in FAMILIES)
    raise UserError(f"{source.name}: not a checkpoint mlx-spec can convert ({found}; it converts {known})")


def _cast(weights: Mapping[str, mx.array], dtype: str | None) -> dict[str, mx.array]:
    """Floating weights to `dtype`; by default as stored, but float64 (which Metal
    lacks) as float32."""

    def target(d: mx.Dtype) -> mx.Dtype:
        return DTYPES[dtype] if dtype else (mx.float32 if d == mx.float64 else d)

    return {k: v.astype(target(v.dtype)) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}


def _read_all(weights: dict[str, mx.array], origin: dict[str, Path]) -> None:
    """Read every weight now, so a damaged file is reported (naming it) before OUT is touched."""
    for name, value in weights.items():
        try:
            mx.eval(value)
        except RuntimeError as e:
            raise UserError(f"{origin[name]}: reading weight '{name}' failed ({e})".splitlines()[0]) from None


def _quantize(model: nn.Module, weights: dict[str, mx.array], bits: int, group_size: int) -> dict[str, mx.array]:
    model.load_weights(list(weights.items()))

    # Layers whose input size the group size does not divide stay as they are;
    # load_model quantizes exactly the layers that come with scales.
    def predicate(path: str, module: nn.Module) -> bool:
        return hasattr(module, "to_quantized") and module.weight.shape[-1] % group_size == 0

    nn.quantize(model, group_size, bits, class_predicate=predicate)
    return dict(tree_flatten(model.parameters()))


def convert(
    source_name: str,
    out: Path,
    *,
    revision: str | None = None,
    target: str | None = None,
    dtype: str | None = None,
    q_bits: int | None = None,
    q_group_size: int = 64,
    force: bool = False,
    family: Family | None = None,
) -> str:
    """Convert SOURCE into OUT (as `family`, by default the one that recognises it); returns a one-line summary."""
    check_out(out, force)  # before downloading anything
    source = read_source(source_name, revision)
    family = family or detect(source)
    if q_bits and not getattr(family, "QUANTIZABLE", True):  # before anything big is fetched
        raise UserError(
            f"--quantize: {family.NAME} checkpoints cannot be quantized (they are loaded unquantized); convert without -q"
        )
    path = family.fetch(source)
    converted = family.convert(path, source)
    if q_bits and "quantization" in converted.config:
        raise UserError(f"--quantize: {source_name} is already quantized")
    if target:
        family.check_target(converted, path, target)
    config = dict(converted.config)
    weights = _cast(converted.weights, dtype)
    _read_all(weights, converted.origin)
    if dtype:
        for key in ("torch_dtype", "dtype"):  # transformers 4 and 5 spellings, where present
            if key in config:
                config[key] = dtype
    if q_bits:
        weights = _quantize(family.build(config), weights, q_bits, q_group_size)
        config["quantization"] = {"group_size": q_group_size, "bits": q_bits}
    config["mlx_spec"] = {"family": family.NAME, "source": source_name}
    if revision:
        config["mlx_spec"]["revision"] = revision
    if target:
        config["mlx_spec"]["target"] = target

    def fill(directory: Path) -> None:
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        save_weights(directory, weights)
        for f in converted.copy:
            shutil.copyfile(f, directory / f.name)

    write_atomically(out, fill, force)
    dtypes = sorted({str(v.dtype).removeprefix("mlx.core.") for v in weights.values() if mx.issubdtype(v.dtype, mx.floating)})
    quant = f", {q_bits}-bit groups of {q_group_size}" if q_bits else ""
    return f"{out}: {family.NAME} model from {source_name}, {len(weights)} tensors ({', '.join(dtypes)}{quant})"
