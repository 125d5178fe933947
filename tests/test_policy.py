"""The decoding policy on its own, driven by measured cost curves: it drafts where the formula says
drafting pays, as far as the formula says, and not elsewhere.

The curves are what a target forward of S tokens a row cost, measured (`mlx-spec bench`, and scratch
timings): on an NVIDIA H200 (MLX's CUDA backend), the demo widened to 3.3B bfloat16, a step from one
token to two, then flat; on a 2-core x86-64 CPU (OpenBLAS, float32), the demo widened to 0.2B, rising."""

import random
from collections import deque

import pytest

from mlx_spec.drafters.draft_model import DraftModel
from mlx_spec.drafters.lookup import PromptLookup
from mlx_spec.metrics import expected_tokens
from mlx_spec.policy import EXPLORE, Acceptance, Costs, Policy, tokens_by_k

GPU = {1: {1: 7.0, **{s: 13.5 for s in range(2, 18)}},  # ms by tokens a row, by batch size
       16: {1: 7.5, **{s: 13.9 for s in range(2, 18)}}}
CPU = {1: {1: 71, 2: 82, 3: 89, 4: 98, 5: 102, 6: 104, 7: 108, 8: 111, 9: 115},
       4: {1: 100, 2: 111, 3: 146, 4: 131, 5: 168, 6: 182, 7: 188, 8: 193, 9: 200}}
for ms in CPU.values():  # past 8 tokens, as the last measured grew
    ms.update({s: ms[9] + 4 * (s - 9) for s in range(10, 18)})


def draft_model() -> DraftModel:
    """A drafter that runs a model (no guesses): nothing of it is used but its kind."""
    return DraftModel.__new__(DraftModel)


def best_fixed(curve: dict, alpha: float, draft_ms: float, most: int = 8) -> tuple[int, float]:
    """The formula: the K with the most tokens a millisecond, E(alpha, K) / (T(K + 1) + K d), and its
    throughput over plain decoding's."""
    rate = [expected_tokens(alpha, k) / (curve[k + 1] + k * draft_ms * (k > 0)) for k in range(most + 1)]
    k = max(range(most + 1), key=rate.__getitem__)
    return k, rate[k] / rate[0]


def simulate(curve: dict, alpha: float, draft_ms: float, rows: int = 1, rounds: int = 400, seed: int = 0,
             switch_ms: float = 0.0, policy: Policy | None = None, drafter=None):
    """`rounds` rounds of `rows` rows whose drafts are each kept with probability `alpha`, at the curve's
    costs (and `switch_ms` more for a drafting round after plain ones: its drafter reads the tokens they
    committed, as the decoder tells the policy). Returns (throughput over plain decoding's, share of rounds
    that drafted, the K chosen each round)."""
    policy, drafter = policy or Policy(), drafter or draft_model()
    rng, keys = random.Random(seed), list(range(rows))
    tokens = ms = 0.0
    chosen, before, unread = [], 0, 0
    for _ in range(rounds):
        ks = policy.choose(keys, [drafter] * rows, [100] * rows, unread=[unread] * rows)
        if any(ks) and unread and switch_ms:
            policy.read(unread * rows, switch_ms / 1e3)
        k = max(ks)
        kept = []
        for row_k in ks:
            n = 0
            while n < row_k and rng.random() < alpha:
                n += 1
            kept.append(n)
        spent = curve[k + 1] + k * draft_ms + (switch_ms if k and not before else 0.0)
        policy.record(keys, ks, kept, (spent - (switch_ms if k and not before else 0.0)) / 1e3)
        unread = 0 if k else unread + 1
        tokens += rows + sum(kept)
        ms += spent
        chosen.append(k)
        before = k
    return tokens / ms / (rows / curve[1]), sum(k > 0 for k in chosen) / rounds, chosen


def test_expected_tokens_follow_the_rates_per_position():
    assert tokens_by_k([0.5, 0.5]) == [1.0, 1.5, 1.75]
    assert tokens_by_k([0.8] * 4)[-1] == pytest.approx(expected_tokens(0.8, 4))
    a = Acceptance()
    for _ in range(50):
        a.update(3, 1, 0.9)  # always the first kept, never the second
    rates = a.rates(3)
    assert rates[0] > 0.95 and rates[1] < 0.1


