"""Targets mlx-spec runs through mlx-lm's model code (mlx_spec/models/mlxlm.py),
checked against transformers: tiny checkpoints transformers saved, and the
greedy tokens transformers computed on them (scripts/make_mlxlm_reference.py,
tests/fixtures/mlxlm_reference); every chain drafter greedy-identical to plain,
and speculative sampling distributed as the MoE target's own."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec import api, sampling
from mlx_spec.decoding import plain_steps, speculative_steps
from mlx_spec.drafters.base import Draft, HostDrafter
from mlx_spec.errors import UserError
from mlx_spec.drafters.draft_model import DraftModel
from mlx_spec.drafters.eagle import Eagle, EagleNet, eagle_config
from mlx_spec.drafters.lookup import PromptLookup
from mlx_spec.drafters.suffix import SuffixDecoding
from mlx_spec.models import load_model
from mlx_spec.models.mlxlm import MLXLMTarget
from mlx_spec.sampling import SamplingParams

from helpers import assert_one_line_error, cli_here, later_turns_are_exact
from stats import FAMILY_N, STAT_PROMPT, V, empirical_tv, told_apart, exact_joint, tiny, tv_bound
from test_speculative import resample_from_target

FIXTURES = Path(__file__).parent / "fixtures" / "mlxlm_reference"
FAMILIES = ("qwen3_moe", "mimo", "mixtral", "qwen2_moe", "olmoe", "gpt_oss", "gemma3_text", "qwen3_next", "qwen3_5",
            "qwen3_5_moe", "deepseek_v3")
HYBRID = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
# State beside keys and values, rolled back from a tape (recurrences, LFM2's convolution windows, Mamba-2), or
# a layer's several caches (DeepSeek-V3.2's indexer's keys beside its attention's)
ROLLED_BACK = (*HYBRID, "lfm2", "lfm2_moe", "granitemoehybrid", "nemotron_h", "deepseek_v32")
GREEDY = SamplingParams()


def load_family(name: str) -> tuple:
    """A fixture's name, folder, model, prompt and transformers' greedy tokens after it."""
    path = FIXTURES / name
    model, _ = load_model(str(path))
    ref = np.load(path / "reference.npz")
    return name, path, model, ref["prompt"].tolist(), ref["greedy"].tolist()


def assert_is_transformers(family: tuple) -> None:
    """The prompt's logits as transformers' (float32 noise; a misread is 1e-2), and the greedy tokens after it."""
    name, path, model, prompt, greedy = family
    logits = np.array(model(mx.array(prompt)[None])[0][0])
    assert np.abs(logits - np.load(path / "reference.npz")["logits"]).max() < 5e-4
    assert [t for e in plain_steps(model, prompt, GREEDY, len(greedy)) for t in e.tokens] == greedy


def families(names: tuple[str, ...]):
    """The module fixture `family`: each of `names`, loaded (`load_family`)."""
    return pytest.fixture(scope="module", params=names, name="family")(lambda request: load_family(request.param))


family = families(FAMILIES)


def test_plain_greedy_is_transformers(family):
    """Token for token; gpt-oss and Gemma 3 with their sliding windows shorter than the text, Qwen3.5 as published."""
    assert isinstance(family[2], MLXLMTarget)
    assert_is_transformers(family)


@pytest.mark.parametrize("name", ["qwen3_moe", "mimo", "gpt_oss", "gemma3_text", "qwen3_next"])
def test_mlx_lm_alone_misreads_transformers_5_configs(name):
    """Why the config and weights are rewritten: mlx-lm alone refuses Qwen3-MoE's and Qwen3-Next's
    configs (`num_local_experts`, RoPE in `rope_parameters`), fails on Gemma 3's (it builds a
    sliding-window period of 6 where `layer_types` says 3) and on gpt-oss's experts as transformers
    stores them, and reads MiMo's RoPE base as 10000, not 640000."""
    from mlx_lm.utils import load_model as mlx_lm_load

    path = FIXTURES / name
    ours, _ = load_model(str(path))
    prompt = np.load(path / "reference.npz")["prompt"].tolist()
    refused = {"qwen3_moe": (TypeError, "num_experts"), "qwen3_next": (TypeError, "rope_theta"),
               "gpt_oss": (ValueError, "experts")}
    if name in refused:
        error, match = refused[name]
        with pytest.raises(error, match=match):
            mlx_lm_load(path)
        return
    theirs, _ = mlx_lm_load(path)
    x = mx.array(prompt)[None]
    if name == "gemma3_text":
        with pytest.raises(IndexError):  # its masks are made from the cache of a 6th layer
            theirs(x, cache=theirs.make_cache())
        return
    assert theirs.args.rope_theta == 10000.0
    assert not mx.allclose(theirs(x), ours(x)[0], atol=1e-3)


