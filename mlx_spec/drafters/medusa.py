"""Medusa (Cai et al. 2024): extra heads on the target's last hidden state.

Head k (0-based) reads the target's final normed hidden state h_t, the same
input as its LM head, and predicts token t + 2 + k:

    z = h + SiLU(W h + b)        (one residual block per layer)
    logits_k = U_k z

Every head predicts from the same h_t, so one round drafts a whole tree: the
top candidates of each head, combined along a static list of paths
(`medusa_choices`) or best-first within a node budget. The target verifies
the tree in one forward, whose hidden state at the last accepted token feeds
the next round.

Weights are named as in FasterDecoding's `medusa_lm_head` files
(`{k}.{j}.linear.weight`, `{k}.{j}.linear.bias`, `{k}.{L}.weight`) and kept
under `heads`; a folder holds `config.json` (`medusa_num_heads`,
`medusa_num_layers`, `hidden_size`, `vocab_size`) and `model.safetensors`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlx_spec import hub, tree
from mlx_spec.weights import read_safetensors
from mlx_spec.drafters.base import EMPTY, Conversion, Draft, Kind, Options, Recipe, RowStates, depth_tree
from mlx_spec.errors import UserError
from mlx_spec.files import write_model_files
from mlx_spec.models.llama import Model
from mlx_spec.models.dtypes import compute_dtype
from mlx_spec.models.load import check_weights, read_json
from mlx_spec.sampling import SamplingParams

TOPK = 10  # candidates per head that static trees index (mc_sim_7b_63's ranks are < 10)


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def __call__(self, x: mx.array) -> mx.array:
        return x + nn.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, vocab_size: int):
        super().__init__()
        self.num_layers = num_layers
        self.heads = [
            [ResBlock(hidden_size) for _ in range(num_layers)] + [nn.Linear(hidden_size, vocab_size, bias=False)]
            for _ in range(num_heads)
        ]

    @property
    def config(self) -> dict:
        out = self.heads[0][-1].weight.shape
        return {"medusa_num_heads": len(self.heads), "medusa_num_layers": self.num_layers,
                "hidden_size": out[1], "vocab_size": out[0]}

    def __call__(self, h: mx.array) -> mx.array:
        """`h` `[..., H]` (final normed hidden) -> logits `[..., K, V]`, one row per head."""
        outs = []
        for head in self.heads:
            z = h
            for block in head[:-1]:
                z = block(z)
            outs.append(head[-1](z))
        return mx.stack(outs, axis=-2)

    def init_from_target(self, target: Model) -> None:
        """Start every head as the target's LM head (blocks at zero: z = h)."""
        lm = target.embed_tokens.weight if target.args.tie_word_embeddings else target.lm_head.weight
        for head in self.heads:
            for block in head[:-1]:
                block.linear.weight = mx.zeros_like(block.linear.weight)
                block.linear.bias = mx.zeros_like(block.linear.bias)
            head[-1].weight = mx.array(lm)

    def weights(self) -> dict[str, mx.array]:
        """Parameters under their published names (`0.0.linear.weight`, ...)."""
        return dict(tree_flatten(self.heads))


def save_medusa(out: Path, heads: MedusaHeads, extra: dict | None = None) -> None:
    """Write config.json and model.safetensors into `out`, each file whole."""
    write_model_files(out, {**heads.config, **(extra or {})}, heads.weights())


def load_medusa(path_or_repo: str, revision: str | None = None) -> tuple[MedusaHeads, Path]:
    """A Medusa folder written by `mlx-spec convert` or `mlx-spec train medusa`."""
    path = hub.resolve(path_or_repo, revision)
    config_path = path / "config.json"
    config = read_json(config_path)
    fields = ("medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size")
    for name in fields:
        if not isinstance(config.get(name), int) or config[name] < (0 if name == "medusa_num_layers" else 1):
            raise UserError(f"{config_path}: '{name}' must be a positive integer (is this a Medusa folder?)")
    heads = MedusaHeads(*(config[f] for f in fields))
    weights, origin = read_safetensors(path)
    check_weights(heads.weights(), weights, origin, path, "Medusa heads")
    dtype = compute_dtype()
    if dtype is not None:
        weights = {k: v.astype(dtype) for k, v in weights.items()}
    heads.update({"heads": tree_unflatten(list(weights.items()))})
    try:
        mx.eval(heads.parameters())
    except RuntimeError as e:
        raise UserError(f"{path}: reading weights failed ({e})".splitlines()[0]) from None
    return heads, path


