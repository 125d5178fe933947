"""Greedy output under OpenBLAS, default and exact verification, for every drafter kind: run by
tests/test_exact.py in a process of its own (OpenBLAS loads before MLX or not at all).

    python tests/exactness.py WORK [FAMILY ...]

Targets: one untrained checkpoint per architecture whose LM head holds its rows in pairs a few
parts in 10^7 apart, so that nearly every step is a near-tie the last bits of a logit decide.
Prints one JSON object: for each architecture and drafter (every kind on Qwen3; a draft model,
lookup and three trees on Llama and Qwen2), the prompts on which speculative greedy output parted
from `--exact` plain decoding with `--exact`, and the same for the rows of a batch; on Qwen3, the
prompts on which it parted from plain decoding in the default mode. With FAMILY names (folders of
tests/fixtures/mlxlm_reference: targets run on mlx-lm's modules), each fixture with its LM head made
near-tie: a draft model, LayerSkip (where the family's layers run apart) and a scripted tree (where it
verifies trees), alone, and a draft model as rows of a batch."""

import json
import shutil
import sys
from pathlib import Path

import mlx_spec  # noqa: F401  (OpenBLAS before MLX)
import mlx.core as mx
import numpy as np

from mlx_spec import _blas, exact
from mlx_spec.decoding import Decoder, plain_steps, speculative_steps
from mlx_spec.drafters.dflash import DFlash
from mlx_spec.drafters.draft_model import DraftModel
from mlx_spec.drafters.eagle import Eagle
from mlx_spec.drafters.layerskip import LayerSkip
from mlx_spec.drafters.lookup import PromptLookup
from mlx_spec.drafters.medusa import Medusa
from mlx_spec.drafters.mtp_heads import MTPHeadsDrafter, MTPHeads, mtp_heads_config
from mlx_spec.drafters.suffix import SuffixDecoding
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams
from tiny import make_checkpoint
from test_dflash import random_net as dflash_net
from test_eagle import random_net as eagle_net
from test_trees import SHAPES, ScriptedTree, noisy_heads

GREEDY = SamplingParams()
ARCHS = ("llama", "qwen2", "qwen3")


FIXTURES = Path(__file__).parent / "fixtures" / "mlxlm_reference"


def near_ties(out: Path, arch: str, seed: int) -> Path:
    """An untrained checkpoint whose LM head (or tied embedding) has rows 2j and 2j + 1 nearly equal."""
    make_checkpoint(out, arch, seed=seed, hidden_size=128, intermediate_size=256, head_dim=32)
    return tie_head(out, seed)


def tie_head(out: Path, seed: int) -> Path:
    """The checkpoint in `out` with rows 2j and 2j + 1 of its LM head (or tied embedding) nearly equal."""
    weights = dict(mx.load(str(out / "model.safetensors")))
    name = "lm_head.weight" if "lm_head.weight" in weights else \
        next(k for k in weights if k.endswith("embed_tokens.weight") and "layers." not in k)
    head = np.array(weights[name])
    rng = np.random.default_rng(seed)
    odd = head[1::2].shape[0]
    head[1::2] = head[0::2][:odd] * (1 + 3e-7 * rng.standard_normal(head[1::2].shape))
    weights[name] = mx.array(head)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out


def tokens(events) -> list[int]:
    return [t for e in events for t in e.tokens]


def drafters(target, other, truth_of):
    """Every drafter kind, built fresh for a prompt (`truth_of(prompt)`: what it is checked against)."""
    V = target.args.vocab_size
    eagle3, dflash, medusa = eagle_net(target, 3), dflash_net(target)[0], noisy_heads(target)
    heads = MTPHeads(mtp_heads_config(target, 3))
    mx.eval(heads.parameters())
    return {
        "lookup": lambda p: PromptLookup(1, 3),
        "suffix": lambda p: SuffixDecoding(),
        "draft-same": lambda p: DraftModel(target, V),
        "draft-other": lambda p: DraftModel(other, V),
        "eagle3": lambda p: Eagle(eagle3, target),
        "eagle3-tree": lambda p: Eagle(eagle3, target, budget=7),
        "medusa-tree": lambda p: Medusa(medusa, target, budget=7),
        "dflash": lambda p: DFlash(dflash, target),
        "dflash-tree": lambda p: DFlash(dflash, target, budget=7),
        "mtp-heads": lambda p: MTPHeadsDrafter(heads, target),
        "layerskip": lambda p: LayerSkip(target, 1),
        "scripted-tree": lambda p: ScriptedTree(truth_of(p), SHAPES["deep"], V, seed=len(p)),
    }


