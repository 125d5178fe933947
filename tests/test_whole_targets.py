"""Families mlx-spec runs through mlx-lm's forward, whole (mlx_spec/models/whole.py): Gemma 4
(per-layer inputs, keys and values shared across layers, a final softcap), Gemma 2 (softcaps),
GLM-4.5's mixture of experts, LFM2, dense and mixture of experts (short convolutions beside
attention), Granite 4.0-H and Nemotron-H (Mamba-2 layers beside attention) and DeepSeek-V3.2 (its
sparse attention's indexer keeping keys of its own), each a tiny checkpoint transformers saved,
checked against the tokens and logits transformers computed on it (scripts/make_mlxlm_reference.py,
`WHOLE`); every chain drafter, the feature-reading ones included, greedy-identical to plain;
speculative sampling distributed as the target's own; what needs the layers apart refused in one
line."""

import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec import sampling
from mlx_spec.cache import RecurrentCache
from mlx_spec.decoding import plain_steps, speculative_steps
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.draft_model import DraftModel
from mlx_spec.errors import UserError
from mlx_spec.models import load_model
from mlx_spec.models.mlxlm import MLXLMTarget
from mlx_spec.models.whole import WholeTarget
from mlx_spec.sampling import SamplingParams

from stats import FAMILY_N, STAT_PROMPT, V, empirical_tv, exact_joint, tiny, told_apart, tv_bound
from test_mlxlm_targets import FIXTURES, assert_is_transformers, chain_drafter, families, load_family, seeded
from test_speculative import resample_from_target

WHOLE = ("gemma4_text", "gemma4", "gemma2", "glm4_moe", "lfm2", "lfm2_moe", "granitemoehybrid", "nemotron_h",
         "deepseek_v32")
GREEDY = SamplingParams()


family = families(WHOLE)


def test_plain_greedy_is_transformers(family):
    """Softcaps, Gemma 4's shared keys and values and per-layer inputs, sliding windows shorter than the text."""
    assert isinstance(family[2], WholeTarget)
    assert_is_transformers(family)


@pytest.mark.parametrize("kind", ["lookup", "draft", "eagle3", "dflash", "mtp-heads"])
def test_chain_drafters_are_greedy_identical(family, kind):
    """Chains verified by mlx-lm's forward on mlx-spec's cache; EAGLE-3 and DFlash read the hidden
    states captured entering the wrapped layers."""
    name, _, model, prompt, _ = family
    prompt = prompt + prompt[:12]  # (something for lookup to find)
    plain = [t for e in plain_steps(model, prompt, GREEDY, 24) for t in e.tokens]
    events = list(speculative_steps(model, prompt, GREEDY, 24, chain_drafter(kind, model), num_draft=3))
    assert [t for e in events for t in e.tokens] == plain
    assert sum(len(e.drafted) for e in events) > 0


def test_a_model_with_several_caches_a_layer_drafts_for_itself():
    """DeepSeek-V3.2 (each layer's attention keys beside its indexer's) as a draft model: its rows' caches
    grow as the target's do."""
    _, _, model, prompt, _ = load_family("deepseek_v32")
    plain = [t for e in plain_steps(model, prompt, GREEDY, 16) for t in e.tokens]
    events = list(speculative_steps(model, prompt, GREEDY, 16, chain_drafter("self", model), num_draft=3))
    assert [t for e in events for t in e.tokens] == plain and sum(e.accepted for e in events) > 0


def test_gemma3_with_a_softcap_is_transformers():
    """A Gemma 3 config that sets `final_logit_softcapping`: transformers caps the logits, mlx-lm's
    gemma3_text does not, mlx-spec does (the cap here is below the uncapped logits: it matters)."""
    path = FIXTURES / "gemma3_softcap"
    model, _ = load_model(str(path))
    ref = np.load(path / "reference.npz")
    logits = np.array(model(mx.array(ref["prompt"])[None])[0][0])
    assert isinstance(model, MLXLMTarget) and model.softcap == 3.0
    assert np.abs(logits - ref["logits"]).max() < 5e-4
    model.softcap = None
    assert np.abs(np.array(model(mx.array(ref["prompt"])[None])[0][0]) - ref["logits"]).max() > 1e-2


def test_what_needs_the_layers_apart_is_refused(family):
    name, _, model, prompt, _ = family
    for spec in ("layerskip", "skip"):
        with pytest.raises(UserError, match=f"a {name} target runs whole"):
            make_drafter(spec, model)
    with pytest.raises(UserError, match="verifies chains only"):
        model(mx.array(prompt)[None], model.make_cache(), mask=mx.ones((1, 1, 24, 24), dtype=mx.bool_))


