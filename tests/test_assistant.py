"""Gemma 4 assistants as Google publishes them (google/gemma-4-E2B-it-assistant: a centroid head;
google/gemma-4-31B-it-assistant: the tied embedding as head; both `gemma4_assistant`, bfloat16, the
tied head not stored): loaded as they are, round for round the drafts and logits transformers'
Gemma4AssistantForCausalLM computes (scripts/make_assistant_reference.py), greedy output identical
to plain decoding alone and in a batch, sampled output distributed as the target's; `--drafter
assistant` or `mtp` alone on a Gemma 4 model finds its published assistant."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec.drafters import find_drafter, make_drafter
from mlx_spec.drafters.assistant import Assistant, AssistantNet, check_fits
from mlx_spec.errors import UserError
from mlx_spec.models import load_model
from mlx_spec.models.whole import WholeTarget
from mlx_spec.sampling import SamplingParams

from helpers import assert_batch_is_greedy_identical, assert_rounds_are, fake_hub_cache
from stats import V, assert_distributed_as_target
from test_mlxlm_targets import FIXTURES as MLXLM, seeded

REFERENCE = MLXLM.parent / "assistant_reference"
TARGET = MLXLM / "gemma4_text"
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def target():
    return load_model(str(TARGET))[0]


@pytest.mark.parametrize("name", ["e2b", "31b"])
def test_drafts_are_transformers(target, name, monkeypatch):
    """Every round transformers drafted (3 tokens after the context it had): the same tokens and the same
    logits; the decoded tokens are plain greedy decoding's."""
    ref = np.load(REFERENCE / name / "reference.npz")
    drafter = make_drafter(f"assistant={REFERENCE / name}", target)
    assert isinstance(drafter, Assistant) and ("masked_embedding" in drafter.net) == (name == "e2b")
    logits, head = [], AssistantNet.logits
    monkeypatch.setattr(AssistantNet, "logits", lambda self, x: logits.append(head(self, x)) or logits[-1])
    assert_rounds_are(ref, target, drafter, 3, logits, lambda r: np.stack([np.array(x[0, 0]) for x in r]), atol=1e-3)  # float32 noise, three steps deep


def test_a_batch_is_greedy_identical(target):
    """Rows of different lengths drafted together (each its own keys, window and position)."""
    prompts = [list(np.load(REFERENCE / "e2b" / "reference.npz")["prompt"][:n]) for n in (5, 11, 24)]
    drafter = make_drafter(f"assistant={REFERENCE / 'e2b'}", target)
    assert_batch_is_greedy_identical(target, drafter, [[int(t) for t in p] for p in prompts], 20, 3)


def test_gemma4_as_published_is_drafted_for():
    """The multimodal form Google publishes (`gemma4`: the text model beside a vision tower) reads as the text
    model does: the assistant drafts from its caches, greedy output identical to plain."""
    published, _ = load_model(str(MLXLM / "gemma4"))
    prompt = np.load(MLXLM / "gemma4" / "reference.npz")["prompt"].tolist()
    drafter = make_drafter(f"assistant={REFERENCE / 'e2b'}", published)
    assert_batch_is_greedy_identical(published, drafter, [prompt, prompt[:9]], 16, 3)


def tiny_target(seed: int) -> WholeTarget:
    """A Gemma 4 text target of vocabulary V: a sliding layer (window 2) and a full one, each its own keys."""
    from mlx_lm.models import gemma4_text

    config = dict(model_type="gemma4_text", vocab_size=V, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=16, sliding_window=2,
                  layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0,
                  hidden_size_per_layer_input=0, vocab_size_per_layer_input=V, final_logit_softcapping=2.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=512)
    return WholeTarget(seeded(gemma4_text.Model(gemma4_text.ModelArgs.from_dict(config)), seed), config)


def tiny_assistant(target: WholeTarget, seed: int) -> Assistant:
    """An assistant for `tiny_target` with a centroid head (2 clusters of 2 tokens, the best one given logits)."""
    config = dict(model_type="gemma4_assistant", backbone_hidden_size=32, use_ordered_embeddings=True, num_centroids=2,
                  centroid_intermediate_top_k=1, text_config=dict(
                      hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, global_head_dim=16, sliding_window=2, vocab_size=V,
                      layer_types=["sliding_attention", "full_attention"], rms_norm_eps=1e-6))
    net = AssistantNet(config)
    order = net.masked_embedding.token_ordering
    seeded(net, seed)
    net.masked_embedding.token_ordering = order + mx.array([1, 3, 0, 2], dtype=mx.int32)  # clusters {1, 3}, {0, 2}
    return Assistant(net, target, check_fits(net, target, "test"))


def test_sampling_matches_the_targets_distribution(monkeypatch):
    """At temperature 1, drafts drawn from the centroid head's logits (half the vocabulary at its floor)."""
    target = tiny_target(0)
    assert_distributed_as_target(target, lambda: tiny_assistant(target, 1), monkeypatch)


def test_published_assistant_found_alone(target, tmp_path, monkeypatch):
    """`--drafter assistant`, or `mtp`, alone on google/gemma-4-E2B-it (from the Hugging Face cache, offline)."""
    from huggingface_hub import constants

    assert find_drafter("assistant", "mlx-community/gemma-4-26B-A4B-it-4bit") == "google/gemma-4-26B-A4B-it-assistant"
    assert find_drafter("assistant", "gemma4") == "google/gemma-4-26B-A4B-it-assistant"
    fake_hub_cache(tmp_path, "google/gemma-4-E2B-it-assistant", REFERENCE / "e2b")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for kind in ("assistant", "mtp"):
        drafter = make_drafter(kind, target, target_source="google/gemma-4-E2B-it")
        assert isinstance(drafter, Assistant) and "masked_embedding" in drafter.net


def test_what_does_not_fit_is_refused(target, tmp_path, checkpoints):
    """Another family's target, another Gemma 4's (E2B's assistant on a model of another width), a layer
    whose head size is not the target's, a config whose layers would keep keys of their own."""
    qwen3, _ = load_model(str(checkpoints["qwen3"]))
    with pytest.raises(UserError, match="drafts for a Gemma 4 model, not qwen3"):
        make_drafter(f"assistant={REFERENCE / 'e2b'}", qwen3)
    with pytest.raises(UserError, match="backbone_hidden_size 64, the target's hidden size is 32"):
        make_drafter(f"assistant={REFERENCE / 'e2b'}", tiny_target(0))
    config = json.loads((REFERENCE / "31b" / "config.json").read_text())
    narrow = AssistantNet({**config, "text_config": {**config["text_config"], "global_head_dim": 16}})
    with pytest.raises(UserError, match="full_attention layers' head size is 16, the target's 32"):
        check_fits(narrow, target, "--drafter assistant=x")
    folder = tmp_path / "assistant"
    shutil.copytree(REFERENCE / "31b", folder)
    (folder / "config.json").write_text(json.dumps({**config, "text_config": {**config["text_config"],
                                                                              "num_kv_shared_layers": 2}}))
    with pytest.raises(UserError, match="config.json: text_config.num_kv_shared_layers must be num_hidden_layers"):
        make_drafter(f"assistant={folder}", target)
