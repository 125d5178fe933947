"""EAGLE-1/2/3 drafters: lossless greedy and exact sampling, chain and dynamic tree."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec.decoding import plain_steps, speculative_steps
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.eagle import Eagle, EagleNet, eagle_config, load_eagle, save_eagle
from mlx_spec.errors import UserError
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams
from helpers import later_turns_are_exact
from stats import N, STAT_PROMPT, V, empirical_tv, exact_joint, plain_greedy, tiny, tokens_of, tv_bound

GREEDY = SamplingParams()


def random_net(target, version, seed=0, draft_vocab=None):
    """A drafter with random weights; EAGLE-3 with a reduced vocabulary when asked."""
    mx.random.seed(seed)
    net = EagleNet(eagle_config(target, version, draft_vocab_size=draft_vocab))
    if version == 3 and draft_vocab:
        used = np.sort(np.random.default_rng(seed).choice(target.args.vocab_size, draft_vocab, replace=False))
        net.d2t = mx.array(used - np.arange(draft_vocab), dtype=mx.int32)
    mx.eval(net.parameters())
    return net


@pytest.fixture(scope="module")
def target(checkpoints):
    return load_model(str(checkpoints["qwen3"]))[0]


PROMPTS = [[1, 87, 85, 71, 84], [40, 41, 42, 43, 44, 45, 46, 47, 40, 41], [7]]
CASES = {
    "eagle1-chain": (1, None, None),
    "eagle1-tree": (1, None, 10),
    "eagle3-chain": (3, None, None),
    "eagle3-small-vocab-chain": (3, 100, None),
    "eagle3-small-vocab-tree": (3, 100, 12),
}


@pytest.fixture(scope="module")
def greedy(target):
    return plain_greedy(target, PROMPTS, 30)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_is_token_identical_to_plain(target, greedy, case):
    version, draft_vocab, budget = CASES[case]
    net = random_net(target, version, draft_vocab=draft_vocab)
    for prompt, max_tokens, k in itertools.product(PROMPTS, (1, 5, 30), (None, 1, 4)):
        plain = greedy(prompt, max_tokens)
        drafter = Eagle(net, target, budget=budget, topk=3, depth=4)
        events = list(speculative_steps(target, prompt, GREEDY, max_tokens, drafter, num_draft=k))
        assert tokens_of(events) == plain, (case, prompt, max_tokens, k)


@pytest.mark.parametrize("version,budget", [(1, None), (3, None), (3, 10)])
def test_a_compiled_drafter_drafts_what_the_eager_one_does(target, version, budget):
    # A drafter built from a checkpoint compiles its net (what runs before and after its attention, traced
    # per shape): its drafts, chain or tree, are the same tokens.
    eager, fast = random_net(target, version), random_net(target, version)
    fast.compile()
    for prompt in PROMPTS:
        drafted = [[e.drafted for e in speculative_steps(target, prompt, GREEDY, 20,
                                                         Eagle(net, target, budget=budget, topk=3, depth=4),
                                                         num_draft=4)]
                   for net in (eager, fast)]
        assert drafted[0] == drafted[1]


@pytest.mark.parametrize("most", [512, 4])
def test_draft_extend_keeps_the_drafters_cache_exact(target, most, monkeypatch):
    """After any run, the drafter's committed slots equal a fresh pass over the
    same tokens with the target's real features (also where it reads its features
    `most` slots a forward: a long prompt's are read in pieces)."""
    from mlx_spec.drafters import eagle

    monkeypatch.setattr(eagle, "READ_MAX", most)
    net = random_net(target, 3)
    drafter = Eagle(net, target)
    prompt = PROMPTS[1]
    out = tokens_of(speculative_steps(target, prompt, GREEDY, 20, drafter, num_draft=3))
    context = prompt + out
    drafter.propose([context], [1], [GREEDY])  # extends over the last round's features
    n = drafter.committed[0]
    assert n == len(context) - 1
    _, hidden = target(mx.array([context]), capture=drafter.capture)
    f = mx.concatenate(hidden, axis=-1)[:, :n]
    fresh = net(f, target.model.embed_tokens(mx.array([context[1 : n + 1]])), mask="causal")
    keys = drafter.cache[0].keys[..., :n, :]
    from mlx_spec.cache import KVCache

    ref_cache = KVCache()
    net(f, target.model.embed_tokens(mx.array([context[1 : n + 1]])), ref_cache, mask="causal")
    assert mx.abs(keys - ref_cache.keys[..., :n, :]).max().item() < 1e-5
    assert mx.abs(drafter.ahead[0] - fresh[0, -1]).max().item() < 1e-5


@pytest.mark.parametrize("version,budget", [(1, None), (3, None), (3, 10)])
def test_a_later_turn_keeps_the_cache_and_is_exact(target, version, budget):
    kept = later_turns_are_exact(target, Eagle(random_net(target, version), target, budget=budget, topk=3, depth=4), PROMPTS[1])
    assert kept[0] > len(PROMPTS[1]) and kept[1] > 0


