"""The decoder with many rows: every row produces what it would alone."""

import mlx.core as mx
import pytest

from mlx_spec import api
from mlx_spec.bench import _Free
from mlx_spec.decoding import Decoder, plain_steps, speculative_steps
from mlx_spec.drafters.draft_model import DraftModel
from mlx_spec.drafters.eagle import Eagle, EagleNet, eagle_config
from mlx_spec.drafters.lookup import PromptLookup
from mlx_spec.errors import UserError
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams
from stats import N, STAT_PROMPT, V, exact_joint, tiny, tv_bound

GREEDY = SamplingParams()
PROMPTS = [[1, 87, 85, 71, 84, 87, 85, 71, 84, 87, 85], [40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42, 43],
           [7], [5, 9, 13, 5, 9]]


@pytest.fixture(scope="module")
def target(checkpoints):
    return load_model(str(checkpoints["qwen3"]))[0]


def alone(target, prompt, n):
    return [t for e in plain_steps(target, prompt, GREEDY, n) for t in e.tokens]


def test_rows_with_different_drafters_produce_what_they_would_alone(target, checkpoints):
    other = load_model(str(checkpoints["llama"]))[0]
    mx.random.seed(0)
    eagle = EagleNet(eagle_config(target, 3))
    mx.eval(eagle.parameters())
    V = target.args.vocab_size
    drafters = [PromptLookup(1, 3), DraftModel(other, V), None, Eagle(eagle, target, budget=6, topk=2, depth=3)]
    lengths = [20, 9, 14, 17]
    decoder = Decoder(target)
    out = {i: [] for i in range(4)}
    # Rows 0 and 1 start; 2 and 3 join a few rounds later; each leaves at its own length.
    for i in (0, 1):
        decoder.add(i, PROMPTS[i], GREEDY, lengths[i], drafters[i])
    rounds, widest, accepted = 0, 0, {i: 0 for i in range(4)}
    while decoder.rows:
        widest = max(widest, len(decoder.rows))
        for key, event in decoder.step().items():
            out[key] += event.tokens
            accepted[key] += event.accepted
        rounds += 1
        if rounds == 2:
            for i in (2, 3):
                decoder.add(i, PROMPTS[i], GREEDY, lengths[i], drafters[i])
    assert widest == 4 and accepted[0] > 0 and accepted[2] == 0
    for i in range(4):
        assert out[i] == alone(target, PROMPTS[i], lengths[i]), i


