"""PARD drafters as AMD publishes them (amd/PARD-Qwen3-0.6B: a Qwen3 causal LM whose config.json
adds `pard_token` and `spd_type: "pard"`, its weights and tokenizer as any model's): K drafts from
one forward over the new tokens and K-1 mask tokens, round for round the drafts AMD's own inference
loop computes (scripts/make_pard_reference.py, tests/fixtures/pard_reference) and those of a fresh
forward over the whole context and the masks (the cache after each round holds the context alone),
greedy output identical to plain decoding, sampled output distributed as the target's. PARD-2
(amd/PARD2-Qwen3-8B: `spd_type: "pard2"` and `warp_model.bin`) reads the target's features too:
against AMD's PARD-2 loop (scripts/make_pard2_reference.py, tests/fixtures/pard2_reference)."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

import numpy as np

from mlx_spec import api, sampling
from mlx_spec.decoding import Decoder, plain_steps, speculative_steps
from mlx_spec.drafters import find_drafter, make_drafter
from mlx_spec.drafters.draft_model import Pard, Pard2
from mlx_spec.errors import UserError
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams

from helpers import assert_one_line_error
from stats import (N, STAT_PROMPT, V, assert_distributed_as_target, empirical_tv, exact_joint, tiny, told_apart,
                   tv_bound)
from test_speculative import resample_from_target
from tiny import make_checkpoint


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pard")
    target = make_checkpoint(root / "target", "qwen3", seed=0)
    pard = make_checkpoint(root / "PARD-Qwen3-0.6B", "qwen3", seed=3, num_hidden_layers=1)
    config = json.loads((pard / "config.json").read_text())
    config.update(pard_token=config["vocab_size"] - 1, spd_type="pard")
    (pard / "config.json").write_text(json.dumps(config, indent=2))
    return target, pard


def test_a_pard_folder_drafts_greedy_identical(folders, in_process):
    target, pard = folders
    for spec in (f"pard={pard}", f"draft={pard}"):  # found by its pard_token under draft= too
        out = in_process("generate", "--model", target, "--drafter", spec, "--prompt", "def f(x):", "--max-tokens", "32",
                         "--check", "--json", "--num-draft", "4")
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["identical_to_plain"] is True and result["drafted_tokens"] > 0


REFERENCE = Path(__file__).parent / "fixtures" / "pard_reference"
GREEDY = SamplingParams()


def test_drafts_are_those_of_amds_pard_loop(monkeypatch):
    """Each round of AMD's loop (its `--para` path) from the context it had: the same K drafts, from the
    same logits; and mlx-spec's own loop gives the tokens AMD's kept, identical to plain decoding."""
    seen = []
    read = Pard._to_target_vocab
    monkeypatch.setattr(Pard, "_to_target_vocab", lambda self, logits: seen.append(logits[0]) or read(self, logits))
    ref = np.load(REFERENCE / "reference.npz")
    target, _ = load_model(str(REFERENCE / "target"))
    drafter = make_drafter(f"pard={REFERENCE / 'pard'}", target).new_session()
    K = ref["drafts"].shape[1]
    context = ref["prompt"].tolist()
    drafter.add()
    drafter.restart(0, context)
    for r, (drafts, kept) in enumerate(zip(ref["drafts"].tolist(), ref["kept"].tolist())):
        if r:
            drafter.commit(0, context)
        assert drafter.propose([context], [K], [GREEDY])[0].tokens.tolist() == drafts
        np.testing.assert_allclose(np.array(seen[-1]), ref["logits"][r], atol=2e-4)
        context = context + [t for t in kept if t >= 0]
    amd = context[len(ref["prompt"]):]
    n = 24
    events = list(speculative_steps(target, ref["prompt"].tolist(), GREEDY, n,
                                    make_drafter(f"pard={REFERENCE / 'pard'}", target).new_session(), num_draft=K))
    assert [t for e in events for t in e.tokens] == amd[:n]
    assert [t for e in plain_steps(target, ref["prompt"].tolist(), GREEDY, n) for t in e.tokens] == amd[:n]
    assert sum(len(e.drafted) for e in events) > 0


class Counted:
    """A model that counts its forwards."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)

    def make_cache(self, rows: int):
        return self.model.make_cache(rows)


