"""Widen the demo into a target of real size that computes the same function, with its drafters.

    python scripts/widen_demo.py OUT [--size 0.2b|3b] [--hidden D] [--heads H] [--intermediate I]
                                     [--layers L] [--dtype float32|bfloat16|float16] [--seed 0] [--pair WORK]
    mlx-spec generate --model OUT/target --drafter eagle3=OUT/eagle3 --check --prompt ...

The demo target (a Qwen3: hidden size 256, 4 query heads over 2 key-value heads of 64, 768 MLP
units, 8 layers) decodes a step in a few milliseconds, where fixed costs hide what drafting saves;
a Mac's targets read gigabytes of weights a step. The widened target is as large as asked and gives
the demo's logits up to float rounding, so its greedy output is the demo's and every drafter keeps
its acceptance. `0.2b` (the default): hidden 1024, 16 heads, 3072 units, 16 layers, 0.8 GB in
float32; `3b`: hidden 2560, 32 heads, 9728 units, 36 layers, 6.6 GB in bfloat16 (for GPUs; writing
it takes about 16 GB of memory).

The rules, exact in real arithmetic (new entries: seeded random, or zero where they would reach
the residual stream):

- hidden size d -> D: the residual stream's extra D - d dimensions stay exactly zero. Every tensor
  whose output has the hidden size (embedding, o_proj, down_proj, EAGLE-3's and DFlash's `fc`,
  Medusa's ResBlocks) gets zero rows there; inputs from them multiply zeros, so those columns are
  random. Tied embeddings: the LM head is the embedding, zero-padded too.
- RMSNorm over the hidden size: with D - d zeros the mean square is d/D of the original, so each
  weight is scaled by sqrt(d/D) and `rms_norm_eps` by d/D: w' x / sqrt(m d/D + eps d/D) = w x / sqrt(m + eps).
- Qwen3's per-head q_norm/k_norm (over head_dim, which does not change) read the same config eps,
  now eps d/D. q_proj and k_proj are scaled by c = sqrt(d/D) to match: q_norm(c q) with eps c^2 is
  exactly q_norm(q) with eps, and no norm sees an eps other than the one it was trained with.
- query heads h -> H and key-value heads g -> H g / h (the GQA group kept: query head j reads
  key-value head j // group, so the original heads keep their indices): new q/k/v rows random,
  their o_proj columns zero. MLP units i -> I: new gate/up rows random, their down_proj columns zero.
- layers L -> L': appended after the last, random but for o_proj and down_proj (all zero), so each
  is the identity on the residual stream and the layer indices drafters read stay valid.

The widened models equal the demo's only in real arithmetic: a longer dot product sums in another
order (logits differ by about 1e-5 in float32), and a `--dtype` other than float32 rounds.

OUT/target and OUT/layerskip (the demo's copy tuned for early exit: `--model OUT/layerskip
--drafter layerskip=E`; an exit chosen from the prompt weighs the appended layers' cost too, so it
may differ from the demo's) are widened as above; EAGLE-3, DFlash, Medusa and the MTP heads read the
target's features (and EAGLE-3 and DFlash its embedding and LM head), so their hidden size, heads
and MLP widen the same way, their layers do not. The draft models (OUT/student,
OUT/student-labels) read tokens alone and are copied as they are. Every folder loads without a
convert step. `_name_or_path` names the widened target apart from the demo's, so `--drafter KIND`
needs its source (`eagle3=OUT/eagle3`): the demo's own drafters do not fit it.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from functools import partial
from pathlib import Path

import mlx_spec  # noqa: F401  (preloads OpenBLAS before mlx.core)
import mlx.core as mx
import numpy as np

from mlx_spec import demo
from mlx_spec.files import replace_atomically, write_model_files
from mlx_spec.weights import read_safetensors

SIZES = {"0.2b": dict(hidden=1024, heads=16, intermediate=3072, layers=16),
         "3b": dict(hidden=2560, heads=32, intermediate=9728, layers=36)}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
WIDENED = ("target", "layerskip", "eagle3", "dflash", "medusa", "mtp-heads")
GROWN = ("target", "layerskip")  # the models that get layers appended
COPIED = ("student", "student-labels")
NAME = "mlx-spec/demo-widened"  # `_name_or_path`: not the demo (its drafters do not fit)

# What each axis of a tensor holds, by its module's name (a bias: its weight's first axis):
# "d" the hidden size, or several hidden-size blocks side by side (EAGLE-3's attention reads
# [embedding; feature], `fc` the taps' features); "q" query heads x head_dim; "k" key-value
# heads x head_dim; "i" MLP units; "." an axis that keeps its size (vocabulary, head_dim).
AXES = {"embed_tokens": ".d", "lm_head": ".d", "q_proj": "qd", "k_proj": "kd", "v_proj": "kd", "o_proj": "dq",
        "gate_proj": "id", "up_proj": "id", "down_proj": "di", "fc": "dd", "linear": "dd",
        "input_layernorm": "d", "post_attention_layernorm": "d", "hidden_norm": "d", "norm": "d",
        "q_norm": ".", "k_norm": "."}
NORMS = {"input_layernorm", "post_attention_layernorm", "hidden_norm", "norm"}  # RMSNorms over the hidden size
# Modules whose output has the hidden size: their new entries are zero, so the padded dimensions
# stay zero and new heads, MLP units and layers add nothing (Medusa's `linear`: z + SiLU(W z + b)).
WRITERS = {"embed_tokens", "o_proj", "down_proj", "fc", "linear"}


def module(name: str) -> str:
    """`model.layers.3.mlp.down_proj.weight` -> `down_proj`; Medusa's `{head}.{layers}.weight`, a head's
    unembedding, -> `lm_head`."""
    parts = name.split(".")
    key = parts[-2] if parts[-1] in ("weight", "bias") else parts[-1]
    return "lm_head" if key.isdigit() else key


def fresh(key: str, like: np.ndarray, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """New entries for `key`'s tensor: zero for a writer, else random with `like`'s mean and spread."""
    if key in WRITERS:
        return np.zeros(shape, np.float32)
    out = rng.standard_normal(shape, dtype=np.float32)
    out *= like.std()
    out += like.mean()
    return out


def widen_tensor(name: str, w: np.ndarray, grow: dict[str, tuple[int, int]], qk_norm: bool,
                 rng: np.random.Generator) -> np.ndarray:
    """One tensor, each axis grown per `grow` (kind -> (old, new) unit), originals in place."""
    key = module(name)
    if key in NORMS or (qk_norm and key in ("q_proj", "k_proj")):
        d, D = grow["d"]
        w = w * math.sqrt(d / D)
    shape, where = [], []  # new size and the original entries' indices, per axis
    for size, kind in zip(w.shape, AXES[key]):
        unit, new = grow.get(kind, (size, size))
        blocks, rest = divmod(size, unit)
        if rest:
            raise SystemExit(f"{name}: axis of {size} is not a multiple of {unit}, the target's")
        shape.append(blocks * new)
        where.append((np.arange(blocks)[:, None] * new + np.arange(unit)).ravel())  # block k's at k * new
    if shape == list(w.shape):
        return w
    out = fresh(key, w, tuple(shape), rng)
    out[np.ix_(*where)] = w
    return out


def appended_layers(weights: dict[str, np.ndarray], layers: int, total: int,
                    rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Layers `layers`..`total`-1, shaped like the last and all new (`fresh`): identity on the residual."""
    last = f"model.layers.{layers - 1}."
    template = {name[len(last):]: w for name, w in weights.items() if name.startswith(last)}
    return {f"model.layers.{j}.{rest}": fresh(module(rest), w, w.shape, rng)
            for j in range(layers, total) for rest, w in template.items()}


