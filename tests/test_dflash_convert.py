"""`mlx-spec convert` of z-lab's DFlash drafters: the published layouts
(tests/fixtures/dflash/*, scripts/make_dflash_fixtures.py: block_size at the
top level or in dflash_config, sliding-window layers) convert into folders
whose drafter computes the block logits of an independent numpy implementation
(tests/fixtures/dflash_reference, scripts/make_dflash_reference.py) and decodes
losslessly, chain and DDTree; other spellings of the same tensors convert alike;
what DFlashNet cannot run, damaged files and targets the drafter does not fit
are one-line errors."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec.cache import KVCache
from mlx_spec.cli import main
from mlx_spec.convert import pipeline
from mlx_spec.convert.family import Source
from mlx_spec.weights import read_safetensors_file
from mlx_spec.drafters import find_drafter
from mlx_spec.drafters.dflash import load_dflash
from mlx_spec.models import load_model
from tiny import make_checkpoint

from helpers import assert_one_line_error, cli, cli_here

FIXTURES = Path(__file__).parent / "fixtures" / "dflash"
REFERENCE = Path(__file__).parent / "fixtures" / "dflash_reference"
NAMES = ("b16", "nested", "sliding")  # all made for conftest's `qwen3`


@pytest.fixture(scope="module")
def target_path(checkpoints) -> Path:
    return checkpoints["qwen3"]


@pytest.fixture(scope="module")
def target(target_path):
    return load_model(str(target_path))[0]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, target_path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dflash")
    out = {}
    for name in NAMES:
        out[name] = root / name
        proc = cli_here("convert", FIXTURES / name, "-o", out[name], "--target", target_path)
        assert proc.returncode == 0, proc.stderr
        assert ": dflash model from" in proc.stdout and "(bfloat16)" in proc.stdout, proc.stdout
    return out


def fixture_config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def published(name: str) -> dict[str, mx.array]:
    return read_safetensors_file(FIXTURES / name / "model.safetensors")


def source(tmp_path: Path, weights: dict, config: dict) -> Path:
    src = tmp_path / "src"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(src / "model.safetensors"), weights)
    return src


def test_published_layouts_convert(converted, target_path):
    for name in NAMES:
        config = json.loads((converted[name] / "config.json").read_text())
        section = config.pop("mlx_spec")
        assert section == {"family": "dflash", "source": str(FIXTURES / name), "target": str(target_path)}
        assert config == fixture_config(name) | {"layer_types": config["layer_types"]}, name  # as published
        written, original = mx.load(str(converted[name] / "model.safetensors")), published(name)
        assert sorted(written) == sorted(original), name
        for k, v in written.items():  # values and dtype as published
            assert v.dtype == mx.bfloat16 and mx.array_equal(v, original[k]), (name, k)
    # block_size where each layout keeps it; layer kinds made explicit where absent
    nets = {name: load_dflash(str(converted[name]))[0] for name in ("b16", "nested")}
    assert nets["b16"].block_size == 16 and nets["nested"].block_size == 8
    assert nets["nested"].args.rope_theta == 1e7 and nets["nested"].settings["target_layer_ids"] == [1]
    assert json.loads((converted["nested"] / "config.json").read_text())["layer_types"] == ["full_attention"] * 2


def drafter_logits(net, target, ref) -> list[np.ndarray]:
    """Two rounds as DFlash.propose runs them: the context's features arrive
    (positions 0..5, then 6..8) and a block [anchor, mask...] follows them."""
    features, split = mx.array(ref["features"])[None], int(ref["split"])
    cache = [KVCache() for _ in net.layers]
    out = []
    for anchor, (lo, hi) in zip(ref["anchors"].tolist(), ((0, split), (split, features.shape[1]))):
        block = mx.array([[anchor] + [net.settings["mask_token_id"]] * (net.block_size - 1)])
        h = net(target.model.embed_tokens(block), features[:, lo:hi], cache)
        out.append(np.array(net.logits(target, h[0, 1:])))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_block_logits_match_the_reference_implementation(converted, target, name):
    """Against scripts/make_dflash_reference.py's float64 numpy (here in float32)."""
    ref = np.load(REFERENCE / f"{name}.npz")
    net, _, _ = load_dflash(str(converted[name]))
    net.set_dtype(mx.float32)
    for got, want in zip(drafter_logits(net, target, ref), ref["logits"]):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_the_published_folder_loads_as_it_is(converted, target, name):
    ref = np.load(REFERENCE / f"{name}.npz")
    as_published = drafter_logits(load_dflash(str(FIXTURES / name))[0], target, ref)
    for a, b in zip(as_published, drafter_logits(load_dflash(str(converted[name]))[0], target, ref)):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("budget", [None, 8], ids=["block", "ddtree"])