def test_save_load_and_make_drafter(target, checkpoints, tmp_path):
    path = str(checkpoints["qwen3"])
    for version, kind in ((1, "eagle"), (3, "eagle3")):
        net = random_net(target, version, draft_vocab=100 if version == 3 else None)
        config = eagle_config(target, version, draft_vocab_size=100 if version == 3 else None)
        save_eagle(tmp_path / kind, net, config)
        loaded, _, _ = load_eagle(str(tmp_path / kind))
        H = target.args.hidden_size
        x = mx.ones((1, 2, H if version == 1 else 3 * H)) * 0.1
        e = mx.ones((1, 2, H)) * 0.2
        assert mx.array_equal(loaded(x, e, mask="causal"), net(x, e, mask="causal"))
        drafter = make_drafter(f"{kind}={tmp_path / kind}", target, tree_budget=8)
        assert isinstance(drafter, Eagle) and drafter.budget == 8
    with pytest.raises(UserError, match="eagle3="):
        make_drafter(f"eagle={tmp_path / 'eagle3'}", target)
    other, _ = load_model(path)
    other.args.hidden_size += 1
    with pytest.raises(UserError, match="hidden size"):
        make_drafter(f"eagle={tmp_path / 'eagle'}", other)


@pytest.fixture(scope="module")
def stat_target():
    return tiny(0, V, logit_scale=0.3)


@pytest.mark.parametrize(
    "version,budget", [(1, None), (1, 6), (3, None), (3, 6)], ids=["eagle1-chain", "eagle1-tree", "eagle3-chain", "eagle3-tree"]
)
def test_sampling_matches_target_distribution(stat_target, version, budget):
    net = random_net(stat_target, version, seed=3)
    params = SamplingParams(temp=1.0)
    p = exact_joint(stat_target, STAT_PROMPT, params, 3)
    make = lambda: Eagle(net, stat_target, budget=budget, topk=2, depth=2)  # noqa: E731
    assert empirical_tv(stat_target, make, params, p) < tv_bound(p, N)


def test_trained_eagle3_accepts_and_trees_beat_chains(stride_model, tmp_path):
    """`mlx-spec train eagle3` for short runs on a tiny trained target: on
    held-out rows, >= 2 tokens per target forward; and for a drafter whose
    chains still break (trained for one drafting step only), a dynamic tree of
    the same depth does better (a chain that is always right leaves it nothing)."""
    from conftest import _fast_blas_env
    from helpers import cli, tau_on_held_out_rows
    from tiny import write_stride_data

    data = write_stride_data(tmp_path / "data", stride_model)
    target, _ = load_model(str(stride_model))
    taus = {}
    for name, steps, ttt in (("full", "30", "3"), ("one-step", "15", "1")):
        out = tmp_path / name
        proc = cli("train", "eagle3", "--target", stride_model, "--data", data, "-o", out, "--steps", steps,
                   "--ttt-steps", ttt, "--batch-size", "16", "--seq-len", "48", "--lr", "3e-3", "--warmup", "10",
                   "--draft-vocab", "64", "--quiet", env=_fast_blas_env())
        assert proc.returncode == 0, proc.stderr
        net, config, _ = load_eagle(str(out))
        assert config["eagle"]["draft_vocab_size"] == 64 and net.version == 3
        for b in (None, 16):
            make = lambda: Eagle(net, target, budget=b, topk=4, depth=4)  # noqa: E731
            taus[name, b] = tau_on_held_out_rows(target, stride_model, make, 4)
    assert taus["full", None] >= 2.0 and taus["full", 16] >= taus["full", None], taus
    assert taus["one-step", 16] > taus["one-step", None], taus


def test_train_eagle1_writes_a_loadable_drafter(stride_model, tmp_path):
    from conftest import _fast_blas_env
    from helpers import cli
    from tiny import write_stride_data

    data = write_stride_data(tmp_path / "data", stride_model)
    out = tmp_path / "eagle1"
    proc = cli("train", "eagle", "--target", stride_model, "--data", data, "-o", out, "--steps", "20",
               "--batch-size", "8", "--seq-len", "32", "--lr", "3e-3", "--warmup", "2", "--quiet",
               env=_fast_blas_env())
    assert proc.returncode == 0, proc.stderr
    target, _ = load_model(str(stride_model))
    drafter = make_drafter(f"eagle={out}", target)
    prompt = [int(t) for t in np.arange(5) + 67]
    assert tokens_of(speculative_steps(target, prompt, GREEDY, 12, drafter)) == tokens_of(
        plain_steps(target, prompt, GREEDY, 12)
    )


def test_recycle_normed_feeds_the_normed_state(target):
    """EAGLE 3.1's option changes what later drafting steps read, not the output."""
    net = random_net(target, 3)
    x = mx.random.normal((1, 1, target.args.hidden_size))
    assert mx.array_equal(net.next_feature(x), x)
    net.recycle_normed = True
    assert mx.allclose(net.next_feature(x), net.norm(x))
    prompt = PROMPTS[1]
    plain = tokens_of(plain_steps(target, prompt, GREEDY, 20))
    assert tokens_of(speculative_steps(target, prompt, GREEDY, 20, Eagle(net, target), num_draft=4)) == plain


def test_regenerate_rewrites_answers_with_the_target(target):
    from mlx_spec.train.data import Example, regenerate

    # More examples than rows in the batch, one without a prompt, one stopped by EOS.
    solo = [tokens_of(plain_steps(target, p, GREEDY, 6)) for p in PROMPTS[:3]]
    eos = solo[1][2]
    examples = [Example(p + [5, 6, 7, 8, 9, 10], len(p)) for p in PROMPTS[:3]] + [Example([9, 10, 11], 0)]
    out = regenerate(target, examples, seq_len=64, eos={eos}, batch_size=2)
    for p, want, got in zip(PROMPTS, solo, out):
        stop = want.index(eos) + 1 if eos in want else len(want)
        assert got == Example(p + want[:stop], len(p))
    assert out[3] == examples[3]
