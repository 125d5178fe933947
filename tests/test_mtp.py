"""MTP modules inside base checkpoints (DeepSeek, MiMo, Qwen3-Next layouts):
extraction, module logits against an independent numpy reference, lossless
greedy and exact sampling."""

import itertools
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_spec.convert.mtp import convert_mtp
from mlx_spec.cache import KVCache
from mlx_spec.decoding import plain_steps, speculative_steps
from mlx_spec.drafters.mtp import MTP, MTPNet, load_mtp
from mlx_spec.errors import UserError
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams
from stats import N, STAT_PROMPT, V, empirical_tv, exact_joint, plain_greedy, tiny, tokens_of, tv_bound

FIXTURES = Path(__file__).parent / "fixtures" / "mtp"
LAYOUTS = ("deepseek", "mimo", "qwen3_next")
GREEDY = SamplingParams()


def target_only(source: Path, out: Path) -> Path:
    """The base model alone: the loader refuses weights it does not expect, so the MTP shard stays behind."""
    out.mkdir()
    shutil.copy(source / "config.json", out)
    shutil.copy(source / "model-00001-of-00002.safetensors", out / "model.safetensors")
    return out


@pytest.fixture(scope="module", params=LAYOUTS)
def case(request, tmp_path_factory):
    layout = request.param
    root = tmp_path_factory.mktemp(layout)
    convert_mtp(FIXTURES / layout, root / "mtp")
    net, config, _ = load_mtp(str(root / "mtp"))
    target, _ = load_model(str(target_only(FIXTURES / layout, root / "target")))
    return layout, net, config, target


@pytest.mark.parametrize("layout", ["deepseek", "mimo", "qwen3_next"])
def test_the_checkpoints_own_modules_draft(layout):
    """The target loads from the whole checkpoint (its MTP tensors set aside), and
    `--drafter mtp` with no source drafts with those modules, losslessly."""
    from mlx_spec import api
    from mlx_spec.sampling import SamplingParams

    path = FIXTURES / layout  # weights and config only: no tokenizer to load
    target, _ = load_model(str(path))
    drafter = api.drafter("mtp", api.Target(target, None, path, str(path)))
    greedy = SamplingParams()
    for prompt in ([1, 5, 9, 13, 17], [3]):
        plain = [t for e in plain_steps(target, prompt, greedy, 16) for t in e.tokens]
        events = speculative_steps(target, prompt, greedy, 16, drafter.new_session(), num_draft=3)
        assert [t for e in events for t in e.tokens] == plain


def test_module_logits_match_reference(case):
    layout, net, config, target = case
    ref = np.load(FIXTURES / f"{layout}.npz")
    assert config["mtp"]["layout"] == layout and len(net.layers) == ref["logits"].shape[0]
    assert config["mtp"]["hidden_first"] == (layout == "mimo")
    hidden = mx.array(ref["hidden"])[None]
    embedding = target.model.embed_tokens(mx.array(ref["tokens"])[None])
    for k, module in enumerate(net.layers):
        logits = module.logits(module(hidden, embedding, mask="causal"), target)[0]
        assert np.abs(np.array(logits) - ref["logits"][k]).max() < 1e-4, (layout, k)


PROMPTS = [[1, 87, 85, 71, 84], [40, 41, 42, 43, 44, 45, 46, 47, 40, 41], [7], [3, 9]]


@pytest.fixture(scope="module")
def greedy(case):
    return plain_greedy(case[3], PROMPTS, 24)


def test_greedy_is_token_identical_to_plain(case, greedy):
    layout, net, _, target = case
    for prompt, max_tokens, k in itertools.product(PROMPTS, (1, 5, 24), (None, 1, 4)):
        plain = greedy(prompt, max_tokens)
        events = speculative_steps(target, prompt, GREEDY, max_tokens, MTP(net, target), num_draft=k)
        assert tokens_of(events) == plain, (layout, prompt, max_tokens, k)


@pytest.mark.parametrize("most", [512, 4])
def test_modules_keep_exact_caches(case, most, monkeypatch):
    """After a run, each module's committed slots equal a fresh pass over the
    committed tokens: module 1 on the target's normed states, module k on module k-1's (also where
    the modules read `most` slots a forward: a long prompt's are read in pieces)."""
    from mlx_spec.drafters import mtp

    monkeypatch.setattr(mtp, "READ_MAX", most)
    _, net, _, target = case
    drafter = MTP(net, target)
    prompt = PROMPTS[1] * 6
    context = prompt + tokens_of(speculative_steps(target, prompt, GREEDY, 12, drafter, num_draft=3))
    drafter.propose([context], [1], [GREEDY])
    n = len(context)
    _, (h,) = target(mx.array([context]), capture=drafter.capture)
    h = target.model.norm(h)
    for k, module in enumerate(net.layers):
        m = n - 1 - k
        assert drafter.committed[0][k] == m
        h = h[:, :m]
        ref = KVCache()
        h = module(h, target.model.embed_tokens(mx.array([context[k + 1 : k + 1 + m]])), ref, "causal")
        assert mx.abs(drafter.cache[k].keys[..., :m, :] - ref.keys[..., :m, :]).max().item() < 1e-5


