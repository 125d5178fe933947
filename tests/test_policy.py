"""The decoding policy on its own, fed rounds as a decoder would feed them: what it learns from a round,
and when a row drafts again."""

import random

from mlx_spec.drafters.draft_model import DraftModel
from mlx_spec.drafters.lookup import PromptLookup
from mlx_spec.policy import Acceptance, Policy


def draft_model() -> DraftModel:
    """A drafter that runs a model (costly, no guesses): nothing of it is used but its kind."""
    return DraftModel.__new__(DraftModel)


def simulate(policy: Policy, drafter, rounds: int, accepted, seconds, key=0, rates: list | None = None) -> list[int]:
    """`rounds` rounds of one row; `accepted(k)` drafts of k are kept, a round of k costs `seconds(k, before)`
    (`before`: the K of the round before). Returns the K chosen each round; `rates` gets each round's
    tokens a second."""
    chosen, before = [], 0
    for _ in range(rounds):
        k = policy.choose([key], [drafter], [100])[0]
        n = accepted(k) if k else 0
        policy.record([key], [k], [n], k + 1, n + 1, seconds(k, before))
        chosen.append(k)
        if rates is not None:
            rates.append((n + 1) / seconds(k, before))
        before = k
    return chosen


def throughput(policy: Policy, drafter, rounds: int, accepted, seconds) -> float:
    """Tokens a plain step over `rounds` rounds of one row (as `simulate`)."""
    made, spent = [], []

    def kept(k):
        made.append(accepted(k))
        return made[-1]

    def cost(k, before):
        spent.append(seconds(k, before))
        return spent[-1]

    simulate(policy, drafter, rounds, kept, cost)
    return (rounds + sum(made)) / sum(spent)


def kept_with(alpha: float, seed: int):
    """`accepted(k)` where each draft is kept with probability alpha (its row's text, a temperature)."""
    rng = random.Random(seed)

    def accepted(k):
        n = 0
        while n < k and rng.random() < alpha:
            n += 1
        return n

    return accepted


def test_the_round_that_switches_to_drafting_is_not_what_drafting_costs():
    # A drafter that first catches up after plain rounds: that round costs 6 plain steps, the next ones
    # 1 + 0.1 K. Text it drafts badly, then text where two drafts a round are kept (K = 2 is best: 3 tokens
    # in 1.2). Learning from the switches (every probe is one), short drafts would look as dear as 6 steps.
    def seconds(k, before):
        return 1.0 if not k else 6.0 if not before else 1.0 + 0.1 * k

    policy, d = Policy(8), draft_model()
    assert max(simulate(policy, d, 40, lambda k: 0, seconds)[-20:]) <= Policy.PROBE_K  # plain, but for probes
    rates = []
    simulate(policy, d, 100, lambda k: min(k, 2), seconds, rates=rates)
    assert sum(rates[-50:]) / 50 > 0.9 * 3 / 1.2


def test_a_row_drafts_again_once_a_bad_patch_fades():
    # The drafter's rows draft well (its pool); this row then meets text it drafts badly, and every probe
    # fails too. What the row knew fades toward its drafter's pool in plain rounds: the model itself, not
    # only a probe, tries again (without the fading, only probes ever would).
    def seconds(k, before):
        return 1.0 + 0.3 * k

    policy, d = Policy(8), draft_model()
    simulate(policy, d, 60, lambda k: k, seconds, key="others")
    policy.forget("others")
    bad = simulate(policy, d, 8, lambda k: 0, seconds)
    assert bad[-1] == 0
    later = simulate(policy, d, 64, lambda k: 0 if k <= Policy.PROBE_K else 1, seconds)
    assert max(later) > Policy.PROBE_K


def test_a_row_that_keeps_its_whole_drafts_drafts_longer():
    # The pool learned that position 1 fails (another row's text); this row keeps everything it drafts.
    # What the pool knows of a far position may be long stale: the row's own rate before it counts.
    policy, d = Policy(8), draft_model()
    simulate(policy, d, 30, lambda k: min(k, 1), lambda k, before: 1.0 + 0.1 * k, key="others")
    policy.forget("others")
    chosen = simulate(policy, d, 6, lambda k: k, lambda k, before: 1.0 + 0.1 * k)
    assert max(chosen) > 2


def test_what_is_known_of_far_positions_fades_while_shorter_drafts_are_kept():
    row = Acceptance()
    for _ in range(6):
        row.update(4, 1)  # position 1 fails
    assert row.rates(2)[1] < 0.2
    for _ in range(60):
        row.update(1, 1)  # only position 0 is drafted now, and always kept
    assert row.rates(2)[1] > 0.8


