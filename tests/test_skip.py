"""Draft & Verify: the target with layers skipped drafts, losslessly."""

import itertools
import json

import mlx.core as mx
import pytest

from mlx_spec.decoding import plain_steps, speculative_steps
from mlx_spec.drafters.skip import SkipDrafter, SkipView, load_skip_set, save_skip_set, search_skip, skip_drafter
from mlx_spec.errors import UserError
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams
from tiny import make_checkpoint
from stats import N, STAT_PROMPT, V, empirical_tv, exact_joint, plain_greedy, tiny, tokens_of, tv_bound

GREEDY = SamplingParams()
PROMPTS = [[1, 87, 85, 71, 84], [40, 41, 42, 43, 44, 45, 46, 47, 40, 41], [7]]


@pytest.fixture(scope="module")
def greedy(deep):
    return plain_greedy(deep, PROMPTS, 30)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("deep"), "qwen3", num_hidden_layers=6)
    return load_model(str(path))[0]


@pytest.mark.parametrize("skip", [[1], [2, 3], [1, 2, 3, 4], None])
def test_greedy_is_token_identical_to_plain(deep, greedy, skip):
    for prompt, max_tokens, k in itertools.product(PROMPTS, (1, 5, 30), (None, 1, 4)):
        plain = greedy(prompt, max_tokens)
        events = list(speculative_steps(deep, prompt, GREEDY, max_tokens, SkipDrafter(deep, skip), num_draft=k))
        assert tokens_of(events) == plain, (skip, prompt, max_tokens, k)


def test_a_session_reuses_its_cache_and_set(deep):
    """Two generations of one drafter (a chat's turns) stay identical to plain."""
    drafter = SkipDrafter(deep)
    first = PROMPTS[1]
    out = tokens_of(speculative_steps(deep, first, GREEDY, 12, drafter, num_draft=3))
    skip = drafter.skip
    second = first + out + [7, 8]
    events = speculative_steps(deep, second, GREEDY, 12, drafter, num_draft=3)
    assert tokens_of(events) == tokens_of(plain_steps(deep, second, GREEDY, 12))
    assert drafter.skip == skip and drafter.new_session().skip == skip


def make_identity(target, i):
    """Layer i adds nothing to the residual stream. Before any forward: the
    loaded model's compiled layers keep the weights they were traced with."""
    layer = target.layers[i]
    layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)


def test_view_is_the_model_without_those_layers(tmp_path):
    """Skipping a layer equals running the target with that layer an identity."""
    path = str(make_checkpoint(tmp_path, "qwen3", num_hidden_layers=4))
    target, identity = load_model(path)[0], load_model(path)[0]
    make_identity(identity, 2)
    tokens = mx.array([PROMPTS[1]])
    assert mx.allclose(SkipView(target, [2])(tokens)[0], identity(tokens)[0], atol=1e-4)


def test_sampling_matches_target_distribution():
    target = tiny(0, V, logit_scale=0.3, num_hidden_layers=3)
    params = SamplingParams(temp=1.0)
    p = exact_joint(target, STAT_PROMPT, params, 3)
    assert empirical_tv(target, lambda: SkipDrafter(target, [1]), params, p, n=N // 2) < tv_bound(p, N // 2)


def test_search_skips_an_identity_layer_but_never_the_first_or_last(tmp_path):
    path = str(make_checkpoint(tmp_path, "qwen3", num_hidden_layers=5))
    assert search_skip(load_model(path)[0], PROMPTS) == []  # random layers: no set pays
    target = load_model(path)[0]
    for i in (0, 2, 4):
        make_identity(target, i)
    skip = search_skip(target, PROMPTS)
    assert 2 in skip and skip == sorted(set(skip)) and all(0 < i < 4 for i in skip)


def test_save_load_round_trip_and_mismatch(deep, tmp_path):
    path = tmp_path / "skip.json"
    save_skip_set(path, [3, 1], deep)
    assert json.loads(path.read_text()) == {"skip": [1, 3], "num_hidden_layers": 6}
    assert load_skip_set(path, deep) == [1, 3]
    assert skip_drafter(deep, str(path)).skip == [1, 3]
    path.write_text(json.dumps({"skip": [1], "num_hidden_layers": 4}))
    with pytest.raises(UserError, match="skip.json.*4 layers.*6"):
        load_skip_set(path, deep)
    path.write_text(json.dumps({"skip": [5], "num_hidden_layers": 6}))
    with pytest.raises(UserError, match="skip.json"):
        load_skip_set(path, deep)


def test_spec_parsing_and_search_saved_at_first_prompt(deep, tmp_path):
    assert skip_drafter(deep, "3,1").skip == [1, 3]
    for bad in ("0", "5", "1,1", "x"):
        with pytest.raises(UserError, match="skip="):
            skip_drafter(deep, bad)
    path = tmp_path / "searched.json"
    drafter = skip_drafter(deep, str(path))
    assert drafter.skip is None and not path.exists()
    drafter.add()
    drafter.restart(0, PROMPTS[1])
    assert load_skip_set(path, deep) == drafter.skip == search_skip(deep, [PROMPTS[1]])
    assert skip_drafter(deep, None).skip is None