def policy_rounds(accepted_per_draft: float, rounds: int = 300) -> list[int]:
    """K chosen each round by a policy for 8 rows whose drafts look good to
    the model (every draft reported accepted, flat verification cost) while
    each round in fact yields `accepted_per_draft` tokens per drafted one."""
    from mlx_spec.policy import Policy

    policy = Policy(k_max=4)
    keys, drafters = list(range(8)), [PromptLookup()] * 8
    chosen = []
    for _ in range(rounds):
        k = policy.choose(keys, drafters, [10**6] * 8)[0]
        tokens = len(keys) * (1 + accepted_per_draft * k)
        seconds = 0.01 * (1 + 0.1 * k)
        policy.record(keys, [k] * 8, [k] * 8, k + 1, tokens, seconds)
        chosen.append(k)
    return chosen[rounds // 3 :]


def test_batch_policy_turns_speculation_off_where_plain_rounds_are_faster():
    # Drafts that are never accepted: the measured rounds, not the model, decide.
    off = policy_rounds(0.0)
    assert sum(k == 0 for k in off) > 0.8 * len(off)
    # Drafts that pay: speculation stays on, plain rounds only to measure them.
    on = policy_rounds(0.8)
    assert sum(k > 0 for k in on) > 0.85 * len(on)


def test_a_drafter_that_does_not_pay_is_not_tried_at_its_most_again():
    # The demo's target (a verification of 9 tokens costs more than one) and drafts that are never right:
    # the first sequence starts at K = 8 and learns; the next ones, with the same drafter (or a session of
    # it, as each of the benchmark's runs has) at the same temperature, start from what it learnt, and
    # stay exact.
    target, never = api.load("demo").model, _Free()
    firsts = []
    for i, prompt in enumerate(PROMPTS[:2] * 2):
        events = list(speculative_steps(target, prompt, GREEDY, 24, never if i < 2 else never.new_session()))
        assert [t for e in events for t in e.tokens] == alone(target, prompt, 24)
        firsts.append(len(events[0].drafted))
    assert firsts[0] == 8 and max(firsts[1:]) < 8
    # Another temperature has its own acceptance: it starts optimistic again.
    events = speculative_steps(target, PROMPTS[0], SamplingParams(temp=1.0), 16, never)
    assert len(next(events).drafted) == 8


def test_self_speculation_is_refused(target):
    from mlx_spec.drafters.layerskip import LayerSkip

    decoder = Decoder(target)
    decoder.add(0, PROMPTS[0], GREEDY, 4)
    with pytest.raises(UserError, match="one sequence at a time"):
        decoder.add(1, PROMPTS[1], GREEDY, 4, LayerSkip(target, 1))


def batch_tv(target, draft, p, params, rows=12):
    """TV distance between N rows' 3-token samples, drawn in batches, and the exact joint."""
    mx.random.seed(0)
    counts = dict.fromkeys(p, 0)
    for start in range(0, N, rows):
        decoder = Decoder(target, num_draft=3)  # every round drafts: the rule is what is tested
        drafters = [DraftModel(draft, V), PromptLookup(1, 3)]  # half the rows each, batched per drafter
        for i in range(rows):
            decoder.add(i, STAT_PROMPT, params, 3, drafters[i % 2])
        out = {i: [] for i in range(rows)}
        while decoder.rows:
            for key, event in decoder.step().items():
                out[key] += event.tokens
        for tokens in out.values():
            counts[tuple(tokens)] += 1
    return 0.5 * sum(abs(counts[s] / N - p[s]) for s in p)


def test_sampled_rows_have_the_targets_distribution(monkeypatch):
    import mlx_spec.sampling as sampling
    from test_speculative import resample_from_target

    target, draft = tiny(0, V, logit_scale=0.3), tiny(1, V, logit_scale=0.3, rope_theta=100.0)
    params = SamplingParams(temp=1.0)
    p = exact_joint(target, STAT_PROMPT, params, 3)
    bound = tv_bound(p, N)
    assert batch_tv(target, draft, p, params) < bound
    monkeypatch.setattr(sampling, "accept_sampled", resample_from_target)  # a wrong rule fails the same check
    assert batch_tv(target, draft, p, params) > bound


@pytest.mark.parametrize("temp", [0.0, 1.0])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_round_waits_for_the_device_a_fixed_number_of_times(monkeypatch, temp, rows):
    """Host syncs per round, counted: a speculative round evaluates twice for the whole batch (the drafts,
    then every verdict) and reads each row's verdict, drafted tokens and the draft model's commit once;
    a plain round evaluates nothing (its next round is queued) and reads the batch's tokens once."""
    from mlx_spec import host

    counts = {"eval": 0, "read": 0}
    real_eval, real_read = mx.eval, host.read

    def counted(name, real):
        def call(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)
        return call

    target = tiny(0, 64)
    params = SamplingParams(temp=temp)
    for make, evals, reads in ((lambda: DraftModel(tiny(1, 64), 64), 2, 3 * rows), (lambda: None, 0, 1)):
        decoder = Decoder(target, num_draft=3)
        drafter = make()
        for b in range(rows):
            decoder.add(b, PROMPTS[b % 2], params, 64, drafter)
        decoder.step()
        monkeypatch.setattr(mx, "eval", counted("eval", real_eval))
        monkeypatch.setattr(host, "read", counted("read", real_read))
        for _ in range(6):
            counts.update(eval=0, read=0)
            decoder.step()
            assert counts == {"eval": evals, "read": reads}, (drafter, counts)
        monkeypatch.setattr(mx, "eval", real_eval)
        monkeypatch.setattr(host, "read", real_read)


def test_the_round_reads_the_device_only_through_host_read():
    """What the count above sees is all there is: the round's modules (and the draft model's) read
    device values only through `mlx_spec.host.read`."""
    from pathlib import Path

    import mlx_spec

    root = Path(mlx_spec.__file__).parent
    for name in ("decoding.py", "sampling.py", "policy.py", "cache.py", "drafters/base.py", "drafters/draft_model.py"):
        text = (root / name).read_text()
        assert ".tolist()" not in text and ".item()" not in text, name


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_plain_rounds_tell_the_policy_the_odds_of_each_guess(monkeypatch, target, temp):
    """A plain round of rows drafting by prompt lookup (one at each temperature, in one batch) tells
    the policy, per row that has something to draft, the target's probability of the token the lookup
    would have drafted (greedy: 1 when it is the argmax, else 0), computed by the round's own forward."""
    from mlx_spec.policy import Policy
    from mlx_spec.sampling import log_probs

    seen = []
    monkeypatch.setattr(Policy, "observe", lambda self, key, odds: seen.append((key, odds)))
    monkeypatch.setattr(Policy, "choose", lambda self, keys, drafters, rooms, empty=None: [0] * len(keys))
    drafter = PromptLookup(1, 3)
    params = {0: SamplingParams(temp=temp), 1: SamplingParams(temp=1.0 - temp)}
    decoder = Decoder(target)
    for key in (0, 1):
        decoder.add(key, PROMPTS[key], params[key], 12, drafter)
    sampled = []  # the sampled row's odds: fractions, not only 0 or 1
    for _ in range(10):
        expected = {}
        for b, row in enumerate(decoder.rows):
            guess = drafter.guess(row.slot, row.context)
            logits, _ = target(mx.array([row.context]), target.make_cache())
            lp = log_probs(logits[0, -1], row.params) if row.params.temp else None
            if guess is not None:  # a row with nothing to draft learns nothing
                expected[row.key] = float(mx.exp(lp[guess])) if lp is not None else \
                    float(int(mx.argmax(logits[0, -1])) == guess)
        seen.clear()
        decoder.step()
        assert {key: round(odds, 4) for key, odds in seen} == {key: round(p, 4) for key, p in expected.items()}
        sampled += [odds for key, odds in seen if params[key].temp]
    assert any(0.01 < odds < 0.99 for odds in sampled)