def test_a_verification_cost_is_guessed_from_the_nearest_measured():
    policy, d = Policy(8), PromptLookup()
    for _ in range(3):
        policy.record([0], [0], [0], 1, 1, 1.0)
    m = policy.measured(1)
    assert m.verify_time(5) == 1.0 + 4 * m.SLOPE  # from plain rounds alone: SLOPE plain steps a token
    for _ in range(3):
        policy.record([0], [4], [4], 5, 5, 3.0)
    m = policy.measured(1)
    assert abs(m.verify_time(9) - (3.0 + 4 * m.SLOPE)) < 1e-9  # one drafting length measured
    assert abs(m.verify_time(3) - 2.0) < 1e-9  # shorter: between it and a plain round
    for _ in range(3):
        policy.record([0], [8], [8], 9, 9, 5.0)
    m = policy.measured(1)
    assert abs(m.verify_time(7) - 4.0) < 1e-9  # two: the line through them (not through the plain round)
    for _ in range(3):  # a length chosen seldom, its rounds slow: the line through all still speaks for it
        policy.record([0], [6], [6], 7, 7, 9.0)  # (the first of a shape is not counted)
    m = policy.measured(1)
    assert m.samples(7) == 2 and m.verify_time(7) < 6.0
    for _ in range(2):  # measured four times: it stands alone
        policy.record([0], [6], [6], 7, 7, 9.0)
    assert policy.measured(1).verify_time(7) == 9.0


def test_a_row_that_keeps_one_draft_of_eight_drafts_one_at_once():
    # A costly drafter (0.3 plain steps a token) whose first draft is kept and second never: one token a
    # round gives 2 tokens in 1.3 steps, eight 2 in 3.4. Once a plain round is measured the model drafts
    # one token, without waiting for a probe (eight's cost, less a small slope, made one look as dear).
    def seconds(k, before):
        return 1.0 if not k else 4.0 if not before else 1.0 + 0.3 * k

    chosen = simulate(Policy(8), draft_model(), 12, lambda k: min(k, 1), seconds)
    assert chosen[:2] == [8, 8] and 1 in chosen[2:6]


def test_the_round_after_a_row_joins_is_not_what_drafting_costs():
    # A new row's drafter first reads its prompt: that round's time is not learned from.
    policy, d = Policy(8), draft_model()
    simulate(policy, d, 30, lambda k: k, lambda k, before: 1.0 + 0.1 * k)
    m = policy.measured(1)
    k = policy.choose(["new"], [d], [100])[0]
    assert k > 0
    before = m.samples(k + 1)
    policy.record(["new"], [k], [k], k + 1, k + 1, 50.0)
    assert m.samples(k + 1) == before
    assert max(m.times[k + 1]) < 50.0


def simulate_batch(policy: Policy, drafter, B: int, rounds: int, seconds, compiling: bool = False) -> list[int]:
    """`rounds` rounds of B rows whose drafts are all kept, a round of K costing `seconds(K)`; `compiling`:
    every drafting round's shape is new (the first rounds of a batch size, few of each length)."""
    keys, chosen = list(range(B)), []
    for i in range(rounds):
        ks = policy.choose(keys, [drafter] * B, [100] * B)
        S = 1000 + i if compiling and any(ks) else max(ks) + 1
        policy.record(keys, ks, ks, S, sum(k + 1 for k in ks), seconds(max(ks)))
        chosen.append(max(ks))
    return chosen


def test_a_batch_size_met_first_starts_from_the_nearest_measured():
    # Four rows found that drafting pays; one finishes. Three rows measure their plain rounds, then draft
    # at once, as four did, instead of exploring one-token drafts first.
    policy, d = Policy(4), draft_model()
    four = simulate_batch(policy, d, 4, 40, lambda k: 1.0 + 0.2 * k)
    assert policy.measured(4).mode == "drafting" and four[-1] > 1
    three = simulate_batch(policy, d, 3, 5, lambda k: 0.8 + 0.15 * k)
    assert three[:3] == [0, 0, 0] and min(three[3:]) > 1  # (the first plain round of a shape compiles)


def test_a_batch_size_met_while_drafting_drafts_on_until_its_drafting_is_measured():
    # Four rows draft; one finishes. The three's first drafting rounds each compile a shape, so none is
    # counted: their first run of plain rounds finds nothing of drafting to compare with, and must not
    # read that as drafting losing (it would decode plainly for hundreds of rounds).
    policy, d = Policy(4), draft_model()
    simulate_batch(policy, d, 4, 40, lambda k: 1.0 + 0.2 * k)
    three = simulate_batch(policy, d, 3, 30, lambda k: 0.8 + 0.15 * k, compiling=True)
    assert sum(k > 0 for k in three[10:]) >= 10