def test_gpt_oss_yarn_is_transformers(monkeypatch):
    """gpt-oss's YaRN says `truncate: false`; mlx-lm's rounds the ramp anyway, off transformers' logits."""
    from mlx_spec.models import mlxlm

    path = FIXTURES / "gpt_oss"
    ref = np.load(path / "reference.npz")
    monkeypatch.setattr(mlxlm, "_yarn_untruncated", lambda text, config: None)
    rounded, _ = load_model(str(path))
    logits = np.array(rounded(mx.array(ref["prompt"].tolist())[None])[0][0])
    assert np.abs(logits - ref["logits"]).max() > 1e-3


def test_qwen3_5_as_published_loads_its_text_model():
    """Qwen3.5's published form (Qwen3_5ForConditionalGeneration: `model.visual.*` beside
    `model.language_model.*`, the text config in `text_config`, `mtp.*`): a text target."""
    from safetensors import safe_open

    path = FIXTURES / "qwen3_5"
    with safe_open(path / "model.safetensors", "numpy") as f:
        names = list(f.keys())
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("mtp.") for n in names)
    assert "text_config" in json.loads((path / "config.json").read_text())
    model, _ = load_model(str(path))
    assert model.args.num_hidden_layers == 4 and model.args.hidden_size == 64
    assert model.kinds == ["recurrent"] * 3 + [None]


def draft_model_for(vocab: int):
    return DraftModel(tiny(5, vocab, hidden_size=64, num_attention_heads=4, num_key_value_heads=2), vocab)


CHAIN_KINDS = ["lookup", "suffix", "draft", "layerskip", "skip", "eagle", "eagle3", "dflash", "mtp-heads"]


def chain_drafter(kind: str, model):
    """A drafter of `kind` for `model` (random weights where it has any), drafting chains: EAGLE-3
    tapping three layers, a z-lab-layout DFlash drafter tapping every layer."""
    from mlx_spec.drafters import make_drafter
    from mlx_spec.drafters.dflash import DFlash, DFlashNet
    from mlx_spec.drafters.dflash_layouts import dflash_config
    from mlx_spec.drafters.mtp_heads import MTPHeads, MTPHeadsDrafter, mtp_heads_config

    mx.random.seed(4)
    L, V = model.args.num_hidden_layers, model.args.vocab_size
    return {"lookup": lambda: PromptLookup(1, 3), "suffix": SuffixDecoding,
            "eagle3": lambda: Eagle(EagleNet(eagle_config(model, 3, layers=[0, 1, 2])), model, None, 4, 3),
            "dflash": lambda: DFlash(DFlashNet(dflash_config(model, 1, 4, V - 1, list(range(L)))), model, None, None),
            "draft": lambda: draft_model_for(model.args.vocab_size),
            "self": lambda: DraftModel(model, V),  # the family's model as a draft model (its caches, its state)
            "layerskip": lambda: make_drafter("layerskip=1", model),  # the first layer, then the head
            "skip": lambda: make_drafter("skip=1", model),  # the target without its second layer
            "eagle": lambda: Eagle(EagleNet(eagle_config(model, 1)), model, None, 4, 3),
            "mtp-heads": lambda: MTPHeadsDrafter(MTPHeads(mtp_heads_config(model, 3)), model)}[kind]()