@pytest.mark.parametrize("name", NAMES)
def test_converted_drafter_decodes_losslessly(converted, target_path, name, budget):
    tree = ["--tree-budget", budget] if budget else []
    gen = cli_here("generate", "--model", target_path, "--drafter", f"dflash={converted[name]}",
                   "--prompt", "def greet(name):", "--max-tokens", "24", "--check", "--json", *tree)
    assert gen.returncode == 0, gen.stderr
    result = json.loads(gen.stdout)
    assert result["identical_to_plain"] is True and result["drafted_tokens"] > 0


def speculators_config(name: str, **changes) -> dict:
    """The fixture's config as vllm-project/speculators writes a DFlash drafter (DFlashSpeculatorConfig, as
    RedHatAI/Qwen3-8B-speculator.dflash is published): the draft layers' Qwen3 config nested in
    `transformer_layer_config`, the target's hidden states by their index in transformers' `hidden_states`
    (z-lab's layer ids + 1), the greedy proposal's K in `speculators_config`; the tensors as z-lab names them."""
    zlab = fixture_config(name)
    extra = zlab["dflash_config"]
    body = {k: v for k, v in zlab.items() if k not in ("architectures", "auto_map", "block_size", "dflash_config",
                                                        "num_target_layers", "torch_dtype")}
    block = extra.get("block_size", zlab.get("block_size"))
    return {
        "architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "speculators_version": "0.5.0",
        "transformer_layer_config": body, "draft_vocab_size": body["vocab_size"], "block_size": block,
        "target_hidden_size": None, "aux_hidden_state_layer_ids": [i + 1 for i in extra["target_layer_ids"]],
        "mask_token_id": extra["mask_token_id"], "sliding_window_non_causal": False, "projector_type": "dflash",
        "shift_label": False, "sample_from_anchor": False, "torch_dtype": "bfloat16",
        "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block - 1,
                                                     "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                               "verifier": {"name_or_path": "Qwen/Qwen3-8B", "architectures": ["Qwen3ForCausalLM"]}},
        **changes,
    }


@pytest.mark.parametrize("name", ["b16", "sliding"])
def test_the_speculators_layout_drafts_as_z_labs(tmp_path, target, target_path, name):
    """The same weights in speculators' layout, read as published (no convert step): the block logits of the
    reference implementation, and lossless decoding with `--drafter dflash=FOLDER`, nothing converted."""
    src = source(tmp_path, published(name), speculators_config(name))
    net, _, _ = load_dflash(str(src))
    net.set_dtype(mx.float32)
    assert net.settings["target_layer_ids"] == fixture_config(name)["dflash_config"]["target_layer_ids"]
    ref = np.load(REFERENCE / f"{name}.npz")
    for got, want in zip(drafter_logits(net, target, ref), ref["logits"]):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    gen = cli("generate", "--model", target_path, "--drafter", f"dflash={src}", "--prompt", "def greet(name):",
              "--max-tokens", "16", "--check", "--json", env={"MLX_SPEC_HOME": str(tmp_path / "home")})
    assert gen.returncode == 0, gen.stderr
    assert json.loads(gen.stdout)["identical_to_plain"] is True
    assert "converting" not in gen.stderr and not (tmp_path / "home" / "converted").exists()