def test_drafts_are_one_forward_over_the_masks(folders):
    target, folder = folders
    loaded = api.load(str(target))
    drafter = api.drafter(f"pard={folder}", loaded).new_session()
    assert isinstance(drafter, Pard)
    model, mask = drafter.model, drafter.pard_token
    drafter.model = counted = Counted(model)
    drafter.add()
    context = [5, 9, 12, 7, 30, 31, 8]
    drafter.restart(0, context)
    for accepted in ([], [40, 41], [42]):  # rounds: the target keeps some drafts and adds its own token
        context = context + accepted
        if accepted:
            drafter.commit(0, context)
        calls = counted.calls
        draft = drafter.propose([context], [4], [SamplingParams()])[0]
        assert counted.calls == calls + 1
        fresh = model(mx.array([context + [mask] * 3]))[0][0, -4:]  # [K, V]: no cache, the whole context
        assert draft.tokens.tolist() == mx.argmax(fresh, axis=-1).tolist()
        assert drafter.cached[0] == context  # the masks left the cache


def test_sampling_matches_the_targets_distribution(monkeypatch):
    target = tiny(0, V)
    params = SamplingParams(temp=1.0)
    make = lambda: Pard(tiny(1, V, logit_scale=0.3), V, pard_token=V - 1)  # noqa: E731
    p = exact_joint(target, STAT_PROMPT, params, 3)
    assert empirical_tv(target, make, params, p) < tv_bound(p, N)
    monkeypatch.setattr(sampling, "accept_sampled", resample_from_target)  # a wrong rule fails it
    assert told_apart(target, make, params, p)


def test_published_and_refused(folders, in_process, checkpoints):
    target, pard = folders
    assert find_drafter("pard", "mlx-community/Qwen3-4B-4bit") == "amd/PARD-Qwen3-0.6B"
    assert find_drafter("pard", "mlx-community/Qwen3-8B-4bit") == "amd/PARD2-Qwen3-8B"  # trained on its features
    assert find_drafter("pard", "meta-llama/Llama-3.1-8B-Instruct") == "amd/PARD2-Llama-3.1-8B"
    assert find_drafter("pard", "meta-llama/Llama-3.3-70B-Instruct") == "amd/PARD-Llama-3.2-1B"
    plain = in_process("generate", "--model", target, "--drafter", f"pard={checkpoints['qwen3']}", "--prompt", "x")
    assert_one_line_error(plain, "--drafter pard=", "pard_token")
    config = json.loads((pard / "config.json").read_text())
    (pard / "config.json").write_text(json.dumps({**config, "pard_token": config["vocab_size"] + 5}))
    try:
        bad = in_process("generate", "--model", target, "--drafter", f"pard={pard}", "--prompt", "x")
    finally:
        (pard / "config.json").write_text(json.dumps(config))
    assert_one_line_error(bad, "config.json", "pard_token")
    # A PARD model drafts its K in one forward: a tree of it is refused (the draft model's trees are EAGLE-2's).
    tree = in_process("generate", "--model", target, "--drafter", f"draft={pard}", "--tree-budget", "6", "--prompt", "x")
    assert_one_line_error(tree, "--tree-budget", "PARD")


def test_copies_mask_is_amds():
    """The mask of AMD's collator (AMD-AGI/PARD `pard_train.py`, `pard2_train.py`), built as it builds it: the
    query at position j of copy i sees copy 0 up to position j - i, and the masks from there to itself
    (those before it at inference). Compared where the copy has a real token to read (j >= i)."""
    from mlx_spec.train.pard import copies_mask

    S, K = 5, 3
    q = np.arange(K * S)
    amd = q[None, :] == q[:, None]
    for i in range(K):
        amd |= q[None, :] == (q - S * i - i)[:, None]
        amd |= (q[None, :] < (q - i * S - (i - 1))[:, None]) & (q < (i + 1) * S)[:, None]
    sees = np.array(copies_mask(S, K))[0, 0]
    for query in q:
        i, j = divmod(query, S)
        if j >= i:
            assert set(np.flatnonzero(sees[query])) == set(np.flatnonzero(amd[query])), (i, j)
            assert set(np.flatnonzero(sees[query])) == set(range(j - i + 1)) | {(i - t) * S + j - t for t in range(i)}