def test_a_batch_where_one_token_drafts_barely_pay_decodes_plainly():
    # Every draft kept, a round of K costing 1 + 0.85 K plain steps: one-token drafts give 1.08x plain
    # decoding's throughput (longer ones a little more, by the model). Within what a batch's rates miss (its
    # last rounds, a machine's noise), a batch does not start drafting.
    policy, d = Policy(8), draft_model()
    chosen = simulate_batch(policy, d, 4, 200, lambda k: 1.0 + 0.85 * k)
    assert policy.measured(4).mode == "plain" and not any(chosen[20:])


def test_a_batch_climbs_one_token_past_the_longest_draft_it_has_measured():
    # Every draft kept, a round of K costing 1 + 0.3 K plain steps: K = 8 pays most, but a batch's first
    # rounds at a length compile it and catch its drafters up; it gets there a token at a time, each
    # length measured before the next is tried, not by jumping to 8 from two one-token rounds.
    policy, d = Policy(8), draft_model()
    chosen = simulate_batch(policy, d, 4, 80, lambda k: 1.0 + 0.3 * k)
    assert all(k <= max(chosen[:i], default=0) + 1 for i, k in enumerate(chosen))
    assert chosen[-1] == 8


def test_probes_that_keep_losing_stay_far_apart_in_the_next_sequences():
    # A drafter nothing of which is accepted at this temperature (a chat's turns, a benchmark's prompts):
    # each sequence would probe at 4, 8, 16... rounds again; it goes on as far apart as the last left off.
    from mlx_spec.sampling import SamplingParams

    d, params = draft_model(), SamplingParams(temp=1.0)
    probes = []
    for _ in range(4):
        policy = Policy.remembered(d, params, 8)
        chosen = simulate(policy, d, 64, lambda k: 0, lambda k, before: 1.0 + 0.3 * k)
        probes.append(sum(k > 0 for k in chosen))
    assert probes[-1] <= 1 < probes[0]


def test_sequences_shorter_than_the_probes_spacing_still_see_probes():
    # A chat's turns of 32 rounds: nothing is accepted in the first ones, so probes go 64 rounds apart or
    # more; then the text turns to what the drafter knows. The plain rounds since the last probe count on
    # from one sequence to the next: a probe comes, is accepted, and the row drafts again.
    from mlx_spec.sampling import SamplingParams

    d, params = draft_model(), SamplingParams(temp=0.5)
    for _ in range(12):
        simulate(Policy.remembered(d, params, 8), d, 32, lambda k: 0, lambda k, before: 1.0 + 0.3 * k)
    drafted = [sum(k > 0 for k in simulate(Policy.remembered(d, params, 8), d, 32, lambda k: k,
                                           lambda k, before: 1.0 + 0.1 * k)) for _ in range(24)]
    assert sum(drafted[-8:]) > 8 * 16  # drafting most rounds again


def test_a_batch_weighs_what_its_switches_to_drafting_cost():
    # Four rows; a drafting round yields 2 tokens a row for 1.6 plain steps (1.25x plain decoding), but the
    # round that drafts after plain ones costs 30 (every row's drafter catching up). Drafting, with a run
    # of plain rounds now and then to compare, would lose to plain decoding (0.77x of it): a batch counts
    # its switches. (Finding that out costs a few switches: 0.96x over these rounds.)
    policy, d, keys = Policy(1), draft_model(), list(range(4))
    tokens = seconds = 0.0
    before = 0
    for _ in range(3000):
        ks = policy.choose(keys, [d] * 4, [100] * 4)
        k = max(ks)
        cost = 1.0 if not k else 30.0 if not before else 1.6
        policy.record(keys, ks, ks, k + 1, sum(n + 1 for n in ks), cost)
        tokens, seconds, before = tokens + sum(n + 1 for n in ks), seconds + cost, k
    assert tokens / seconds > 0.9 * 4


def test_accepted_probes_stay_far_apart_where_drafting_costs_too_much():
    # Every draft is kept, but a drafting round costs 2 plain steps and one more a drafted token (a target
    # split over a slow link): the model says plain. An accepted probe tells nothing new, so probes still
    # grow further apart.
    policy, d = Policy(8), draft_model()
    chosen = simulate(policy, d, 300, lambda k: k, lambda k, before: 2.0 + k if k else 1.0)
    assert sum(k > 0 for k in chosen[50:]) <= 10


