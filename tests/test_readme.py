"""Every command the README shows, run as a user would type it, in a shell.

Hub repos come from a local Hugging Face cache holding tiny checkpoints under the
repos' names (`HF_HUB_OFFLINE=1`, as for a user whose cache already holds them):
mlx-community/Qwen3-8B-4bit and z-lab's DFlash drafter for it (the repo's files as
published), Qwen/Qwen3-8B and Qwen/Qwen3-0.6B. What a test changes in a command is
said where it does: the server's port (0: any free one), and the length of the
answers and training runs, the size of the widened demo and of the benchmark run
(flags appended, which argparse reads last).
The set-up commands are .ci/run's own."""

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from conftest import _fast_blas_env
from helpers import fake_hub_cache

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FIXTURES = Path(__file__).parent / "fixtures"


def blocks(language: str = "") -> list[str]:
    """The README's fenced blocks of `language` ("": none given)."""
    found, inside, lines = [], None, []
    for line in README.splitlines():
        if line.startswith("```"):
            if inside is None:
                inside, lines = line[3:].strip(), []
            else:
                if inside == language:
                    found.append("\n".join(lines))
                inside = None
        elif inside is not None:
            lines.append(line)
    return found


COMMANDS = [line for block in blocks() for line in block.splitlines() if line.strip()]
PYTHON = blocks("python")


def command(start: str) -> str:
    """The one README command that starts with `start`."""
    found = [c for c in COMMANDS if c.startswith(start)]
    assert len(found) == 1, (start, found)
    return found[0]


SETUP = ['python3 -m pip install -e ".[test]"', "python3 -m pytest -q"]
RUN_HERE = {  # each README command, and the test that runs it
    'mlx-spec generate --model qwen3 --drafter dflash': "test_generate_with_a_published_drafter",
    "mlx-spec generate --no-chat-template": "test_the_demo",
    "mlx-spec chat --model qwen3": "test_chat",
    "mlx-spec serve --model qwen3": "test_serve_and_the_openai_client",
    "mlx-spec convert Qwen/Qwen3-0.6B": "test_convert",
    "mlx-spec distill": "test_distill_then_draft",
    "mlx-spec generate --model Qwen/Qwen3-8B --drafter draft=student": "test_distill_then_draft",
    "mlx-spec train eagle3": "test_train_then_draft",
    "mlx-spec generate --model Qwen/Qwen3-8B --drafter eagle3=eagle3": "test_train_then_draft",
    "python3 scripts/widen_demo.py widened": "test_the_speed_table_command",
    "mlx-spec bench --model widened/target": "test_the_speed_table_command",
}


def test_every_command_is_run_here():
    assert COMMANDS[:2] == SETUP
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-2:] == SETUP  # CI runs exactly these
    for line in COMMANDS[2:]:
        assert sum(line.startswith(start) for start in RUN_HERE) == 1, f"a README command no test runs: {line}"