def test_train_pard_makes_the_masks_draft(stride_model, tmp_path):
    """`mlx-spec train pard` for a short run, from the stride model itself (as a PARD drafter untrained, its
    first draft is the target's own token and its masks know nothing): more tokens per target forward
    than untrained, greedy identical to plain."""
    from conftest import _fast_blas_env
    from helpers import cli, tau_on_held_out_rows
    from tiny import write_stride_data

    data = write_stride_data(tmp_path / "data", stride_model)
    out = tmp_path / "pard"
    proc = cli("train", "pard", "--student", stride_model, "--data", data, "-o", out, "--k", "4", "--steps", "30",
               "--batch-size", "8", "--seq-len", "32", "--lr", "1e-3", "--warmup", "5", "--quiet", env=_fast_blas_env())
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "config.json").read_text())["spd_type"] == "pard"
    target, _ = load_model(str(stride_model))
    model, _ = load_model(str(stride_model))
    V = target.args.vocab_size
    untrained = tau_on_held_out_rows(target, stride_model, lambda: Pard(model, V, pard_token=V - 1), 4)
    trained = tau_on_held_out_rows(target, stride_model, make_drafter(f"pard={out}", target).new_session, 4)
    assert trained > untrained + 0.5, (trained, untrained)


REFERENCE2 = Path(__file__).parent / "fixtures" / "pard2_reference"


def test_pard2_drafts_and_logits_are_amds(monkeypatch):
    """A PARD-2 drafter as amd/PARD2-Qwen3-8B is laid out (config fields and warp_model.bin), loaded as it is:
    round for round the K drafts and the draft logits of AMD's PARD-2 loop (scripts/make_pard2_reference.py:
    the target's features of the position before added to each input, the masks reusing the last), the tokens
    it kept, identical to plain decoding."""
    ref = np.load(REFERENCE2 / "reference.npz")
    target, _ = load_model(str(REFERENCE2 / "target"))
    drafter = make_drafter(f"pard={REFERENCE2 / 'pard2'}", target).new_session()
    assert isinstance(drafter, Pard2) and drafter.capture == (4, 3, 1)  # transformers' hidden_states -1, -2, -4
    seen = []
    read = Pard2._to_target_vocab
    monkeypatch.setattr(Pard2, "_to_target_vocab", lambda self, logits: seen.append(logits[0]) or read(self, logits))
    K, prompt = ref["drafts"].shape[1], ref["prompt"].tolist()
    events = list(speculative_steps(target, prompt, GREEDY, 24, drafter, num_draft=K))
    drafting = [e for e in events if e.drafted]  # (the last rounds draft only as many as are still to come)
    assert len(seen) == len(drafting)
    for event, logits, drafts, amds in zip(drafting, seen, ref["drafts"].tolist(), ref["logits"]):
        assert event.drafted == drafts[: len(event.drafted)]
        np.testing.assert_allclose(np.array(logits), amds[: logits.shape[0]], atol=2e-4)
    amd = [t for kept in ref["kept"].tolist() for t in kept if t >= 0]
    assert [t for e in events for t in e.tokens] == amd[:24]
    assert [t for e in plain_steps(target, prompt, GREEDY, 24) for t in e.tokens] == amd[:24]
    assert sum(len(e.tokens) - 1 for e in events) > 0  # drafts were accepted


@pytest.fixture(scope="module")
def pard2():
    target, _ = load_model(str(REFERENCE2 / "target"))
    return target, make_drafter(f"pard={REFERENCE2 / 'pard2'}", target), np.load(REFERENCE2 / "reference.npz")


def test_pard2_rows_of_a_batch_draft_as_alone(pard2):
    """Each row reads its own positions' features: in a batch, the drafts it makes alone; plain's tokens."""
    target, drafter, ref = pard2
    prompt, amd = ref["prompt"].tolist(), ref["kept"][ref["kept"] >= 0].tolist()
    rows = [prompt, prompt[5:], prompt[:3] + amd[:9], prompt[:1]]
    batch = decoded(Decoder(target, num_draft=4), rows, drafter)
    for row, text in enumerate(rows):
        assert batch[row] == decoded(Decoder(target, num_draft=4), [text], drafter.new_session())[0]
        assert [t for tokens, _ in batch[row] for t in tokens] == plain(target, text)


def test_pard2_a_later_turn_drafts_as_a_fresh_run(pard2):
    """A chat's next turn: the target keeps its cache but from the position before the drafter's first new
    one (whose features that drafter reads), and the turn drafts as a fresh run on the whole prompt."""
    target, drafter, ref = pard2
    prompt, session, cache = ref["prompt"].tolist(), drafter.new_session(), target.make_cache()
    context = prompt + [t for e in speculative_steps(target, prompt, GREEDY, 12, session, num_draft=4, cache=cache)
                        for t in e.tokens]
    follow_up, kept, restart = context + [40, 41, 42], [], session.restart
    session.restart = lambda b, text, cached=0: kept.append(restart(b, text, cached)) or kept[-1]
    later = list(speculative_steps(target, follow_up, GREEDY, 12, session, num_draft=4, cache=cache))
    fresh = list(speculative_steps(target, follow_up, GREEDY, 12, drafter.new_session(), num_draft=4))
    assert [(e.tokens, e.drafted) for e in later] == [(e.tokens, e.drafted) for e in fresh]
    assert len(prompt) < kept[0] < len(context) - 1