def chains_are_plain(model, prompt: list[int], kind: str) -> None:
    plain = [t for e in plain_steps(model, prompt, GREEDY, 24) for t in e.tokens]
    events = list(speculative_steps(model, prompt, GREEDY, 24, chain_drafter(kind, model), num_draft=3))
    assert [t for e in events for t in e.tokens] == plain
    assert sum(len(e.drafted) for e in events) > 0


@pytest.mark.parametrize("kind", CHAIN_KINDS)
def test_chain_drafters_are_greedy_identical(family, kind):
    name, _, model, prompt, greedy = family
    if kind == "skip" and model.args.num_hidden_layers < 3:  # the first and last layers are never skipped
        with pytest.raises(UserError, match="no intermediate layer to skip"):
            chain_drafter(kind, model)
        return
    chains_are_plain(model, prompt + prompt[:12], kind)  # (something for lookup to find)


@pytest.mark.parametrize("kind", [k for k in CHAIN_KINDS if k != "skip"])
def test_chain_drafters_keep_mistrals_sliding_window(kind):
    """Mistral with its sliding window shorter than the text (mlx-spec's own model code,
    tests/fixtures/hf_reference/mistral): every chain drafter greedy-identical to plain."""
    path = Path(__file__).parent / "fixtures" / "hf_reference" / "mistral"
    model, _ = load_model(str(path))
    prompt = np.load(path / "reference.npz")["input_ids"][0].tolist()
    assert model.args.sliding_window and len(prompt) + 24 > model.args.sliding_window
    chains_are_plain(model, prompt + prompt[:10], kind)


@pytest.mark.parametrize("name", ["mimo", "qwen3_5", "qwen3_5_moe", "deepseek_v3"])
def test_a_checkpoint_drafts_with_its_own_mtp_modules(name):
    """`--drafter mtp` alone on a MiMo checkpoint (`model.mtp_layers.*`, model_type mimo) and on
    Qwen3.5 as published (`mtp.*`: its block a gated full-attention layer, mlx-lm's)."""
    path = FIXTURES / name
    model, _ = load_model(str(path))
    target = api.Target(model, None, path, str(path))  # weights and config only: no tokenizer
    drafter = api.drafter("mtp", target)
    prompt = np.load(path / "reference.npz")["prompt"].tolist()
    plain = [t for e in plain_steps(model, prompt, GREEDY, 24) for t in e.tokens]
    events = list(speculative_steps(model, prompt, GREEDY, 24, drafter.new_session()))
    assert [t for e in events for t in e.tokens] == plain
    assert sum(len(e.drafted) for e in events) > 0


def test_trees_are_exact_or_refused_with_the_architecture_named(family):
    """Medusa's static tree: per-token positions and the tree's mask inside mlx-lm's attention (within
    each sliding layer's window, which the text outgrows), greedy-identical to plain; a hybrid refuses it."""
    from mlx_spec.drafters.medusa import Medusa, MedusaHeads

    name, _, model, prompt, _ = family
    mx.random.seed(5)
    heads = MedusaHeads(3, 1, model.args.hidden_size, model.args.vocab_size)
    mx.eval(heads.parameters())
    if name in HYBRID:
        with pytest.raises(UserError, match=f"a {name} target verifies chains only"):
            list(speculative_steps(model, prompt, GREEDY, 8, Medusa(heads, model, None, 8)))
        return
    plain = [t for e in plain_steps(model, prompt, GREEDY, 24) for t in e.tokens]
    events = list(speculative_steps(model, prompt, GREEDY, 24, Medusa(heads, model, None, 8)))
    assert [t for e in events for t in e.tokens] == plain
    assert any(e.depth for e in events)


