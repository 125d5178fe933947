"""scripts/widen_demo.py: the demo widened computes the demo's function, and its drafters draft what the demo's do."""

import functools
import json
import runpy
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_spec import demo
from mlx_spec.decoding import plain_steps, speculative_steps
from mlx_spec.drafters import make_drafter
from mlx_spec.models import load_model
from mlx_spec.published import is_demo
from mlx_spec.sampling import SamplingParams
from mlx_spec.tokenizer import encode_prompt, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
# Small: the tests' reference BLAS is slow.
SHAPE = ("--hidden", "384", "--heads", "6", "--intermediate", "1024", "--layers", "10")
TEXTS = ("def is_prime(n):\n", "import os\n\n\nclass ")
MAX_TOKENS = 32
SPECULATIVE_TOKENS = 24
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def widen():
    """The script's `main`, as `python scripts/widen_demo.py ARGS` runs it."""
    return runpy.run_path(str(ROOT / "scripts" / "widen_demo.py"))["main"]


@pytest.fixture(scope="module")
def widened(widen, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("widened")
    widen([str(out), *SHAPE])
    return out


@pytest.fixture(scope="module")
def models(widened) -> dict:
    """name -> (the demo's, the widened) target, or LayerSkip's model."""
    return {"target": (load_model("demo")[0], load_model(str(widened / "target"))[0]),
            "layerskip": (load_model("demo-layerskip")[0], load_model(str(widened / "layerskip"))[0])}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = load_tokenizer(demo.path())
    return [encode_prompt(tokenizer, text, chat_template=False) for text in TEXTS]


@pytest.fixture(scope="module")
def greedy(models, prompts):
    """Plain greedy tokens of model `models[name][which]` on prompt i, each decoded once."""
    @functools.cache
    def run(name: str, which: int, i: int) -> list[int]:
        return [t for e in plain_steps(models[name][which], prompts[i], GREEDY, MAX_TOKENS) for t in e.tokens]
    return run


def test_widened_target_gives_the_demo_targets_logits_and_tokens(widened, models, prompts, greedy):
    config = json.loads((widened / "target" / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["intermediate_size"], config["num_hidden_layers"]) == (384, 6, 3, 1024, 10)
    assert config["rms_norm_eps"] == pytest.approx(1e-6 * 256 / 384)
    assert not is_demo(str(widened / "target"))  # `--drafter KIND` alone must not pick the demo's, which do not fit
    demo, wide = models["target"]
    for i, prompt in enumerate(prompts):
        a, b = (m(mx.array([prompt]))[0][0, -1] for m in (demo, wide))  # [V]
        assert mx.abs(a - b).max().item() < 1e-3 * mx.abs(a).max().item()
        assert greedy("target", 1, i) == greedy("target", 0, i)


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "medusa", "mtp-heads", "layerskip"])
def test_widened_drafter_drafts_as_the_demos(widened, models, prompts, greedy, kind):
    """Round by round, the same drafts, the same accepted, the same tokens: plain greedy decoding's."""
    name = "layerskip" if kind == "layerskip" else "target"
    demo, wide = models[name]
    if kind == "layerskip":  # the exit fixed (chosen from the prompt, it would count the appended layers' cost)
        runs = ((demo, "layerskip=4", "demo-layerskip"), (wide, "layerskip=4", str(widened / "layerskip")))
    else:
        runs = ((demo, kind, "demo"), (wide, f"{kind}={widened / kind}", str(widened / "target")))
    flags = {"tree_budget": 6} if kind == "medusa" else {}  # a small tree: verifying one is slow here
    rounds = []
    for model, spec, source in runs:
        drafter = make_drafter(spec, model, target_source=source, **flags)
        events = speculative_steps(model, prompts[0], GREEDY, SPECULATIVE_TOKENS, drafter, num_draft=3)
        rounds.append([(e.tokens, e.from_draft, e.drafted) for e in events])
    assert rounds[1] == rounds[0]
    assert sum(sum(from_draft) for _, from_draft, _ in rounds[1]) > 0
    assert [t for tokens, _, _ in rounds[1] for t in tokens] == greedy(name, 1, 0)[:SPECULATIVE_TOKENS]


def test_shape_it_cannot_widen_to_is_refused(widen, tmp_path):
    with pytest.raises(SystemExit, match="multiple of 2"):
        widen([str(tmp_path), "--heads", "5"])
    with pytest.raises(SystemExit, match="below the demo's 256"):
        widen([str(tmp_path), "--hidden", "128"])


def test_a_held_out_pair_widens_its_target_and_copies_its_student(widen, greedy, prompts, tmp_path):
    """`--pair WORK` (a folder scripts/heldout_pair.py wrote: target-lm, student): here the demo's own."""
    import shutil

    pair = tmp_path / "pair"
    shutil.copytree(demo.path("target"), pair / "target-lm")
    shutil.copytree(demo.path("student"), pair / "student")
    widen([str(tmp_path / "out"), *SHAPE, "--pair", str(pair)])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["student", "target"]
    target = load_model(str(tmp_path / "out" / "target"))[0]
    assert target.args.hidden_size == 384
    assert [t for e in plain_steps(target, prompts[0], GREEDY, MAX_TOKENS) for t in e.tokens] == greedy("target", 0, 0)
