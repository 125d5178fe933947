"""mlx-lm's flags, where they mean what an mlx-spec flag means, and `--adapter-path`
with adapters written by mlx-lm's own code."""

import json
import shutil

import mlx.core as mx
import pytest

from helpers import assert_one_line_error, cli_here, rendered_prompt
from mlx_spec.cli import build_parser
from mlx_spec.flags import dest, resolve_aliases
from mlx_spec.tokenizer import encode_prompt, load_tokenizer


def resolved(*argv) -> dict:
    """The mlx-spec flags' values once the aliases among `argv` have set them."""
    args = build_parser().parse_args(list(argv))
    resolve_aliases(args)
    aliases = {dest(alias.flag) for alias in args.aliases}
    return {k: v for k, v in vars(args).items() if k not in aliases and k != "aliases"}


@pytest.mark.parametrize("mlx_lm, ours", [
    (("generate", "-p", "hi", "-m", "7", "--ignore-chat-template", "--draft-model", "D", "--num-draft-tokens", "3",
      "--system-prompt", "Be brief."),
     ("generate", "--prompt", "hi", "--max-tokens", "7", "--no-chat-template", "--drafter", "draft=D",
      "--num-draft", "3", "--system", "Be brief.")),
    (("chat", "-m", "9", "--draft-model", "D", "--system-prompt", "Be brief."),
     ("chat", "--max-tokens", "9", "--drafter", "draft=D", "--system", "Be brief.")),
    (("bench", "--draft-model", "D", "--num-draft-tokens", "2", "--ignore-chat-template"),
     ("bench", "--drafters", "draft=D", "--num-draft", "2", "--no-chat-template")),
    (("serve", "--draft-model", "D"), ("serve", "--drafter", "draft=D")),
])
def test_mlx_lm_flags_set_the_mlx_spec_flags(mlx_lm, ours):
    assert resolved(*mlx_lm) == resolved(*ours)
    assert resolved(*ours, *mlx_lm[1:]) == resolved(*ours)  # both spellings, agreeing


@pytest.mark.parametrize("flags, needles", [
    (("--draft-model", "D", "--drafter", "lookup"), ("--draft-model D", "--drafter lookup")),
    (("--num-draft-tokens", "2", "--num-draft", "3"), ("--num-draft-tokens 2", "--num-draft 3")),
    (("--system-prompt", "a", "--system", "b"), ("--system-prompt a", "--system b")),
])
def test_an_alias_and_its_flag_must_agree(flags, needles, in_process):
    assert_one_line_error(in_process("generate", "--prompt", "x", *flags), *needles)


def test_system_prompt_comes_before_the_users_message(monkeypatch, capsys, checkpoints, in_process):
    path = checkpoints["qwen3"]
    tokenizer = load_tokenizer(path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert encode_prompt(tokenizer, "hi", system="Be brief.") == expected != encode_prompt(tokenizer, "hi")
    for flag in ("--system", "--system-prompt"):
        assert rendered_prompt(monkeypatch, "--model", path, "--prompt", "hi", flag, "Be brief.") == expected
    assert_one_line_error(in_process("generate", "--model", path, "--prompt", "x", "--system", "s",
                                     "--no-chat-template"),
                          "--system", "--no-chat-template")


# --- --adapter-path -------------------------------------------------------------------

LORA = {"rank": 4, "scale": 2.0, "dropout": 0.0}


def mlx_lm_adapter(base, out, num_layers: int = 2):
    """LoRA adapters as mlx-lm's trainer saves them, for the last `num_layers` layers
    of `base`: made with mlx-lm's own model and `linear_to_lora_layers`, with
    random B matrices (a fresh LoRA's are zero: it would change nothing)."""
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import save_config

    model, _ = load(str(base))
    model.freeze()
    linear_to_lora_layers(model, num_layers, LORA)
    mx.random.seed(0)
    weights = {k: mx.random.normal(v.shape) * 0.5 if k.endswith("lora_b") else v
               for k, v in tree_flatten(model.trainable_parameters())}
    assert weights and all(k.rsplit(".", 1)[-1] in ("lora_a", "lora_b") for k in weights)
    out.mkdir()
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    save_config({"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": LORA},
                out / "adapter_config.json")
    return out


@pytest.fixture(scope="module")
def adapter(checkpoints, tmp_path_factory):
    return mlx_lm_adapter(checkpoints["qwen3"], tmp_path_factory.mktemp("lora") / "adapters")


def test_adapters_apply_as_mlx_lm_applies_them(checkpoints, adapter):
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from mlx_spec import api

    path = checkpoints["qwen3"]
    ids = encode_prompt(load_tokenizer(path), "Hello fox", chat_template=False)
    ours = api.load(str(path), adapter_path=adapter)
    plain = api.load(str(path))
    reference, _ = mlx_lm_load(str(path), adapter_path=str(adapter))
    for prompt in (ids, ids * 5):  # a few tokens (compiled layers) and many (eager ones)
        logits, _ = ours.model(mx.array([prompt]))
        expected = reference(mx.array([prompt]))
        assert mx.allclose(logits, expected, atol=1e-4).item()
        assert not mx.allclose(logits, plain.model(mx.array([prompt]))[0], atol=1e-2).item()

    def tokens(*flags):
        proc = cli_here("generate", "--model", path, "--prompt", "Hello fox", "--no-chat-template", "--max-tokens", 12,
                   "--json", *flags)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["tokens"]

    theirs = [t for t, _ in generate_step(mx.array(ids), reference, max_tokens=12, sampler=make_sampler(0.0))]
    assert tokens("--adapter-path", adapter) == theirs != tokens()


def test_bad_adapter_folders_are_one_line(checkpoints, adapter, tmp_path, in_process):
    path = checkpoints["qwen3"]

    def broken(name):
        return shutil.copytree(adapter, tmp_path / name)

    def fails(folder, *needles):
        assert_one_line_error(in_process("generate", "--model", path, "--prompt", "x", "--adapter-path", folder),
                              "--adapter-path", *needles)

    fails(tmp_path / "nowhere", "no such folder")
    (broken("no-weights") / "adapters.safetensors").unlink()
    fails(tmp_path / "no-weights", "adapters.safetensors")
    (broken("bad-json") / "adapter_config.json").write_text("{not json")
    fails(tmp_path / "bad-json", "adapter_config.json", "invalid JSON")
    (broken("no-lora") / "adapter_config.json").write_text(json.dumps({"num_layers": 2}))
    fails(tmp_path / "no-lora", "lora_parameters")
    (broken("corrupt") / "adapters.safetensors").write_bytes(b"\x07" * 64)
    fails(tmp_path / "corrupt")
    (broken("rank") / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": {**LORA, "rank": 8}}))
    fails(tmp_path / "rank", "shape")
