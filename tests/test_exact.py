"""Exact verification (`--exact`): with OpenBLAS, where the default verification parts from plain greedy
decoding at near-ties, every drafter's greedy output is `--exact` plain decoding's, bit for bit; with the
reference BLAS too; and sampled output keeps the target's distribution."""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_spec.sampling as sampling
from mlx_spec import exact
from mlx_spec.attention import TreeMask
from mlx_spec.decoding import plain_steps, speculative_steps
from mlx_spec.drafters.base import Draft
from mlx_spec.drafters.draft_model import DraftModel
from mlx_spec.drafters.lookup import PromptLookup
from mlx_spec.errors import UserError
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams
from helpers import cli
from stats import N, STAT_PROMPT, V, empirical_tv, exact_joint, tiny, tokens_of, told_apart, tv_bound
from test_speculative import resample_from_target
from test_trees import SHAPES, SampledTree, ScriptedTree

GREEDY = SamplingParams()
HERE = Path(__file__).parent
FAMILIES = HERE / "fixtures" / "mlxlm_reference"


def test_openblas_parts_from_plain_and_exact_verification_does_not(tmp_path):
    """tests/exactness.py under OpenBLAS: near-tie checkpoints of every architecture, every drafter kind
    (chains and trees, a batch of one and rows of a batch); the default mode parts from plain decoding."""
    env = {**os.environ, "MLX_SPEC_NO_OPENBLAS": ""}
    proc = subprocess.run([sys.executable, str(HERE / "exactness.py"), str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    if not result.pop("blas"):
        pytest.skip("no system OpenBLAS here (.ci/run installs one)")
    assert result["qwen3"].pop("default, 4 x 32") >= 1  # the problem is real here
    for arch, row in result.items():
        assert row.pop("width") == 8
        assert row and all(v == 0 for v in row.values()), (arch, row)


@pytest.fixture(scope="module")
def target(checkpoints):
    return load_model(str(checkpoints["qwen3"]))[0]


PROMPTS = [[1, 87, 85, 71, 84], [40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42, 43], list(range(3, 250))]


@pytest.mark.parametrize("kind", ["draft", "lookup", "scripted-tree"])
def test_exact_greedy_is_exact_plain_with_the_reference_blas(target, kind):
    width = exact.width(target, 8)
    for prompt in PROMPTS:
        plain = tokens_of(plain_steps(target, prompt, GREEDY, 40, width=width))
        make = {"draft": lambda: DraftModel(target, target.args.vocab_size), "lookup": lambda: PromptLookup(1, 3),
                "scripted-tree": lambda: ScriptedTree(plain, SHAPES["deep"], target.args.vocab_size, 0)}[kind]
        assert tokens_of(speculative_steps(target, prompt, GREEDY, 40, make(), width=width)) == plain, prompt


def test_an_exact_round_takes_the_first_nodes_its_width_holds():
    parents = [-1, -1, 0, 1, 2, 3, 4]  # two roots, then each root's chain
    assert exact.fits(parents, 8) == list(range(7))
    assert exact.fits(parents, 4) == [0, 1, 2]
    assert exact.fits(None, 8) == list(range(7))  # a chain: as many as it drafted, up to 7


def test_exact_attention_sees_only_what_its_mask_allows():
    mx.random.seed(0)
    q, k, v = mx.random.normal((1, 4, 3, 8)), mx.random.normal((1, 2, 512, 8)), mx.random.normal((1, 2, 512, 8))
    mask = mx.array([[True] * 300 + [False] * 212] * 3)[None, None]
    got = exact.attention(q, k, v, exact.ExactMask(mask), 0.5)
    want = mx.fast.scaled_dot_product_attention(q, k[:, :, :300], v[:, :, :300], scale=0.5)
    assert mx.allclose(got, want, atol=1e-5).item()


def test_a_tree_nodes_attention_reads_its_keys_where_its_chain_holds_them():
    """Each node of a tree verified exactly attends bit for bit as its own chain would: its ancestor at depth d
    read from the slot after the pending token's d - 1 (kernels that sum a block in several accumulators, as
    OpenBLAS's AVX-512 ones do, add a term to the one its slot falls to)."""
    parents, cached = (-1, 0, 0, 1, 2, 3), 253  # the pending token, two children, a chain below each
    assert exact.chain_order(parents, 2, 8)[4].tolist() == [0, 1, 2, 4, 6, 3, 5, 7]  # node 4: nodes 0, 2, itself
    mx.random.seed(1)
    S, L = len(parents), exact.blocks(cached + len(parents))
    q, k, v = mx.random.normal((1, 4, S, 16)), mx.random.normal((1, 2, L, 16)), mx.random.normal((1, 2, L, 16))
    tree_mask = TreeMask(parents, cached)
    got = exact.attention(q, k, v, exact.ExactMask.of(tree_mask.dense[None, None], tree_mask), 0.25)
    for node in range(S):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        slots = mx.array([*range(cached), *(cached + i for i in reversed(path)), *range(cached + len(path), L)])
        chain = exact.ExactMask.of(mx.ones((1, 1, 1, cached + len(path)), mx.bool_))
        want = exact.attention(q[:, :, node : node + 1], k[:, :, slots], v[:, :, slots], chain, 0.25)
        assert mx.array_equal(got[:, :, node], want[:, :, 0]).item(), node


@pytest.fixture(scope="module")
def stat_models():
    return tiny(0, V, logit_scale=0.3), tiny(1, V, logit_scale=0.3, rope_theta=100.0)


def test_sampling_matches_target_distribution_when_exact(stat_models, monkeypatch):
    target, draft = stat_models
    params = SamplingParams(temp=1.0)
    p = exact_joint(target, STAT_PROMPT, params, 3)
    make = lambda: DraftModel(draft, V)  # noqa: E731
    assert empirical_tv(target, make, params, p, width=4) < tv_bound(p, N)
    monkeypatch.setattr(sampling, "accept_sampled", resample_from_target)  # a wrong rule is told apart
    assert told_apart(target, make, params, p, width=4)


def test_tree_sampling_matches_target_distribution_when_exact(stat_models):
    """Two levels of two siblings (the second drawn without the first) cut to a width of 4: the first
    three nodes, an earlier sibling always kept with a later one."""
    target, draft = stat_models
    params = SamplingParams(temp=1.0)
    p = exact_joint(target, STAT_PROMPT, params, 3)
    assert empirical_tv(target, lambda: SampledTree(draft, replace=False), params, p, width=4) < tv_bound(p, N)


def test_exact_refuses_what_it_cannot_hold(target):
    with pytest.raises(UserError, match="--num-draft 9"):
        list(speculative_steps(target, [1, 2], GREEDY, 4, PromptLookup(1, 3), num_draft=9, width=8))
    with pytest.raises(UserError, match="wider than 32"):
        exact.width(target, 40)


def test_exact_attention_computes_what_each_familys_own_does():
    """Each family run on mlx-lm's modules: a forward verifying exactly gives the logits its own does (float
    rounding apart) after a context of more than one block of keys: sinks, softcaps, windows, latent attention
    and DeepSeek-V3.2's indexer (its top-k of keys picked from exact scores)."""
    rng = np.random.default_rng(0)
    for path in sorted(FAMILIES.iterdir()):
        model = load_model(str(path))[0]
        seq = mx.array([rng.integers(3, model.args.vocab_size, 300).tolist()])
        mine, theirs = model.make_cache(), model.make_cache()
        for cache in (mine, theirs):
            model(seq[:, :292], cache)
        own, exactly = model(seq[:, 292:], theirs)[0], model(seq[:, 292:], mine, exact=True)[0]
        assert mx.abs(own - exactly).max().item() < 1e-4, path.name


# Families run on mlx-lm's modules, in two halves (each a process of its own: workers share them out).
FAMILY_HALVES = (("deepseek_v3 deepseek_v32 gemma2 gemma3_softcap gemma3_text gemma4 gemma4_text glm4_moe gpt_oss "
                  "granitemoehybrid lfm2"),
                 ("lfm2_moe mimo mixtral nemotron_h olmoe qwen2_moe qwen3_5 qwen3_5_moe qwen3_moe qwen3_next"))


@pytest.mark.parametrize("names", FAMILY_HALVES, ids=("first-half", "second-half"))
def test_every_family_on_mlx_lms_modules_is_exact_under_openblas(tmp_path, names):
    """tests/exactness.py FAMILY ...: each fixture with a near-tie LM head, under OpenBLAS; a draft model,
    LayerSkip and a tree where the family runs them, alone, and a draft model for rows of a batch:
    identical to `--exact` plain decoding (sinks, softcaps, sliding windows, latent attention and its
    indexer, mixtures of experts, Gated DeltaNet, short convolutions and Mamba-2 layers)."""
    env = {**os.environ, "MLX_SPEC_NO_OPENBLAS": ""}
    proc = subprocess.run([sys.executable, str(HERE / "exactness.py"), str(tmp_path), *names.split()],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    if not result.pop("blas"):
        pytest.skip("no system OpenBLAS here (.ci/run installs one)")
    assert sorted(result) == sorted(names.split())
    for name, row in result.items():
        assert row.pop("width") == 8
        assert row and all(v == 0 for v in row.values()), (name, row)


def test_generate_check_says_where_outputs_parted_and_the_margin(checkpoints):
    out = cli("generate", "--model", checkpoints["qwen3"], "--prompt", "hi", "--drafter", "lookup", "--exact",
              "--check", "--json", "--max-tokens", "12")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["identical_to_plain"] is True and report["parted_from_plain"] is None and report["exact_width"] == 8


REFERENCE = """
import json, sys
from mlx_spec import api
target = api.load(sys.argv[1])
width = api.exact_width(target)
print(json.dumps([api.generate(target, p, chat_template=False, max_tokens=32, width=width).text for p in sys.argv[2:]]))
"""


def test_rows_of_a_served_batch_are_exact_plain_alone_under_openblas(tmp_path):
    """`mlx-spec serve --exact` under OpenBLAS on a near-tie checkpoint: requests decoded together, each
    answer the one `--exact` plain decoding gives its prompt alone."""
    from concurrent.futures import ThreadPoolExecutor

    from exactness import near_ties

    model = str(near_ties(tmp_path / "qwen3", "qwen3", 0))
    env = {**os.environ, "MLX_SPEC_NO_OPENBLAS": ""}
    prompts = ["abc abc", "hello there", "the the the", "zq"]
    reference = subprocess.run([sys.executable, "-c", REFERENCE, model, *prompts], capture_output=True, text=True,
                               env=env, timeout=300)
    assert reference.returncode == 0, reference.stderr
    server = subprocess.Popen([sys.executable, "-m", "mlx_spec.cli", "serve", "--model", model, "--drafter", "lookup",
                               "--exact", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = server.stdout.readline()
        assert "exact, 8 tokens wide" in line, line + server.stderr.read()
        url = line.split(" on ")[-1].strip()

        def ask(prompt):
            body = json.dumps({"prompt": prompt, "max_tokens": 32, "temperature": 0}).encode()
            request = urllib.request.Request(url + "/completions", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read())["choices"][0]["text"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(ask, prompts))
    finally:
        server.terminate()
        server.wait(30)
    assert answers == json.loads(reference.stdout)


def test_generate_check_prints_where_the_default_mode_parted_under_openblas(tmp_path):
    """What a user reads on stderr: the default mode parts at a near-tie (and says where, and the margin);
    --exact does not."""
    from exactness import near_ties

    model = str(near_ties(tmp_path / "qwen3", "qwen3", 0))
    env = {"MLX_SPEC_NO_OPENBLAS": ""}
    args = ("generate", "--model", model, "--drafter", f"draft={model}", "--prompt", "abc abc abc", "--no-chat-template",
            "--check", "--max-tokens", "64")
    default, exact_run = cli(*args, env=env), cli(*args, "--exact", env=env)
    assert default.returncode == 0 and exact_run.returncode == 0, default.stderr + exact_run.stderr
    if "reference BLAS" in cli("doctor", env=env).stdout:
        pytest.skip("no system OpenBLAS here (.ci/run installs one)")
    line = default.stderr.strip().splitlines()[-1]
    assert "identical to plain: False (parted at token " in line and "two best logits were" in line, line
    assert "identical to plain (both exact): True" in exact_run.stderr.strip().splitlines()[-1]
