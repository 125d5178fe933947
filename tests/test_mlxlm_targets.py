"""Targets mlx-spec runs through mlx-lm's model code (mlx_spec/models/mlxlm.py),
checked against transformers: tiny checkpoints transformers saved, and the
greedy tokens transformers computed on them (scripts/make_mlxlm_reference.py,
tests/fixtures/mlxlm_reference); every chain drafter greedy-identical to plain,
and speculative sampling distributed as the MoE target's own."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec import api, sampling
from mlx_spec.decoding import plain_steps, speculative_steps
from mlx_spec.drafters.draft_model import DraftModel
from mlx_spec.drafters.lookup import PromptLookup
from mlx_spec.drafters.suffix import SuffixDecoding
from mlx_spec.models import load_model
from mlx_spec.models.mlxlm import Model as MLXLMTarget
from mlx_spec.sampling import SamplingParams

from helpers import assert_one_line_error, cli
from stats import N, STAT_PROMPT, V, empirical_tv, exact_joint, tiny, tv_bound
from test_speculative import resample_from_target

FIXTURES = Path(__file__).parent / "fixtures" / "mlxlm_reference"
FAMILIES = ("qwen3_moe", "mimo", "mixtral", "qwen2_moe", "olmoe")
GREEDY = SamplingParams()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    path = FIXTURES / request.param
    model, _ = load_model(str(path))
    ref = np.load(path / "reference.npz")
    return request.param, path, model, ref["prompt"].tolist(), ref["greedy"].tolist()


def test_plain_greedy_is_transformers(family):
    name, _, model, prompt, greedy = family
    assert isinstance(model, MLXLMTarget)
    assert [t for e in plain_steps(model, prompt, GREEDY, len(greedy)) for t in e.tokens] == greedy


@pytest.mark.parametrize("name", ["qwen3_moe", "mimo"])
def test_mlx_lm_alone_misreads_transformers_5_configs(name):
    """Why the config is rewritten: mlx-lm refuses Qwen3-MoE's (`num_local_experts`,
    RoPE in `rope_parameters`) and reads MiMo's RoPE base as 10000, not 640000."""
    from mlx_lm.utils import load_model as mlx_lm_load

    path = FIXTURES / name
    ours, _ = load_model(str(path))
    prompt = np.load(path / "reference.npz")["prompt"].tolist()
    if name == "qwen3_moe":
        with pytest.raises(TypeError, match="num_experts"):
            mlx_lm_load(path)
        return
    theirs, _ = mlx_lm_load(path)
    assert theirs.args.rope_theta == 10000.0
    x = mx.array(prompt)[None]
    assert not mx.allclose(theirs(x), ours(x)[0], atol=1e-3)


def draft_model_for(vocab: int):
    return DraftModel(tiny(5, vocab, hidden_size=64, num_attention_heads=4, num_key_value_heads=2), vocab)


@pytest.mark.parametrize("kind", ["lookup", "suffix", "draft", "layerskip"])
def test_chain_drafters_are_greedy_identical(family, kind):
    from mlx_spec.drafters import make_drafter

    name, _, model, prompt, greedy = family
    prompt = prompt + prompt[:12]  # something for lookup to find
    plain = [t for e in plain_steps(model, prompt, GREEDY, 24) for t in e.tokens]
    make = {"lookup": lambda: PromptLookup(1, 3), "suffix": SuffixDecoding,
            "draft": lambda: draft_model_for(model.args.vocab_size),
            "layerskip": lambda: make_drafter("layerskip=1", model)}[kind]  # the first layer, then the head
    events = list(speculative_steps(model, prompt, GREEDY, 24, make(), num_draft=3))
    assert [t for e in events for t in e.tokens] == plain
    assert sum(len(e.drafted) for e in events) > 0


def test_mimo_drafts_with_its_own_mtp_modules():
    """`--drafter mtp` alone on a MiMo checkpoint (`model.mtp_layers.*`, model_type mimo)."""
    path = FIXTURES / "mimo"
    model, _ = load_model(str(path))
    target = api.Target(model, None, path, str(path))  # weights and config only: no tokenizer
    drafter = api.drafter("mtp", target)
    prompt = np.load(path / "reference.npz")["prompt"].tolist()
    plain = [t for e in plain_steps(model, prompt, GREEDY, 24) for t in e.tokens]
    events = list(speculative_steps(model, prompt, GREEDY, 24, drafter.new_session()))
    assert [t for e in events for t in e.tokens] == plain
    assert sum(len(e.drafted) for e in events) > 0


def test_trees_are_refused_with_the_architecture_named(family):
    from mlx_spec.drafters.medusa import Medusa, MedusaHeads
    from mlx_spec.errors import UserError

    name, _, model, prompt, _ = family
    heads = MedusaHeads(3, 1, model.args.hidden_size, model.args.vocab_size)
    with pytest.raises(UserError, match=f"a {name} target verifies chains only"):
        list(speculative_steps(model, prompt, GREEDY, 8, Medusa(heads, model, None, 8)))


