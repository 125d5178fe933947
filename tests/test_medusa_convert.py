"""`mlx-spec convert` of FasterDecoding's Medusa-1 heads: the published layout
(tests/fixtures/torch/medusa, written by real torch.save: 5 heads behind a
config that claims 2) and its safetensors twin convert into a folder that
`--drafter medusa=OUT` decodes with, losslessly; damaged head files and
targets the heads do not fit are one-line errors."""

import itertools
import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_spec.cli import main
from mlx_spec.weights import read_torch_file
from mlx_spec.decoding import plain_steps, speculative_steps
from mlx_spec.drafters import make_drafter
from mlx_spec.drafters.medusa import load_medusa
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams
from tiny import make_checkpoint
from mlx_spec.tokenizer import load_tokenizer

from helpers import assert_one_line_error, cli, cli_here

FIXTURE = Path(__file__).parent / "fixtures" / "torch" / "medusa"
PUBLISHED = read_torch_file(FIXTURE / "medusa_lm_head.pt")
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def target(checkpoints) -> Path:
    """The tiny Llama the fixture's heads were made for (hidden 64, vocabulary 384)."""
    return checkpoints["llama"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, target) -> Path:
    out = tmp_path_factory.mktemp("medusa") / "out"
    proc = cli_here("convert", FIXTURE, "-o", out, "--target", target)
    assert proc.returncode == 0, proc.stderr
    assert "medusa" in proc.stdout and "15 tensors" in proc.stdout
    return out


def heads_source(tmp_path: Path, weights: dict, config: dict | None = None) -> Path:
    """A Medusa repo in the training script's layout: medusa_lm_head.safetensors."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((FIXTURE / "config.json").read_text() if config is None else json.dumps(config))
    mx.save_safetensors(str(src / "medusa_lm_head.safetensors"), weights)
    return src


def test_published_file_converts_with_every_head(converted, target):
    config = json.loads((converted / "config.json").read_text())
    # the file's 5 heads, not the 2 its config claims
    assert {k: config[k] for k in ("medusa_num_heads", "medusa_num_layers", "hidden_size", "vocab_size")} == {
        "medusa_num_heads": 5, "medusa_num_layers": 1, "hidden_size": 64, "vocab_size": 384,
    }
    assert config["mlx_spec"] == {"family": "medusa", "source": str(FIXTURE), "target": str(target)}
    heads, _ = load_medusa(str(converted))
    assert len(heads.heads) == 5
    written = mx.load(str(converted / "model.safetensors"))
    assert sorted(written) == sorted(PUBLISHED)
    for name in PUBLISHED:  # names kept, values and dtype (bf16) as published
        assert written[name].dtype == mx.bfloat16 and mx.array_equal(written[name], PUBLISHED[name]), name


def test_converted_heads_decode_losslessly(converted, target):
    gen = cli("generate", "--model", target, "--drafter", f"medusa={converted}", "--prompt", "def greet(name):",
              "--max-tokens", "24", "--check", "--json")
    assert gen.returncode == 0, gen.stderr
    assert json.loads(gen.stdout)["identical_to_plain"] is True

    model, path = load_model(str(target))
    drafter = make_drafter(f"medusa={converted}", model, tokenizer=load_tokenizer(path))
    prompts = [[1, 87, 85, 71, 84], [40, 41, 42, 43, 44, 45, 46, 47, 40, 41], [7]]
    accepted = 0
    for prompt, max_tokens in itertools.product(prompts, (1, 5, 40)):
        plain = [t for e in plain_steps(model, prompt, GREEDY, max_tokens) for t in e.tokens]
        # every round drafts (K fixed at the heads' depth): where drafting does not pay, the policy would not
        events = list(speculative_steps(model, prompt, GREEDY, max_tokens, drafter.new_session(), num_draft=5))
        assert [t for e in events for t in e.tokens] == plain, (prompt, max_tokens)
        accepted += sum(e.accepted for e in events)
    assert accepted > 0  # the converted heads drafted tokens the target kept


def test_safetensors_layout_converts(tmp_path, converted):
    src = heads_source(tmp_path, dict(PUBLISHED))
    assert main(["convert", str(src), "-o", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["medusa_num_heads"] == 5
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (converted / "model.safetensors").read_bytes()


def damaged(kind: str) -> tuple[dict, str]:
    """The fixture's tensors with one defect, and what the error must name."""
    weights = dict(PUBLISHED)
    if kind == "wrong shape":
        weights["2.0.linear.weight"] = weights["2.0.linear.weight"][:, :32]
        return weights, "tensor '2.0.linear.weight' has shape (64, 32), expected (64, 64)"
    if kind == "missing tensor":
        del weights["3.0.linear.bias"]
        return weights, "lacks tensor '3.0.linear.bias'"
    if kind == "missing head":
        for name in [n for n in weights if n.startswith("1.")]:
            del weights[name]
        return weights, "lacks tensor '1.0.linear.weight'"
    if kind == "unknown tensor":
        weights["medusa_head.0.weight"] = weights["0.1.weight"]
        return weights, "unexpected tensor 'medusa_head.0.weight'"
    if kind == "extra layer":
        weights["4.1.linear.weight"] = weights["4.0.linear.weight"]
        return weights, "unexpected tensor '4.1.linear.weight'"
    if kind == "layers disagree":
        weights["4.2.weight"] = weights.pop("4.1.weight")
        return weights, "head 4 has 2 layers ('4.2.weight'), head 0 has 1"
    if kind == "not floating":
        weights["0.0.linear.bias"] = weights["0.0.linear.bias"].astype(mx.int32)
        return weights, "tensor '0.0.linear.bias' is int32, not floating point"
    raise ValueError(kind)


@pytest.mark.parametrize(
    "kind",
    ["wrong shape", "missing tensor", "missing head", "unknown tensor", "extra layer", "layers disagree",
     "not floating"],
)
def test_damaged_head_files_are_one_line_errors(tmp_path, kind, in_process):
    weights, needle = damaged(kind)
    src = heads_source(tmp_path, weights)
    proc = in_process("convert", src, "-o", tmp_path / "out")
    assert_one_line_error(proc, src / "medusa_lm_head.safetensors", needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "sizes, needle",
    [
        (dict(hidden_size=128, head_dim=32, intermediate_size=256), "heads read hidden size 64, the target's is 128"),
        (dict(vocab_size=512), "heads predict 384 tokens, the target has 512"),
    ],
    ids=["hidden size", "vocabulary"],
)
def test_target_the_heads_do_not_fit(tmp_path, sizes, needle, in_process):
    other = make_checkpoint(tmp_path / "other", "llama", **sizes)
    proc = in_process("convert", FIXTURE, "-o", tmp_path / "out", "--target", other)
    assert_one_line_error(proc, f"--target {other}", needle)
    assert not (tmp_path / "out").exists()


def test_quantize_is_refused(tmp_path, in_process):
    proc = in_process("convert", FIXTURE, "-o", tmp_path / "out", "-q")
    assert_one_line_error(proc, "--quantize", "medusa")
    assert not (tmp_path / "out").exists()


def test_a_medusa_config_with_no_heads_anywhere(tmp_path, in_process):
    """Neither a medusa_lm_head file nor a Medusa-2 model's heads inside its shards
    (tests/test_published_folders.py converts those)."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(FIXTURE / "config.json", src)
    proc = in_process("convert", src, "-o", tmp_path / "out")
    assert_one_line_error(proc, "medusa_lm_head.safetensors or medusa_lm_head.pt", "Medusa-2")