def widen_config(config: dict, target: dict, sizes: dict[str, int], layers: int, grown: bool, dtype: str,
                 where: str) -> dict:
    """`config` with the new sizes (those it has), eps scaled, and the target's new layer count where it
    is the model's own (`grown`) or names the target's (DFlash's `num_target_layers`)."""
    out = dict(config)
    d, D = target["hidden_size"], sizes["hidden_size"]
    for key, value in sizes.items():
        if key in out:
            if out[key] != target[key]:  # a layer shape of its own: it would not widen like the target's
                raise SystemExit(f"{where}: {key} {out[key]}, the target's is {target[key]}")
            out[key] = value
    if "rms_norm_eps" in out:
        out["rms_norm_eps"] = out["rms_norm_eps"] * d / D
    if grown:
        out["num_hidden_layers"] = layers
    if "num_target_layers" in out:
        out["num_target_layers"] = layers
    if "eagle" in out:
        out["eagle"] = {**out["eagle"], "target_hidden_size": D}
    if "torch_dtype" in out:
        out["torch_dtype"] = dtype
    for key in ("_name_or_path", "base_model_name_or_path"):
        if isinstance(out.get(key), str):
            out[key] = out[key].replace(demo.NAME, NAME, 1)
    return out


def widen_folder(src: Path, out: Path, target: dict, sizes: dict[str, int], grow: dict[str, tuple[int, int]],
                 layers: int, grown: bool, dtype: str, rng: np.random.Generator) -> int:
    """Write `src` widened to `out`; returns its parameter count."""
    config = widen_config(json.loads((src / "config.json").read_text()), target, sizes, layers, grown, dtype, str(src))
    source, _ = read_safetensors(src)
    qk_norm = any(module(name) == "q_norm" for name in source)
    weights = {}
    for name, w in source.items():
        if mx.issubdtype(w.dtype, mx.floating):
            weights[name] = widen_tensor(name, np.array(w.astype(mx.float32)), grow, qk_norm, rng)
        else:  # EAGLE-3's d2t: token ids
            weights[name] = np.array(w)
    if grown:
        weights.update(appended_layers(weights, target["num_hidden_layers"], layers, rng))
    arrays = {}
    for name in list(weights):  # one tensor at a time: the float32 copies go as the `dtype` ones come
        w = weights.pop(name)
        arrays[name] = mx.array(w).astype(DTYPES[dtype]) if w.dtype == np.float32 else mx.array(w)
        mx.eval(arrays[name])
    replace_atomically(out, lambda tmp: write_model_files(tmp, config, arrays, source=src))
    return sum(a.size for a in arrays.values())


