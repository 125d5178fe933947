"""`mlx-spec convert` of published EAGLE drafters: yuhuili's EAGLE-1 and EAGLE-3
`pytorch_model.bin` files, SpecForge's `model.safetensors` and the speculators
layout (tests/fixtures/torch/eagle*, written by real torch.save) convert into
folders whose drafter computes the logits of an independent torch
implementation (tests/fixtures/eagle_reference, scripts/make_eagle_reference.py)
and decodes losslessly; damaged files and targets the drafter does not fit are
one-line errors."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec.cache import KVCache
from mlx_spec.cli import main
from mlx_spec.weights import read_safetensors_file, read_torch_file
from mlx_spec.drafters.eagle import load_eagle
from mlx_spec.models import load_model
from tiny import make_checkpoint

from helpers import assert_one_line_error, cli_here

FIXTURES = Path(__file__).parent / "fixtures" / "torch"
REFERENCE = Path(__file__).parent / "fixtures" / "eagle_reference"
# fixture -> (drafter kind, conftest checkpoint it was made for)
CASES = {
    "eagle1": ("eagle", "llama"),
    "eagle1-nobias": ("eagle", "qwen2"),
    "eagle3": ("eagle3", "qwen3"),
    "eagle3-specforge": ("eagle3", "qwen3"),
}


def published(name: str) -> dict[str, mx.array]:
    directory = FIXTURES / name
    if (directory / "model.safetensors").exists():
        return read_safetensors_file(directory / "model.safetensors")
    return dict(read_torch_file(directory / "pytorch_model.bin"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory, checkpoints) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eagle")
    out = {}
    for name, (kind, arch) in CASES.items():
        out[name] = root / name
        proc = cli_here("convert", FIXTURES / name, "-o", out[name], "--target", checkpoints[arch])
        assert proc.returncode == 0, proc.stderr
        assert f": {kind} model from" in proc.stdout, proc.stdout
    return out


def source(tmp_path: Path, weights: dict, config: dict) -> Path:
    """A drafter repo in SpecForge's layout: config.json and model.safetensors."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(src / "model.safetensors"), weights)
    return src


def fixture_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def test_published_layouts_convert(converted, checkpoints):
    expect = {
        "eagle1": ({"version": 1, "fc_bias": True}, mx.float32, 10000.0),
        "eagle1-nobias": ({"version": 1, "fc_bias": False}, mx.float16, 1e6),
        # yuhuili's EAGLE-3 config has no rope_theta: 10000, not the target's 1e6
        "eagle3": ({"version": 3, "target_hidden_size": 64, "draft_vocab_size": 32, "norm_before_residual": False},
                   mx.float16, 10000.0),
        # eagle_config's aux ids [0, 1, 1] name layer outputs: hidden_states 1, 2, 2
        "eagle3-specforge": ({"version": 3, "target_hidden_size": 64, "draft_vocab_size": 384,
                              "norm_before_residual": False, "layers": [1, 2, 2]}, mx.bfloat16, 1e6),
    }
    for name, (eagle, dtype, theta) in expect.items():
        config = json.loads((converted[name] / "config.json").read_text())
        assert config["eagle"] == eagle, name
        assert config["head_dim"] == 16 and config["num_hidden_layers"] == 1, name  # specforge's says 32
        kind, arch = CASES[name]
        assert config["mlx_spec"] == {"family": kind, "source": str(FIXTURES / name), "target": str(checkpoints[arch])}
        net, _, _ = load_eagle(str(converted[name]))
        assert net.args.rope_theta == theta, name

        written = mx.load(str(converted[name] / "model.safetensors"))
        original = published(name)
        renamed = {k for k in original if k not in ("embed_tokens.weight", "t2d")}
        renamed.discard("layers.0.self_attn.rotary_emb.inv_freq")
        assert set(written) == (renamed | {"d2t"} if eagle["version"] == 3 else renamed), name
        for k in renamed - {"d2t"}:  # values and dtype as published
            assert written[k].dtype == dtype and mx.array_equal(written[k], original[k]), (name, k)
    d2t = mx.load(str(converted["eagle3"] / "model.safetensors"))["d2t"]
    assert d2t.dtype == mx.int32 and mx.array_equal(d2t, published("eagle3")["d2t"])
    # torch's LongStorage (d2t) and BoolStorage (t2d) read back consistently: t2d marks d2t's ids
    t2d = published("eagle3")["t2d"]
    assert t2d.dtype == mx.bool_ and np.nonzero(np.array(t2d))[0].tolist() == (np.arange(32) + np.array(d2t)).tolist()
    zeros = mx.load(str(converted["eagle3-specforge"] / "model.safetensors"))["d2t"]
    assert zeros.dtype == mx.int32 and zeros.shape == (384,) and not zeros.any().item()


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_the_reference_implementation(converted, checkpoints, name):
    """Four slots in one causal pass, then one drafting step that reads slot 3's
    output as its feature, against scripts/make_eagle_reference.py's float64 torch."""
    ref = np.load(REFERENCE / f"{name}.npz")
    target, _ = load_model(str(checkpoints[CASES[name][1]]))
    net, _, _ = load_eagle(str(converted[name]))
    embed = target.model.embed_tokens
    cache = KVCache()
    x = net(mx.array(ref["features"])[None], embed(mx.array(ref["tokens"])[None]), cache, mask="causal")
    x_next = net(x[:, -1:], embed(mx.array(ref["next_token"])[None]), cache)
    for got, want in ((net.logits(x, target)[0], ref["logits"]), (net.logits(x_next, target)[0], ref["next_logits"])):
        got = np.array(got)
        assert np.array_equal(np.isinf(got), np.isinf(want))  # EAGLE-3: outside the draft vocabulary
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("budget", [None, 8], ids=["chain", "tree"])
@pytest.mark.parametrize("name", list(CASES))
def test_converted_drafter_decodes_losslessly(converted, checkpoints, name, budget):
    kind, arch = CASES[name]
    tree = ["--tree-budget", budget] if budget else []
    gen = cli_here("generate", "--model", checkpoints[arch], "--drafter", f"{kind}={converted[name]}",
                   "--prompt", "def greet(name):", "--max-tokens", "24", "--check", "--json", *tree)
    assert gen.returncode == 0, gen.stderr
    result = json.loads(gen.stdout)
    assert result["identical_to_plain"] is True and result["drafted_tokens"] > 0