@pytest.mark.parametrize("curve,rows,draft_ms", [(GPU, 1, 1.0), (GPU, 16, 1.0), (CPU, 1, 1.5), (CPU, 4, 3.0)],
                         ids=["gpu-1", "gpu-16", "cpu-1", "cpu-4"])
@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.8, 0.9])
def test_it_drafts_where_the_formula_says_drafting_pays_and_not_elsewhere(curve, rows, draft_ms, alpha):
    costs = curve[rows]
    k_best, gain = best_fixed(costs, alpha, draft_ms)
    speed, drafting, chosen = simulate(costs, alpha, draft_ms, rows, rounds=1000)
    if gain > 1.2:  # drafting pays: it drafts nearly always, about as far as the formula says
        k = sorted(chosen[100:])[150]
        assert drafting > 0.85 and speed > 0.9 * gain, (gain, drafting, speed)
        rate = lambda k: expected_tokens(alpha, k) / (costs[k + 1] + k * draft_ms)  # noqa: E731
        assert rate(k) > 0.95 * rate(k_best), (k, k_best)
    else:  # near break-even or below: it never loses much
        assert speed > 0.97, (gain, speed)
    if gain < 1:  # drafting does not pay: only probes
        assert drafting < 0.1, drafting


def test_on_a_gpu_a_row_drafts_far_where_verification_is_flat():
    """Past two tokens, a GPU verification costs little more: well-accepted drafts go as far as the formula says."""
    for alpha in (0.8, 0.95):
        k_best, gain = best_fixed(GPU[1], alpha, 0.3)
        speed, _, chosen = simulate(GPU[1], alpha, 0.3)
        assert k_best >= 6 and abs(sorted(chosen[100:])[150] - k_best) <= 1 and speed > 0.9 * gain


def test_a_batch_drafts_past_one_token_where_longer_drafts_pay():
    """Four rows on the CPU curve: a round of 4 x 4 tokens costs 1.31 plain rounds, so well-accepted
    drafts are worth several tokens a row (a batch that drafted under one token a round lost most of it)."""
    k_best, gain = best_fixed(CPU[4], 0.8, 3.0)
    assert k_best >= 3 and gain > 1.5
    speed, _, chosen = simulate(CPU[4], 0.8, 3.0, rows=4)
    assert sum(chosen[100:]) / len(chosen[100:]) > 2.5 and speed > 0.9 * gain


def test_probes_lose_at_most_their_share_whatever_a_switch_costs():
    """A drafter that never pays, whose first round after plain ones may cost 3 plain rounds more (it
    catches up): probes go further apart, so that they cost about EXPLORE of plain decoding's time (and
    the first ones, before what they cost is known, a little more)."""
    for switch in (0.0, 213.0):
        speed, drafting, _ = simulate(CPU[1], 0.1, 1.5, switch_ms=switch, rounds=2000)
        assert speed > 0.97 and drafting > 0, (switch, speed, drafting)


def test_a_drafter_that_never_pays_reads_plain_decodings_speed_to_within_half_a_percent():
    """The draft model at 8k tokens of context (the demo widened to 0.2B, CPU, measured): a forward of 1 and 2 tokens
    104 and 129 ms, each more about 20; a seventh of the student's first drafts kept; its catch-up after plain
    rounds about 25 ms. No K pays, so probes are all it drafts: they lose under half a percent of plain decoding's
    time over 1,000 rounds (spaced to lose 1%, they read 0.99x of it, where the benchmark asks 1.00x)."""
    long = {1: 104, 2: 129, **{s: 129 + 20 * (s - 2) for s in range(3, 18)}}
    for seed in range(3):
        speed, drafting, _ = simulate(long, 0.14, 1.5, rounds=1000, switch_ms=25.0, seed=seed)
        assert 0.995 < speed < 1 and 0 < drafting < 0.05, (seed, speed, drafting)