def widen(out: Path, hidden: int, heads: int, intermediate: int, layers: int, dtype: str = "float32",
          seed: int = 0, pair: Path | None = None) -> None:
    """Write OUT/target, OUT/layerskip and the demo's drafters, widened (see the module's docstring); with
    `pair` (a folder `scripts/heldout_pair.py` wrote), its target widened and its student copied instead."""
    widened, copied = ({name: demo.path(name) for name in WIDENED}, {name: demo.path(name) for name in COPIED}) \
        if pair is None else ({"target": pair / "target-lm"}, {"student": pair / "student"})
    target = json.loads((widened["target"] / "config.json").read_text())
    h, g, hd = target["num_attention_heads"], target["num_key_value_heads"], target["head_dim"]
    group = h // g
    floors = {"--hidden": (hidden, target["hidden_size"]), "--heads": (heads, h),
              "--intermediate": (intermediate, target["intermediate_size"]),
              "--layers": (layers, target["num_hidden_layers"])}
    for flag, (value, floor) in floors.items():
        if value < floor:
            raise SystemExit(f"{flag} {value}: widening cannot go below the demo's {floor}")
    if heads % group:
        raise SystemExit(f"--heads {heads}: must be a multiple of {group}, the demo's query heads per key-value head")
    sizes = {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads // group,
             "intermediate_size": intermediate}
    grow = {"d": (target["hidden_size"], hidden), "q": (h * hd, heads * hd), "k": (g * hd, heads // group * hd),
            "i": (target["intermediate_size"], intermediate)}
    rng = np.random.default_rng(seed)
    for name, src in widened.items():
        n = widen_folder(src, out / name, target, sizes, grow, layers, name in GROWN, dtype, rng)
        print(f"{name}: {n / 1e6:.1f}M parameters -> {out / name}", flush=True)
    for name, src in copied.items():
        replace_atomically(out / name, partial(shutil.copytree, src, dirs_exist_ok=True))
        print(f"{name}: as it is -> {out / name}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", choices=SIZES, default="0.2b", help="preset shape; the flags below override it")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--heads", type=int, help="query heads (key-value heads keep the demo's group)")
    parser.add_argument("--intermediate", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="float32 on CPUs (bf16/fp16 matmul there skips BLAS), bfloat16 on GPUs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pair", type=Path, default=None, metavar="WORK",
                        help="widen the target of scripts/heldout_pair.py's WORK (and copy its student) instead of the demo")
    args = parser.parse_args(argv)
    shape = {k: getattr(args, k) or v for k, v in SIZES[args.size].items()}
    widen(args.out, **shape, dtype=args.dtype, seed=args.seed, pair=args.pair)


if __name__ == "__main__":
    main()