def speculators(tmp_path: Path) -> Path:
    """The SpecForge fixture in the speculators layout: the layer as `layers.0.*`, no
    embedding, the Llama config nested, aux ids at the top level (hidden_states indices)."""
    weights = {k.replace("midlayer.", "layers.0."): v for k, v in published("eagle3-specforge").items()}
    del weights["embed_tokens.weight"]
    layer = {k: v for k, v in fixture_config("eagle3-specforge").items() if k not in ("eagle_config", "architectures")}
    layer["head_dim"] = 16
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny-qwen3"}},
        "transformer_layer_config": layer,
        "draft_vocab_size": 384,
        "norm_before_residual": False,
        "target_hidden_size": 64,
        "eagle_aux_hidden_state_layer_ids": [1, 2, 2],
    }
    return source(tmp_path, weights, config)


def test_speculators_layout_converts_as_specforges(tmp_path, converted):
    out = tmp_path / "out"
    assert main(["convert", str(speculators(tmp_path)), "-o", str(out)]) == 0
    ours, theirs = (json.loads((d / "config.json").read_text()) for d in (out, converted["eagle3-specforge"]))
    assert ours["eagle"] == theirs["eagle"] and ours["mlx_spec"]["family"] == "eagle3"
    a, b = mx.load(str(out / "model.safetensors")), mx.load(str(converted["eagle3-specforge"] / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(mx.array_equal(a[k], b[k]) for k in a)


def test_a_plain_config_is_told_by_its_tensors(tmp_path):
    """An EAGLE-3 config that names nothing EAGLE (as yuhuili's Vicuna-13B one,
    with the full vocabulary): lm_head and midlayer.* say it; taps stay the default."""
    config = {k: v for k, v in fixture_config("eagle3-specforge").items() if k != "eagle_config"}
    config["architectures"] = ["LlamaForCausalLM"]
    src = source(tmp_path, published("eagle3-specforge"), config)
    assert main(["convert", str(src), "-o", str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["mlx_spec"]["family"] == "eagle3" and "layers" not in written["eagle"]


def test_a_one_layer_llama_still_converts_as_llama(tmp_path, in_process):
    """yuhuili's configs are plain one-layer Llama configs: the tensors decide."""
    src = make_checkpoint(tmp_path / "src", "llama", num_hidden_layers=1)
    proc = in_process("convert", src, "-o", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert ": llama model from" in proc.stdout


def damaged(kind: str, tmp_path: Path) -> tuple[Path, str]:
    """A fixture as model.safetensors with one defect, and what the error must name."""
    fixture, defect = kind.split(":")
    name = {"eagle1": "eagle1", "eagle3": "eagle3", "specforge": "eagle3-specforge"}[fixture]
    weights, config = published(name), fixture_config(name)
    needle = {
        "missing": "lacks tensor 'midlayer.mlp.down_proj.weight'",
        "missing speculators": "lacks tensor 'layers.0.mlp.down_proj.weight'",
        "wrong shape": "tensor 'midlayer.self_attn.k_proj.weight' has shape (32, 64), expected (32, 128)",
        "not floating": "tensor 'norm.weight' is int32, not floating point",
        "fc width": "tensor 'fc.weight' has shape (64, 190); its input must be 3 target hidden states",
        "d2t range": "tensor 'd2t' maps draft ids outside the target's 0..383",
        "no d2t": "lacks tensor 'd2t'",
        "no fc bias": "lacks tensor 'fc.bias' (config.json does not say \"bias\": false)",
        "input norm": "tensor 'layers.0.input_layernorm.weight' is unexpected in an EAGLE-1 drafter",
        "embedding": "tensor 'embed_tokens.weight' has shape (384, 64), expected (400, 64)",
    }[defect]
    if defect == "missing":
        del weights["midlayer.mlp.down_proj.weight"]
    elif defect == "missing speculators":  # named as the file names it
        src = speculators(tmp_path)
        weights = read_safetensors_file(src / "model.safetensors")
        del weights["layers.0.mlp.down_proj.weight"]
        mx.save_safetensors(str(src / "model.safetensors"), weights)
        return src, needle
    elif defect == "wrong shape":
        weights["midlayer.self_attn.k_proj.weight"] = weights["midlayer.self_attn.k_proj.weight"][:, :64]
    elif defect == "not floating":
        weights["norm.weight"] = weights["norm.weight"].astype(mx.int32)
    elif defect == "fc width":
        weights["fc.weight"] = weights["fc.weight"][:, :190]
    elif defect == "d2t range":
        weights["d2t"] = weights["d2t"] + mx.array([0] * 31 + [1000])
    elif defect == "no d2t":
        del weights["d2t"]
    elif defect == "no fc bias":
        del weights["fc.bias"]
    elif defect == "input norm":
        weights["layers.0.input_layernorm.weight"] = weights["layers.0.post_attention_layernorm.weight"]
    elif defect == "embedding":
        config["vocab_size"] = 400
    return source(tmp_path, weights, config), needle


@pytest.mark.parametrize(
    "kind",
    ["specforge:missing", "specforge:missing speculators", "specforge:wrong shape", "eagle3:not floating",
     "specforge:fc width", "eagle3:d2t range", "eagle3:no d2t", "eagle1:no fc bias", "eagle1:input norm",
     "eagle1:embedding"],
)
def test_damaged_drafters_are_one_line_errors(tmp_path, kind, in_process):
    src, needle = damaged(kind, tmp_path)
    proc = in_process("convert", src, "-o", tmp_path / "out")
    assert_one_line_error(proc, src / "model.safetensors", needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "name, target, needle",
    [
        ("eagle1", dict(arch="llama", hidden_size=128, head_dim=32, intermediate_size=256),
         "drafter hidden size 64, the target's is 128"),
        ("eagle3", dict(arch="qwen3", hidden_size=128, head_dim=32, intermediate_size=256),
         "fc reads 192 features, the target gives 3 x 128"),
        ("eagle3", dict(arch="qwen3", vocab_size=512), "drafter vocabulary 384, the target's is 512"),
        ("eagle3-specforge", dict(arch="qwen3", num_hidden_layers=1), "layers [1, 2, 2] outside the target's 0..1"),
    ],
    ids=["eagle1 hidden size", "eagle3 hidden size", "vocabulary", "layers"],
)
def test_target_the_drafter_does_not_fit(tmp_path, name, target, needle, in_process):
    other = make_checkpoint(tmp_path / "other", **target)
    proc = in_process("convert", FIXTURES / name, "-o", tmp_path / "out", "--target", other)
    assert_one_line_error(proc, f"--target {other}", needle)
    assert not (tmp_path / "out").exists()


def test_quantize_is_refused(tmp_path, in_process):
    proc = in_process("convert", FIXTURES / "eagle3", "-o", tmp_path / "out", "-q")
    assert_one_line_error(proc, "--quantize", "eagle3 checkpoints cannot be quantized")
    assert not (tmp_path / "out").exists()