def test_a_batch_size_met_later_believes_what_it_borrows_over_the_assumed_slope():
    """Rows drafting a 16-node tree on the demo (EAGLE-3, CPU, 16 rows): a round costs 11.5 plain rounds
    whatever its depth (26 ms plain, 265-370 ms drafted, measured), where the assumed slope says 1.3. The
    first batch size learns it in its first rounds (two that go on outweigh the slope: one may be a shape
    compiling); each size met after it (rows leaving) borrows it and drafts no more. (Believing the slope
    over what it borrowed, every size drafted 4 dear rounds, as the demo's trees did at 15, 10 and 4 rows.)"""
    tree = {1: 26.0, **{s: 300.0 for s in range(2, 18)}}
    for alpha in (0.3, 0.6, 0.8):
        policy, drafted = Policy(), []
        for rows in (16, 15, 14, 13, 12):
            _, _, chosen = simulate(tree, alpha, 0.0, rows=rows, rounds=60, policy=policy)
            drafted.append(sum(k > 0 for k in chosen))
        assert drafted[0] <= 4 and drafted[1:] == [0] * 4, (alpha, drafted)


def test_dear_rounds_after_plain_ones_are_believed_once_two_are_run():
    """Medusa's 63-node tree at sixteen rows of the demo (CPU): a drafting round costs 391 ms against 12 ms plain
    (measured), where the assumed slope says 1.3 plain rounds. Every drafting round there follows plain ones (a
    switch): two of them say what K costs (the first may compile), and it drafts no more. (Read only once rounds
    going on were timed, it drafted 4 rounds, dearer than the other 90 together: 0.56x plain decoding.)"""
    tree, keys, rows = {1: 12.0, **{s: 391.0 for s in range(2, 18)}}, list(range(16)), [draft_model()] * 16
    for alpha in (0.6, 0.9):
        policy, drafted = Policy(), 0
        for _ in range(100):
            ks = policy.choose(keys, rows, [100] * 16)
            policy.record(keys, ks, [round(alpha * k) for k in ks], tree[max(ks) + 1] / 1e3)
            if any(ks):  # plain rounds follow it: the next drafting round is a switch again
                drafted += 1
                policy.record(keys, [0] * 16, [0] * 16, tree[1] / 1e3)
        assert drafted <= 2, (alpha, drafted)


def test_a_dear_round_run_once_spaces_the_probes_by_what_it_cost():
    """EAGLE-3's 16-node tree at sixteen rows of the demo, measured: plain rounds 17 ms, a tree round 228-390 ms. Run
    once (the benchmark's warm-up), its K reads off the assumed line (one round may be a shape compiling), where
    drafting pays too little to start; a probe weighed at that line came every 63 plain rounds, and one cost a
    96-round run a fifth of its time (0.81x plain decoding). Weighed at what its one round cost, none comes."""
    tree = {1: 17.0, **{s: 309.0 for s in range(2, 18)}}
    policy = Policy()
    simulate(tree, 0.3, 0.0, rows=16, rounds=1, policy=policy)  # the first round drafts on what is assumed
    simulate(tree, 0.3, 0.0, rows=16, rounds=3, policy=policy)  # two plain rounds it is weighed against, then
    assert "does not pay" in policy.last.reason and policy.last.seconds[policy.last.weighed] < 0.1
    _, drafted, _ = simulate(tree, 0.3, 0.0, rows=16, rounds=200, policy=policy)
    assert drafted == 0


def test_plain_decoding_is_timed_by_two_rounds_their_least():
    """The draft model at sixteen rows of the demo, measured: the first plain round after the benchmark's warm-up
    drafted took 24 ms (a shape compiling, the host's work exposed), the plain rounds after it 12 ms, the one round at
    K=3 93 ms. Weighed against that first plain round alone, K=8 read 1.37x plain decoding and its rounds cost 7-10
    plain rounds each (the run: 0.76x). Two plain rounds are timed, and the cheaper stands for plain decoding."""
    policy, keys, rows = Policy(), list(range(16)), [draft_model()] * 16
    ks = policy.choose(keys, rows, [100] * 16)  # the first round drafts on what is assumed: every draft is kept
    policy.record(keys, ks, ks, 0.093)
    for seconds in (0.024, 0.012):
        assert policy.choose(keys, rows, [100] * 16) == [0] * 16 and "timing" in policy.last.reason
        policy.record(keys, [0] * 16, [0] * 16, seconds)
    ks = policy.choose(keys, rows, [100] * 16)  # K=3 a second time at most (its one round may have compiled)
    assert policy.last.seconds[0] == pytest.approx(0.012) and max(ks) <= 3