@pytest.fixture(scope="module")
def hub(tmp_path_factory, checkpoints) -> dict:
    """The environment of a user whose Hugging Face cache holds the README's repos."""
    from tiny import make_checkpoint

    root = tmp_path_factory.mktemp("readme")
    cache = root / "hub"
    big = dict(hidden_size=128, head_dim=32, intermediate_size=256)  # quantizable in groups of 64
    fake_hub_cache(cache, "mlx-community/Qwen3-8B-4bit", checkpoints["qwen3"])
    fake_hub_cache(cache, "z-lab/Qwen3-8B-DFlash-b16", FIXTURES / "dflash" / "b16")
    fake_hub_cache(cache, "Qwen/Qwen3-8B", make_checkpoint(root / "qwen3-8b", "qwen3", seed=5, num_hidden_layers=6, **big))
    fake_hub_cache(cache, "Qwen/Qwen3-0.6B", make_checkpoint(root / "qwen3-0.6b", "qwen3", seed=6, **big))
    # (OpenBLAS as a user has it: nothing here asserts bit-exactness)
    return {**_fast_blas_env(), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "MLX_SPEC_HOME": str(root / "home"),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def shell(line: str, cwd: Path, env: dict, stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, input=stdin, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{line}\n{proc.stderr}"
    return proc


def test_generate_with_a_published_drafter(hub, tmp_path):
    out = shell(command("mlx-spec generate --model qwen3 --drafter dflash") + ANSWER, tmp_path, hub)
    assert out.stdout.strip()


def test_the_demo(tmp_path):
    out = shell(command("mlx-spec generate --no-chat-template") + ANSWER, tmp_path, os.environ)
    assert "def " in out.stdout and "identical to plain: True" in out.stdout + out.stderr


def test_chat(hub, tmp_path):
    out = shell(command("mlx-spec chat --model qwen3"), tmp_path, hub, stdin="Hello!\n")
    assert out.stdout.strip()


def test_serve_and_the_openai_client(hub, tmp_path):
    line = command("mlx-spec serve --model qwen3").replace("--port 8080", "--port 0")
    server = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=tmp_path, env=hub, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        banner = server.stdout.readline()
        port = re.search(r"http://127\.0\.0\.1:(\d+)/v1", banner)
        assert port, banner + server.stderr.read()
        client = next(code for code in PYTHON if "OpenAI(" in code).replace(":8080/", f":{port.group(1)}/")
        scope: dict = {}
        exec(client, scope)  # the README's client, as written
        reply = scope["client"].chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "Hi"}],
                                                        max_tokens=8)
        assert reply.choices[0].message.content is not None and reply.usage.completion_tokens > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/health") as health:
            assert json.load(health) == {"status": "ok"}
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(60) == 0


def test_convert(hub, tmp_path):
    shell(command("mlx-spec convert Qwen/Qwen3-0.6B"), tmp_path, hub)
    config = json.loads((tmp_path / "qwen3-0.6b-4bit" / "config.json").read_text())
    assert config["quantization"]["bits"] == 4


SHORT = " --steps 8 --batch-size 2 --seq-len 64"  # a training run's length, cut
ANSWER = " --max-tokens 48"  # an answer's length, cut


def write_data(folder: Path) -> None:
    from tiny import CORPUS

    rows = [{"prompt": line, "completion": CORPUS} for line in CORPUS.splitlines() if line.strip()]
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 4))


def test_distill_then_draft(hub, tmp_path):
    write_data(tmp_path)
    shell(command("mlx-spec distill") + SHORT, tmp_path, hub)
    out = shell(command("mlx-spec generate --model Qwen/Qwen3-8B --drafter draft=student") + ANSWER, tmp_path, hub)
    assert out.stdout.strip()


def test_train_then_draft(hub, tmp_path):
    write_data(tmp_path)
    shell(command("mlx-spec train eagle3") + SHORT, tmp_path, hub)
    out = shell(command("mlx-spec generate --model Qwen/Qwen3-8B --drafter eagle3=eagle3") + ANSWER, tmp_path, hub)
    assert out.stdout.strip()


def test_the_speed_table_command(tmp_path):
    """At a small size: the widening's shape and the run's length are cut by flags appended."""
    env = {**_fast_blas_env(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    widen = command("python3 scripts/widen_demo.py widened").replace("scripts/", f"{ROOT}/scripts/")
    shell(f"{widen} --hidden 256 --heads 4 --intermediate 768 --layers 8", tmp_path, env)
    bench = command("mlx-spec bench --model widened/target")
    out = shell(f"{bench} --num-prompts 1 --max-tokens 8 --repeats 1 --temps 0 --concurrency 1 --no-mlx-lm", tmp_path, env)
    assert "draft=widened/student" in out.stdout and "lookup" in out.stdout


def test_the_python_example(capsys):
    """The Python API example, as written, on the demo."""
    (code,) = [code for code in PYTHON if "from mlx_spec import api" in code and "register(" not in code]
    exec(compile(code, "README.md", "exec"), {})
    text, stats = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    assert text.startswith("def ") and "tokens per target forward" in stats
    assert float(stats.split()[0]) > 1.0  # EAGLE-3's drafts were accepted


def test_the_drafter_added_there():
    """The "Add a drafter" example, as written: a kind registered and decoded with."""
    from mlx_spec.drafters import REGISTRY

    (code,) = [code for code in PYTHON if "register(" in code]
    try:
        exec(compile(code, "README.md", "exec"), {})
        assert "repeat" in REGISTRY
    finally:
        REGISTRY.pop("repeat", None)