def test_an_architecture_mlx_spec_does_not_run_is_named(tmp_path):
    folder = tmp_path / "ssm"
    shutil.copytree(FIXTURES / "qwen3_moe", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    proc = cli("generate", "--model", folder, "--prompt", "hi", "--max-tokens", "4")
    assert_one_line_error(proc, "config.json", "gpt_neox")


def tiny_moe(seed: int) -> MLXLMTarget:
    """A Qwen3-MoE target of vocabulary V (mlx-lm's class, seeded weights) for the sampling test."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import qwen3_moe

    config = dict(model_type="qwen3_moe", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                  num_attention_heads=2, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                  mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-6, vocab_size=V,
                  num_key_value_heads=1, head_dim=16, rope_theta=10000.0, tie_word_embeddings=False,
                  max_position_embeddings=512, norm_topk_prob=True)
    inner = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    key = mx.random.key(seed)
    params = []
    for i, (k, v) in enumerate(tree_flatten(inner.parameters())):
        noise = mx.random.normal(v.shape, key=mx.random.split(key, i + 1)[0])
        params.append((k, 1.0 + 0.1 * noise if "norm" in k else 0.3 * noise / (v.shape[-1] ** 0.5)))
    inner.update(tree_unflatten(params))
    return MLXLMTarget(inner, config)


def test_sampling_matches_an_moe_targets_distribution(monkeypatch):
    target = tiny_moe(0)
    params = SamplingParams(temp=1.0)
    make = lambda: DraftModel(tiny(1, V, logit_scale=0.3), V)  # noqa: E731
    p = exact_joint(target, STAT_PROMPT, params, 3)
    bound = tv_bound(p, N)
    assert empirical_tv(target, make, params, p) < bound
    monkeypatch.setattr(sampling, "accept_sampled", resample_from_target)  # a wrong rule fails it
    assert empirical_tv(target, make, params, p) > bound


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "eagle3-tree-refused"])
def test_feature_drafters_read_the_captured_layers(family, kind):
    """EAGLE-3 (three tapped layers) and a z-lab-layout DFlash drafter (every layer
    tapped), random weights, on each family: greedy-identical to plain decoding."""
    from mlx_spec.drafters.dflash import DFlash, DFlashNet, dflash_config
    from mlx_spec.drafters.eagle import Eagle, EagleNet, eagle_config
    from mlx_spec.errors import UserError

    name, _, model, prompt, _ = family
    mx.random.seed(3)
    if kind == "dflash":
        config = dflash_config(model, num_layers=1, block_size=4, mask_token_id=model.args.vocab_size - 1,
                               target_layers=list(range(model.args.num_hidden_layers)))
        net = DFlashNet(config)
        make = lambda: DFlash(net, model, None, None)  # noqa: E731
    else:
        net = EagleNet(eagle_config(model, 3, layers=[0, 1, 2]))
        make = lambda: Eagle(net, model, 8 if kind == "eagle3-tree-refused" else None, 4, 3)  # noqa: E731
    mx.eval(net.parameters())
    if kind == "eagle3-tree-refused":
        with pytest.raises(UserError, match=f"a {name} target verifies chains only"):
            list(speculative_steps(model, prompt, GREEDY, 8, make()))
        return
    plain = [t for e in plain_steps(model, prompt, GREEDY, 20) for t in e.tokens]
    events = list(speculative_steps(model, prompt, GREEDY, 20, make(), num_draft=3))
    assert [t for e in events for t in e.tokens] == plain
    assert sum(len(e.drafted) for e in events) > 0


def test_an_mlx_quantized_moe_loads_quantized(tmp_path):
    """A 4-bit Qwen3-MoE as mlx-lm writes one (mlx-community's layout: `quantization` in
    config.json, QuantizedSwitchLinear experts): loaded quantized, greedy-identical with a drafter."""
    from mlx_lm.utils import load_model as mlx_lm_load, quantize_model, save_config, save_model

    from mlx_spec.models.mlxlm import mlx_lm_config

    config = mlx_lm_config(json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text()))
    inner, _ = mlx_lm_load(FIXTURES / "qwen3_moe", model_config=config)
    inner, config = quantize_model(inner, config, group_size=32, bits=4)
    save_model(tmp_path, inner)
    save_config(config, tmp_path / "config.json")
    model, _ = load_model(str(tmp_path))
    experts = model.layers[0].mlp.switch_mlp.gate_proj
    assert experts.bits == 4 and experts.weight.dtype == mx.uint32
    prompt = np.load(FIXTURES / "qwen3_moe" / "reference.npz")["prompt"].tolist()
    prompt = prompt + prompt[:12]
    plain = [t for e in plain_steps(model, prompt, GREEDY, 24) for t in e.tokens]
    events = list(speculative_steps(model, prompt, GREEDY, 24, PromptLookup(1, 3), num_draft=3))
    assert [t for e in events for t in e.tokens] == plain
