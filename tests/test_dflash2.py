"""DFlash 2 drafters as z-lab publishes them (z-lab/Qwen3.8-27B-DFlash2: `DFlash2DraftModel`, its
convolutions and candidate selector sized in `dflash_config`, the selector's codebooks stored bare,
bfloat16): loaded as they are by `--drafter dflash=`, round for round the drafts, logits and selector
distributions of z-lab's own DFlash 2 code (z-lab/dflash `dflash/model.py`, scripts/make_dflash2_reference.py),
greedy output identical to plain decoding alone and in a batch, sampled output distributed as the
target's (drawn from the selector's own distributions, which acceptance reads)."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.dflash import DFlash, DFlash2Net, DFlashNet
from mlx_spec.errors import UserError
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams

from helpers import assert_batch_is_greedy_identical, assert_rounds_are
from stats import V, assert_distributed_as_target, tiny
from test_mlxlm_targets import FIXTURES as MLXLM

REFERENCE = MLXLM.parent / "dflash2_reference"
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def target():
    return load_model(str(REFERENCE / "target"))[0]


def scaled(tmp_path):
    """The fixture's weights under the scalings z-lab's code reads in dflash_config (as its own test fixture
    of a DFlash 2 config sets output_multiplier and final_logit_softcapping)."""
    folder = tmp_path / "scaled"
    shutil.copytree(REFERENCE / "dflash2", folder)
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"].update(input_embedding_scale=1.5, output_multiplier=0.5, final_logit_softcapping=4.0)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("variant", ["reference", "scaled"])
def test_drafts_are_z_labs(target, monkeypatch, tmp_path, variant):
    """Every round z-lab's code drafted (a block of 5 after the context it had, the context past the sliding
    window): the same chain, the same logits; the decoded tokens are plain greedy decoding's."""
    ref = np.load(REFERENCE / f"{variant}.npz")
    folder = REFERENCE / "dflash2" if variant == "reference" else scaled(tmp_path)
    drafter = make_drafter(f"dflash={folder}", target)
    assert isinstance(drafter.net, DFlash2Net) and drafter.block_size == 5
    logits, head = [], DFlashNet.logits
    monkeypatch.setattr(DFlashNet, "logits", lambda self, t, h: logits.append(head(self, t, h)) or logits[-1])
    assert_rounds_are(ref, target, drafter, 4, logits, lambda r: np.array(r[0][0]), atol=2e-4)


def test_the_selectors_distributions_are_z_labs(target, monkeypatch):
    """At temperature 1, each step's distribution over its candidates along the chain z-lab's selector took
    (softmax of logit + <A[previous] * P h, B[candidate]>), round for round: what acceptance reads."""
    ref = np.load(REFERENCE / "reference.npz")
    monkeypatch.setattr(mx.random, "categorical", lambda lq: mx.argmax(lq, axis=-1))  # take z-lab's chain
    prompt, tokens = [int(t) for t in ref["prompt"]], [int(t) for t in ref["tokens"]]
    n = len(prompt) + 1
    for drafts, candidates, q in zip(ref["drafts"].tolist(), ref["candidates"], ref["q"]):
        context = (prompt + tokens)[:n]
        drafter = make_drafter(f"dflash={REFERENCE / 'dflash2'}", target).new_session()
        drafter.add()
        _, features = target(mx.array([context[:-1]]), target.make_cache(), capture=drafter.capture)
        drafter.commit(0, context, features)
        draft = drafter.propose([context], [4], [SamplingParams(temp=1.0)])[0]
        assert draft.tokens.tolist() == drafts
        got = np.exp(np.take_along_axis(np.array(draft.log_probs), candidates, axis=-1))  # [K, top_k]
        np.testing.assert_allclose(got, q, atol=2e-4, rtol=0)
        n += next((i for i, (d, t) in enumerate(zip(drafts, tokens[n - len(prompt):])) if d != t), 4) + 1
        if n - len(prompt) >= len(tokens):
            break


