"""Which published drafter serves a target (each kind declares its repos: `Kind.published`).

`find_drafter("dflash", "Qwen/Qwen3-8B")` -> "z-lab/Qwen3-8B-DFlash-b16". A target
is matched by its model name, so mirrors and MLX conversions of it match too
("mlx-community/Qwen3-8B-4bit" is Qwen3-8B); `--model` aliases ("qwen3") too.
The demo target's drafters are the folders that ship with it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

from mlx_spec import demo, hub
from mlx_spec.errors import UserError
from mlx_spec.models.load import read_json

# Drafters trained on answers given without thinking (their model cards say so): with a template that
# thinks by default, their acceptance is higher under --no-think.
NON_THINKING = frozenset({"z-lab/Qwen3-4B-DFlash-b16", "z-lab/Qwen3-8B-DFlash-b16"})

# Suffixes that mirrors and conversions add to a model's name (mlx-community's "-4bit", "-4bit-DWQ-053125", ...).
_SUFFIX = re.compile(r"-(mlx|\d+bits?|bf16|fp16|fp8|float16|bfloat16|mxfp4|nvfp4|dwq|awq|gptq|int4|int8|q\d|\d{6})$")


def model_key(repo: str) -> str:
    """A model's name without owner, case, "Meta-" prefix or conversion suffixes."""
    name = repo.rstrip("/").split("/")[-1].lower()
    while (stripped := _SUFFIX.sub("", name)) != name:
        name = stripped
    return name.removeprefix("meta-")


def _target_name(target: str | Mapping) -> str:
    """The repo id a target comes from: given, or as its config.json records it."""
    if isinstance(target, str):
        target = hub.expand(target)
        path = Path(target).expanduser()
        if not path.is_dir():
            return target
        config, where = read_json(path / "config.json"), str(path / "config.json")
    else:
        config, where = target, "target config"
    section = config.get("mlx_spec")
    name = (section.get("source") if isinstance(section, Mapping) else None) or config.get("_name_or_path")
    if isinstance(name, str) and name:
        return name
    if isinstance(target, Mapping):
        raise UserError(f"{where}: cannot tell which model it is (no 'mlx_spec.source' or '_name_or_path')")
    # A Hub snapshot (models--OWNER--NAME/snapshots/COMMIT) says its repo; any other folder, its name.
    snapshot = next((p.name for p in path.resolve().parents if p.name.startswith("models--")), None)
    return snapshot.removeprefix("models--").replace("--", "/") if snapshot else path.resolve().name


def is_demo(target: str | Mapping) -> bool:
    """Whether `target` is the demo target that ships with mlx-spec."""
    try:
        return model_key(_target_name(target)) == model_key(demo.NAME)
    except UserError:  # a model that does not say what it is: not the demo
        return False


def holds_medusa_heads(target: str) -> bool:
    """Whether `target` is a Medusa-2 model folder, holding its own heads."""
    path = Path(hub.expand(target)).expanduser()
    return path.is_dir() and (path / "config.json").exists() and "medusa_num_heads" in read_json(path / "config.json")


def find(kind: str, published: Mapping[str, tuple[str, ...]], target: str | Mapping) -> str:
    """The drafter of `kind` published for `target` (a repo id, a model directory or a config), from `published`
    (target repo -> drafter repos); the demo's own for the demo target."""
    name = _target_name(target)
    key = model_key(name)
    if key == model_key(demo.NAME) and kind in demo.DRAFTERS:
        return str(demo.path(demo.DRAFTERS[kind]))
    if kind == "medusa" and isinstance(target, str) and holds_medusa_heads(target):
        return hub.expand(target)  # a Medusa-2 model: its own heads
    # The model itself, else the base it was fine-tuned from ("qwen3-4b-instruct-2507" is Qwen3-4B's):
    # the longest known name it starts with. The drafter's loader checks that it fits.
    bases = [known for known in published if key == model_key(known) or key.startswith(model_key(known) + "-")]
    if bases:
        return published[max(bases, key=lambda known: len(model_key(known)))][0]
    known_names = ", ".join(known.split("/")[-1] for known in published)
    raise UserError(f"{name}: no published {kind} drafter is known for it (known targets: {known_names or 'none'})")
