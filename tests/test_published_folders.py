"""`--drafter KIND=SOURCE` on drafters as their authors publish them: no convert
step. Each folder mirrors a published repo's files, tensor names, dtypes and
config fields (written by scripts/make_torch_fixtures.py and
scripts/make_dflash_fixtures.py with real torch.save / safetensors, from
research/checkpoint-formats.md); the first run converts it into mlx-spec's data
folder, the second converts nothing, and greedy output is identical to plain
decoding both times."""

import json
import shutil
from pathlib import Path

import pytest

from helpers import assert_one_line_error, cli, cli_here, fake_hub_cache

FIXTURES = Path(__file__).parent / "fixtures"
TORCH = FIXTURES / "torch"

# published repo it mirrors -> (kind, folder, target: a conftest checkpoint, or the folder itself)
CASES = {
    # fp16 pytorch_model.bin, midlayer.*, d2t/t2d over a draft vocabulary, no embed_tokens, no rope_theta
    "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B": ("eagle3", TORCH / "eagle3", "qwen3"),
    # LlamaForCausalLMEagle3 in SpecForge's layout; config head_dim hidden/heads, q_proj's twice that
    "AngelSlim/Qwen3-4B_eagle3": ("eagle3", TORCH / "eagle3-angelslim", "qwen3"),
    # config.json (dflash_config, block_size 16) and bf16 model.safetensors, loaded as they are
    "z-lab/Qwen3-8B-DFlash-b16": ("dflash", FIXTURES / "dflash" / "b16", "qwen3"),
    # medusa_lm_head.pt (bf16 pickle) holding 5 heads, a config.json that says 2
    "FasterDecoding/medusa-vicuna-7b-v1.3": ("medusa", TORCH / "medusa", "llama"),
    # a whole Llama in pytorch_model-0000i-of-00002.bin shards, its heads inside: the target too
    "FasterDecoding/medusa-1.0-vicuna-7b-v1.5": ("medusa", TORCH / "medusa2", None),
    # fp16 pytorch_model.bin with embed_tokens, fc without bias ("bias": false), rope_theta 500000
    "yuhuili/EAGLE-LLaMA3.1-Instruct-8B": ("eagle", TORCH / "eagle1-llama3", "llama"),
}


def generate(target, spec: str, home: Path, *extra, env=None):
    # (huggingface_hub reads its cache's place as it is imported: a run given another starts a process)
    run = cli if env else cli_here
    return run("generate", "--model", target, "--drafter", spec, "--prompt", "def greet(name):",
               "--max-tokens", "24", "--check", "--json", *extra, env={"MLX_SPEC_HOME": str(home), **(env or {})})


def converted(home: Path) -> dict[str, int]:
    return {str(f.relative_to(home)): f.stat().st_mtime_ns for f in home.rglob("*") if f.is_file()}


@pytest.mark.parametrize("repo", CASES)
def test_published_folder_runs_as_it_is(tmp_path, checkpoints, repo):
    kind, folder, target = CASES[repo]
    target = checkpoints[target] if target else folder
    home = tmp_path / "home"
    first = generate(target, f"{kind}={folder}", home)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["identical_to_plain"] is True
    if kind == "dflash":  # z-lab's folders are read where they lie
        assert "converting" not in first.stderr and not converted(home)
    else:
        assert f"converting {folder} for --drafter {kind}, once" in first.stderr, first.stderr
    made = converted(home)

    second = generate(target, f"{kind}={folder}", home)
    assert second.returncode == 0, second.stderr
    assert "converting" not in second.stderr, second.stderr
    assert converted(home) == made  # nothing written again
    assert json.loads(second.stdout)["tokens"] == json.loads(first.stdout)["tokens"]


def test_a_medusa_2_model_drafts_with_its_own_heads(tmp_path):
    """`--drafter medusa` alone on a Medusa-2 model: the heads its checkpoint holds (every round drafting:
    its random heads seldom pay, and the policy would soon stop)."""
    folder = TORCH / "medusa2"
    proc = generate(folder, "medusa", tmp_path / "home", "--num-draft", "3")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["identical_to_plain"] is True and out["tau"] > 1.0


def test_an_edited_folder_converts_again(tmp_path, checkpoints):
    folder = tmp_path / "eagle3"
    shutil.copytree(TORCH / "eagle3", folder)
    home = tmp_path / "home"
    assert "converting" in generate(checkpoints["qwen3"], f"eagle3={folder}", home).stderr
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    proc = generate(checkpoints["qwen3"], f"eagle3={folder}", home)
    assert "converting" in proc.stderr and proc.returncode == 0, proc.stderr


