"""DFlash: lossless greedy and exact sampling, block and DDTree."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec.cache import KVCache
from mlx_spec.decoding import speculative_steps
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.dflash import DFlash, DFlashNet, load_dflash, save_dflash
from mlx_spec.drafters.dflash_layouts import dflash_config
from mlx_spec.errors import UserError
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams
from helpers import later_turns_are_exact
from stats import N, STAT_PROMPT, V, empirical_tv, exact_joint, plain_greedy, tiny, told_apart, tokens_of, tv_bound

GREEDY = SamplingParams()


def random_net(target, seed=0, block=8, sliding=False):
    mx.random.seed(seed)
    config = dflash_config(target, num_layers=2, block_size=block, mask_token_id=target.args.vocab_size - 1,
                           target_layers=list(range(target.args.num_hidden_layers)))
    if sliding:
        config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    net = DFlashNet(config)
    mx.eval(net.parameters())
    return net, config


@pytest.fixture(scope="module")
def target(checkpoints):
    return load_model(str(checkpoints["qwen3"]))[0]


PROMPTS = [[1, 87, 85, 71, 84], [40, 41, 42, 43, 44, 45, 46, 47, 40, 41], [7]]


@pytest.fixture(scope="module")
def greedy(target):
    return plain_greedy(target, PROMPTS, 30)


@pytest.mark.parametrize("budget,sliding", [(None, False), (10, False), (None, True)], ids=["block", "ddtree", "sliding"])
def test_greedy_is_token_identical_to_plain(target, greedy, budget, sliding):
    net, _ = random_net(target, sliding=sliding)
    for prompt, max_tokens, k in itertools.product(PROMPTS, (1, 5, 30), (None, 2, 7)):
        plain = greedy(prompt, max_tokens)
        events = list(speculative_steps(target, prompt, GREEDY, max_tokens, DFlash(net, target, budget), num_draft=k))
        assert tokens_of(events) == plain, (budget, prompt, max_tokens, k)


def test_block_attends_to_the_whole_context(target):
    """Context features arrive in pieces over rounds; the cached keys equal one
    pass over all of them, and the block's output does not depend on how they came."""
    net, _ = random_net(target)
    rng = np.random.default_rng(0)
    F = net.fc.weight.shape[1]
    feats = mx.array(rng.standard_normal((1, 9, F)).astype(np.float32))
    block = target.model.embed_tokens(mx.array([[5] + [target.args.vocab_size - 1] * 7]))
    whole = [KVCache() for _ in net.layers]
    pieces = [KVCache() for _ in net.layers]
    a = net(block, feats, whole)
    net(block, feats[:, :4], pieces)
    b = net(block, feats[:, 4:], pieces)
    assert mx.abs(a - b).max().item() < 1e-5
    assert whole[0].offset == pieces[0].offset == 9


@pytest.mark.parametrize("budget", [None, 10])
def test_a_later_turn_keeps_the_cache_and_is_exact(target, budget):
    kept = later_turns_are_exact(target, DFlash(random_net(target)[0], target, budget), PROMPTS[1])
    assert kept[0] > len(PROMPTS[1]) and kept[1] > 0


def test_save_load_and_errors(target, tmp_path):
    net, config = random_net(target)
    save_dflash(tmp_path / "dflash", net, config)
    loaded, _, _ = load_dflash(str(tmp_path / "dflash"))
    block = mx.ones((1, 8, target.args.hidden_size))
    feats = mx.ones((1, 3, net.fc.weight.shape[1]))
    assert mx.array_equal(loaded(block, feats, [KVCache() for _ in net.layers]),
                          net(block, feats, [KVCache() for _ in net.layers]))
    assert isinstance(make_drafter(f"dflash={tmp_path / 'dflash'}", target), DFlash)
    config["dflash_config"]["mask_token_id"] = target.args.vocab_size + 5
    save_dflash(tmp_path / "bad-mask", net, config)
    with pytest.raises(UserError, match="mask_token_id"):
        make_drafter(f"dflash={tmp_path / 'bad-mask'}", target)
    config["dflash_config"]["mask_token_id"] = 3
    config["dflash_config"]["target_layer_ids"] = [0, 7]
    save_dflash(tmp_path / "bad-layers", net, config)
    with pytest.raises(UserError, match="target_layer_ids"):
        make_drafter(f"dflash={tmp_path / 'bad-layers'}", target)


