"""Published EAGLE drafters -> an EAGLE folder that `load_eagle` (and so
`--drafter eagle=OUT` / `--drafter eagle3=OUT`) reads. Two families:

- `eagle1` (NAME "eagle"): yuhuili's EAGLE-1 weights (also what EAGLE-2
  decodes with): `config.json`, a plain Llama config of one layer (`"bias":
  false` when `fc` has no bias; absent means it has one), and
  `pytorch_model.bin` (fp32 or fp16) holding `embed_tokens.weight`, `fc.*` and
  `layers.0.*` without an input norm; no final norm, no LM head.
- `eagle3` (NAME "eagle3"): yuhuili's `pytorch_model.bin` and SpecForge's /
  AngelSlim's `model.safetensors` (`fc`, `midlayer.*`, `norm`, `lm_head`,
  `d2t`, `t2d`, optionally `embed_tokens`), and the speculators format (config
  under `transformer_layer_config`, the layer named `layers.0.*`).

The drafter borrows the target's embedding (and, for EAGLE-1, its LM head), so
`embed_tokens.weight` is checked and dropped; so is `t2d`, which inference does
not use. `d2t` becomes int32; without a reduced vocabulary (`draft_vocab_size`
absent) it is written as zeros. The configs are not trusted where published
ones are known to be wrong: the head size comes from `q_proj.weight` and the
target's hidden size from `fc.weight`.

EAGLE-3's taps: `eagle_config.eagle_aux_hidden_state_layer_ids` (yuhuili,
SpecForge) number layer OUTPUTS as SGLang, which serves them, reads them
(DeepSeek-V3's [1, 29, 57] are the default inputs of layers 2, 30, 58), so they
are shifted by one into our `layers` (Hugging Face hidden_states indices); the
speculators format's top-level ids are already such indices (vLLM's reading).

yuhuili publishes both versions with a plain `LlamaForCausalLM` config, so
such a config of one layer is told from a one-layer Llama by its tensor names
(`fc.weight`; `lm_head.weight` or `d2t` for EAGLE-3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import mlx.core as mx
import numpy as np

from mlx_spec import hub
from mlx_spec.convert import llama
from mlx_spec.convert.family import Converted, Source
from mlx_spec.weights import read_weights
from mlx_spec.drafters.eagle import EagleNet, check_eagle_fits
from mlx_spec.errors import UserError
from mlx_spec.models.config import ModelArgs, parse_config
from mlx_spec.models.llama import Model
from mlx_spec.models.load import read_json

# speculators variants with extra norms around `fc` or on the output: not supported.
_VARIANTS = ("fc_norm", "norm_before_fc", "norm_output")


def _declared(config: dict) -> int | None:
    """The EAGLE version a config names outright (SGLang / speculators configs do)."""
    if config.get("speculators_model_type") == "eagle3":
        return 3
    architectures = " ".join(map(str, config.get("architectures") or [])).lower()
    if "eagle3" in architectures or "draft_vocab_size" in config or "eagle_config" in config:
        return 3
    return None


def _version(source: Source) -> int | None:
    """1 or 3 for an EAGLE drafter, None for anything else."""
    if (version := _declared(source.config)) is not None:
        return version
    if not llama.detect(source) or source.config.get("num_hidden_layers") != 1:
        return None
    weights, _ = read_weights(llama.fetch(source))  # names only: no tensor is read
    if "fc.weight" not in weights:
        return None  # a one-layer Llama
    return 3 if "lm_head.weight" in weights or "d2t" in weights else 1


def _flatten(config: dict) -> dict:
    """The draft layer's config with the EAGLE fields beside it (the speculators
    format nests the layer's under `transformer_layer_config`)."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return dict(config)
    outer = {k: v for k, v in config.items() if k not in ("transformer_layer_config", "speculators_config")}
    return {**outer, **layer}


class _Checkpoint:
    """A drafter's tensors under our names, with the file's names for messages."""

    def __init__(self, path: Path, weights: Mapping[str, mx.array], origin: dict[str, Path]):
        self.weights, self.origin = weights, origin
        files = sorted(set(origin.values()))
        self.file = files[0] if len(files) == 1 else path  # what messages about missing tensors name
        self.published: dict[str, str] = {}  # our name -> the file's
        self.layer_prefix = "midlayer."  # how the file names EAGLE-3's layer
        self._read: dict[str, mx.array] = {}  # looked up once: a .bin's tensors are copied out at each lookup

    def add(self, ours: str, name: str) -> None:
        if ours in self.published:
            raise UserError(f"{self.origin[name]}: holds both '{self.published[ours]}' and '{name}' (the same tensor)")
        self.published[ours] = name

    def get(self, ours: str) -> mx.array:
        if ours not in self.published:
            spelled = self.layer_prefix + ours.removeprefix("midlayer.") if ours.startswith("midlayer.") else ours
            raise UserError(f"{self.file}: lacks tensor '{spelled}'")
        if ours not in self._read:
            self._read[ours] = self.weights[self.published[ours]]
        return self._read[ours]

    def fail(self, ours: str, problem: str) -> UserError:
        name = self.published[ours]
        return UserError(f"{self.origin[name]}: tensor '{name}' {problem}")


