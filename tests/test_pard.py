"""PARD drafters as AMD publishes them (amd/PARD-Qwen3-0.6B: a Qwen3 causal LM whose config.json
adds `pard_token` and `spd_type: "pard"`, its weights and tokenizer as any model's): K drafts from
one forward over the new tokens and K-1 mask tokens, round for round the drafts AMD's own inference
loop computes (scripts/make_pard_reference.py, tests/fixtures/pard_reference) and those of a fresh
forward over the whole context and the masks (the cache after each round holds the context alone),
greedy output identical to plain decoding, sampled output distributed as the target's."""

import json
from pathlib import Path

import mlx.core as mx
import pytest

import numpy as np

from mlx_spec import api, sampling
from mlx_spec.decoding import plain_steps, speculative_steps
from mlx_spec.drafters import find_drafter, make_drafter
from mlx_spec.drafters.draft_model import Pard
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams

from helpers import assert_one_line_error
from stats import N, STAT_PROMPT, V, empirical_tv, exact_joint, tiny, told_apart, tv_bound
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


def test_drafts_are_those_of_amds_pard_loop():
    """Each round of AMD's loop (its `--para` path) from the context it had: the same K drafts; and
    mlx-spec's own loop gives the tokens AMD's kept, identical to plain decoding."""
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
    assert find_drafter("pard", "mlx-community/Qwen3-8B-4bit") == "amd/PARD-Qwen3-0.6B"
    assert find_drafter("pard", "meta-llama/Llama-3.1-8B-Instruct") == "amd/PARD-Llama-3.2-1B"
    plain = in_process("generate", "--model", target, "--drafter", f"pard={checkpoints['qwen3']}", "--prompt", "x")
    assert_one_line_error(plain, "--drafter pard=", "pard_token")
    config = json.loads((pard / "config.json").read_text())
    (pard / "config.json").write_text(json.dumps({**config, "pard_token": config["vocab_size"] + 5}))
    try:
        bad = in_process("generate", "--model", target, "--drafter", f"pard={pard}", "--prompt", "x")
    finally:
        (pard / "config.json").write_text(json.dumps(config))
    assert_one_line_error(bad, "config.json", "pard_token")


def test_copies_mask_is_amds():
    """The query at position j of copy i sees copy 0 up to position j - i, and itself (AMD's collator's mask)."""
    from mlx_spec.train.pard import copies_mask

    S, K = 5, 3
    sees = np.array(copies_mask(S, K))[0, 0]
    for q in range(K * S):
        i, j = divmod(q, S)
        assert set(np.flatnonzero(sees[q])) == set(range(j - i + 1)) | {q}


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
