"""Hostile command lines and config files, through the real CLI under an address-space limit:
each is refused with one line naming the flag (or the file and field) and exit code 2, or,
where it is valid, runs in bounded memory."""

import json
import os
import resource
import shutil
import subprocess
import sys

import pytest

from helpers import assert_one_line_error, cli_bounded
from tiny import make_checkpoint

ADDRESS_SPACE = 1536 << 20  # as cli_bounded's: for the runs that need stdin or a live process


@pytest.fixture
def broken(tmp_path, checkpoints):
    """A fresh copy of a good checkpoint, and a function that rewrites fields of its config.json."""
    dst = tmp_path / "broken"
    shutil.copytree(checkpoints["qwen3"], dst)

    def with_fields(**fields):
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, **fields}))
        return dst

    return with_fields


def generate(model, *flags):
    return cli_bounded("generate", "--model", model, "--prompt", "x", "--max-tokens", "2", *flags)


@pytest.mark.parametrize("flag, value", [
    ("--max-tokens", "1e9"), ("--max-tokens", "1000000000000000"), ("--temp", "nan"), ("--temp", "inf"),
    ("--temp", "-1"), ("--top-p", "0"), ("--top-p", "1.5"), ("--min-p", "2"), ("--seed", "-1"),
    ("--seed", str(2**64)), ("--num-draft", "0"),
])
def test_generate_refuses_a_numeric_flag_out_of_range(checkpoints, flag, value):
    assert_one_line_error(generate(checkpoints["qwen3"], flag, value), flag, value)


@pytest.mark.parametrize("command, flag, value", [
    ("chat", "--temp", "nan"), ("chat", "--top-p", "2"), ("bench", "--max-tokens", "1e15"), ("bench", "--temps", "inf"),
    ("serve", "--port", "70000"), ("serve", "--timeout", "1e300"), ("serve", "--max-tokens", "99999999999"),
    ("serve", "--read-timeout", "0"), ("serve", "--read-timeout", "nan"),
])
def test_chat_bench_and_serve_refuse_a_numeric_flag_out_of_range(command, flag, value):
    assert_one_line_error(cli_bounded(command, "--model", "demo", flag, value), flag, value)


def test_prompt_and_max_tokens_beyond_the_context_are_refused(checkpoints):
    model = checkpoints["qwen3"]  # max_position_embeddings 4096
    assert_one_line_error(generate(model, "--max-tokens", "1000000000"), "--max-tokens", "1000000000", "4096")
    long = cli_bounded("generate", "--model", model, "--prompt", "word " * 3000, "--max-tokens", "8")
    assert_one_line_error(long, "--max-tokens", "context of 4096 tokens")
    bench = cli_bounded("bench", "--model", model, "--prompt", "word " * 3000, "--max-tokens", "8")
    assert_one_line_error(bench, "--prompt", "--max-tokens", "context of 4096 tokens")


def _bounded():
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def test_chat_checks_the_conversation_against_the_context(checkpoints, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mlx_spec.cli", "chat", "--model", str(checkpoints["qwen3"]),
                           "--max-tokens", "5000"], input="hello\n", capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MLX_SPEC_HOME": str(tmp_path)}, preexec_fn=_bounded)
    assert_one_line_error(proc, "--max-tokens", "5000", "context of 4096 tokens")


def test_a_huge_max_tokens_decodes_in_bounded_memory(tmp_path):
    """3,000,000 tokens of KV cache would take 3 GB here (2 layers, 4 KV heads of 16, float32):
    the run decodes under a 1.5 GB address space, the cache growing as it goes."""
    model = make_checkpoint(tmp_path / "long", "qwen3", num_key_value_heads=4, max_position_embeddings=4_000_000)
    proc = subprocess.Popen([sys.executable, "-m", "mlx_spec.cli", "generate", "--model", str(model),
                             "--prompt", "hi", "--max-tokens", "3000000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_bounded)
    try:
        out = b""
        while len(out) < 1000 and proc.poll() is None:
            out += os.read(proc.stdout.fileno(), 4096)
        assert proc.poll() is None, proc.stderr.read().decode()  # still decoding, thousands of tokens in
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("fields, needle", [
    ({"hidden_size": -64}, "'hidden_size'"), ({"hidden_size": "64"}, "'hidden_size'"),
    ({"hidden_size": None}, "'hidden_size'"), ({"num_attention_heads": 0}, "'num_attention_heads'"),
    ({"rms_norm_eps": "1e-6"}, "'rms_norm_eps'"), ({"num_hidden_layers": -2}, "'num_hidden_layers'"),
    # an mlx-lm family: the same checks run before mlx-lm reads the config
    ({"model_type": "mixtral", "hidden_size": -1}, "'hidden_size'"),
])
def test_a_malformed_config_field_is_named(broken, fields, needle):
    assert_one_line_error(generate(broken(**fields)), "config.json", needle)


def test_a_config_json_that_is_a_directory_or_not_json(broken):
    model = broken()
    (model / "config.json").unlink()
    (model / "config.json").mkdir()
    assert_one_line_error(generate(model), "config.json", "directory")
    (model / "config.json").rmdir()
    (model / "config.json").write_text('{"model_type": "qwen3", ')
    assert_one_line_error(generate(model), "config.json", "invalid JSON")