def test_a_probe_runs_a_length_measured():
    """The draft model at sixteen rows of the demo: plain rounds 12 ms, K=3 100 ms, measured. A K never run reads off
    the line (between plain rounds and K=3, or K=3 and the assumed slope past it), far cheaper than it may cost: a
    probe weighed there came far too often, each paying the length's first rounds. A probe runs K=3, spaced by its
    cost."""
    policy, keys, rows = Policy(), list(range(16)), [draft_model()] * 16
    for _ in range(3):
        policy.record(keys, [3] * 16, [2] * 16, 0.100)  # two of three drafts kept
    for _ in range(8):
        policy.record(keys, [0] * 16, [0] * 16, 0.012)
    assert policy.choose(keys, rows, [100] * 16) == [0] * 16
    assert policy.last.weighed == 3 and policy.last.seconds[3] == pytest.approx(0.100)


def test_two_rounds_at_a_k_stand_over_the_line_between_its_neighbours():
    """DFlash at sixteen rows of the demo, measured: plain rounds 24 ms, K=3 70 ms, K=1 61 ms. The line from plain
    to K=3 reads K=1 at 39 ms, where its 16 rows' 1.8 tokens each would pay; two rounds at 61 ms say they do not
    (believing the line until three had run, it drafted 4 rounds at K=1 where none paid). One round may be a
    shape compiling: the line stands where it is cheaper."""
    c = Costs(times={0: deque([0.024] * 8), 3: deque([0.070] * 3), 1: deque([0.061, 0.062])})
    assert c.curve(1)[1] == pytest.approx(0.061)
    c.times[1].popleft()
    assert c.curve(1)[1] == pytest.approx(0.024 + (0.070 - 0.024) / 3)


def test_a_length_never_run_is_tried_where_it_promises_the_margin_to_start():
    """Drafting, at a K never run that the line between two run says breaks even (1.03x plain decoding) while K=1, run,
    pays 1.4x: the line's figure is a guess, like a start's, so K=1 goes on; promising 1.14x, it is tried once (a dip
    where tiles fall). EAGLE-3 on the demo at four rows, T=1, tried every length it had not run this way, each costing
    4-5 plain rounds for about two tokens a row (0.90x plain decoding)."""
    for t4, tried in ((0.240, False), (0.200, True)):
        policy = Policy(k_max=4)  # K=3 reads (0.1505 + t4) / 2: 1.03x, and 1.14x
        policy.costs[1] = Costs(times={0: deque([0.1] * 8), 1: deque([0.14] * 3), 2: deque([0.1505] * 3),
                                       4: deque([t4] * 3)}, drafting=True)
        policy.rows[0] = Acceptance(accepted=[100.0, 0.0], reached=[100.0, 100.0])  # the first kept, never the second
        assert policy.choose([0], [draft_model()], [100]) == [3 if tried else 1], t4


def test_a_row_whose_first_drafts_are_kept_weighs_its_second_by_them_over_the_pool():
    """The widened demo's student on the benchmark's code prompts at T=0: the warm-up's text keeps every other draft
    (a second position never kept), the next texts nearly all. Drafting one a round and keeping it, a row learns
    nothing of its second position: read as the pool's, it drafted K=1 for 137 rounds (1.51x plain decoding);
    drawn to the rate of its own first position, it drafts deeper (2.04x, the same run otherwise)."""
    pool, row = Acceptance(), Acceptance()
    for _ in range(30):
        pool.update(2, 1, 0.99)  # the first kept, the second not
    for _ in range(20):
        row.update(1, 1, 0.9)
    rates = row.rates(2, pool.rates(2))
    assert rates[0] > 0.9 and rates[1] > 0.8, rates
    assert Acceptance().rates(2, pool.rates(2))[1] < 0.1  # a row with no rounds of its own: the pool's


def test_a_row_drafts_again_once_its_text_turns_easy():
    policy = Policy()
    simulate(CPU[1], 0.05, 1.5, policy=policy, rounds=200)
    _, _, chosen = simulate(CPU[1], 0.95, 1.5, policy=policy, rounds=200)
    assert sum(k > 0 for k in chosen[60:]) > 0.9 * len(chosen[60:])