def test_pard2_reads_features_sent_a_token_at_a_time_as_sent_at_once(pard2):
    """Plain rounds send one token's features each (kept as they came, joined when the drafter next reads):
    its drafts are those of the same features sent in one piece."""
    target, drafter, ref = pard2
    context = ref["prompt"].tolist()
    _, hidden = target(mx.array([context]), capture=drafter.capture)  # [1, n, H] a tap
    drafts = []
    for pieces in ([len(context) - 1], [1] * (len(context) - 1)):
        session, at = drafter.new_session(), 0
        session.add()
        session.restart(0, context[:1])
        for n in pieces:  # the features of context[at : at + n], the context then ending at at + n
            session.commit(0, context[: at + n + 1], tuple(h[:, at : at + n] for h in hidden))
            at += n
        drafts.append(session.propose([context], [4], [GREEDY])[0].tokens.tolist())
    assert drafts[0] == drafts[1]


def decoded(decoder: Decoder, prompts: list[list[int]], drafter) -> list[list]:
    """Each row's rounds, (tokens, drafted), greedy: 16 tokens."""
    out = [[] for _ in prompts]
    for b, prompt in enumerate(prompts):
        decoder.add(b, prompt, GREEDY, 16, drafter)
    while not decoder.done:
        for b, event in decoder.step().items():
            out[b].append((event.tokens, event.drafted))
    return out


def plain(target, prompt: list[int]) -> list[int]:
    return [t for e in plain_steps(target, prompt, GREEDY, 16) for t in e.tokens]


def test_pard2_sampling_matches_the_targets_distribution(monkeypatch):
    target = tiny(0, V)
    proj = nn.Linear(2 * 32, 32, bias=False)
    make = lambda: Pard2(tiny(1, V, logit_scale=0.3), V, V - 1, proj, 0.5, (1, 0), target.final_norm)  # noqa: E731
    assert_distributed_as_target(target, make, monkeypatch)


def test_pard2_folder_that_does_not_fit_is_refused(tmp_path):
    """A PARD-2 folder whose layers or projection do not fit the target: an error naming the field or file."""
    target, _ = load_model(str(REFERENCE2 / "target"))
    folder = tmp_path / "pard2"
    shutil.copytree(REFERENCE2 / "pard2", folder)
    config = json.loads((folder / "config.json").read_text())
    for change, words in (({"pard2_target_dim": 100}, "pard2_target_dim is 100, the target gives 3 x 64"),
                          ({"pard2_target_layers": [9]}, "pard2_target_layers must list")):
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(UserError, match=f"config.json: {words}"):
            make_drafter(f"pard={folder}", target)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "warp_model.bin").unlink()
    with pytest.raises(UserError, match="warp_model.bin: missing"):
        make_drafter(f"pard={folder}", target)