def test_a_draft_vocabulary_of_its_own_is_mapped_to_the_targets(tmp_path, target, target_path):
    """speculators' reduced vocabulary (`draft_vocab_size`, its own `lm_head` over it, `d2t` from draft to target
    ids, `t2d` back): here the rows of the target's head at 128 of its 384 tokens, so the drafter's logits are
    the reference's at those tokens, -inf at the others; decoding stays lossless."""
    rng = np.random.default_rng(0)
    ids = np.sort(rng.choice(384, 128, replace=False))
    head = target.model.embed_tokens.weight if target.args.tie_word_embeddings else target.lm_head.weight
    weights = published("b16") | {"lm_head.weight": head[mx.array(ids)], "d2t": mx.array(ids - np.arange(128)),
                                  "t2d": mx.array(np.isin(np.arange(384), ids))}
    src = source(tmp_path, weights, speculators_config("b16", draft_vocab_size=128))
    proc = cli_here("convert", src, "-o", tmp_path / "out", "--target", target_path)  # `mlx-spec convert` reads it too
    assert proc.returncode == 0, proc.stderr
    ref = np.load(REFERENCE / "b16.npz")
    for folder in (src, tmp_path / "out"):
        net, _, _ = load_dflash(str(folder))
        net.set_dtype(mx.float32)
        for got, want in zip(drafter_logits(net, target, ref), ref["logits"]):
            np.testing.assert_allclose(got[:, ids], want[:, ids], rtol=0, atol=1e-4)
            assert np.isneginf(np.delete(got, ids, axis=1)).all()
    gen = cli("generate", "--model", target_path, "--drafter", f"dflash={src}", "--prompt", "def greet(name):",
              "--max-tokens", "16", "--check", "--json", env={"MLX_SPEC_HOME": str(tmp_path / "home")})
    assert gen.returncode == 0, gen.stderr
    assert json.loads(gen.stdout)["identical_to_plain"] is True


def test_a_draft_vocabulary_past_the_targets_is_refused(tmp_path, target_path, in_process):
    weights = published("b16") | {"lm_head.weight": mx.zeros((128, 64), dtype=mx.bfloat16),
                                  "d2t": mx.full((128,), 300, dtype=mx.int64)}  # draft token 127 -> 427
    src = source(tmp_path, weights, speculators_config("b16", draft_vocab_size=128))
    assert in_process("convert", src, "-o", tmp_path / "out").returncode == 0
    proc = in_process("generate", "--model", target_path, "--drafter", f"dflash={tmp_path / 'out'}", "--prompt", "hi")
    assert_one_line_error(proc, "--drafter dflash=", "its d2t maps draft tokens outside the target's vocabulary")