def differing(target, prompts, n, make, width, refs) -> int:
    outs = [tokens(speculative_steps(target, p, GREEDY, n, make(p), width=width)) for p in prompts]
    return sum(o != r for o, r in zip(outs, refs))


def batch_differing(target, prompts, n, make, width, refs) -> int:
    """Rows of one batch (as the server runs them), each against its reference alone."""
    decoder = Decoder(target, width=width)
    drafter = make(prompts[0])
    for i, p in enumerate(prompts):
        decoder.add(i, p, GREEDY, n, drafter)
    out = {i: [] for i in range(len(prompts))}
    while decoder.rows:
        for key, event in decoder.step().items():
            out[key] += event.tokens
    return sum(out[i] != r for i, r in enumerate(refs))


def family_drafters(target, truth: dict) -> dict:
    """The drafter kinds a family runs, built fresh for a prompt: a draft model (the target itself: it drafts
    what the target decodes but at near-ties), LayerSkip where its layers run apart, a scripted tree
    following `truth[prompt]` where it verifies trees."""
    V = target.args.vocab_size
    kinds = {"draft-same": lambda p: DraftModel(target, V)}
    if target.runs_apart:
        kinds["layerskip"] = lambda p: LayerSkip(target, 1)
    if target.verifies_trees:
        kinds["scripted-tree"] = lambda p: ScriptedTree(truth[tuple(p)], SHAPES["deep"], V, seed=len(p))
    return kinds


def families(work: Path, names: list[str]) -> dict:
    """Each family's fixture, near-tie: the prompts on which a drafter's `--exact` greedy output parted from
    `--exact` plain decoding's, alone and as rows of a batch (prompts decoded into a second block of keys)."""
    result = {}
    rng = np.random.default_rng(1)
    for i, name in enumerate(names):
        shutil.copytree(FIXTURES / name, work / name)
        target = load_model(str(tie_head(work / name, i)))[0]
        V = target.args.vocab_size
        width = exact.width(target, 8)
        prompts = [rng.integers(3, V, n).tolist() for n in (246, 250)]
        refs = [tokens(plain_steps(target, p, GREEDY, 14, width=width)) for p in prompts]
        kinds = family_drafters(target, {tuple(p): r for p, r in zip(prompts, refs)})
        alone = {k: differing(target, prompts[:1], 14, make, width, refs[:1]) for k, make in kinds.items()}
        row = {"width": width, **alone, "batch, draft-same": batch_differing(target, prompts, 14, kinds["draft-same"],
                                                                             width, refs)}
        result[name] = row
        print(json.dumps({name: row}), file=sys.stderr, flush=True)
    return result


def main() -> None:
    work = Path(sys.argv[1])
    if sys.argv[2:]:
        print(json.dumps({"blas": _blas.loaded, **families(work, sys.argv[2:])}))
        return
    result = {"blas": _blas.loaded}
    rng = np.random.default_rng(0)
    for i, arch in enumerate(ARCHS):
        target = load_model(str(near_ties(work / arch, arch, i)))[0]
        other = load_model(str(near_ties(work / f"{arch}-other", arch, 10 + i)))[0]
        V = target.args.vocab_size
        width = exact.width(target, 8)
        row = {"width": width}
        if arch == "qwen3":  # the problem, shown once: default verification parts from plain decoding
            prompts = [rng.integers(3, V, int(rng.integers(4, 40))).tolist() for _ in range(4)]
            plain = [tokens(plain_steps(target, p, GREEDY, 32)) for p in prompts]
            row["default, 4 x 32"] = differing(target, prompts, 32, lambda p: DraftModel(target, V), None, plain)
        # Short prompts, and one whose decoding crosses into a second block of keys (trees pruned there).
        prompts = [rng.integers(3, V, n).tolist() for n in (7, 247)]
        refs = [tokens(plain_steps(target, p, GREEDY, 32, width=width)) for p in prompts]
        truth = {tuple(p): r for p, r in zip(prompts, refs)}
        kinds = drafters(target, other, lambda p: truth[tuple(p)])
        for name, make in kinds.items():
            if arch == "qwen3" or name in ("draft-other", "lookup", "eagle3-tree", "medusa-tree", "scripted-tree"):
                row[name] = differing(target, prompts, 32, make, width, refs)
        for name in ("draft-same", "lookup", "eagle3-tree", "scripted-tree"):
            row[f"batch of {len(prompts)}, {name}"] = batch_differing(target, prompts, 32, kinds[name], width, refs)
        result[arch] = row
        print(json.dumps({arch: row}), file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
