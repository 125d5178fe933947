"""Shared by the exactness tests: tiny models and the statistical check that
speculative sampling draws from the target's distribution."""

import itertools

import mlx.core as mx
import numpy as np

from mlx_spec.decoding import Decoder, plain_steps, speculative_steps
from mlx_spec.models import Model, parse_config
from mlx_spec.sampling import SamplingParams, log_probs
from tiny import make_config, random_weights


def tiny(seed: int, vocab: int, logit_scale: float = 1.0, **overrides) -> Model:
    shape = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, intermediate_size=64)
    config = make_config("qwen3", vocab_size=vocab, **{**shape, **overrides})
    weights = random_weights(config, seed)
    weights["model.norm.weight"] *= logit_scale  # flatter or peakier next-token distributions
    model = Model(parse_config(config))
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    model.compile()
    return model


def tokens_of(events, limit=None):
    out = [t for e in events for t in e.tokens]
    return out[:limit] if limit is not None else out


def plain_greedy(model, prompts, n: int):
    """`of(prompt, max_tokens)`: plain greedy decoding's tokens, each prompt decoded once, n tokens (a
    shorter run's tokens are a longer one's first)."""
    runs = {tuple(p): tokens_of(plain_steps(model, p, SamplingParams(), n)) for p in prompts}
    return lambda prompt, max_tokens: runs[tuple(prompt)][:max_tokens]


V = 4
STAT_PROMPT = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
N = 1500
FAMILY_N = 1000  # an architecture's own sampling check (its forwards, rollback and batch rows under the rule the
# drafters' checks hold to N draws): a wrong rule is told apart within 125-1000 draws on every family


def exact_joint(model, prompt, params, n_tokens):
    """P(t1..tn) under the target's processed distribution, over all V^n sequences."""
    probs = {}
    for seq in itertools.product(range(V), repeat=n_tokens):
        logits, _ = model(mx.array([prompt + list(seq)]))
        lp = np.array(log_probs(logits[0, len(prompt) - 1 : -1], params))  # [n, V]
        probs[seq] = float(np.exp(sum(lp[i, t] for i, t in enumerate(seq))))
    return probs


def tv_bound(p, n, quantile=0.999, sims=4000):
    """The TV distance that N exact draws from p exceed with probability 1e-3."""
    rng = np.random.default_rng(0)
    pv = np.array(list(p.values()))
    draws = rng.multinomial(n, pv / pv.sum(), size=sims) / n
    return float(np.quantile(0.5 * np.abs(draws - pv).sum(axis=1), quantile))


ALONE, ROWS = 50, 16  # ROWS: as many as the server decodes together by default (serve --max-batch)


def _draws(model, make_drafter, params, n_tokens, acceptance="exact", width=None):
    """Speculative samples of `n_tokens` from seed 0: the first ALONE a sequence at a time (the batch of one,
    as `generate` decodes), then ROWS at a time in one batch (as the server does; a drafter that holds one
    row only, a sequence at a time still)."""
    mx.random.seed(0)
    for i in itertools.count():
        drafter = make_drafter()
        if i < ALONE or drafter.one_row:
            events = speculative_steps(model, STAT_PROMPT, params, n_tokens, drafter, num_draft=3, acceptance=acceptance,
                                       width=width)
            yield tuple(tokens_of(events))
            continue
        decoder = Decoder(model, num_draft=3, acceptance=acceptance, width=width)
        for b in range(ROWS):
            decoder.add(b, STAT_PROMPT, params, n_tokens, drafter)
        out = {b: [] for b in range(ROWS)}
        while decoder.rows:
            for key, event in decoder.step().items():
                out[key] += event.tokens
        yield from map(tuple, out.values())


def _tv(counts, n, p):
    return 0.5 * sum(abs(counts[s] / n - p[s]) for s in p)


def empirical_tv(model, make_drafter, params, p, n_tokens=3, n=N, **options):
    """TV distance between n speculative samples of `n_tokens` and the exact joint `p` (compare with
    `tv_bound(p, n)`; a drafter that holds one row draws a sequence at a time: fewer keep it quick)."""
    counts = dict.fromkeys(p, 0)
    for seq in itertools.islice(_draws(model, make_drafter, params, n_tokens, **options), n):
        counts[seq] += 1
    return _tv(counts, n, p)


def told_apart(model, make_drafter, params, p, **options) -> bool:
    """Whether samples from a wrong rule are told from `p`: their TV distance exceeds what as many exact
    draws exceed with probability 1e-3, looked at after 125, 250, 500, 1000 and N draws (a wrong rule shows early)."""
    counts = dict.fromkeys(p, 0)
    for n, seq in enumerate(itertools.islice(_draws(model, make_drafter, params, 3, **options), N), 1):
        counts[seq] += 1
        if n in (125, 250, 500, 1000, N) and _tv(counts, n, p) > tv_bound(p, n):
            return True
    return False


def assert_distributed_as_target(target, make_drafter, monkeypatch, params=None) -> None:
    """Speculative samples (temperature 1 unless `params`) are distributed as the target's own, and a wrong
    acceptance rule (the residual drawn from the target alone) is told apart: the check has teeth."""
    from mlx_spec import sampling
    from mlx_spec.sampling import SamplingParams
    from test_speculative import resample_from_target

    params = params or SamplingParams(temp=1.0)
    p = exact_joint(target, STAT_PROMPT, params, 3)
    assert empirical_tv(target, make_drafter, params, p) < tv_bound(p, N)
    monkeypatch.setattr(sampling, "accept_sampled", resample_from_target)
    assert told_apart(target, make_drafter, params, p)