def _head_dim(ckpt: _Checkpoint, q_name: str, args: ModelArgs) -> int:
    """From `q_proj.weight`: published configs' `head_dim` can be wrong."""
    rows = ckpt.get(q_name).shape[0]
    if rows % args.num_attention_heads:
        raise ckpt.fail(q_name, f"has {rows} rows, not a multiple of num_attention_heads {args.num_attention_heads}")
    return rows // args.num_attention_heads


def _checked(ckpt: _Checkpoint, config: dict, config_path: Path, dropped: dict[str, tuple[int, ...]]) -> dict[str, mx.array]:
    """The drafter's weights: every one present, of the shape `config` implies and
    floating point, none extra. `dropped`: published tensors left out, whose shapes
    are checked all the same."""
    net = EagleNet(config, str(config_path))
    expected = {k: tuple(v.shape) for k, v in net.weights().items()}
    for ours in ckpt.published.keys() - expected.keys() - dropped.keys():
        raise ckpt.fail(ours, f"is unexpected in an EAGLE-{net.version} drafter")
    why = f"config.json: hidden size {config['hidden_size']}, vocabulary {config['vocab_size']}"
    weights = {}
    for ours, shape in {**expected, **dropped}.items():
        if ours == "d2t":
            continue  # see _d2t
        value = ckpt.get(ours)
        if tuple(value.shape) != shape:
            raise ckpt.fail(ours, f"has shape {tuple(value.shape)}, expected {shape} ({why})")
        if not mx.issubdtype(value.dtype, mx.floating):
            raise ckpt.fail(ours, f"is {_dtype(value)}, not floating point")
        if ours in expected:
            weights[ours] = value
    return weights


def _dtype(value: mx.array) -> str:
    return str(value.dtype).removeprefix("mlx.core.")


def _d2t(ckpt: _Checkpoint, draft_vocab: int, vocab: int) -> mx.array:
    """Draft id i is target id i + d2t[i]: distinct ids of the target's vocabulary."""
    if draft_vocab == vocab:
        return mx.zeros((vocab,), dtype=mx.int32)  # the full vocabulary: d2t is not used
    d2t = ckpt.get("d2t")
    if tuple(d2t.shape) != (draft_vocab,):
        raise ckpt.fail("d2t", f"has shape {tuple(d2t.shape)}, expected ({draft_vocab},) (the draft vocabulary)")
    if not mx.issubdtype(d2t.dtype, mx.integer):
        raise ckpt.fail("d2t", f"is {_dtype(d2t)}, not integer")
    ids = np.arange(draft_vocab) + np.array(d2t, dtype=np.int64)
    if ids.min() < 0 or ids.max() >= vocab or np.unique(ids).size != draft_vocab:
        raise ckpt.fail("d2t", f"maps draft ids outside the target's 0..{vocab - 1}, or two to one id")
    return d2t.astype(mx.int32)


def _read(path: Path, config: dict, version: int) -> tuple[_Checkpoint, ModelArgs, dict[str, tuple[int, ...]]]:
    """The checkpoint's tensors under our names (EAGLE-3's layer as `midlayer.*`),
    and those set aside: the shipped embedding (shape checked) and `t2d`."""
    args = parse_config(config, str(path / "config.json"))
    weights, origin = read_weights(path)
    ckpt = _Checkpoint(path, weights, origin)
    dropped = {"embed_tokens.weight": (args.vocab_size, args.hidden_size)}  # a copy of the target's
    for name in weights:
        if name.endswith("rotary_emb.inv_freq") or name == "t2d":
            continue  # a RoPE buffer older transformers saved; t2d, unused at inference
        if version == 3 and name.startswith("layers.0."):  # speculators' spelling
            ckpt.layer_prefix = "layers.0."
            ckpt.add("midlayer." + name.removeprefix("layers.0."), name)
        else:
            ckpt.add(name, name)
    if "embed_tokens.weight" not in ckpt.published:
        dropped.clear()  # optional: the target's is used
    return ckpt, args, dropped