def test_a_drafter_that_guesses_is_weighed_by_plain_rounds_instead_of_probes():
    """Prompt lookup where its guesses are rarely right: plain rounds tell their odds, so no round is spent
    on a probe while they stay low, and it drafts again within a few rounds once they are high."""
    policy, lookup = Policy(), PromptLookup()
    simulate(CPU[1], 0.9, 0.0, policy=policy, drafter=lookup, rounds=20)

    def plain_rounds(odds: float, most: int) -> int:
        for n in range(most):
            if any(policy.choose([0], [lookup], [100])):
                return n
            policy.record([0], [0], [0], CPU[1][1] / 1e3, odds={0: odds})
        return most

    for _ in range(100):  # its text turns: drafts and guesses are wrong
        k = policy.choose([0], [lookup], [100])[0]
        policy.record([0], [k], [0], CPU[1][k + 1] / 1e3, odds=None if k else {0: 0.02})
    assert plain_rounds(0.02, 200) == 200  # no probe
    assert plain_rounds(1.0, 50) <= 20
    assert policy.choose([0], [lookup], [100], empty=[True]) == [0]  # nothing to copy: plain


def count_decisions(monkeypatch, share: float) -> tuple[list[int], list[int]]:
    """The rounds at which the policy decides anew (each the length then of the second list, the K of each round,
    which the caller fills), where deciding costs `share` times EXPLORE of a plain round of the CPU curve, one row."""
    from types import SimpleNamespace

    from mlx_spec import policy as module

    clock, decided, ks, real = [0.0], [], [], Policy._decide

    def decide(self, *args):
        decided.append(len(ks))
        clock[0] += share * EXPLORE * CPU[1][1] / 1e3
        return real(self, *args)

    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(Policy, "_decide", decide)
    return decided, ks


def plain_until_drafting(policy: Policy, d, decided: list[int], ks: list[int], draft_ms: float) -> int:
    """Drafts never kept until a choice is plain, then rounds from it until one drafts, their K added to `ks`;
    the rounds the first plain choice said were left to its probe."""
    while (k := policy.choose([0], [d], [100])[0]) != 0:
        policy.record([0], [k], [0], (CPU[1][k + 1] + k * draft_ms) / 1e3)
    every = int(str(policy.last).split("a probe every ")[1].split()[0])
    said, decided[:] = every - policy.costs[1].plain_rounds, []
    while not ks or ks[-1] == 0:
        ks.append(policy.choose([0], [d], [100])[0])
        assert policy.choose([0], [d], [100])[0] == ks[-1]  # the decoder asks twice a round
        policy.record([0], ks[-1:], [0], (CPU[1][ks[-1] + 1] + ks[-1] * draft_ms) / 1e3)
    return said


@pytest.mark.parametrize("share", [0.5, 4.0, 1e6])
def test_a_plain_choice_stands_while_deciding_anew_would_cost_more_than_its_share(monkeypatch, share):
    """Deciding anew each round cost 0.1 ms of a 4 ms round on the tiny demo at one sequence on 2 CPU cores. Where
    it costs `share` times EXPLORE of a plain round, a plain choice stands for that many rounds, never past its probe
    (where it stands throughout, the probe comes when it said); a drafting round decides anew. Here the row's text
    turned hard where its drafter's pool drafts well: as the row's rates fade toward the pool's, it may draft again."""
    decided, ks = count_decisions(monkeypatch, share)
    policy, d = Policy(), draft_model()
    simulate(CPU[1], 0.95, 30, policy=policy, drafter=d, rounds=100)  # a dear drafter: probes far apart
    said = plain_until_drafting(policy, d, decided, ks, 30)
    every = 1 if share < 1 else 4 if share < 10 else len(ks)  # rounds a choice stands; the probe's round decides
    assert decided == sorted({*range(every, len(ks) - 1, every), len(ks) - 1})
    assert len(ks) == said + 1 or share < 10  # standing throughout, the probe comes when the first choice said
    assert len(ks) < said + 1 or share >= 10  # deciding anew, the row drafts again before its probe
    policy.choose([0], [d], [100])
    assert decided[-1] == len(ks)  # the drafting round: the next decides anew


