"""The benchmark's analysis: where greedy outputs part, the seed's prediction."""

import pytest

import mlx_spec.bench as bench
import mlx_spec.bench.methods as methods
from mlx_spec.metrics import StepEvent
from mlx_spec.metrics import Metrics
from mlx_spec.models import load_model


def test_a_greedy_divergence_is_placed_and_its_margin_measured(checkpoints):
    import mlx.core as mx

    from mlx_spec import exact

    model = load_model(str(checkpoints["qwen3"]))[0]
    prompt, plain = [1, 2, 3], [5, 6, 7, 8]
    token, margin = exact.parted(model, prompt, plain, [5, 6, 9, 9])
    logits, _ = model(mx.array([prompt + plain[:2]]))
    top = sorted(logits[0, -1].tolist())[-2:]
    assert token == 2 and margin == pytest.approx(top[1] - top[0]) and margin > 1e-3  # a random model's: far from a tie
    assert exact.parted(model, prompt, plain, plain[:2]) is None  # stopped early: not parted


def test_prediction_follows_the_seed_formula():
    m = Metrics()
    for _ in range(10):  # K = 4 drafted each round, 2 accepted: alpha = 2 / 3
        m.add(StepEvent([1, 2, 3], [True, True, False], drafted=[1, 2, 0, 0], draft_time=0.4, verify_time=1.0))
    alpha, K, c = 2 / 3, 4, 0.1  # a drafted position costs 0.1 of a 1-second step
    expected = (1 - alpha ** (K + 1)) / (1 - alpha) / (K * c + 1)
    predicted, why = bench.predict(m, step_time=1.0, measured=expected)
    assert predicted == pytest.approx(expected) and why == ""
    predicted, why = bench.predict(m, step_time=0.25, measured=expected)  # verification = 4 plain steps
    assert "4.00 plain steps" in why


