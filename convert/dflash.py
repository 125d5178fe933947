"""z-lab's DFlash drafters -> a DFlash folder that `load_dflash` (and so
`--drafter dflash=OUT`) reads.

A published repo holds `config.json`, a Qwen3 body (`"model_type": "qwen3"`,
`"architectures": ["DFlashDraftModel"]`) with `dflash_config`
(`mask_token_id`, `target_layer_ids`) and `block_size` at the top level (the
Qwen3 and LLaMA drafts) or inside `dflash_config` (Qwen3.5 on), and one bf16
`model.safetensors` named as `DFlashNet`'s parameters, without a prefix (`fc`,
`hidden_norm`, `layers.{i}.*`, `norm`). The tensors are checked and written
unchanged; a re-export's `model.` prefix and vLLM's aliases are undone. The
config is kept as published (`DFlashNet` reads `block_size` in either place),
with the layer kinds written out when it lists none: z-lab's loader reads the
config through transformers' Qwen3Config, where `sliding_window` counts only
with `use_sliding_window` and, without `layer_types`, applies from layer
`max_window_layers` on.

DFlash 2 (`DFlash2DraftModel`) converts the same way, its convolutions and
candidate selector with it (the selector's bare codebooks named `.weight`), as
do the scalings Gemma 4 and DFlash 2 drafts set in `dflash_config`.

The speculators format (vllm-project/speculators: `speculators_model_type`
"dflash" or "dflash2", as RedHatAI publishes them) keeps the same tensors and
another config: the draft layers' in `transformer_layer_config`, the rest at
the top level, the target layers read as indices into transformers'
`hidden_states` (`aux_hidden_state_layer_ids`: z-lab's ids + 1). It is written
as z-lab's. Within a block, its sliding-window layers attend causally unless
`sliding_window_non_causal` (then every layer attends both ways, as DFlash's
full layers always do).

A speculators drafter with a draft vocabulary of its own (`draft_vocab_size`
below the target's) keeps its LM head over it (`lm_head`) and `d2t` (draft
token i is the target's i + d2t[i]); `t2d`, the way back, is not needed.

Refused, each in one line: any other drafter's own `lm_head` or `embed_tokens`
(DFlash uses the target's, and one a drafter ships may have been trained: vLLM
then uses it, so dropping it is not known to be safe); speculators' Domino
projector, `shift_label` and `sample_from_anchor` (other drafts than DFlash's),
and a DFlash 2 selector over a draft vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from mlx_spec import hub
from mlx_spec.convert.family import Converted, Source
from mlx_spec.weights import read_safetensors
from mlx_spec.drafters.dflash import DFlash2Net, DFlashNet, check_dflash_fits
from mlx_spec.drafters.dflash_layouts import is_dflash2, zlab_config
from mlx_spec.errors import UserError
from mlx_spec.models.config import parse_config
from mlx_spec.models.llama import Model
from mlx_spec.models.load import read_json

NAME = "dflash"
DESCRIPTION = "z-lab's DFlash drafters (DFlashDraftModel) in model.safetensors"
# load_dflash reads unquantized weights only.
QUANTIZABLE = False

WEIGHTS = ("model*.safetensors", "model.safetensors.index.json")

# Other spellings of z-lab's names: vLLM's aliases (after any `model.` prefix, which
# vLLM's loader puts on every weight).
_ALIASES = {"midlayer.": "layers.0.", "encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
_OWN_HEADS = ("lm_head.", "embed_tokens.")
_BOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")  # stored bare


def detect(source: Source) -> bool:
    config = source.config
    architectures = " ".join(map(str, config.get("architectures") or [])).lower()
    return "dflash" in architectures or "dflash_config" in config or \
        config.get("speculators_model_type") in ("dflash", "dflash2")


def fetch(source: Source) -> Path:
    # Just config and weights: not the remote code (dflash.py) nor the README.
    return hub.resolve(source.name, source.revision, ["config.json", *WEIGHTS])


def _ours(name: str) -> str:
    name = name.removeprefix("model.")
    if name in _BOOKS:
        return f"{name}.weight"
    for alias, ours in _ALIASES.items():
        if name.startswith(alias):
            return ours + name.removeprefix(alias)
    return name


def convert(path: Path, source: Source) -> Converted:
    config_path = path / "config.json"
    config = zlab_config(source.config, config_path)
    net = build(config, str(config_path))
    vocab = config.get("vocab_size")
    mask = net.settings["mask_token_id"]
    if isinstance(vocab, int) and mask >= vocab:
        raise UserError(
            f"{config_path}: dflash_config.mask_token_id {mask} is outside the vocabulary of {vocab} tokens (vocab_size)"
        )

    weights, origin = read_safetensors(path)
    files = sorted(set(origin.values()))
    file = files[0] if len(files) == 1 else path  # what messages about missing tensors name
    expected = {k: tuple(v.shape) for k, v in net.weights().items()}
    published: dict[str, str] = {}  # our name -> the file's
    for name in weights:
        ours = _ours(name)
        if ours == "t2d" and "d2t" in expected:
            continue
        if ours.startswith(_OWN_HEADS) and ours not in expected:
            raise UserError(
                f"{origin[name]}: tensor '{name}': the drafter ships its own embedding or LM head, which is not "
                "supported (DFlash uses the target's, and dropping a trained one would change the drafts)"
            )
        if ours in published:
            raise UserError(f"{origin[name]}: holds both '{published[ours]}' and '{name}' (the same tensor)")
        published[ours] = name

    for ours in sorted(published.keys() - expected.keys()):
        raise UserError(f"{origin[published[ours]]}: unexpected tensor '{published[ours]}' in a DFlash drafter")
    for ours in sorted(expected.keys() - published.keys()):
        raise UserError(f"{file}: lacks tensor '{ours}'")
    for ours, shape in expected.items():
        name = published[ours]
        value = weights[name]
        if tuple(value.shape) != shape:
            raise UserError(
                f"{origin[name]}: tensor '{name}' has shape {tuple(value.shape)}, config.json implies {shape}"
            )
        if not mx.issubdtype(value.dtype, mx.integer if ours == "d2t" else mx.floating):
            dtype = str(value.dtype).removeprefix("mlx.core.")
            raise UserError(f"{origin[name]}: tensor '{name}' is {dtype}, not "
                            f"{'integer' if ours == 'd2t' else 'floating point'}")
    return Converted(config, {k: weights[published[k]] for k in expected}, {k: origin[published[k]] for k in expected})


def build(config: dict, where: str = "config.json") -> DFlashNet:
    # parameters initialised lazily, never evaluated here
    return DFlash2Net(config, where) if is_dflash2(config) else DFlashNet(config, where)


def check_target(converted: Converted, path: Path, target: str) -> None:
    """The drafter reads the target's hidden states, embedding (the mask row
    included) and LM head."""
    target_path = hub.resolve(target, None, ["config.json"])  # its weights are not needed
    config = target_path / "config.json"
    args = parse_config(read_json(config), f"--target {target}: {config}")
    check_dflash_fits(build(converted.config), Model(args), f"--target {target}")