def test_an_architecture_mlx_spec_does_not_run_is_named(tmp_path):
    folder = tmp_path / "ssm"
    shutil.copytree(FIXTURES / "qwen3_moe", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    proc = cli_here("generate", "--model", folder, "--prompt", "hi", "--max-tokens", "4")
    assert_one_line_error(proc, "config.json", "gpt_neox")


def seeded(inner, seed: int):
    """`inner` with random weights large enough that its distributions are far from uniform."""
    from mlx.utils import tree_flatten, tree_unflatten

    key = mx.random.key(seed)
    params = []
    for i, (k, v) in enumerate(tree_flatten(inner.parameters())):
        noise = mx.random.normal(v.shape, key=mx.random.split(key, i + 1)[0])
        params.append((k, 1.0 + 0.1 * noise if "norm" in k else 0.3 * noise / (v.shape[-1] ** 0.5)))
    inner.update(tree_unflatten(params))
    return inner


def tiny_moe(seed: int) -> MLXLMTarget:
    """A Qwen3-MoE target of vocabulary V (mlx-lm's class, seeded weights) for the sampling test."""
    from mlx_lm.models import qwen3_moe

    config = dict(model_type="qwen3_moe", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                  num_attention_heads=2, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                  mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-6, vocab_size=V,
                  num_key_value_heads=1, head_dim=16, rope_theta=10000.0, tie_word_embeddings=False,
                  max_position_embeddings=512, norm_topk_prob=True)
    return MLXLMTarget(seeded(qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config)), seed), config)


def test_eagle2_trees_are_exact_or_refused(family):
    """EAGLE-3 drafting EAGLE-2's dynamic trees (three tapped layers, random weights): greedy-identical
    to plain decoding on every attention-only family; a hybrid refuses the tree."""
    name, _, model, prompt, _ = family
    mx.random.seed(3)
    make = lambda: Eagle(EagleNet(eagle_config(model, 3, layers=[0, 1, 2])), model, 8, 4, 3)  # noqa: E731
    if name in HYBRID:
        with pytest.raises(UserError, match=f"a {name} target verifies chains only"):
            list(speculative_steps(model, prompt, GREEDY, 8, make()))
        return
    plain = [t for e in plain_steps(model, prompt, GREEDY, 20) for t in e.tokens]
    events = list(speculative_steps(model, prompt, GREEDY, 20, make()))
    assert [t for e in events for t in e.tokens] == plain
    assert any(e.depth for e in events)


def test_an_mlx_quantized_moe_loads_quantized(tmp_path):
    """A 4-bit Qwen3-MoE as mlx-lm writes one (mlx-community's layout: `quantization` in
    config.json, QuantizedSwitchLinear experts): loaded quantized, greedy-identical with a drafter."""
    from mlx_lm.utils import load_model as mlx_lm_load, quantize_model, save_config, save_model

    from mlx_spec.models.config import mlx_lm_config

    config = mlx_lm_config(json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text()))
    inner, _ = mlx_lm_load(FIXTURES / "qwen3_moe", model_config=config)
    inner, config = quantize_model(inner, config, group_size=32, bits=4)
    save_model(tmp_path, inner)
    save_config(config, tmp_path / "config.json")
    model, _ = load_model(str(tmp_path))
    experts = model.layers[0].mlp.switch_mlp.gate_proj
    assert experts.bits == 4 and experts.weight.dtype == mx.uint32
    prompt = np.load(FIXTURES / "qwen3_moe" / "reference.npz")["prompt"].tolist()
    prompt = prompt + prompt[:12]
    plain = [t for e in plain_steps(model, prompt, GREEDY, 24) for t in e.tokens]
    events = list(speculative_steps(model, prompt, GREEDY, 24, PromptLookup(1, 3), num_draft=3))
    assert [t for e in events for t in e.tokens] == plain


class EveryLength(HostDrafter):
    """Drafts K tokens of the known greedy continuation, the first j of them right, j = 0..K in turn:
    every acceptance length of a chain round, each rolled back from one verification forward."""

    def __init__(self, truth: list[int], k: int):
        super().__init__()
        self.truth, self.k, self.round = truth, k, 0

    def restart(self, b, prompt, cached=0):
        self.states[b] = len(prompt)
        return cached

    def propose_row(self, b, context, k, params):
        right = self.round % (self.k + 1)
        self.round += 1
        start = len(context) - self.states[b]
        tokens = list(self.truth[start : start + self.k])
        tokens[right:] = [(t + 1) % 256 for t in tokens[right:]]
        return Draft(mx.array(tokens, dtype=mx.int32))

    def _session(self):
        return EveryLength(self.truth, self.k)


