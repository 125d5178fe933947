"""The decoder with many rows: every row produces what it would alone."""

import itertools
import types

import mlx.core as mx
import pytest

from mlx_spec import api, decoding
from mlx_spec.bench.machine import FreeDrafter
from mlx_spec.decoding import Decoder, plain_steps, speculative_steps
from mlx_spec.drafters.draft_model import DraftModel
from mlx_spec.drafters.eagle import Eagle, EagleNet, eagle_config
from mlx_spec.drafters.lookup import PromptLookup
from mlx_spec.errors import UserError
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams
from stats import N, STAT_PROMPT, V, exact_joint, tiny, tv_bound

GREEDY = SamplingParams()
# Ids up to 87: the models they are decoded by have vocabularies of 96 or more.
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
    decoder = Decoder(target, num_draft=3)  # K fixed: whether drafting pays here is not the question
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


def test_a_draft_models_trees_for_rows_of_different_lengths_keep_each_row_exact():
    """One draft model grows every row's tree in one forward a depth, each row's nodes at their own positions
    seeing their own context and ancestors: the demo drafting for itself a tree of one branch, every round keeps
    its whole depth (a node one position off keeps 83% here, one blind to its ancestors 73%)."""
    demo = api.load("demo")
    drafter = DraftModel(demo.model, demo.model.args.vocab_size, budget=4, topk=1, depth=4)  # its greedy chain
    decoder = Decoder(demo.model, num_draft=4)
    prompts = [demo.tokenizer.encode(text) for text in ("def fib(n):", "The capital of France", "import numpy as np")]
    lengths = [21, 12, 17]
    out, kept = {i: [] for i in range(3)}, []
    for i, prompt in enumerate(prompts):
        decoder.add(i, prompt, GREEDY, lengths[i], drafter)
    while decoder.rows:
        for key, event in decoder.step().items():
            room = min(4, lengths[key] - len(out[key]) - 1)  # the row's last token comes from a plain round
            if room:
                assert event.depth == room  # a tree as deep as there was room for was verified
                kept.append(event.accepted / room)
            out[key] += event.tokens
    assert sum(kept) / len(kept) > 0.95
    for i, prompt in enumerate(prompts):
        assert out[i] == alone(demo.model, prompt, lengths[i]), i


class Widths:
    """A drafter's network, recording the widest input each call runs (its first argument's second axis)."""

    def __init__(self, net):
        self.net, self.widths = net, []

    def __call__(self, x, *args, **kwargs):
        self.widths.append(x.shape[1])
        return self.net(x, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.net, name)


@pytest.mark.parametrize("kind", ["draft", "eagle3"])
def test_a_row_joining_a_batch_reads_its_prompt_into_the_drafter_as_it_joins(target, checkpoints, kind):
    """The drafter reads a joining row's prompt then, alone: the rounds after it pad no row to that prompt
    (each row's forward would be as long as it), and every row stays exact."""
    if kind == "draft":
        net = Widths(load_model(str(checkpoints["llama"]))[0])
        drafter = DraftModel(net, target.args.vocab_size)
    else:
        mx.random.seed(0)
        net = Widths(EagleNet(eagle_config(target, 3)))
        mx.eval(net.net.parameters())
        drafter = Eagle(net, target)
    decoder = Decoder(target, num_draft=3)
    long = PROMPTS[1] * 6  # 72 tokens
    out = {key: [] for key in range(3)}
    for key, prompt in enumerate(PROMPTS[:2]):
        decoder.add(key, prompt, GREEDY, 12, drafter)
    for _ in range(2):
        for key, event in decoder.step().items():
            out[key] += event.tokens
    decoder.add(2, long, GREEDY, 12, drafter)
    assert max(net.widths) >= len(long) - 1  # read as it joined, alone
    del net.widths[:]
    while decoder.rows:
        for key, event in decoder.step().items():
            out[key] += event.tokens
    assert net.widths and max(net.widths) <= 8
    for key, prompt in enumerate([*PROMPTS[:2], long]):
        assert out[key] == alone(target, prompt, 12), key


def test_a_drafter_that_does_not_pay_is_not_tried_again_at_once(monkeypatch):
    # The demo's target and drafts that are never right: the first sequence drafts first and learns; the
    # next ones, with the same drafter (or a session of it, as each of the benchmark's runs has) at the same
    # temperature, start from what it learnt, and stay exact. A clock that ticks once a reading makes a
    # round of drafting cost 1.5 plain steps, whatever else the machine is doing.
    monkeypatch.setattr(decoding, "time", types.SimpleNamespace(perf_counter=itertools.count().__next__))
    target, never = api.load("demo").model, FreeDrafter()
    firsts = []
    for i, prompt in enumerate(PROMPTS[:2] * 2):
        events = list(speculative_steps(target, prompt, GREEDY, 24, never if i < 2 else never.new_session()))
        assert [t for e in events for t in e.tokens] == alone(target, prompt, 24)
        firsts.append(len(events[0].drafted))
    assert firsts[0] > 0 and max(firsts[1:]) < firsts[0]
    # Another temperature has its own acceptance: it starts optimistic again.
    events = speculative_steps(target, PROMPTS[0], SamplingParams(temp=1.0), 16, never)
    assert len(next(events).drafted) == firsts[0]