def test_a_plain_choice_stands_while_the_rows_guesses_come_and_go(monkeypatch):
    """Prompt lookup and suffix decoding at temperature 1, sixteen rows of the demo: a row's guess is found one round
    and not the next, so which rows could draft changed every round and the policy decided anew every round (430
    times in 430 rounds, 120-165 us each: 1.1-1.5% of plain decoding's time). A plain choice stands while deciding
    anew would cost more than its share of the rounds, whatever the rows' drafters find."""
    decided, _ = count_decisions(monkeypatch, 4.0)  # four times its share: a choice stands about three rounds
    policy, lookup, keys = Policy(), PromptLookup(), [0, 1]
    for n in range(80):
        empty = [n % 2 == 0, n % 3 == 0]  # whose guess was found, this round
        if n == 20:
            decided.clear()
        ks = policy.choose(keys, [lookup] * 2, [100] * 2, empty)
        odds = None if any(ks) else {b: 0.0 for b in range(2) if not empty[b]}  # never right
        policy.record(keys, ks, [0, 0], CPU[4][max(ks) + 1] / 1e3, odds=odds)
        assert n < 20 or not any(ks)
    assert 10 <= len(decided) <= 25, len(decided)


def test_a_plain_choice_stands_to_its_probe_where_fading_could_not_change_it(monkeypatch):
    """Where neither a row's rates nor its pool's make drafting pay, its rates fading toward the pool's cannot:
    the choice stands to its probe, however cheap deciding anew would be (on the tiny demo at sixteen rows, deciding
    each third round cost 1-2% of plain decoding)."""
    decided, ks = count_decisions(monkeypatch, 0.1)
    policy, d = Policy(), draft_model()
    simulate(CPU[1], 0.3, 1.5, policy=policy, drafter=d, rounds=60)
    said = plain_until_drafting(policy, d, decided, ks, 1.5)
    assert len(ks) == said + 1 and decided == [len(ks) - 1]  # its probe, when it said; decided then only


def test_choosing_has_no_effect_and_says_why():
    policy, d = Policy(), draft_model()
    simulate(CPU[1], 0.8, 1.5, policy=policy, drafter=d, rounds=50)
    first = policy.choose([0], [d], [100])
    assert all(policy.choose([0], [d], [100]) == first for _ in range(5))
    why = str(policy.last)
    assert why.startswith(f"K={first[0]}: drafting pays") and "plain rounds" in why and "x plain decoding" in why
    assert Policy(num_draft=5).choose([0], [d], [100]) == [5]
    assert Policy().choose([0], [d], [2])[0] <= 2  # never past the room the row has left
    assert Policy().choose([0, 1], [d, None], [100, 100])[1] == 0


def test_a_later_sequence_starts_from_what_earlier_ones_measured():
    """`Policy.remembered`: a drafter's round times and pooled acceptance go on from one sequence to the
    next (a chat's turns), so a drafter that did not pay is not tried at its most again."""
    from mlx_spec.sampling import SamplingParams

    class Never(PromptLookup):
        guesses = False

    d, params = Never(), SamplingParams()
    first = Policy.remembered(d, params)
    simulate(CPU[1], 0.0, 1.5, policy=first, drafter=d, rounds=100)
    second = Policy.remembered(d.new_session(), params)
    k = second.choose([7], [d], [100])[0]  # plain, or the probe due at the length measured
    assert second is first and k <= 1 and not str(second.last).startswith(f"K={k}: drafting pays")
    assert Policy.remembered(d, SamplingParams(temp=1.0)) is not first


def test_each_drafter_drafts_up_to_its_own_most():
    lookup, model = PromptLookup(), draft_model()
    policy = Policy()
    simulate(GPU[1], 1.0, 0.0, policy=policy, drafter=lookup, rounds=100)
    assert policy.choose([0], [lookup], [100])[0] > 8
    assert max(simulate(GPU[1], 1.0, 0.0, drafter=model, rounds=100)[2]) == model.k_max


def test_a_row_near_its_end_is_weighed_by_the_drafts_it_has_room_for():
    """Prompt lookup drafts up to 16 tokens; a row with two tokens left to write keeps no more than two drafts,
    whatever K the batch runs: its expected tokens stop growing past K=2 (weighed as if it could keep them, the
    rows' last rounds read drafting as worth more than it can be)."""
    policy, lookup = Policy(), PromptLookup()
    simulate(GPU[1], 1.0, 0.0, policy=policy, drafter=lookup, rounds=50)
    policy.choose([0], [lookup], [2])
    tokens = policy.last.tokens
    assert tokens[2] > 2.5 and tokens[3:] == [tokens[2]] * (len(tokens) - 3), tokens