@pytest.mark.parametrize("name", ROLLED_BACK)
def test_hybrid_rollback_is_exact_at_every_acceptance_length(name):
    """Gated DeltaNet layers (and LFM2's convolutions) cut back to 0..K accepted tokens of a round (the
    recurrence replayed from its tape, the window taken from the taped inputs; no second forward),
    checked against plain decoding token by token."""
    path = FIXTURES / name
    model, _ = load_model(str(path))
    prompt = np.load(path / "reference.npz")["prompt"].tolist()
    K = 4
    plain = [t for e in plain_steps(model, prompt, GREEDY, 40) for t in e.tokens]
    events = list(speculative_steps(model, prompt, GREEDY, 40, EveryLength(plain, K), num_draft=K))
    assert [t for e in events for t in e.tokens] == plain
    assert {e.accepted for e in events[:-1]} == set(range(K + 1))


def test_a_hybrid_draft_model_reads_a_long_prompt():
    """A model with linear-attention layers as the draft model (Qwen3.5-0.8B for Qwen3.5-9B): its prompt is
    read in forwards whose padding those layers can cut back (a forward past the tape's reach cannot be)."""
    model, _ = load_model(str(FIXTURES / "qwen3_5"))
    prompt = [3 + i % 200 for i in range(100)]
    plain = [t for e in plain_steps(model, prompt, GREEDY, 8) for t in e.tokens]
    assert [t for e in speculative_steps(model, prompt, GREEDY, 8, DraftModel(model, model.args.vocab_size))
            for t in e.tokens] == plain


@pytest.mark.parametrize("name", ROLLED_BACK)
def test_hybrid_rows_of_a_batch_are_each_exact(name):
    """Rows of different lengths and different drafters in one batch: each row's tokens are its plain ones."""
    from mlx_spec.decoding import Decoder

    path = FIXTURES / name
    model, _ = load_model(str(path))
    prompt = np.load(path / "reference.npz")["prompt"].tolist()
    prompts = [prompt + prompt[:12], prompt[5:], prompt[:9] + prompt]
    plain = [[t for e in plain_steps(model, p, GREEDY, 16) for t in e.tokens] for p in prompts]
    decoder = Decoder(model, num_draft=3)
    for key, (p, drafter) in enumerate(zip(prompts, [PromptLookup(1, 3), None, SuffixDecoding()])):
        decoder.add(key, p, GREEDY, 16, drafter)
    out = {key: [] for key in range(len(prompts))}
    while decoder.rows:
        for key, event in decoder.step().items():
            out[key] += event.tokens
    assert [out[key] for key in range(len(prompts))] == plain


@pytest.mark.parametrize("drafter", [None, "lookup"])
def test_hybrid_later_chat_turns_are_exact(drafter):
    """A chat's next turn keeps the cache where it can and reads the prompt again where a
    linear-attention layer cannot go back so far: the same tokens as a fresh run."""
    path = FIXTURES / "qwen3_5"
    model, _ = load_model(str(path))
    prompt = np.load(path / "reference.npz")["prompt"].tolist()
    later_turns_are_exact(model, PromptLookup(1, 3) if drafter else None, prompt)


def test_a_cut_a_linear_attention_layer_cannot_make_raises():
    from mlx_spec.cache import TAPE_MAX
    from mlx_spec.errors import CacheError

    model, _ = load_model(str(FIXTURES / "qwen3_5"))
    cache = model.make_cache()
    model(mx.array([list(range(1, TAPE_MAX + 10))]), cache)  # a prompt: longer than a tape holds
    model(mx.array([[5, 6, 7]]), cache)
    cache[0].cut(0, TAPE_MAX + 9)  # back into the last forward: fine
    with pytest.raises(CacheError, match="can go back only to"):
        cache[0].cut(0, TAPE_MAX)