def _convert1(path: Path, source: Source) -> Converted:
    config = dict(source.config)
    ckpt, args, dropped = _read(path, config, 1)
    fc_bias = bool(config.get("bias", True))  # as yuhuili's loader reads it
    if fc_bias and "fc.bias" not in ckpt.published:
        raise UserError(f"{ckpt.file}: lacks tensor 'fc.bias' (config.json does not say \"bias\": false)")
    config.update(
        num_hidden_layers=1,
        head_dim=_head_dim(ckpt, "layers.0.self_attn.q_proj.weight", args),
        tie_word_embeddings=False,
        eagle={"version": 1, "fc_bias": fc_bias},
    )
    weights = _checked(ckpt, config, path / "config.json", dropped)
    return Converted(config, weights, {k: ckpt.origin[ckpt.published[k]] for k in weights})


def _taps(config: dict, config_path: Path) -> list[int]:
    """Our `layers` (hidden_states indices) from either spelling; [] for the default."""
    if "eagle_aux_hidden_state_layer_ids" in config:  # speculators: already indices
        ids, shift = config["eagle_aux_hidden_state_layer_ids"], 0
    else:  # SGLang's reading: layer outputs
        ids, shift = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"), 1
    if ids is None:
        return []
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
        raise UserError(f"{config_path}: eagle_aux_hidden_state_layer_ids must be a list of layer numbers, got {ids!r:.60}")
    return [i + shift for i in ids]


def _convert3(path: Path, source: Source) -> Converted:
    config = _flatten(source.config)
    config_path = path / "config.json"
    for key in _VARIANTS:
        if config.get(key):
            raise UserError(f"{config_path}: '{key}' (a speculators EAGLE-3 variant) is not supported")
    if (config.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
        raise UserError(f"{config_path}: eagle_config.use_aux_hidden_state false (no fc) is not supported")
    ckpt, args, dropped = _read(path, config, 3)
    draft_vocab = int(config.get("draft_vocab_size") or args.vocab_size)
    layers = _taps(config, config_path)
    fc = ckpt.get("fc.weight")
    taps = len(layers) or 3
    if fc.ndim != 2 or fc.shape[1] % taps:
        raise ckpt.fail("fc.weight", f"has shape {tuple(fc.shape)}; its input must be {taps} target hidden states")
    target_hidden = fc.shape[1] // taps
    if config.get("target_hidden_size") not in (None, target_hidden):
        raise ckpt.fail(
            "fc.weight", f"reads {taps} x {target_hidden} features, config.json's target_hidden_size is "
            f"{config['target_hidden_size']}"
        )
    eagle: dict = {"version": 3, "target_hidden_size": target_hidden, "draft_vocab_size": draft_vocab,
                   "norm_before_residual": bool(config.get("norm_before_residual", False))}
    if layers:
        eagle["layers"] = layers
    config.update(
        num_hidden_layers=1,
        head_dim=_head_dim(ckpt, "midlayer.self_attn.q_proj.weight", args),
        tie_word_embeddings=False,
        eagle=eagle,
    )
    weights = _checked(ckpt, config, config_path, dropped)
    weights["d2t"] = _d2t(ckpt, draft_vocab, args.vocab_size)
    origin = {k: ckpt.origin[ckpt.published[k if k in ckpt.published else "fc.weight"]] for k in weights}
    return Converted(config, weights, origin)


class EagleFamily:
    """One EAGLE version as a `convert.family.Family`."""

    QUANTIZABLE = False  # load_eagle reads unquantized weights only

    def __init__(self, version: int):
        self.version = version
        self.NAME = "eagle" if version == 1 else "eagle3"
        self.DESCRIPTION = (
            "yuhuili's EAGLE-1 drafters (pytorch_model.bin)"
            if version == 1
            else "EAGLE-3 drafters (yuhuili, SpecForge, speculators)"
        )

    def detect(self, source: Source) -> bool:
        return _version(source) == self.version

    def fetch(self, source: Source) -> Path:
        return llama.fetch(source)  # config.json and one copy of the weights

    def convert(self, path: Path, source: Source) -> Converted:
        return _convert1(path, source) if self.version == 1 else _convert3(path, source)

    def build(self, config: dict) -> EagleNet:
        return EagleNet(config)

    def check_target(self, converted: Converted, path: Path, target: str) -> None:
        """The drafter reads the target's hidden states and embedding and speaks its vocabulary."""
        target_path = hub.resolve(target, None, ["config.json"])  # its weights are not needed
        config = target_path / "config.json"
        args = parse_config(read_json(config), f"--target {target}: {config}")
        # Neither module allocates: MLX initialises parameters lazily and none is evaluated.
        check_eagle_fits(self.build(converted.config), Model(args), f"--target {target}")


eagle1 = EagleFamily(1)
eagle3 = EagleFamily(3)