@pytest.mark.parametrize("kind", ["draft", "eagle3"])
def test_a_drafter_reading_what_it_missed_tells_the_policy_what_that_cost(monkeypatch, target, checkpoints, kind):
    """A drafter that runs a model reads a joining row's prompt, and the tokens plain rounds committed before it drafts
    again: each read is timed apart and told to the policy (tokens, seconds), which weighs drafting again by it; the
    policy is told how many tokens each row's drafter has not read; the rows stay exact."""
    from mlx_spec.policy import Decision, Policy

    reads, unread, rounds = [], [], []
    monkeypatch.setattr(Policy, "read", lambda self, tokens, seconds: reads.append((tokens, seconds)))
    monkeypatch.setattr(Policy, "record", lambda self, keys, ks, *a, **k: rounds.append(max(ks)))

    def choose(self, keys, drafters, rooms, empty=None, behind=None):  # plain rounds, then K = 2
        unread.append(sum(behind))
        self.last = Decision(2 if len(rounds) >= 5 else 0, "scripted")
        return [min(self.last.k, room) for room in rooms]

    monkeypatch.setattr(Policy, "choose", choose)
    if kind == "draft":
        drafter = DraftModel(load_model(str(checkpoints["llama"]))[0], target.args.vocab_size)
    else:
        mx.random.seed(0)
        net = EagleNet(eagle_config(target, 3))
        mx.eval(net.parameters())
        drafter = Eagle(net, target)
    decoder, out = Decoder(target), {0: [], 1: []}
    for key in (0, 1):
        decoder.add(key, PROMPTS[key], GREEDY, 12, drafter)
    assert [t for t, _ in reads] == [len(PROMPTS[0]) - 1, len(PROMPTS[1]) - 1]  # the last is read as it drafts
    while decoder.rows:
        for key, event in decoder.step().items():
            out[key] += event.tokens
    plain = rounds.index(2)  # the plain rounds before the first that drafted
    assert plain >= 5 and [t for t, _ in reads[2:]] == [2 * plain] and all(s > 0 for _, s in reads)
    assert 2 * plain in unread  # asked with what its drafter had not read
    for key in (0, 1):
        assert out[key] == alone(target, PROMPTS[key], 12), key


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
def test_a_round_waits_for_the_device_once(monkeypatch, temp, rows):
    """Host syncs per round, counted: a speculative round evaluates once for the whole batch (every verdict,
    the drafted tokens) and reads what it evaluated; a plain round likewise, its next round queued first."""
    from mlx_spec import host

    counts = {"eval": 0, "read": 0}
    real_eval, real_read = mx.eval, host.read

    def counted(name, real):
        def call(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)
        return call

    target = tiny(0, 96)
    params = SamplingParams(temp=temp)
    for make in (lambda: DraftModel(tiny(1, 96), 96), lambda: None):
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
            assert counts == {"eval": 1, "read": 1}, (drafter, counts)
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
def test_plain_rounds_tell_the_policy_whether_each_guess_would_have_been_kept(monkeypatch, target, temp):
    """A plain round of rows drafting by prompt lookup (one at each temperature, in one batch) tells the policy,
    per row that has something to draft, whether the token drawn is the one the lookup would have drafted: greedy,
    whether it is the target's argmax; sampling, 1 with the target's probability for it (a draft's odds)."""
    from mlx_spec.policy import Decision, Policy

    seen = []
    real_record = Policy.record

    def record(self, keys, ks, accepted, seconds, steady=True, odds=None):
        seen.extend((odds or {}).items())
        real_record(self, keys, ks, accepted, seconds, steady, odds)

    monkeypatch.setattr(Policy, "record", record)
    def choose(self, keys, drafters, rooms, empty=None, unread=None):
        self.last = Decision(0, "plain rounds only")
        return [0] * len(keys)

    monkeypatch.setattr(Policy, "choose", choose)
    mx.random.seed(0)  # the sampled row's draws (what ran before in this process must not decide them)
    drafter = PromptLookup(1, 3)
    params = {0: SamplingParams(temp=temp), 1: SamplingParams(temp=1.0 - temp)}
    decoder = Decoder(target)
    for key in (0, 1):
        decoder.add(key, PROMPTS[key], params[key], 12, drafter)
    kept = []
    for _ in range(10):
        guesses, argmax = {}, {}
        for row in decoder.rows:
            if (guess := drafter.guess(row.slot, row.context)) is not None:  # nothing to draft: nothing learnt
                guesses[row.key] = guess
                argmax[row.key] = int(mx.argmax(target(mx.array([row.context]), target.make_cache())[0][0, -1]))
        seen.clear()
        events = decoder.step()
        assert dict(seen) == {key: float(events[key].tokens[0] == guess) for key, guess in guesses.items()}
        assert all(dict(seen)[key] == float(argmax[key] == guesses[key]) for key in guesses if not params[key].temp)
        kept += [p for key, p in seen]
    assert 0 < sum(kept) < len(kept)  # guesses both kept and not: the odds are read, not assumed