# Each family's tiny config for the sampling test: vocabulary V, one or two layers (mlx-lm's classes).
# (`gemma4` is `gemma4_text` in a `text_config`: the same model.)
TINY = {
    "gemma4_text": dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, global_head_dim=16, vocab_size_per_layer_input=V,
                        hidden_size_per_layer_input=8, num_kv_shared_layers=1, sliding_window=4,
                        layer_types=["full_attention", "full_attention"], final_logit_softcapping=2.0),
    "gemma2": dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=16, rope_theta=10000.0, rope_traditional=False,
                   attn_logit_softcapping=5.0, final_logit_softcapping=2.0, query_pre_attn_scalar=16),
    "glm4_moe": dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64, moe_intermediate_size=16,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, n_group=1, topk_group=1,
                     n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=0,
                     routed_scaling_factor=1.0, norm_topk_prob=True, use_qk_norm=True, attention_bias=False,
                     partial_rotary_factor=0.5, rope_theta=10000.0, rope_scaling=None),
    "lfm2": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, norm_eps=1e-5,
                 conv_bias=False, conv_L_cache=3, block_dim=32, block_ff_dim=64, block_multiple_of=16,
                 block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, full_attn_idxs=[1], rope_theta=10000.0),
    "lfm2_moe": dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                     num_experts_per_tok=2, norm_topk_prob=True, num_attention_heads=2, num_key_value_heads=1,
                     use_expert_bias=True, num_dense_layers=0, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
                     full_attn_idxs=[1], rope_theta=10000.0),
    "granitemoehybrid": dict(hidden_size=32, num_hidden_layers=2, intermediate_size=16, num_attention_heads=2,
                             num_key_value_heads=1, attention_bias=False, embedding_multiplier=2.0,
                             attention_multiplier=0.25, logits_scaling=3.0, residual_multiplier=0.5,
                             layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=32, mamba_n_heads=4, mamba_d_head=16, mamba_proj_bias=False,
                             mamba_d_state=8, mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=True,
                             position_embedding_type="nope"),
    "nemotron_h": dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                       attention_bias=False, mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False,
                       ssm_state_size=8, conv_kernel=4, n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5,
                       use_bias=False, use_conv_bias=True, hybrid_override_pattern=["M", "*", "-"]),
    "deepseek_v32": dict(hidden_size=32, num_hidden_layers=1, intermediate_size=64, moe_intermediate_size=16,
                         num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=8,
                         qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, index_n_heads=16, index_head_dim=16,
                         index_topk=6, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2),
}


def tiny_whole(name: str, seed: int) -> WholeTarget:
    """A target of vocabulary V in family `name` (mlx-lm's class, seeded weights)."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{name}")
    config = dict(model_type=name, vocab_size=V, rms_norm_eps=1e-6, tie_word_embeddings=name != "glm4_moe",
                  max_position_embeddings=512, **TINY[name])
    return WholeTarget(seeded(module.Model(module.ModelArgs.from_dict(config)), seed), config)


@pytest.mark.parametrize("name", TINY)
def test_sampling_matches_the_targets_distribution(name, monkeypatch):
    """Speculative sampling at temperature 1 is distributed as the target's own (Gemma's softcapped ones,
    GLM-4.5's mixture of experts, ...; Gemma 4 as published runs gemma4_text's model)."""
    target = tiny_whole(name, 0)
    params = SamplingParams(temp=1.0)
    make = lambda: DraftModel(tiny(1, V, logit_scale=0.3), V)  # noqa: E731
    p = exact_joint(target, STAT_PROMPT, params, 3)
    assert empirical_tv(target, make, params, p, n=FAMILY_N) < tv_bound(p, FAMILY_N)
    monkeypatch.setattr(sampling, "accept_sampled", resample_from_target)  # a wrong rule fails it
    assert told_apart(target, make, params, p)


def test_a_family_with_state_beside_keys_and_values_is_refused(tmp_path):
    """Mamba's recurrence has no replay in mlx-spec: it could not be rolled back after a rejected draft,
    so it is refused, in one line."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import mamba

    config = dict(model_type="mamba", vocab_size=64, hidden_size=32, intermediate_size=64, state_size=8,
                  num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4)
    model = mamba.Model(mamba.ModelArgs.from_dict(config))
    folder = tmp_path / "mamba"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="mamba model keeps state mlx-spec cannot roll back"):
        load_model(str(folder))


def test_a_convolution_window_is_cut_to_the_kept_tokens():
    """LFM2: after a verification of 5 tokens cut back to 2 of them, each convolution's window is the
    one a forward of the kept tokens alone leaves (the rows' windows apart, one row not cut)."""
    model, _ = load_model(str(FIXTURES / "lfm2"))
    prompt = np.load(FIXTURES / "lfm2" / "reference.npz")["prompt"].tolist()
    cut = model.make_cache(2)
    model(mx.array([prompt, prompt[::-1]]), cut)
    model(mx.array([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]]), cut)
    for c in cut:
        c.cut(0, len(prompt) + 2)
    windows = [i for i, c in enumerate(cut) if isinstance(c, RecurrentCache)]
    assert len(windows) == 3
    for i in windows:
        cut[i].settle()
    for b, kept in enumerate([prompt + [5, 6], prompt[::-1] + [9, 8, 7, 6, 5]]):
        alone = model.make_cache()
        model(mx.array([kept]), alone)
        for i in windows:
            assert np.abs(np.array(cut[i].arrays[0][b]) - np.array(alone[i].arrays[0][0])).max() < 1e-5


def test_a_layer_with_several_caches_is_kept_whole_on_disk(tmp_path):
    """DeepSeek-V3.2's layers keep two caches (the attention's, the indexer's keys): a prompt cache entry
    written to disk and read back by the next start holds both, and the next turn decoded from it is the
    fresh run's."""
    from mlx_spec.prefix import PrefixCache

    model, _ = load_model(str(FIXTURES / "deepseek_v32"))
    prompt = np.load(FIXTURES / "deepseek_v32" / "reference.npz")["prompt"].tolist()
    cache = model.make_cache()
    first = [t for e in plain_steps(model, prompt, GREEDY, 6, cache=cache) for t in e.tokens]
    held = prompt + first[:-1]  # (the last token is not read yet)
    PrefixCache(1 << 30, tmp_path, "deepseek_v32").store(held, cache, None)
    turn = held + first[-1:] + [7, 8, 9]
    n, kept, _ = PrefixCache(1 << 30, tmp_path, "deepseek_v32").lookup(turn, model.make_cache)
    assert n == len(held) and all(len(c.caches) == 2 and c.lengths == [n] for c in kept)
    fresh = [t for e in plain_steps(model, turn, GREEDY, 12) for t in e.tokens]
    assert [t for e in plain_steps(model, turn, GREEDY, 12, cache=kept) for t in e.tokens] == fresh
