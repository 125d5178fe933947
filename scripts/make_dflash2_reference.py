"""Write a DFlash 2 drafter laid out as z-lab publishes one (z-lab/Qwen3.8-27B-DFlash2), for a tiny
Qwen3 target, and what mlx-vlm's DFlash2DraftModel (its port of z-lab's MLX reference) drafts with
it (tests/test_dflash2.py).

Needs mlx-vlm, which mlx-spec itself does not depend on (its own dependencies are not needed here):

    pip install --no-deps mlx-vlm==0.7.10
    python scripts/make_dflash2_reference.py

tests/fixtures/dflash2_reference/
  target/  a Qwen3 checkpoint (tests/tiny.py's, four layers)
  dflash2/ `DFlash2DraftModel`: two non-causal sliding-window layers (`is_causal` false), each
           wrapped in grouped dynamic causal convolutions (`attention_conv`, `mlp_conv`: kernel 2,
           groups of 16), a candidate selector (`predecessor_codebook` and `successor_codebook`
           stored bare, `hidden_projection`; rank 8, top 4), `dflash_config` holding block_size,
           mask_token_id, target_layer_ids and those sizes, `rope_parameters`, bfloat16 weights
  reference.npz: the prompt, and for each round of greedy speculative decoding (a block of 5, so
           4 drafts a round) the drafts the selector chose and the drafter's logits under them,
           and the tokens decoded (checked here to be the target's own greedy tokens)

The target's features are read anew each round (the outputs of its layers `target_layer_ids` over
the context but its last token); the drafter's cache holds the context it has read.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx_spec  # noqa: F401  (OpenBLAS before MLX)
import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_attention_mask
from mlx_lm.utils import load_model
from mlx_vlm.speculative.drafters.dflash2.config import DFlash2Config
from mlx_vlm.speculative.drafters.dflash2.dflash2 import DFlash2DraftModel

from tiny import make_checkpoint

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "dflash2_reference"
BLOCK, TOKENS, LAYERS = 5, 24, [1, 2]


def drafter_config(target: dict) -> dict:
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": target["hidden_size"],
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": target["vocab_size"], "num_target_layers": target["num_hidden_layers"],
        "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "tie_word_embeddings": False, "is_causal": False,
        "layer_types": ["sliding_attention"] * 2, "sliding_window": 64,
        "rope_parameters": {"rope_theta": 10000000.0, "rope_type": "default"},
        "dflash_config": {"block_size": BLOCK, "conv_group_size": 16, "conv_kernel_size": 2,
                          "mask_token_id": target["vocab_size"] - 1, "selector_rank": 8, "selector_top_k": 4,
                          "target_layer_ids": LAYERS},
    }


def random_weights(model, seed: int) -> dict[str, mx.array]:
    from mlx.utils import tree_flatten

    rng = np.random.default_rng(seed)
    out = {}
    for name, v in tree_flatten(model.parameters()):
        if name.endswith("base_kernel"):  # the identity on the token itself, and a little of the one before
            w = 0.2 * rng.standard_normal(v.shape)
            w[:, 0] += 1.0
        elif "norm" in name:
            w = 1.0 + 0.1 * rng.standard_normal(v.shape)
        else:
            w = rng.standard_normal(v.shape) / v.shape[-1] ** 0.5
        out[name] = mx.array(w.astype(np.float32)).astype(mx.bfloat16)
    return out


def features(target, tokens: list[int]) -> mx.array:
    """The outputs of the target's layers LAYERS over `tokens`, joined `[1, n, taps * H]`."""
    h = target.model.embed_tokens(mx.array([tokens]))
    mask = create_attention_mask(h, None)
    taps = []
    for i, layer in enumerate(target.model.layers):
        h = layer(h, mask, None)
        if i in LAYERS:
            taps.append(h)
    return mx.concatenate(taps, axis=-1)


def main() -> None:
    target_dir = make_checkpoint(OUT / "target", "qwen3", seed=5, num_hidden_layers=4)
    target_config = json.loads((target_dir / "config.json").read_text())
    target, _ = load_model(target_dir)
    config = drafter_config(target_config)
    out = OUT / "dflash2"
    out.mkdir(parents=True, exist_ok=True)
    draft = DFlash2DraftModel(DFlash2Config.from_dict(config))
    weights = random_weights(draft, seed=9)
    books = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
    published = {k.removesuffix(".weight") if k.removesuffix(".weight") in books else k: v for k, v in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), published, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    draft.load_weights(list(draft.sanitize({k: v.astype(mx.float32) for k, v in published.items()}).items()))
    super(DFlash2DraftModel, draft).bind(target)  # (its own bind asks for an mlx-vlm target: the same binding)

    prompt = [int(t) for t in np.random.default_rng(3).integers(0, target_config["vocab_size"] - 1, 20)]
    ids = prompt + [int(mx.argmax(target(mx.array([prompt]))[0, -1]))]
    cache, read, drafts, logits = draft.make_cache(), 0, [], []
    while len(ids) - len(prompt) < TOKENS:
        n = len(ids)
        context = features(target, ids[:-1])[:, read:]
        read = n - 1
        block = mx.array([[ids[-1]] + [config["dflash_config"]["mask_token_id"]] * (BLOCK - 1)])
        h = draft._hidden(block, context, cache)[:, 1:]  # as DFlash2DraftModel.draft_block
        lg = draft._logits(h)
        chain = draft.candidate_selector.select(h, lg, block[:, 0], lambda x: mx.argmax(x, axis=-1))[0].tolist()
        verify = mx.argmax(target(mx.array([ids + chain]))[0, n - 1:], axis=-1).tolist()
        a = next((i for i, (d, t) in enumerate(zip(chain, verify)) if d != t), len(chain))
        ids += chain[:a] + [verify[a]]
        drafts.append(chain)
        logits.append(np.array(lg[0].astype(mx.float32)))
    plain = list(prompt)
    while len(plain) < len(ids):
        plain.append(int(mx.argmax(target(mx.array([plain]))[0, -1])))
    assert ids == plain, "speculative greedy tokens differ from plain"
    np.savez_compressed(OUT / "reference.npz", prompt=np.array(prompt, np.int32), drafts=np.array(drafts, np.int32),
                        logits=np.stack(logits), tokens=np.array(ids[len(prompt):], np.int32))
    accepted = len(ids) - len(prompt) - 1 - len(drafts)
    print(out, f"{len(drafts)} rounds, {accepted} drafts accepted of {(BLOCK - 1) * len(drafts)}")


if __name__ == "__main__":
    main()