@pytest.fixture(scope="module")
def stat_target():
    return tiny(0, V, logit_scale=0.3)


@pytest.mark.parametrize("budget, draft_vocab", [(None, None), (5, None), (None, 2)],
                         ids=["block", "ddtree", "draft vocabulary"])
def test_sampling_matches_target_distribution(stat_target, budget, draft_vocab, monkeypatch):
    """(A draft vocabulary of its own, speculators': drafts only ever propose 2 of the 4 tokens; there a
    wrong acceptance rule is told apart too.)"""
    mx.random.seed(3)
    config = dflash_config(stat_target, num_layers=1, block_size=4, mask_token_id=V - 1, target_layers=[0])
    config["dflash_config"]["draft_vocab_size"] = draft_vocab
    net = DFlashNet(config)
    if draft_vocab:
        net.d2t = mx.array([1, 1], dtype=mx.int32)  # draft tokens 0, 1 are the target's 1, 2
    mx.eval(net.parameters())
    params = SamplingParams(temp=1.0)
    p = exact_joint(stat_target, STAT_PROMPT, params, 3)
    assert empirical_tv(stat_target, lambda: DFlash(net, stat_target, budget), params, p) < tv_bound(p, N)
    if draft_vocab:
        from mlx_spec import sampling
        from test_speculative import resample_from_target

        monkeypatch.setattr(sampling, "accept_sampled", resample_from_target)
        assert told_apart(stat_target, lambda: DFlash(net, stat_target, budget), params, p)


def test_registry_names_the_published_drafter(target, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="z-lab/Qwen3-8B-DFlash-b16"):
        make_drafter("dflash", target, target_source="Qwen/Qwen3-8B")
    with pytest.raises(UserError, match="AngelSlim/Qwen3-8B_eagle3: not in the Hugging Face cache"):
        make_drafter("eagle3", target, target_source="Qwen/Qwen3-8B")
    with pytest.raises(UserError, match="no published dflash drafter"):
        make_drafter("dflash", target, target_source="someone/unknown-model")


def test_trained_dflash_accepts_and_ddtree_beats_the_block(stride_model, tmp_path):
    """`mlx-spec train dflash` for short runs on a tiny trained target: on
    held-out rows, more than 2.5 tokens per target forward from one block; and
    where the block still errs (the shorter run), a DDTree over the same block
    does better (a block that is already right everywhere leaves it nothing)."""
    from conftest import _fast_blas_env
    from helpers import cli, tau_on_held_out_rows
    from tiny import write_stride_data

    data = write_stride_data(tmp_path / "data", stride_model)
    target, _ = load_model(str(stride_model))
    taus, out = {}, tmp_path / "dflash"
    for steps in (40, 80):  # the longer run goes on from the shorter one's checkpoint
        proc = cli("train", "dflash", "--target", stride_model, "--data", data, "-o", out, "--steps", str(steps),
                   "--batch-size", "16", "--seq-len", "48", "--lr", "3e-3", "--warmup", "10", "--block-size", "8",
                   "--loss-decay", "0.7", "--save-every", "100", "--quiet", *(["--resume"] if steps == 80 else []),
                   env=_fast_blas_env())
        assert proc.returncode == 0, proc.stderr
        net = make_drafter(f"dflash={out}", target).net
        for budget in (None, 24):
            taus[steps, budget] = tau_on_held_out_rows(target, stride_model, lambda: DFlash(net, target, budget), 7)
    # (Where the block is right nearly everywhere the tree can only tie it, give or take where the rounds
    # end against the 24-token cap: trained with a multithreaded BLAS, each run's drafter differs a little.)
    assert taus[80, None] > 2.5 and taus[80, 24] >= 0.95 * taus[80, None], taus
    assert taus[40, 24] > taus[40, None], taus