def test_a_folder_of_another_kind_is_named(tmp_path, checkpoints):
    proc = generate(checkpoints["llama"], f"eagle3={TORCH / 'medusa'}", tmp_path / "home")
    assert_one_line_error(proc, "--drafter eagle3", "medusa checkpoint", "--drafter medusa=")


def test_a_drafter_for_another_target_is_refused(tmp_path, checkpoints):
    """The EAGLE-1 drafter reads a Llama of hidden size 64: not a Qwen3 of 96."""
    from tiny import make_checkpoint

    other = make_checkpoint(tmp_path / "other", "qwen3", seed=3, hidden_size=96)
    proc = generate(other, f"eagle={TORCH / 'eagle1-llama3'}", tmp_path / "home")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    assert "--drafter eagle=" in error and "hidden size 64" in error and "96" in error, error


def test_a_short_name_finds_converts_and_runs_its_drafter_offline(tmp_path, checkpoints):
    """`--model qwen3-8b --drafter eagle3`: the short name is mlx-community's Qwen3-8B, whose
    published EAGLE-3 drafter is AngelSlim's; both come from the cache, with no network."""
    cache = tmp_path / "hub"
    fake_hub_cache(cache, "mlx-community/Qwen3-8B-4bit", checkpoints["qwen3"])
    fake_hub_cache(cache, "AngelSlim/Qwen3-8B_eagle3", TORCH / "eagle3-angelslim")
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    home = tmp_path / "home"
    first = generate("qwen3-8b", "eagle3", home, env=env)
    assert first.returncode == 0, first.stderr
    assert "converting AngelSlim/Qwen3-8B_eagle3 for --drafter eagle3, once" in first.stderr
    assert json.loads(first.stdout)["identical_to_plain"] is True
    second = generate("qwen3-8b", "eagle3", home, env=env)
    assert second.returncode == 0 and "converting" not in second.stderr, second.stderr


@pytest.mark.parametrize("model, kind, needle", [
    ("qwen3-32b", "dflash", "no published dflash drafter is known"),
    ("vicuna", "eagle3", "no published eagle3 drafter is known"),
])
def test_a_pair_with_no_published_drafter_says_so(tmp_path, model, kind, needle):
    """Before anything is downloaded: the cache is empty."""
    cache = tmp_path / "hub"
    cache.mkdir()
    proc = generate(model, kind, tmp_path / "home", env={"HF_HUB_CACHE": str(cache)})
    assert_one_line_error(proc, needle)