def test_pard2_downloads_its_projection_with_the_model(tmp_path):
    """`--drafter pard=amd/PARD2-Qwen3-8B` from the Hub (a local one, serving the fixture as that repo): the
    projection in warp_model.bin comes down beside the weights, and the output is plain decoding's."""
    from fakehub import FakeHub
    from helpers import cli
    from tiny import make_tokenizer

    target, pard2 = tmp_path / "target", tmp_path / "pard2"
    for folder in (target, pard2):  # as published, each with the tokenizer
        shutil.copytree(REFERENCE2 / folder.name, folder)
        make_tokenizer(folder, vocab_size=256)
    with FakeHub({"amd/PARD2-Qwen3-8B": pard2}) as hub:
        env = {"MLX_SPEC_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url,
               "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_DISABLE_XET": "1"}
        out = cli("generate", "--model", target, "--drafter", "pard=amd/PARD2-Qwen3-8B", "--prompt", "def f(x):",
                  "--max-tokens", "16", "--check", "--json", "--num-draft", "4", env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["identical_to_plain"] is True
    assert list((tmp_path / "hf").glob("models--amd--PARD2-Qwen3-8B/snapshots/*/warp_model.bin"))


def test_cat_weights_are_the_targets_odds_of_the_tokens_between():
    """Copy i's prediction at position j weighs prod_{s=1..i} p(x_{j+1-s}) (AMD's `_build_prev_prob`)."""
    from mlx_spec.train.pard import cat_weights

    gold = np.random.default_rng(0).uniform(0.1, 1.0, (2, 7))
    gold[:, 0] = 1.0
    w = np.array(cat_weights(mx.array(gold, dtype=mx.float32), 4))  # [B, K, S-1]
    for b, i, j in np.ndindex(2, 4, 6):
        expected = np.prod([gold[b, j + 1 - s] for s in range(1, i + 1) if j + 1 - s >= 0])
        assert w[b, i, j] == pytest.approx(expected, rel=1e-5), (b, i, j)


def test_train_pard2_reads_the_targets_features_and_drafts(stride_model, tmp_path):
    """`mlx-spec train pard --target`: PARD-2 (the target's features projected into each input, its loss the
    target's distribution weighted by the odds of reaching each token) from the stride model itself: the
    folder loads as PARD-2 as AMD's do, more tokens per target forward than untrained, greedy identical."""
    from conftest import _fast_blas_env
    from helpers import cli, tau_on_held_out_rows
    from tiny import write_stride_data

    data = write_stride_data(tmp_path / "data", stride_model)
    out = tmp_path / "pard2"
    proc = cli("train", "pard", "--student", stride_model, "--target", stride_model, "--data", data, "-o", out,
               "--k", "4", "--steps", "30", "--batch-size", "8", "--seq-len", "32", "--lr", "1e-3", "--warmup", "5",
               "--quiet", env=_fast_blas_env())
    assert proc.returncode == 0, proc.stderr
    config = json.loads((out / "config.json").read_text())
    target, _ = load_model(str(stride_model))
    L = target.args.num_hidden_layers
    assert config["spd_type"] == "pard2" and config["pard2_target_layers"] == [-1]  # AMD's that a shallow one has
    assert config["pard2_target_dim"] == target.args.hidden_size and (out / "warp_model.safetensors").is_file()
    trained = make_drafter(f"pard={out}", target)
    assert isinstance(trained, Pard2) and trained.capture == (L,)
    model, _ = load_model(str(stride_model))
    V = target.args.vocab_size
    untrained = tau_on_held_out_rows(target, stride_model, lambda: Pard(model, V, pard_token=V - 1), 4)
    tau = tau_on_held_out_rows(target, stride_model, trained.new_session, 4)
    assert tau > untrained + 0.5, (tau, untrained)


def test_pard2_training_reads_what_drafting_reads(pard2, monkeypatch):
    """In training, copy i at position j (its last real token j - i) reads the features and gives the
    distribution that drafting gives as its i-th draft after the context up to j - i."""
    from mlx_spec.train.pard import copies_features, copies_logits

    target, drafter, ref = pard2
    tokens, K = mx.array(ref["prompt"][None, :12]), 4
    features, _ = copies_features(target, tokens, drafter.capture, K)
    trained = copies_logits(drafter.model, tokens, K, drafter.pard_token, drafter.proj(features) * drafter.scale)
    seen = []
    read = Pard2._to_target_vocab
    monkeypatch.setattr(Pard2, "_to_target_vocab", lambda self, logits: seen.append(logits[0]) or read(self, logits))
    _, taps = target(tokens, capture=drafter.capture)
    for n in (1, 3, 8):  # the context: the first n tokens
        session = drafter.new_session()
        session.add()
        session.restart(0, ref["prompt"][:n].tolist())
        session.commit(0, ref["prompt"][:n].tolist(), tuple(h[:, : n - 1] for h in taps) if n > 1 else ())
        session.propose([ref["prompt"][:n].tolist()], [K], [GREEDY])
        for i in range(K):
            np.testing.assert_allclose(np.array(trained[0, i, n - 1 + i]), np.array(seen[-1][i]), atol=1e-4)


def test_train_pard2_flags_are_checked(stride_model, tmp_path, in_process):
    from tiny import write_stride_data

    data = write_stride_data(tmp_path / "data", stride_model)
    base = ("train", "pard", "--student", stride_model, "--target", stride_model, "--data", data, "-o", tmp_path / "o",
            "--seq-len", "32", "--steps", "1")
    assert_one_line_error(in_process(*base, "--feature-drop", "1.5"), "--feature-drop")
    assert_one_line_error(in_process(*base, "--target-layers", "-1,x"), "--target-layers")
    assert_one_line_error(in_process(*base, "--target-layers", "40"), "--target-layers", "40")