def tiny_hybrid(seed: int) -> MLXLMTarget:
    """A Qwen3.5 target of vocabulary V (mlx-lm's class, seeded weights): a Gated DeltaNet layer,
    then a full-attention one, for the sampling test."""
    from mlx_lm.models import qwen3_5

    config = dict(model_type="qwen3_5", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, vocab_size=V,
                  linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_conv_kernel_dim=4, full_attention_interval=2, tie_word_embeddings=False,
                  max_position_embeddings=512, rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                                                "rope_type": "default"})
    return MLXLMTarget(seeded(qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config)), seed), config)


@pytest.mark.parametrize("make_target", [tiny_moe, tiny_hybrid], ids=["moe", "hybrid"])
def test_sampling_matches_the_targets_distribution(make_target, monkeypatch):
    """Speculative sampling at temperature 1 is distributed as the MoE or the hybrid target's own."""
    target = make_target(0)
    params = SamplingParams(temp=1.0)
    make = lambda: DraftModel(tiny(1, V, logit_scale=0.3), V)  # noqa: E731
    p = exact_joint(target, STAT_PROMPT, params, 3)
    assert empirical_tv(target, make, params, p, n=FAMILY_N) < tv_bound(p, FAMILY_N)
    monkeypatch.setattr(sampling, "accept_sampled", resample_from_target)  # a wrong rule fails it
    assert told_apart(target, make, params, p)


TRAIN = {  # command -> the --drafter spec its output is loaded by
    ("train", "eagle3"): "eagle3", ("train", "dflash"): "dflash", ("train", "medusa"): "medusa",
    ("train", "mtp"): "mtp", ("train", "mtp-heads"): "mtp-heads", ("train", "layerskip"): None, ("distill",): "draft",
}


@pytest.mark.parametrize("name", ["qwen3_5", "gpt_oss"])
def test_training_commands_run_on_mlx_lm_targets(name, tmp_path, capsys):
    """Every drafter-training command and `distill --teacher` on a hybrid and on a sliding-window MoE
    target (two steps each: they need only the target contract); what they write drafts losslessly."""
    from mlx_spec.cli import main
    from tiny import make_config, make_tokenizer, random_weights, write_checkpoint

    target_dir = tmp_path / name
    shutil.copytree(FIXTURES / name, target_dir)
    make_tokenizer(target_dir, 250)  # byte-level: ASCII text stays below the fixture's 256 rows
    student = tmp_path / "student"
    config = make_config("llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=256)
    write_checkpoint(student, config, {k: mx.array(v) for k, v in random_weights(config, 1).items()}, 1)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target_dir / f, student / f)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"the quick brown fox jumps over the lazy dog {i} times"}) + "\n"
                            for i in range(48)))
    model, _ = load_model(str(target_dir))
    target = api.Target(model, None, target_dir, str(target_dir))
    prompt = np.load(target_dir / "reference.npz")["prompt"].tolist()
    plain = [t for e in plain_steps(model, prompt, GREEDY, 12) for t in e.tokens]
    common = ["--data", str(data), "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--warmup", "1", "--quiet"]
    for command, kind in TRAIN.items():
        out = tmp_path / "-".join(command)
        place = ["--teacher", str(target_dir), "--student", str(student)] if command == ("distill",) else ["--target", str(target_dir)]
        assert main([*command, *place, "-o", str(out), *common]) == 0, (command, capsys.readouterr().err)
        if kind is None:  # LayerSkip fine-tunes the target itself: it loads back as one
            tuned, _ = load_model(str(out))
            assert [t for e in plain_steps(tuned, prompt, GREEDY, 4) for t in e.tokens]
            continue
        drafter = api.drafter(f"{kind}={out}", target)
        events = list(speculative_steps(model, prompt, GREEDY, 12, drafter.new_session(), num_draft=3))
        assert [t for e in events for t in e.tokens] == plain, command