def test_decoding_speed_counts_the_tokens_after_the_first_event(monkeypatch):
    """A speculative first round brings several tokens at once: they came at the time to the first token,
    not in the decoding timed after it (else a drafter would get them for nothing)."""
    now = [0.0]
    monkeypatch.setattr(methods.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(methods, "settle", lambda events: None)

    def events(first: int):  # the first event 2 s in (the prompt), then one a second
        now[0] = 2.0
        yield StepEvent([0] * first, [True] * (first - 1) + [False])
        for _ in range(4):
            now[0] += 1.0
            yield StepEvent([0, 0], [True, False])

    for first in (1, 4):
        now[0] = 0.0
        prompt_tps, decode_tps, tokens, _ = bench.time_run(events(first), n_prompt=10, max_tokens=100)
        assert len(tokens) == first + 8 and decode_tps == 8 / 4


def test_the_bandwidth_bound_is_a_streaming_read_and_absent_in_cache():
    """The probe reads as decoding does (a row times each weight matrix, transposed), from more than the
    caches hold; weights that fit in the caches read faster than that, and get no bound."""
    from mlx_spec.bench.machine import STREAMING_BYTES, bandwidth_bound

    streaming, bound = bandwidth_bound(4 * STREAMING_BYTES)
    assert streaming > 0 and bound == streaming / (4 * STREAMING_BYTES)
    assert bandwidth_bound(256 * 1024)[1] is None


def test_decoders_taking_turns_each_run_to_their_end_and_are_timed_apart(checkpoints):
    """`take_turns`: a pair decodes by turns of a few rounds; each decoder's tokens, rounds, drafted
    tokens and seconds are its own, and one that ends first leaves the other to run on alone."""
    from mlx_spec.decoding import Decoder
    from mlx_spec.drafters.draft_model import DraftModel
    from mlx_spec.sampling import SamplingParams

    model = load_model(str(checkpoints["qwen3"]))[0]
    plain, spec = Decoder(model), Decoder(model, num_draft=2)
    plain.add(0, [1, 2, 3], SamplingParams(), 5)
    spec.add(0, [1, 2, 3], SamplingParams(), 20, DraftModel(model, model.args.vocab_size))
    (tokens, rounds, drafted, seconds), (spec_tokens, spec_rounds, spec_drafted, spec_seconds) = \
        bench.take_turns([plain, spec], turn=3)
    assert (tokens, rounds, drafted) == (5, 5, 0) and seconds > 0
    # the target drafting for itself: every draft is kept, 3 tokens a round (the last round drafts 1)
    assert (spec_tokens, spec_rounds, spec_drafted) == (20, 7, 13) and spec_seconds > 0
    assert not plain.rows and not spec.rows


def test_batched_rows_draft_the_k_a_method_fixes(checkpoints):
    """`:num-draft=K` holds in the batched rows as in the one-sequence rows: the target drafting for
    itself keeps every draft, so a sequence of 8 tokens takes rounds of K = 2, 2 and (its room) 1 (the
    policy, left to choose, would first decode plainly: what drafting is weighed against)."""
    from mlx_spec.drafters.draft_model import DraftModel

    model = load_model(str(checkpoints["qwen3"]))[0]
    itself = DraftModel(model, model.args.vocab_size)
    rows = bench.measure_concurrency(model, {"fixed": itself}, [[1, 2, 3], [4, 5, 6, 7]], [2], 8,
                                     [0.0], num_draft={"fixed": 2})
    assert next(r["mean_k"] for r in rows if r["name"] == "fixed") == 5 / 3


def test_a_batch_is_kept_full_and_timed_while_it_is(checkpoints):
    """`measure_concurrency`'s batches: a finished sequence is replaced at once by the next (as the server keeps
    its batch full), and the run ends when one finishes with none left to take its place: a batch left to drain
    would be timed at fewer rows. What is left in flight then is dropped."""
    from mlx_spec.decoding import Decoder
    from mlx_spec.sampling import SamplingParams

    model = load_model(str(checkpoints["qwen3"]))[0]
    decoder, lengths, started, in_flight = Decoder(model), [3, 6, 4, 9], [0], []

    def feed(i: int) -> bool:
        while len(decoder.rows) < 2 and started[0] < len(lengths):
            decoder.add(started[0], [1, 2, 3], SamplingParams(), lengths[started[0]])
            started[0] += 1
        in_flight.append(len(decoder.rows))
        return len(decoder.rows) == 2

    feed(0)
    [(tokens, rounds, drafted, seconds)] = bench.take_turns([decoder], turn=3, feed=feed)
    # rounds 1-3: sequences 0 and 1; 4-6: 1 and 2 (0 done after 3); 7: 2 and 3 (1 done after 6); 2 ends after 7
    assert (tokens, rounds, drafted) == (14, 7, 0) and seconds > 0
    assert in_flight == [2] * 7 + [1] and started == [4] and not decoder.rows


def test_each_prompt_is_read_once_for_all_of_mlx_specs_methods(monkeypatch, tmp_path):
    """mlx-spec's methods go on from one reading of each prompt (a long context's prefill takes minutes on a
    CPU): the target reads each of 2 prompts once for 3 methods, their warm-ups, 2 repeats and the machine
    section (18 readings before), and every answer is still plain decoding's."""
    import json

    import mlx_spec.decoding as decoding
    from helpers import cli_here

    read, prefill = [], decoding.prefill

    def counted(model, tokens, cache, *args, **kwargs):
        read.append(len(tokens))
        return prefill(model, tokens, cache, *args, **kwargs)

    monkeypatch.setattr(decoding, "prefill", counted)
    monkeypatch.setattr(methods, "prefill", counted)
    report = tmp_path / "bench.json"
    out = cli_here("bench", "--drafters", "draft,lookup", "--prompts", "code", "--num-prompts", "2", "--max-tokens",
                   "8", "--repeats", "2", "--temps", "0", "--no-mlx-lm", "--json", report)
    assert out.returncode == 0, out.stderr
    # (a method going on from a reading reads nothing more; nor the machine section, after the first prompt)
    assert len([n for n in read if n]) == 2, read
    rows = json.loads(report.read_text())["rows"]
    assert [r["name"] for r in rows] == ["mlx-spec", "mlx-spec draft", "mlx-spec lookup"]
    assert all(r["identical_to_plain"] and r["prompt_tps"] > 0 for r in rows)