def test_other_spellings_convert_alike(tmp_path, converted):
    """A re-export's `model.` prefix and vLLM's aliases (a one-layer draft's `midlayer.`,
    `encoder.fc.`, `encoder.output_norm_enc.`); --dtype as the pipeline sets it."""
    weights = {"model." + k: v for k, v in published("b16").items()}
    src = source(tmp_path, weights, fixture_config("b16"))
    assert main(["convert", str(src), "-o", str(tmp_path / "prefixed")]) == 0
    a, b = mx.load(str(tmp_path / "prefixed" / "model.safetensors")), mx.load(str(converted["b16"] / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(mx.array_equal(a[k], b[k]) for k in a)

    config = fixture_config("b16") | {"num_hidden_layers": 1, "layer_types": ["full_attention"]}
    renames = {"layers.0.": "midlayer.", "fc.": "encoder.fc.", "hidden_norm.": "encoder.output_norm_enc."}
    vllm = {}
    for k, v in published("b16").items():
        if not k.startswith("layers.1."):
            prefix = next((p for p in renames if k.startswith(p)), "")
            vllm[renames.get(prefix, "") + k.removeprefix(prefix)] = v
    assert "midlayer.mlp.up_proj.weight" in vllm and "encoder.fc.weight" in vllm
    out = tmp_path / "vllm"
    assert main(["convert", str(source(tmp_path / "v", vllm, config)), "-o", str(out), "--dtype", "float32"]) == 0
    c = mx.load(str(out / "model.safetensors"))
    assert sorted(c) == sorted(k for k in b if not k.startswith("layers.1."))
    assert all(c[k].dtype == mx.float32 and mx.array_equal(c[k], b[k].astype(mx.float32)) for k in c)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"


def test_layer_kinds_follow_transformers_qwen3_config(tmp_path):
    """Without layer_types, sliding from max_window_layers on, with use_sliding_window only."""
    weights = published("sliding")
    base = {k: v for k, v in fixture_config("sliding").items() if k != "layer_types"}
    for i, (extra, kinds) in enumerate([
        ({"max_window_layers": 1}, ["full_attention", "sliding_attention"]),
        ({"use_sliding_window": False}, ["full_attention", "full_attention"]),
        ({"max_window_layers": 28}, ["full_attention", "full_attention"]),
    ]):
        out = tmp_path / f"out{i}"
        assert main(["convert", str(source(tmp_path / str(i), weights, base | extra)), "-o", str(out)]) == 0
        assert json.loads((out / "config.json").read_text())["layer_types"] == kinds, extra


def test_sliding_layers_without_use_sliding_window_see_the_whole_context(tmp_path, target):
    """As z-lab's code reads such a config (transformers' Qwen3Config drops sliding_window unless
    use_sliding_window): no window, the block still attended causally in those layers; as a window
    wider than any context."""
    config = fixture_config("sliding") | {"use_sliding_window": False}
    unwindowed = source(tmp_path / "a", published("sliding"), config)
    causal = source(tmp_path / "b", published("sliding"), config | {"use_sliding_window": True, "sliding_window": 4096})
    ref = np.load(REFERENCE / "sliding.npz")
    nets = [load_dflash(str(folder))[0] for folder in (unwindowed, causal)]
    assert nets[0].settings["sliding_window"] == 0 and "sliding_attention" in nets[0].settings["layer_types"]
    windowed = load_dflash(str(FIXTURES / "sliding"))[0]
    got, want, other = (drafter_logits(net, target, ref) for net in (*nets, windowed))
    for a, b, c in zip(got, want, other):
        np.testing.assert_array_equal(a, b)
    assert any(not np.allclose(a, c) for a, c in zip(got, other))  # the window of 4 did bite


def test_detection_leaves_the_other_families_alone(tmp_path):
    families = [f.NAME for f in pipeline.FAMILIES]
    assert families.index("dflash") < families.index("eagle3") and families[-1] == "llama"
    for config, family in [
        ({"architectures": ["DFlashDraftModel"], "model_type": "qwen3"}, "dflash"),
        ({"model_type": "qwen3", "dflash_config": {"mask_token_id": 1}}, "dflash"),  # no architectures
        ({"speculators_model_type": "dflash", "draft_vocab_size": 384}, "dflash"),  # not EAGLE-3
        ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, "llama"),
        ({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"}, "eagle3"),
        ({"medusa_num_heads": 5}, "medusa"),
    ]:
        assert pipeline.detect(Source("x", None, config)).NAME == family, config


def test_registry_knows_z_labs_qwen3_drafters():
    for target in ("Qwen/Qwen3-4B", "mlx-community/Qwen3-4B-4bit", "mlx-community/Qwen3-4B-bf16"):
        assert find_drafter("dflash", target) == "z-lab/Qwen3-4B-DFlash-b16"
    for target in ("Qwen/Qwen3-8B", "mlx-community/Qwen3-8B-8bit", "Qwen3-8B-MLX-4bit"):
        assert find_drafter("dflash", target) == "z-lab/Qwen3-8B-DFlash-b16"


def damaged(kind: str, tmp_path: Path) -> tuple[Path, str, str]:
    """The b16 fixture with one defect: (source, the file the error names, what it says)."""
    weights, config = published("b16"), fixture_config("b16")
    where = "model.safetensors"
    if kind == "missing":
        del weights["layers.1.mlp.down_proj.weight"]
        needle = "lacks tensor 'layers.1.mlp.down_proj.weight'"
    elif kind == "wrong shape":
        weights["layers.0.self_attn.k_proj.weight"] = weights["layers.0.self_attn.k_proj.weight"][:16]
        needle = "tensor 'layers.0.self_attn.k_proj.weight' has shape (16, 64), config.json implies (32, 64)"
    elif kind == "fc width":  # a third target layer in the file, two in the config
        weights["fc.weight"] = mx.zeros((64, 192), dtype=mx.bfloat16)
        needle = "tensor 'fc.weight' has shape (64, 192), config.json implies (64, 128)"
    elif kind == "not floating":
        weights["norm.weight"] = weights["norm.weight"].astype(mx.int32)
        needle = "tensor 'norm.weight' is int32, not floating point"
    elif kind == "unexpected":
        weights["d2t"] = mx.zeros((384,), dtype=mx.int64)
        needle = "unexpected tensor 'd2t' in a DFlash drafter"
    elif kind == "twice":
        weights["model.norm.weight"] = weights["norm.weight"]
        needle = "holds both"
    elif kind == "own lm_head":
        weights["lm_head.weight"] = mx.zeros((384, 64), dtype=mx.bfloat16)
        needle = "tensor 'lm_head.weight': the drafter ships its own embedding or LM head"
    elif kind == "own embedding":
        weights["model.embed_tokens.weight"] = mx.zeros((384, 64), dtype=mx.bfloat16)
        needle = "tensor 'model.embed_tokens.weight': the drafter ships its own"
    elif kind == "speculators vocab":  # a draft vocabulary of its own, but no head over it or map from it
        config, needle = speculators_config("b16", draft_vocab_size=128), "lacks tensor 'd2t'"
    elif kind == "dflash2 tensors":
        weights["layers.0.attention_conv.base_kernel"] = mx.zeros((2, 4, 64), dtype=mx.bfloat16)
        needle = "unexpected tensor 'layers.0.attention_conv.base_kernel' in a DFlash drafter"  # a DFlash 2's
    else:
        where = "config.json"
        if kind == "dflash2":
            config["architectures"] = ["DFlash2DraftModel"]
            config["dflash_config"] |= {"conv_kernel_size": 4, "conv_group_size": 16, "selector_rank": 8}
            needle = "dflash_config.selector_top_k must be a positive integer, got None"
        elif kind == "mask id":
            config["dflash_config"]["mask_token_id"] = 400
            needle = "dflash_config.mask_token_id 400 is outside the vocabulary of 384 tokens (vocab_size)"
        elif kind == "no block size":
            del config["block_size"]
            needle = "'block_size' (top level or in dflash_config) must be an integer >= 2"
        elif kind == "no taps":
            del config["dflash_config"]["target_layer_ids"], config["num_target_layers"]
            needle = "neither dflash_config.target_layer_ids nor num_target_layers"
        elif kind.startswith("speculators"):
            config, needle = {
                "speculators domino": (speculators_config("b16", projector_type="domino"),
                                       "projector_type 'domino' drafts otherwise than DFlash"),
                "speculators anchor": (speculators_config("b16", sample_from_anchor=True),
                                       "sample_from_anchor True drafts otherwise than DFlash"),
                "speculators dflash2 vocab": (speculators_config("b16", speculators_model_type="dflash2",
                                                                 draft_vocab_size=128),
                                              "a DFlash 2 candidate selector over a draft vocabulary of its own"),
                "speculators ids": (speculators_config("b16", aux_hidden_state_layer_ids=[0, 1]),
                                    "aux_hidden_state_layer_ids must list the target's hidden states"),
            }[kind]
    src = source(tmp_path, weights, config)
    return src, src / where, needle


@pytest.mark.parametrize(
    "kind",
    ["missing", "wrong shape", "fc width", "not floating", "unexpected", "twice", "own lm_head", "own embedding",
     "dflash2 tensors", "dflash2", "mask id", "no block size", "no taps",
     "speculators domino", "speculators anchor", "speculators vocab", "speculators dflash2 vocab", "speculators ids"],
)
def test_what_cannot_be_converted_is_a_one_line_error(tmp_path, kind, in_process):
    src, where, needle = damaged(kind, tmp_path)
    proc = in_process("convert", src, "-o", tmp_path / "out")
    assert_one_line_error(proc, where, needle)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "mask_id, target, needle",
    [
        (None, dict(num_hidden_layers=1), "target_layer_ids [0, 1] outside the target's 0..0"),
        (None, dict(hidden_size=128, head_dim=32, intermediate_size=256), "fc reads 128 features, the target gives 2 x 128"),
        # a drafter for a larger vocabulary: its mask row is past the target's embedding
        (450, {}, "mask_token_id 450 is outside the target's embedding (0..383)"),
    ],
    ids=["layers", "hidden size", "mask id"],
)
def test_target_the_drafter_does_not_fit(tmp_path, mask_id, target, needle, in_process):
    other = make_checkpoint(tmp_path / "other", "qwen3", **target)
    src = FIXTURES / "b16"
    if mask_id is not None:
        config = fixture_config("b16") | {"vocab_size": 512}
        config["dflash_config"]["mask_token_id"] = mask_id
        src = source(tmp_path, published("b16"), config)
    proc = in_process("convert", src, "-o", tmp_path / "out", "--target", other)
    assert_one_line_error(proc, f"--target {other}", needle)
    assert not (tmp_path / "out").exists()


def test_quantize_is_refused(tmp_path, in_process):
    proc = in_process("convert", FIXTURES / "b16", "-o", tmp_path / "out", "-q")
    assert_one_line_error(proc, "--quantize", "dflash checkpoints cannot be quantized")
    assert not (tmp_path / "out").exists()