def test_bench_on_a_hybrid_target_reports_the_rollback(tmp_path):
    """`mlx-spec bench` on Qwen3.5: plain decoding beside mlx-lm's on the same modules, a drafter
    greedy-identical, and the linear-attention rollback's cost a round next to a plain step."""
    from tiny import make_tokenizer

    target_dir = tmp_path / "qwen3_5"
    shutil.copytree(FIXTURES / "qwen3_5", target_dir)
    make_tokenizer(target_dir, 250)
    report, prompts = tmp_path / "bench.json", tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n    return a + b\n\n" * 6}) + "\n")  # (context 512)
    proc = cli_here("bench", "--model", target_dir, "--drafters", "lookup", "--prompts", prompts,
                    "--max-tokens", "16", "--repeats", "1", "--temps", "0", "--no-chat-template", "--json", report)
    assert proc.returncode == 0, proc.stderr
    assert "linear-attention rollback:" in proc.stdout and "of a plain step" in proc.stdout
    data = json.loads(report.read_text())
    assert data["rollback"]["plain_step_ms"] > 0 and data["rollback"]["replayed_tokens"] == 3
    rows = {r["name"]: r for r in data["rows"]}
    assert {"mlx-spec", "mlx-lm", "mlx-spec lookup"} <= rows.keys()
    assert rows["mlx-spec lookup"]["identical_to_plain"]


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_moe"])
def test_a_z_lab_dflash_folder_drafts_losslessly(name, tmp_path):
    """A DFlash drafter folder as z-lab publishes it for Qwen3.5 and Qwen3-Coder-30B-A3B (research notes
    1.2: `DFlashDraftModel`, a Qwen3 body, `block_size` inside `dflash_config` in the Qwen3.5 form,
    bfloat16 weights), given as `--drafter dflash=FOLDER` on the hybrid and the MoE target."""
    from mlx_spec.drafters.dflash import DFlashNet
    from mlx_spec.drafters.dflash_layouts import dflash_config
    from mlx_spec.files import write_model_files

    path = FIXTURES / name
    model, _ = load_model(str(path))
    config = dflash_config(model, num_layers=2, block_size=4, mask_token_id=model.args.vocab_size - 1)
    config.update(auto_map={"AutoModel": "dflash.DFlashDraftModel"}, dtype="bfloat16", hidden_act="silu",
                  attention_bias=False, tie_word_embeddings=False)
    if name == "qwen3_5":
        config["dflash_config"]["block_size"] = config.pop("block_size")
        config["rope_theta"] = 1e7
    mx.random.seed(2)
    net = DFlashNet(config)
    write_model_files(tmp_path, config, {k: v.astype(mx.bfloat16) for k, v in net.weights().items()})
    drafter = api.drafter(f"dflash={tmp_path}", api.Target(model, None, path, str(path)))
    prompt = np.load(path / "reference.npz")["prompt"].tolist()
    plain = [t for e in plain_steps(model, prompt, GREEDY, 24) for t in e.tokens]
    events = list(speculative_steps(model, prompt, GREEDY, 24, drafter.new_session()))
    assert [t for e in events for t in e.tokens] == plain
    assert sum(len(e.drafted) for e in events) > 0


@pytest.mark.parametrize("name", ["mimo", "qwen3_5"])
def test_generate_with_the_checkpoints_own_mtp_reports_tau(name, tmp_path):
    """`mlx-spec generate --drafter mtp` (no source) on MiMo and on Qwen3.5 as published: the same
    tokens as plain decoding (`--check`), and tau in the report."""
    from tiny import make_tokenizer

    target_dir = tmp_path / name
    shutil.copytree(FIXTURES / name, target_dir)
    make_tokenizer(target_dir, 250)
    proc = cli_here("generate", "--model", target_dir, "--drafter", "mtp", "--prompt",
                    "the lazy dog jumps over the lazy", "--max-tokens", "16", "--no-chat-template", "--check", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["identical_to_plain"] is True and out["drafter"] == "mtp" and out["tau"] >= 1.0
