"""Where an answer stops (every EOS id the checkpoint declares, `--extra-eos-token`)
and how the prompt is rendered (`--think/--no-think`, `--chat-template-args`)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import assert_one_line_error, cli_here, rendered_prompt
from mlx_spec.decoding import plain_steps
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams
from mlx_spec.tokenizer import encode_prompt, load_tokenizer
from test_chat import thinking_model  # noqa: F401  (a fixture: a tiny Qwen3 with Qwen3's chat template)

PROMPT = "Hello fox"


@pytest.fixture
def target(tmp_path, checkpoints):
    """A fresh copy of a tiny Qwen3, to give its own generation config."""
    return shutil.copytree(checkpoints["qwen3"], tmp_path / "qwen3")


def greedy(path, n: int = 12) -> list[int]:
    """The raw prompt's greedy continuation, past any EOS."""
    model, _ = load_model(str(path))
    ids = encode_prompt(load_tokenizer(path), PROMPT, chat_template=False)
    return [e.tokens[0] for e in plain_steps(model, ids, SamplingParams(), n)]


def generate(path, *flags) -> str:
    proc = cli_here("generate", "--model", path, "--prompt", PROMPT, "--no-chat-template", "--max-tokens", 12, *flags)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def first_new(tokens: list[int], start: int) -> int:
    """The first position from `start` on whose token the answer has not produced before."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def test_every_eos_id_of_the_generation_config_stops_the_answer(target):
    tokenizer = load_tokenizer(target)
    full = greedy(target)
    own_eos = tokenizer.eos_token_id
    assert own_eos not in full  # the tokenizer's own EOS alone never stops this answer
    stop = first_new(full, 2)  # the third token, unless an earlier one repeats it
    # As Qwen3's generation config: the tokenizer's EOS first, then another.
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [own_eos, full[stop]]}))
    assert generate(target) == tokenizer.decode(full[:stop]) + "\n"


def test_config_json_eos_list_counts_when_there_is_no_generation_config(target):
    full = greedy(target)
    stop = first_new(full, 3)
    config = json.loads((target / "config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], full[stop]]
    (target / "config.json").write_text(json.dumps(config))
    data = json.loads(generate(target, "--json"))
    assert data["tokens"] == full[:stop] and data["finish_reason"] == "stop"


def test_a_bad_eos_token_id_is_named(target, in_process):
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": "<|im_end|>"}))
    assert_one_line_error(in_process("generate", "--model", target, "--prompt", "x"), "generation_config.json",
                          "eos_token_id")


def test_extra_eos_token_stops_at_a_token_or_an_id(target, in_process):
    tokenizer = load_tokenizer(target)
    full = greedy(target)
    at_token, at_id = first_new(full, 2), first_new(full, 3)
    token = tokenizer.convert_ids_to_tokens(full[at_token])
    assert generate(target, "--extra-eos-token", token) == tokenizer.decode(full[:at_token]) + "\n"
    # several at once (mlx-lm's form) and repeated: the earliest stops it
    both = generate(target, "--extra-eos-token", str(full[at_id]), "--extra-eos-token", token)
    assert both == tokenizer.decode(full[:at_token]) + "\n"
    assert generate(target, "--extra-eos-token", str(full[at_id])) == tokenizer.decode(full[:at_id]) + "\n"
    for bad in ("<|no such token|>", "99999"):
        assert_one_line_error(in_process("generate", "--model", target, "--prompt", "x", "--extra-eos-token", bad),
                              "--extra-eos-token", bad)


def test_extra_eos_token_stops_the_chat(target):
    tokenizer = load_tokenizer(target)
    model, _ = load_model(str(target))
    ids = encode_prompt(tokenizer, "def f(x):")
    full = [e.tokens[0] for e in plain_steps(model, ids, SamplingParams(), 8)]
    stop = first_new(full, 2)
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_spec.cli", "chat", "--model", str(target), "--max-tokens", "8",
         "--extra-eos-token", str(full[stop])],
        input="def f(x):\n", capture_output=True, text=True, timeout=120,
        env={**os.environ, "MLX_SPEC_HOME": str(target / "home")},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == tokenizer.decode(full[:stop]) + "\n\n"


# --- the chat template's arguments --------------------------------------------------

def test_no_think_and_template_args_render_as_transformers_does(monkeypatch, capsys, thinking_model):  # noqa: F811
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(thinking_model))

    def expected(**template_args):
        return reference.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False, **template_args)

    def ours(*flags):
        return rendered_prompt(monkeypatch, "--model", thinking_model, "--prompt", "hello", *flags)

    off = expected(enable_thinking=False)
    assert off != expected()  # the switch changes the prompt
    no_thinking = '{"enable_thinking": false}'
    assert ours("--no-think") == off
    assert ours("--chat-template-args", no_thinking) == off
    assert ours("--no-think", "--chat-template-args", no_thinking) == off
    assert ours("--chat-template-config", no_thinking) == off  # mlx-lm generate's name
    assert ours() == expected()

    # The benchmark renders its prompts the same way.
    from mlx_spec.bench import load_prompts
    from mlx_spec.cli import build_parser

    args = build_parser().parse_args(["bench", "--prompt", "hello", "--no-think"])
    assert load_prompts(args, load_tokenizer(thinking_model)) == [off]
    args = build_parser().parse_args(["bench", "--prompt", "hello"])
    assert load_prompts(args, load_tokenizer(thinking_model), {"enable_thinking": False}) == [off]


def test_the_chat_engine_renders_with_the_template_args(thinking_model):  # noqa: F811
    import threading

    from mlx_spec.tui import engine

    events, done = [], threading.Event()

    def emit(event):
        events.append(event)
        if isinstance(event, (engine.Loaded, engine.Done, engine.Failed)):
            done.set()

    eng = engine.ChatEngine(emit)
    for job in (engine.Load(str(thinking_model)),
                engine.Generate([{"role": "user", "content": "hello"}], max_tokens=2,
                                template_args={"enable_thinking": False})):
        done.clear()
        eng.submit(job)
        assert done.wait(120) and not isinstance(events[-1], engine.Failed), events[-1]
    expected = encode_prompt(load_tokenizer(thinking_model), "hello", template_args={"enable_thinking": False})
    assert eng.state.context[:len(expected)] == expected


@pytest.mark.parametrize("flags, needles", [
    (("--chat-template-args", "{enable_thinking: false}"), ("--chat-template-args", "invalid JSON")),
    (("--chat-template-args", "[1, 2]"), ("--chat-template-args", "JSON object")),
    (("--chat-template-args", '{"tokenize": false}'), ("--chat-template-args", "tokenize")),
    (("--think", "--chat-template-args", '{"enable_thinking": false}'), ("--think", "--chat-template-args")),
])
@pytest.mark.parametrize("command", ["generate", "bench", "chat"])
def test_bad_template_args_are_one_line(checkpoints, command, flags, needles, in_process):
    prompt = ("--prompt", "x") if command == "generate" else ()
    assert_one_line_error(in_process(command, "--model", checkpoints["qwen3"], *prompt, *flags), *needles)