def test_each_drafter_drafts_up_to_its_own_most(checkpoints):
    # Drafts all kept, rounds nearly flat in K: a copy costs nothing to draft (lookup: 16 a round), a model
    # a step a token (8), a DFlash block is one forward (its block but the anchor). `k_max` caps them all.
    from mlx_spec.drafters.dflash import DFlash, DFlashNet, dflash_config
    from mlx_spec.models import load_model

    target = load_model(str(checkpoints["qwen3"]))[0]
    net = DFlashNet(dflash_config(target, num_layers=1, block_size=12, mask_token_id=0, target_layers=[0]))
    for drafter, most in ((PromptLookup(), 16), (draft_model(), 8), (DFlash(net, target), 11)):
        assert max(simulate(Policy(), drafter, 30, lambda k: k, lambda k, before: 1.0 + 0.01 * k)) == most
        assert max(simulate(Policy(4), drafter, 30, lambda k: k, lambda k, before: 1.0 + 0.01 * k)) == 4


def test_probes_that_lose_much_are_further_apart():
    # Nothing is accepted at this temperature. Where a probe's round costs 1.3 plain steps, probes settle
    # 64 rounds apart; where one costs 9 (a wide tree, a drafter catching up on every token it missed),
    # 64 apart they would lose an eighth of plain decoding's time: they go further apart, so that they
    # lose at most a few percent.
    def share_lost(probe_cost: float) -> float:
        policy, d = Policy(8), draft_model()
        chosen = simulate(policy, d, 3000, lambda k: 0, lambda k, before: probe_cost if k else 1.0)
        late = chosen[1000:]
        return sum(probe_cost - 1 for k in late if k) / len(late)

    assert share_lost(1.3) < 0.01
    assert share_lost(9.0) <= Policy.PROBE_SHARE * 1.25


def test_probes_of_a_drafter_that_catches_up_lose_little_however_far_apart():
    # Nothing is accepted; a probe costs 2 plain steps and 0.005 of one more for each round since the last
    # (an EAGLE drafter catching up on the target's features of every token it missed). Weighed by the first
    # probes, a few rounds apart and cheap, later probes would lose 2% of plain decoding's time; weighed by
    # the last few, under 1%.
    policy, d = Policy(8), draft_model()
    missed, lost, late = 0, 0.0, 0
    for i in range(6000):
        k = policy.choose([0], [d], [100])[0]
        cost = 2.0 + 0.005 * missed if k else 1.0
        policy.record([0], [k], [0], k + 1, 1, cost)
        missed = 0 if k else missed + 1
        if i >= 2000:
            lost, late = lost + cost - 1.0, late + 1
    assert lost / late <= 0.01


def test_a_row_drafts_on_through_unlucky_rounds_where_drafting_pays():
    # Each draft is kept with probability 0.7; a round of K costs 1 + 0.5 K plain steps, one that drafts after
    # plain rounds 4 (its drafter catching up). One or two drafts a round pay about 10%. A row that stopped at
    # each unlucky round (its own acceptance, a few rounds' worth, dips by chance) would pay a switch each
    # time it started again: with a shorter memory it loses to plain decoding, and stopping wherever the
    # model weighs drafting a little below plain gives up half of what is left.
    rate = throughput(Policy(8), draft_model(), 4000, kept_with(0.7, 0),
                      lambda k, before: 1.0 if not k else 4.0 if not before else 1.0 + 0.5 * k)
    assert rate > 1.055


def test_a_lucky_probe_where_drafting_loses_does_not_bring_the_probes_closer():
    # Each draft is kept with probability 0.5, a round of K costs 1.8 + 0.3 K (4 after plain rounds): drafting
    # loses. A probe that is accepted now and then starts a few rounds of drafting that lose too; those do not
    # bring the next probes back to 4 rounds apart.
    chosen = simulate(Policy(8), draft_model(), 4000, kept_with(0.5, 1),
                      lambda k, before: 1.0 if not k else 4.0 if not before else 1.8 + 0.3 * k)
    assert sum(k > 0 for k in chosen[1000:]) <= 50


def test_a_slow_spell_just_before_drafting_does_not_make_drafting_look_cheap():
    # A row measured plain rounds at 1 for long, then the machine slowed for 10 rounds; then it drafts, at 2.2
    # a round, measuring no plain round while it does. Weighed against the slow spell alone, a drafting round
    # would cost 1.1 plain rounds for as long as it drafts.
    policy = Policy(8)
    for seconds in [1.0] * 40 + [2.0] * 10:
        policy.record([0], [0], [0], 1, 1, seconds)
    for _ in range(6):
        policy.record([0], [1], [1], 2, 2, 2.2)
    m = policy.measured(1)
    assert m.verify_time(2) / m.verify_time(1) > 2.0