def test_drafts_past_the_last_module_follow_a_fresh_pass(case):
    """Each draft position, against a fresh pass without caches: module k reads module k-1's outputs (module 1
    the target's normed states) and the tokens k + 1 ahead; past the last module, the last reads its own
    output and the token it drafted, as if they were one more committed slot."""
    _, net, _, target = case
    norm = target.model.norm.weight
    # The fixtures' final norm scales by ones: with other scales, normed twice is not normed once.
    target.model.norm.weight = mx.random.uniform(0.2, 3.0, norm.shape, key=mx.random.key(0))
    try:
        drafter, L = MTP(net, target), len(net.layers)
        prompt = PROMPTS[1]
        context = prompt + tokens_of(speculative_steps(target, prompt, GREEDY, 12, drafter, num_draft=3))
        K = L + 2
        drafted = drafter.propose([context], [K], [GREEDY])[0].tokens.tolist()
        n = len(context)
        _, (h,) = target(mx.array([context]), capture=drafter.capture)
        inputs, tokens = target.model.norm(h)[:, : n - 1], context[1:]  # module 1's slots 0 .. n - 2
        expected = []
        for d in range(1, K + 1):
            module = net.layers[min(d, L) - 1]
            x = module(inputs, target.model.embed_tokens(mx.array([tokens])), mask="causal")
            token = int(mx.argmax(module.logits(x[:, -1], target)[0]).item())
            expected.append(token)
            if d < L:  # the next module: these outputs, the tokens one further ahead
                inputs, tokens = x, tokens[1:] + [token]
            else:  # the last module again: its own output and the token it drafted, one slot on
                inputs, tokens = mx.concatenate([inputs, x[:, -1:]], axis=1), tokens + [token]
    finally:
        target.model.norm.weight = norm
    assert drafted == expected


def test_refuses_moe_blocks(tmp_path):
    src = tmp_path / "moe"
    shutil.copytree(FIXTURES / "deepseek", src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.2.mlp.experts.0.up_proj.weight"] = "model-00002-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    shard = src / "model-00002-of-00002.safetensors"
    weights = mx.load(str(shard))
    weights["model.layers.2.mlp.experts.0.up_proj.weight"] = mx.zeros((4, 4))
    mx.save_safetensors(str(shard), weights)
    with pytest.raises(UserError, match="mixture-of-experts"):
        convert_mtp(src, tmp_path / "out")


@pytest.mark.parametrize("D", [1, 2])
def test_sampling_matches_target_distribution(D):
    target = tiny(0, V, logit_scale=0.3)
    t = target.args
    config = {"model_type": "qwen3", "hidden_size": t.hidden_size, "num_hidden_layers": 1,
              "num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
              "head_dim": t.head_dim, "intermediate_size": t.intermediate_size, "vocab_size": V,
              "mtp": {"layout": "deepseek", "num_modules": D}}
    mx.random.seed(3)
    net = MTPNet(config)
    mx.eval(net.parameters())
    params = SamplingParams(temp=1.0)
    p = exact_joint(target, STAT_PROMPT, params, 3)
    assert empirical_tv(target, lambda: MTP(net, target), params, p) < tv_bound(p, N)


def test_trained_modules_get_accepted(stride_model, tmp_path):
    """`mlx-spec train mtp` (two modules, the seed's loss) for a short run on a
    tiny trained target: more than 1.5 tokens per target forward on held-out rows."""
    from conftest import _fast_blas_env
    from helpers import cli, tau_on_held_out_rows
    from mlx_spec.drafters import make_drafter
    from tiny import write_stride_data

    data = write_stride_data(tmp_path / "data", stride_model)
    out = tmp_path / "mtp"
    proc = cli("train", "mtp", "--target", stride_model, "--data", data, "-o", out, "--modules", "2",
               "--steps", "40", "--batch-size", "16", "--seq-len", "48", "--lr", "3e-3", "--warmup", "5",
               "--quiet", env=_fast_blas_env())
    assert proc.returncode == 0, proc.stderr
    target, _ = load_model(str(stride_model))
    drafter = make_drafter(f"mtp={out}", target)
    assert len(drafter.net.layers) == 2
    assert tau_on_held_out_rows(target, stride_model, drafter.new_session, 3) > 1.5