def test_a_batch_size_met_first_weighs_what_it_borrows_by_its_own_rounds():
    """Sixteen rows met after one: on a CPU each token a row drafts costs sixteen rows two plain rounds (a
    tree's nodes, every row), where one row drafted for little. What is borrowed from one row is scaled by
    the first rounds at sixteen: it stops drafting within a few rounds, and loses little."""
    policy = Policy()
    simulate(CPU[1], 0.9, 1.5, policy=policy, rounds=200)
    steep = {s: 20.0 + 40.0 * (s - 1) for s in range(1, 18)}
    speed, drafting, _ = simulate(steep, 0.9, 1.5, rows=16, rounds=200, policy=policy)
    assert drafting <= 0.02 and speed > 0.9, (drafting, speed)


def test_a_first_round_before_any_plain_one_spaces_the_probes_by_what_it_cost():
    """The first round drafts before a plain round is timed, on what is assumed. At 8k tokens of context (the demo
    widened to 0.2B on the CPU: a verification of 2 tokens costs 1.5 plain steps, each more 0.3), where no K pays,
    probes then cost about EXPLORE (read as a free switch, that first round had them come every few rounds)."""
    long = {1: 193, 2: 293, **{s: 293 + 57 * (s - 2) for s in range(3, 18)}}
    policy = Policy()
    policy.record([0], [3], [0], 0.47)  # the first round: 2.4 plain steps
    speed, drafting, _ = simulate(long, 0.1, 15.0, rounds=1000, policy=policy)
    assert speed > 1 - 1.5 * EXPLORE and drafting < 0.02, (speed, drafting)


def test_drafting_again_weighs_what_its_drafter_reads_first():
    """Four rows whose drafts pay about 1.9x at their best K (CPU curve, alpha 0.8), decoding plainly: drafting
    again first has their drafters read the tokens the plain rounds committed, at what a token read has cost
    (1 ms, as a prompt was read). A hundred missed rounds a row (0.4 s) outweigh what drafting gains; five do not."""
    import copy

    policy, keys, rows = Policy(), list(range(4)), [draft_model()] * 4
    simulate(CPU[4], 0.8, 3.0, rows=4, rounds=60, policy=policy)
    assert policy.last.k > 0
    policy.record(keys, [0] * 4, [0] * 4, CPU[4][1] / 1e3)  # a plain round: drafting again is a switch
    policy.read(100, 0.1)  # a prompt read
    policy.record(keys, [0] * 4, [0] * 4, CPU[4][1] / 1e3)
    for missed, drafts in ((5, True), (100, False)):
        ks = copy.deepcopy(policy).choose(keys, rows, [100] * 4, unread=[missed] * 4)
        assert any(ks) == drafts, (missed, ks)


def test_a_plain_choice_for_a_row_that_guesses_stands_no_longer_than_deciding_costs():
    """A batch of a row whose drafter guesses and one whose drafter does not, neither kept: each plain round
    tells the first row's odds, so its plain choice is news-bound, not held to its probe as the second row's
    alone would be; its guesses turning right, the batch drafts again within a few rounds."""
    policy, lookup, model = Policy(), PromptLookup(), draft_model()
    keys, drafters = [0, 1], [lookup, model]

    def rounds(odds: float, most: int) -> int:
        for n in range(most):
            ks = policy.choose(keys, drafters, [100, 100])
            if any(ks):
                return n
            policy.record(keys, ks, [0, 0], CPU[4][1] / 1e3, odds={0: odds})
        return most

    for _ in range(100):  # drafts and guesses are wrong
        ks = policy.choose(keys, drafters, [100, 100])
        policy.record(keys, ks, [0, 0], CPU[4][max(ks) + 1] / 1e3, odds=None if any(ks) else {0: 0.0})
    assert rounds(0.0, 1000) < 1000  # to its probe
    policy.record(keys, ks := policy.choose(keys, drafters, [100, 100]), [0, 0], CPU[4][max(ks) + 1] / 1e3)
    assert policy.choose(keys, drafters, [100, 100]) == [0, 0]  # the probe kept nothing
    probe = int(str(policy.last).split("a probe every ")[1].split()[0]) - policy.costs[2].plain_rounds
    assert rounds(1.0, probe) < probe - 1
