"""Published drafters for known targets (from research/checkpoint-formats.md).

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

# kind -> target repo -> drafter repos, the first being the one `find_drafter` returns
DRAFTERS: dict[str, dict[str, tuple[str, ...]]] = {
    "dflash": {
        "Qwen/Qwen3-4B": ("z-lab/Qwen3-4B-DFlash-b16",),
        "Qwen/Qwen3-8B": ("z-lab/Qwen3-8B-DFlash-b16",),
        "Qwen/Qwen3-Coder-30B-A3B-Instruct": ("z-lab/Qwen3-Coder-30B-A3B-DFlash",),
        "Qwen/Qwen3-Coder-Next": ("z-lab/Qwen3-Coder-Next-DFlash",),
        "meta-llama/Llama-3.1-8B-Instruct": ("z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat",),
        "openai/gpt-oss-20b": ("z-lab/gpt-oss-20b-DFlash",),
        "openai/gpt-oss-120b": ("z-lab/gpt-oss-120b-DFlash",),
        "Qwen/Qwen3.5-4B": ("z-lab/Qwen3.5-4B-DFlash",),
        "Qwen/Qwen3.5-9B": ("z-lab/Qwen3.5-9B-DFlash",),
        "Qwen/Qwen3.5-27B": ("z-lab/Qwen3.5-27B-DFlash",),
        "Qwen/Qwen3.5-35B-A3B": ("z-lab/Qwen3.5-35B-A3B-DFlash",),
        "Qwen/Qwen3.5-122B-A10B": ("z-lab/Qwen3.5-122B-A10B-DFlash",),
        "Qwen/Qwen3.5-397B-A17B": ("z-lab/Qwen3.5-397B-A17B-DFlash",),
        "Qwen/Qwen3.6-27B": ("z-lab/Qwen3.6-27B-DFlash",),
        "Qwen/Qwen3.6-35B-A3B": ("z-lab/Qwen3.6-35B-A3B-DFlash",),
        "moonshotai/Kimi-K2.5": ("z-lab/Kimi-K2.5-DFlash",),
        "google/gemma-4-31B-it": ("z-lab/gemma-4-31B-it-DFlash",),
        "google/gemma-4-26B-A4B-it": ("z-lab/gemma-4-26B-A4B-it-DFlash",),
    },
    "eagle3": {
        "lmsys/vicuna-13b-v1.3": ("yuhuili/EAGLE3-Vicuna1.3-13B",),
        "meta-llama/Llama-3.1-8B-Instruct": (
            "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
            "lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B",
            "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3",
        ),
        "meta-llama/Llama-3.3-70B-Instruct": ("yuhuili/EAGLE3-LLaMA3.3-Instruct-70B",),
        "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": ("yuhuili/EAGLE3-DeepSeek-R1-Distill-LLaMA-8B",),
        "Qwen/Qwen3-1.7B": ("AngelSlim/Qwen3-1.7B_eagle3",),
        "Qwen/Qwen3-4B": ("AngelSlim/Qwen3-4B_eagle3",),
        "Qwen/Qwen3-8B": ("AngelSlim/Qwen3-8B_eagle3", "Tengyunw/qwen3_8b_eagle3", "Zjcxy-SmartAI/Eagle3-Qwen3-8B-zh"),
        "Qwen/Qwen3-14B": ("AngelSlim/Qwen3-14B_eagle3",),
        "Qwen/Qwen3-32B": ("AngelSlim/Qwen3-32B_eagle3",),
        "openai/gpt-oss-120b": ("lmsys/EAGLE3-gpt-oss-120b-bf16", "nvidia/gpt-oss-120b-Eagle3"),
    },
    "eagle": {  # EAGLE-1 weights, also decoded EAGLE-2 style (dynamic trees)
        "lmsys/vicuna-7b-v1.3": ("yuhuili/EAGLE-Vicuna-7B-v1.3",),
        "lmsys/vicuna-13b-v1.3": ("yuhuili/EAGLE-Vicuna-13B-v1.3",),
        "lmsys/vicuna-33b-v1.3": ("yuhuili/EAGLE-Vicuna-33B-v1.3",),
        "meta-llama/Llama-2-7b-chat-hf": ("yuhuili/EAGLE-llama2-chat-7B",),
        "meta-llama/Llama-2-13b-chat-hf": ("yuhuili/EAGLE-llama2-chat-13B",),
        "meta-llama/Llama-2-70b-chat-hf": ("yuhuili/EAGLE-llama2-chat-70B",),
        "mistralai/Mixtral-8x7B-Instruct-v0.1": ("yuhuili/EAGLE-mixtral-instruct-8x7B",),
        "meta-llama/Meta-Llama-3-8B-Instruct": ("yuhuili/EAGLE-LLaMA3-Instruct-8B",),
        "meta-llama/Meta-Llama-3-70B-Instruct": ("yuhuili/EAGLE-LLaMA3-Instruct-70B",),
        "meta-llama/Llama-3.1-8B-Instruct": ("yuhuili/EAGLE-LLaMA3.1-Instruct-8B",),
        "Qwen/Qwen2-7B-Instruct": ("yuhuili/EAGLE-Qwen2-7B-Instruct",),
        "Qwen/Qwen2-72B-Instruct": ("yuhuili/EAGLE-Qwen2-72B-Instruct",),
    },
    "medusa": {
        "lmsys/vicuna-7b-v1.3": ("FasterDecoding/medusa-vicuna-7b-v1.3",),
        "lmsys/vicuna-13b-v1.3": ("FasterDecoding/medusa-vicuna-13b-v1.3",),
        "lmsys/vicuna-33b-v1.3": ("FasterDecoding/medusa-vicuna-33b-v1.3",),
        # Medusa-2: a fine-tuned model holding its own heads, so the target is the repo itself
        **{repo: (repo,) for repo in ("FasterDecoding/medusa-1.0-vicuna-7b-v1.5", "FasterDecoding/medusa-1.0-vicuna-13b-v1.5",
                                      "FasterDecoding/medusa-1.0-vicuna-33b-v1.3", "FasterDecoding/medusa-1.0-zephyr-7b-beta")},
    },
}

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


def _holds_medusa_heads(target: str) -> bool:
    path = Path(hub.expand(target)).expanduser()
    return path.is_dir() and (path / "config.json").exists() and "medusa_num_heads" in read_json(path / "config.json")


def find_drafter(kind: str, target: str | Mapping) -> str:
    """The published `kind` drafter for `target` (a repo id, a model directory or a config)."""
    name = _target_name(target)
    key = model_key(name)
    if key == model_key(demo.NAME) and kind in demo.DRAFTERS:
        return str(demo.path(demo.DRAFTERS[kind]))
    if kind not in DRAFTERS:
        raise UserError(f"drafter kind '{kind}' is unknown (known: {', '.join(sorted(DRAFTERS))})")
    if kind == "medusa" and isinstance(target, str) and _holds_medusa_heads(target):
        return hub.expand(target)  # a Medusa-2 model: its own heads
    # The model itself, else the base it was fine-tuned from ("qwen3-4b-instruct-2507" is Qwen3-4B's):
    # the longest known name it starts with. The drafter's loader checks that it fits.
    bases = [known for known in DRAFTERS[kind] if key == model_key(known) or key.startswith(model_key(known) + "-")]
    if bases:
        return DRAFTERS[kind][max(bases, key=lambda known: len(model_key(known)))][0]
    known_names = ", ".join(known.split("/")[-1] for known in DRAFTERS[kind])
    raise UserError(f"{name}: no published {kind} drafter is known for it (known targets: {known_names})")
