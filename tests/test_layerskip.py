"""LayerSkip: lossless, and verification reuses what the early layers drafted."""

import itertools

import mlx.core as mx
import pytest

from mlx_spec.decoding import speculative_steps
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.layerskip import LayerSkip, choose_exit
from mlx_spec.errors import UserError
from mlx_spec.models import load_model
from mlx_spec.models.llama import DecoderLayer
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
    """A 4-layer target: room for exits at 1, 2 and 3."""
    path = make_checkpoint(tmp_path_factory.mktemp("deep"), "qwen3", num_hidden_layers=4)
    return load_model(str(path))[0]


@pytest.mark.parametrize("exit_layer", [1, 2, 3, None])
def test_greedy_is_token_identical_to_plain(deep, greedy, exit_layer):
    for prompt, max_tokens, k in itertools.product(PROMPTS, (1, 5, 30), (None, 1, 4)):
        plain = greedy(prompt, max_tokens)
        events = list(speculative_steps(deep, prompt, GREEDY, max_tokens, LayerSkip(deep, exit_layer), num_draft=k))
        assert tokens_of(events) == plain, (exit_layer, prompt, max_tokens, k)


def test_verification_does_not_rerun_the_early_layers(deep, monkeypatch):
    """Every layer sees each token once: drafting runs the first E layers over
    the drafts, verification the rest (and the early ones only for the last draft)."""
    seen = [0] * len(deep.layers)
    index = {id(layer): i for i, layer in enumerate(deep.layers)}
    original = DecoderLayer.__call__

    def counting(self, x, mask, cache, positions):
        seen[index[id(self)]] += x.shape[1]
        return original(self, x, mask, cache, positions)

    monkeypatch.setattr(DecoderLayer, "__call__", counting)
    prompt = PROMPTS[1]
    events = list(speculative_steps(deep, prompt, GREEDY, 40, LayerSkip(deep, 2), num_draft=4))
    rounds = sum(len(e.drafted) + 1 for e in events)  # tokens each round puts through the model
    prefill = len(prompt) - 1
    assert seen == [prefill + rounds] * len(deep.layers), (seen, prefill + rounds)


def test_choose_exit_and_flag(deep):
    E = choose_exit(deep, PROMPTS[1])
    assert 1 <= E < len(deep.layers)
    drafter = make_drafter("layerskip", deep)
    drafter.add()
    drafter.restart(0, PROMPTS[1])
    assert drafter.exit == E
    assert make_drafter("layerskip=3", deep).exit == 3
    for bad in ("layerskip=0", "layerskip=4", "layerskip=x"):
        with pytest.raises(UserError, match="exit layer"):
            make_drafter(bad, deep)


def test_sampling_matches_target_distribution():
    target = tiny(0, V, logit_scale=0.3, num_hidden_layers=2)
    params = SamplingParams(temp=1.0)
    p = exact_joint(target, STAT_PROMPT, params, 3)
    assert empirical_tv(target, lambda: LayerSkip(target, 1), params, p, n=N // 2) < tv_bound(p, N // 2)


def test_early_exit_matches_the_truncated_model(deep):
    """The draft is the first E layers, the final norm and the LM head: the model's exit_layer."""
    prompt = PROMPTS[0]
    drafter = LayerSkip(deep, 2)
    cache = deep.make_cache()
    deep(mx.array([prompt[:-1]]), cache)
    drafter.bind(cache)
    drafter.add()
    draft = drafter.propose([prompt], [1], [GREEDY])[0]
    logits, _ = deep(mx.array([prompt]), exit_layer=2)
    assert draft.tokens.tolist() == [mx.argmax(logits[0, -1]).item()]


def test_layerskip_fine_tune_makes_the_half_model_draft(stride_model, tmp_path):
    """`mlx-spec train layerskip` for a short run: the exit at L/2 drafts with
    more than 1.5 tokens per target forward on held-out rows, and the full
    model's held-out perplexity stays within 5% of what it was."""
    import json
    import math

    from conftest import _fast_blas_env
    from helpers import cli, tau_on_held_out_rows
    from tiny import write_stride_data
    from mlx_spec.train.lm import lm_loss

    data = write_stride_data(tmp_path / "data", stride_model)
    rows = mx.array([json.loads(line)["tokens"] for line in (data / "valid.jsonl").read_text().splitlines()])

    def perplexity(path):
        return math.exp(lm_loss(load_model(str(path))[0], rows).item())

    out = tmp_path / "tuned"
    proc = cli("train", "layerskip", "--target", stride_model, "--data", data, "-o", out, "--steps", "40",
               "--batch-size", "16", "--seq-len", "48", "--lr", "1e-3", "--warmup", "10", "--quiet",
               env=_fast_blas_env())
    assert proc.returncode == 0, proc.stderr
    before, after = perplexity(stride_model), perplexity(out)
    assert after < 1.05 * before, (before, after)
    tuned, _ = load_model(str(out))
    half = len(tuned.layers) // 2
    tau = tau_on_held_out_rows(tuned, out, lambda: LayerSkip(tuned, half), 4)
    assert tau > 1.5, tau