@pytest.mark.parametrize("name, kind, expected", [
    ("mlx-community/Qwen3-4B-Instruct-2507-4bit", "dflash", "z-lab/Qwen3-4B-DFlash-b16"),
    ("mlx-community/Qwen3-8B-4bit-DWQ-053125", "dflash", "z-lab/Qwen3-8B-DFlash-b16"),
    ("mlx-community/Qwen3-4B-4bit", "eagle3", "AngelSlim/Qwen3-4B_eagle3"),
    ("Qwen/Qwen3-14B-MLX-4bit", "eagle3", "AngelSlim/Qwen3-14B_eagle3"),
    ("mlx-community/Llama-3.1-8B-Instruct-bf16", "eagle3", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"),
    ("FasterDecoding/medusa-1.0-vicuna-7b-v1.5", "medusa", "FasterDecoding/medusa-1.0-vicuna-7b-v1.5"),
])
def test_conversions_and_fine_tunes_find_their_base_models_drafters(name, kind, expected):
    from mlx_spec.drafters import find_drafter

    assert find_drafter(kind, name) == expected


def test_a_local_conversion_is_known_by_its_folder_name(tmp_path, checkpoints):
    from mlx_spec.drafters import find_drafter

    folder = tmp_path / "Qwen3-8B-4bit"
    shutil.copytree(checkpoints["qwen3"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("_name_or_path", None)
    (folder / "config.json").write_text(json.dumps(config))
    assert find_drafter("dflash", str(folder)) == "z-lab/Qwen3-8B-DFlash-b16"


def test_mtp_modules_inside_a_checkpoint_convert_on_first_use(tmp_path, monkeypatch):
    """`--drafter mtp=SOURCE` on a DeepSeek-V3-layout checkpoint (tests/fixtures/mtp/deepseek,
    its extra layer `model.layers.{L}.*` holding the module): converted once, then reused."""
    from mlx_spec import api
    from mlx_spec.decoding import plain_steps, speculative_steps
    from mlx_spec.models import load_model
    from mlx_spec.sampling import SamplingParams

    monkeypatch.setenv("MLX_SPEC_HOME", str(tmp_path / "home"))
    path = FIXTURES / "mtp" / "deepseek"
    model, _ = load_model(str(path))
    target = api.Target(model, None, path, str(path))  # weights and config only: no tokenizer
    heard: list[str] = []
    drafter = api.drafter(f"mtp={path}", target, report=heard.append)
    assert len(heard) == 1 and heard[0].startswith(f"converting {path} for --drafter mtp, once")
    api.drafter(f"mtp={path}", target, report=heard.append)
    assert len(heard) == 1  # the second time reads the conversion
    greedy, prompt = SamplingParams(), [1, 5, 9, 13, 17]
    plain = [t for e in plain_steps(model, prompt, greedy, 16) for t in e.tokens]
    events = speculative_steps(model, prompt, greedy, 16, drafter.new_session(), num_draft=3)
    assert [t for e in events for t in e.tokens] == plain


def test_a_drafter_trained_without_thinking_is_said_at_start(tmp_path, checkpoints):
    """z-lab's Qwen3 DFlash drafters were trained on answers without thinking (their
    model cards say so), and Qwen3's template thinks by default."""
    model = tmp_path / "qwen3"
    shutil.copytree(checkpoints["qwen3"], model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (FIXTURES / "qwen3-template" / "chat_template.jinja").read_text()
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    cache = tmp_path / "hub"
    fake_hub_cache(cache, "mlx-community/Qwen3-8B-4bit", model)
    fake_hub_cache(cache, "z-lab/Qwen3-8B-DFlash-b16", FIXTURES / "dflash" / "b16")
    proc = generate("qwen3-8b", "dflash", tmp_path / "home", env={"HF_HUB_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr
    assert "z-lab/Qwen3-8B-DFlash-b16 was trained on answers given without thinking" in proc.stderr
    assert "--no-think" in proc.stderr
    assert json.loads(proc.stdout)["identical_to_plain"] is True


def test_the_targets_revision_is_not_the_drafters(tmp_path, checkpoints):
    """`--revision` picks the target's commit, `--drafter-revision` the drafter repo's."""
    cache = tmp_path / "hub"
    fake_hub_cache(cache, "tiny/qwen3", checkpoints["qwen3"], revisions=("main", "v1"))
    fake_hub_cache(cache, "AngelSlim/Qwen3-8B_eagle3", TORCH / "eagle3-angelslim", revisions=("main", "d1"))
    env, home = {"HF_HUB_CACHE": str(cache)}, tmp_path / "home"
    spec = "eagle3=AngelSlim/Qwen3-8B_eagle3"
    proc = generate("tiny/qwen3", spec, home, "--revision", "v1", env=env)
    assert proc.returncode == 0, proc.stderr
    proc = generate("tiny/qwen3", spec, home, "--revision", "v1", "--drafter-revision", "d1", env=env)
    assert proc.returncode == 0, proc.stderr
    proc = generate("tiny/qwen3", spec, home, "--drafter-revision", "v1", env=env)
    assert proc.returncode == 2 and "AngelSlim/Qwen3-8B_eagle3 at revision 'v1'" in proc.stderr, proc.stderr


def test_a_draft_model_in_pytorch_form(tmp_path, checkpoints):
    """A draft model published as `pytorch_model.bin` (tests/fixtures/torch/llama, bf16, a
    module's state_dict as transformers saves it) with its tokenizer: converted on first use."""
    folder = tmp_path / "draft"
    shutil.copytree(TORCH / "llama", folder)
    for f in checkpoints["llama"].glob("tokenizer*"):  # the target's own vocabulary
        shutil.copy(f, folder)
    home = tmp_path / "home"
    first = generate(checkpoints["llama"], f"draft={folder}", home)
    assert first.returncode == 0 and f"converting {folder} for --drafter draft, once" in first.stderr, first.stderr
    assert json.loads(first.stdout)["identical_to_plain"] is True
    second = generate(checkpoints["llama"], f"draft={folder}", home)
    assert second.returncode == 0 and "converting" not in second.stderr, second.stderr


def test_the_chat_says_what_it_converts(tmp_path, checkpoints):
    """Piped `mlx-spec chat`: the conversion's line on stderr, the answer on stdout."""
    import os
    import subprocess
    import sys

    args = [sys.executable, "-m", "mlx_spec.cli", "chat", "--model", str(checkpoints["qwen3"]), "--drafter",
            f"eagle3={TORCH / 'eagle3-angelslim'}", "--max-tokens", "4"]
    proc = subprocess.run(args, input="hello\n", capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MLX_SPEC_HOME": str(tmp_path / "home")})
    assert proc.returncode == 0, proc.stderr
    assert f"converting {TORCH / 'eagle3-angelslim'} for --drafter eagle3, once" in proc.stderr
    assert proc.stdout.strip()