class Medusa(RowStates):
    """Drafts a tree from the Medusa heads; `paths` (static) or `budget` (best-first).
    The heads run once for every row's hidden state; each row's tree is its own."""

    kind = "medusa"

    def __init__(self, heads: MedusaHeads, target: Model, paths: Sequence[Sequence[int]] | None = None,
                 budget: int | None = None, chain: bool = False):
        super().__init__()
        self.heads, self.target, self.chain = heads, target, chain
        self.paths = [list(p) for p in (tree.MC_SIM_7B_63 if paths is None and budget is None else paths or [])]
        self.budget = budget
        self.k_max = len(heads.heads)  # a head a depth: a deeper K drafts no more
        self.capture = (target.args.num_hidden_layers,)
        # per row: [H] at its last committed token, before the final norm (None until the prompt's come)

    def _session(self) -> Medusa:
        return Medusa(self.heads, self.target, self.paths or None, self.budget, self.chain)

    def restart(self, b: int, prompt: list[int], cached: int = 0) -> int:
        self.states[b] = None  # a one-token prompt brings no features: a plain round
        return cached

    def commit(self, b: int, context: list[int], features: tuple[mx.array, ...] = ()) -> None:
        self.states[b] = features[0]  # [1, n, H]: its last state is read when the row drafts

    def propose(self, contexts: list[list[int]], ks: list[int], params: list[SamplingParams]) -> list[Draft]:
        rows = [b for b, (h, k) in enumerate(zip(self.states, ks)) if h is not None and k > 0]
        drafts = [EMPTY() for _ in ks]
        if rows:
            hidden = mx.stack([self.states[b][0, -1] for b in rows])  # [R, H]
            logits = self.heads(self.target.final_norm(hidden))[..., : self.target.args.vocab_size]  # [R, K, V]
            for i, b in enumerate(rows):
                if self.chain:  # each head's most likely token (a target that verifies chains only)
                    drafts[b] = Draft(mx.argmax(logits[i, : ks[b]], axis=-1).astype(mx.int32))
                else:
                    drafts[b] = depth_tree(logits[i], ks[b], self.paths, self.budget, TOPK)
        return drafts


def check_medusa_fits(heads: MedusaHeads, target: Model, what: str) -> None:
    """Medusa heads read the target's hidden state and predict its vocabulary."""
    c, a = heads.config, target.args
    if c["hidden_size"] != a.hidden_size:
        raise UserError(f"{what}: heads read hidden size {c['hidden_size']}, the target's is {a.hidden_size}")
    if c["vocab_size"] < a.vocab_size:
        raise UserError(f"{what}: heads predict {c['vocab_size']} tokens, the target has {a.vocab_size}")


def build(target: Model, o: Options) -> Medusa:
    heads, _ = load_medusa(o.source, o.revision)
    check_medusa_fits(heads, target, f"--drafter {o.spec}")
    chain = not target.verifies_trees  # a hybrid target: the heads' top-1 chain, unless a tree is asked for
    return Medusa(heads, target, o.tree_paths, o.tree_budget, chain and o.tree_paths is None and o.tree_budget is None)


def train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model: folder or Hub repo id")
    p.add_argument("--heads", type=int, default=4, help="number of heads (head k predicts token t + 2 + k)")
    p.add_argument("--layers", type=int, default=1, help="residual blocks per head")
    p.set_defaults(lr=1e-3)


PUBLISHED = {
    "lmsys/vicuna-7b-v1.3": ("FasterDecoding/medusa-vicuna-7b-v1.3",),
    "lmsys/vicuna-13b-v1.3": ("FasterDecoding/medusa-vicuna-13b-v1.3",),
    "lmsys/vicuna-33b-v1.3": ("FasterDecoding/medusa-vicuna-33b-v1.3",),
    # Medusa-2: a fine-tuned model holding its own heads, so the target is the repo itself
    **{repo: (repo,) for repo in ("FasterDecoding/medusa-1.0-vicuna-7b-v1.5", "FasterDecoding/medusa-1.0-vicuna-13b-v1.5",
                                  "FasterDecoding/medusa-1.0-vicuna-33b-v1.3", "FasterDecoding/medusa-1.0-zephyr-7b-beta")},
}
TRAIN = Recipe("Medusa-1: heads on the frozen target; OUT is a folder that --drafter medusa=OUT loads.",
               train_arguments, "mlx_spec.train.medusa:run")
# Heads `mlx-spec train medusa` wrote (sizes said, no model of their own) load as they are.
CONVERT = Conversion("medusa", as_is=lambda path, config: "hidden_size" in config and "model_type" not in config)
KINDS = (Kind("medusa", "Medusa heads on the target's last hidden state: a tree of candidates per round "
              "(--tree, --tree-budget; the heads' top-1 chain on a target that verifies chains only)", build,
              takes=("tree_paths", "tree_budget"), train=TRAIN, convert=CONVERT, published=PUBLISHED),)