def count_waits(monkeypatch) -> dict:
    """Counts of `mx.eval` calls and `host.read` calls (each of which evaluates once within) from now on."""
    from mlx_spec import host

    counts, real_eval, real_read = {"eval": 0, "read": 0}, mx.eval, host.read

    def counted(name, real):
        def call(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(mx, "eval", counted("eval", real_eval))
    monkeypatch.setattr(host, "read", counted("read", real_read))
    return counts


@pytest.mark.parametrize("kind", ["draft", "eagle3", "lookup"])
@pytest.mark.parametrize("rows", [1, 4])
def test_steady_rounds_wait_once_and_compile_nothing_new(monkeypatch, kind, rows):
    """What a GPU exposes, counted on the CPU: after a warm-up pass over the same work, 100 more rounds trace
    no new shape (`mx.compile`'s traces counted: no shape depends on the context's length, the cache's
    size or the rounds before) and wait for the device once a round (evaluations and host reads)."""
    from mlx_spec import sampling

    # A clock that ticks once a reading: the policy's choices (and so the shapes) do not follow the machine's load.
    monkeypatch.setattr(decoding, "time", types.SimpleNamespace(perf_counter=itertools.count().__next__))
    traces, real_compile = set(), mx.compile  # (function, its inputs' shapes) traced

    def counting(fun, *args, **kwargs):
        def traced(*a, **k):  # a shape MLX's cache forgot and traces again is not a new one
            traces.add((id(fun), *(x.shape if isinstance(x, mx.array) else x for x in a)))
            return fun(*a, **k)
        return real_compile(traced, *args, **kwargs)

    monkeypatch.setattr(mx, "compile", counting)
    sampling._compiled_log_probs.cache_clear()
    sampling._compiled_accept.cache_clear()
    target = tiny(0, 96, num_hidden_layers=2)  # small and quick: the counts are what is tested
    target.compile()
    if kind == "eagle3":
        net = EagleNet(eagle_config(target, 3))
        net.compile()
        drafter = Eagle(net, target)
    else:
        drafter = DraftModel(tiny(1, 96), 96) if kind == "draft" else PromptLookup(1, 3)
        if kind == "draft":
            drafter.model.compile()
    prompts = [PROMPTS[b] * 3 for b in range(4)]  # repetitive: prompt lookup finds something to copy
    counts = count_waits(monkeypatch)

    def run() -> list[int]:  # greedy: the warm-up pass meets every shape the measured pass does
        decoder = Decoder(target, num_draft=3)
        session = drafter.new_session()
        for b in range(rows):
            decoder.add(b, prompts[b], SamplingParams(), 10**3, session)
        waits = []
        for _ in range(100):
            counts.update(eval=0, read=0)
            decoder.step()
            waits.append(counts["eval"])  # each read evaluates once within: its wait
        return waits

    run()  # the warm-up: every shape the rounds use is traced
    before = set(traces)
    assert set(run()) == {1}
    assert traces == before, f"new shapes traced in steady rounds: {traces - before}"


def test_a_plain_round_reads_its_tokens_with_the_next_round_queued(monkeypatch):
    """As mlx-lm's `generate_step`: the next step's forward is dispatched before this one's tokens are read,
    so the device computes it while the host works."""
    from mlx_spec import host

    target = tiny(0, 96)
    decoder = Decoder(target)
    decoder.add(0, PROMPTS[0], GREEDY, 40)
    real_read, queued = host.read, []

    def read(*trees):
        queued.append(decoder.queued is not None)
        return real_read(*trees)

    monkeypatch.setattr(host, "read", read)
    while decoder.rows:
        decoder.step()
    assert queued[1:-1] and all(queued[1:-1])  # the first round is not queued; the last queues nothing


def test_a_prompt_token_outside_the_vocabulary_is_refused():
    """An id past the embedding's table reads memory that is not the model's: refused, not decoded."""
    decoder = Decoder(tiny(0, 64))
    for prompt in ([5, 64], [-1, 5]):
        with pytest.raises(ValueError, match=r"outside the vocabulary \(0..63\)"):
            decoder.add(0, prompt, GREEDY, 4)
    assert not decoder.rows


def test_the_batch_trace_prints_each_drafting_round_and_the_plain_ones(monkeypatch, capsys):
    """scripts/batch_trace.py on the demo: a line per drafting round (its rows, K, time and the policy's
    reason), then the plain rounds by batch size."""
    import re
    import sys

    import batch_trace

    monkeypatch.setattr(sys, "argv", ["batch_trace.py", "--drafter", "draft", "--rows", "2", "--max-tokens", "8",
                                      "--temp", "0", "--num-prompts", "2"])
    batch_trace.main()
    lines = capsys.readouterr().out.splitlines()
    drafted = [s for s in lines if re.fullmatch(r" *[12] rows  K=\d+ +[\d.]+ ms  K=\d+: .+", s)]
    plain = [s for s in lines if re.fullmatch(r" *[12] rows  plain: \d+ rounds, [\d.]+ ms each", s)]
    assert drafted and plain and lines == drafted + plain and plain[0].startswith("  2 rows"), lines