def test_the_speculators_layout_drafts_as_z_labs(target, tmp_path, monkeypatch):
    """The same weights as vllm-project/speculators writes a DFlash 2 drafter (DFlash2Speculator, as
    mgoin/Qwen3-4B-speculator.dflash2 is published: the draft layers' config nested, the convolution and
    selector sizes at the top level, the target's hidden states by their index in transformers'
    `hidden_states`, in-block attention both ways by default): read as published, the same rounds."""
    zlab = json.loads((REFERENCE / "dflash2" / "config.json").read_text())
    extra = zlab["dflash_config"]
    config = {"architectures": ["DFlash2Speculator"], "speculators_model_type": "dflash2",
              "transformer_layer_config": {k: v for k, v in zlab.items() if k not in ("architectures", "dflash_config",
                                                                                   "num_target_layers", "is_causal")},
              "draft_vocab_size": zlab["vocab_size"], "block_size": extra["block_size"],
              "aux_hidden_state_layer_ids": [i + 1 for i in extra["target_layer_ids"]],
              "mask_token_id": extra["mask_token_id"], "sliding_window_non_causal": True, "projector_type": "dflash",
              "shift_label": False, "sample_from_anchor": False,
              **{k: extra[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}}
    src = tmp_path / "speculators"
    shutil.copytree(REFERENCE / "dflash2", src)
    (src / "config.json").write_text(json.dumps(config))
    drafter = make_drafter(f"dflash={src}", target)
    assert isinstance(drafter.net, DFlash2Net) and drafter.net.settings["causal"] is False
    logits, head = [], DFlashNet.logits
    monkeypatch.setattr(DFlashNet, "logits", lambda self, t, h: logits.append(head(self, t, h)) or logits[-1])
    assert_rounds_are(np.load(REFERENCE / "reference.npz"), target, drafter, 4, logits, lambda r: np.array(r[0][0]),
                      atol=2e-4)


def test_a_batch_is_greedy_identical(target):
    prompts = [list(np.load(REFERENCE / "reference.npz")["prompt"][:n]) for n in (3, 9, 20)]
    drafter = make_drafter(f"dflash={REFERENCE / 'dflash2'}", target)
    assert_batch_is_greedy_identical(target, drafter, [[int(t) for t in p] for p in prompts], 16, 4)


def tiny_dflash2(target, seed: int) -> DFlash:
    """A DFlash 2 drafter for the vocabulary-V target: one non-causal layer, a selector of the best 3 of 4."""
    config = {"model_type": "qwen3", "architectures": ["DFlash2DraftModel"], "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
              "vocab_size": V, "rms_norm_eps": 1e-6, "is_causal": False, "rope_theta": 10000.0,
              "dflash_config": {"block_size": 4, "mask_token_id": V - 1, "target_layer_ids": [0],
                                "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 3}}
    net = DFlash2Net(config)
    rng = np.random.default_rng(seed)
    from mlx.utils import tree_flatten, tree_unflatten

    net.update(tree_unflatten([(k, mx.array(1 + 0.1 * rng.standard_normal(v.shape) if "norm" in k else
                                            rng.standard_normal(v.shape) / v.shape[-1] ** 0.5, dtype=mx.float32))
                               for k, v in tree_flatten(net.parameters())]))
    return DFlash(net, target)


def test_sampling_matches_the_targets_distribution(monkeypatch):
    """At temperature 1 each step is drawn from the selector's softmax over 3 of the 4 tokens."""
    target = tiny(0, V, logit_scale=0.3)
    assert_distributed_as_target(target, lambda: tiny_dflash2(target, 1), monkeypatch)


def test_what_it_cannot_do_is_refused(target, tmp_path):
    with pytest.raises(UserError, match="candidate selector drafts a chain; give no --tree-budget"):
        make_drafter(f"dflash={REFERENCE / 'dflash2'}", target, tree_budget=8)
    folder = tmp_path / "dflash2"
    shutil.copytree(REFERENCE / "dflash2", folder)
    config = json.loads((folder / "config.json").read_text())
    config["dflash_config"]["conv_group_size"] = 24
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="config.json: dflash_config.conv_group_size must divide hidden_size 64"):
        make_drafter(f"dflash={folder}", target)


def test_mlx_spec_convert_writes_what_loads_as_published(target, tmp_path, in_process):
    """`mlx-spec convert` on the folder: the codebooks named as the module's, every tensor unchanged, and
    the converted drafter drafts as the published one."""
    proc = in_process("convert", REFERENCE / "dflash2", "-o", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    context = [int(t) for t in np.load(REFERENCE / "reference.npz")["prompt"]]
    drafts = []
    for folder in (REFERENCE / "dflash2", tmp_path / "out"):
        drafter = make_drafter(f"dflash={folder}", target).new_session()
        drafter.add()
        _, features = target(mx.array([context[:-1]]), target.make_cache(), capture=drafter.capture)
        drafter.commit(0, context, features)
        drafts.append(drafter.propose([context], [4], [GREEDY])[0].tokens.tolist())
    assert drafts[0] == drafts[1] and len(drafts[0]) == 4
