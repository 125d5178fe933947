"""Parallel MTP heads: lossless, exact, and trained heads get accepted."""

import itertools

import mlx.core as mx
import pytest

from mlx_spec.decoding import speculative_steps
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.mtp_heads import MTPHeads, MTPHeadsDrafter, mtp_heads_config
from mlx_spec.files import write_model_files
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams
from stats import N, STAT_PROMPT, V, empirical_tv, exact_joint, plain_greedy, tiny, tokens_of, tv_bound

GREEDY = SamplingParams()
PROMPTS = [[1, 87, 85, 71, 84], [40, 41, 42, 43, 44, 45, 46, 47, 40, 41], [7]]


@pytest.fixture(scope="module")
def greedy(target):
    return plain_greedy(target, PROMPTS, 30)


@pytest.fixture(scope="module")
def target(checkpoints):
    return load_model(str(checkpoints["qwen3"]))[0]


@pytest.mark.parametrize("budget", [None, 8], ids=["chain", "tree"])
def test_greedy_is_token_identical_to_plain(target, greedy, budget, tmp_path):
    mx.random.seed(0)
    config = mtp_heads_config(target, 3)
    heads = MTPHeads(config)
    write_model_files(tmp_path / "heads", config, heads.weights())
    drafter = make_drafter(f"mtp-heads={tmp_path / 'heads'}", target, tree_budget=budget)
    for prompt, max_tokens, k in itertools.product(PROMPTS, (1, 5, 30), (None, 2, 3)):
        plain = greedy(prompt, max_tokens)
        events = list(speculative_steps(target, prompt, GREEDY, max_tokens, drafter.new_session(), num_draft=k))
        assert tokens_of(events) == plain, (budget, prompt, max_tokens, k)


def test_a_head_reads_the_trunk_only_when_it_drafts(target):
    """Rounds that draft one token run only the first head; when a round drafts
    three, the others catch up and draft what heads that read every state do."""
    mx.random.seed(0)
    heads = MTPHeads(mtp_heads_config(target, 3))
    short, full = MTPHeadsDrafter(heads, target), MTPHeadsDrafter(heads, target)
    prompt = PROMPTS[1]
    for drafter in (short, full):
        drafter.add()
        drafter.restart(0, prompt[:1])

    def draft(drafter, context, k):
        return drafter.propose([context], [k], [GREEDY])[0].tokens.tolist()

    _, (trunk,) = target(mx.array(prompt)[None], capture=short.capture)  # [1, S, H]
    start = 0
    for end in (4, 6, 9):  # the trunk states of prompt[:end] are committed; prompt[end] is pending
        for drafter in (short, full):
            drafter.commit(0, prompt[: end + 1], (trunk[:, start:end],))
        assert draft(short, prompt[: end + 1], 1) == draft(full, prompt[: end + 1], 3)[:1]
        start = end
    assert [c.offset for c in short.caches] == [9, 0, 0]
    assert draft(short, prompt, 3) == draft(full, prompt, 3)
    assert [c.offset for c in short.caches] == [9, 9, 9]


def test_sampling_matches_target_distribution():
    stat_target = tiny(0, V, logit_scale=0.3)
    mx.random.seed(3)
    heads = MTPHeads(mtp_heads_config(stat_target, 2))
    params = SamplingParams(temp=1.0)
    p = exact_joint(stat_target, STAT_PROMPT, params, 3)
    assert empirical_tv(stat_target, lambda: MTPHeadsDrafter(heads, stat_target), params, p) < tv_bound(p, N)


def test_trained_heads_get_accepted(stride_model, tmp_path):
    """`mlx-spec train mtp-heads` for a short run on a tiny trained target: more
    than 1.5 tokens per target forward on held-out rows."""
    from conftest import _fast_blas_env
    from helpers import cli, tau_on_held_out_rows
    from tiny import write_stride_data

    data = write_stride_data(tmp_path / "data", stride_model)
    out = tmp_path / "heads"
    proc = cli("train", "mtp-heads", "--target", stride_model, "--data", data, "-o", out, "--heads", "3",
               "--steps", "20", "--batch-size", "8", "--seq-len", "48", "--lr", "3e-3", "--warmup", "5",
               "--quiet", env=_fast_blas_env())
    assert proc.returncode == 0, proc.stderr
    stride_target, _ = load_model(str(stride_model))
    drafter = make_drafter(f"mtp-heads={out}", stride_target)
    tau = tau_on_held_out_rows(stride_target, stride_model, drafter.new_session, 3)
    assert tau > 1.5, tau
