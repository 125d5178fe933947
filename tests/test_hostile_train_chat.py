"""Hostile resumes and chats, through the real CLI: `--resume` refuses a checkpoint that is not
this run's, naming both values; a chat's file is never another chat's, holds the user's message
as soon as it is sent, and `--load` works without a terminal and refuses a damaged file."""

import json
import os
import resource
import shutil
import subprocess
import sys
import time

import pytest

from conftest import _fast_blas_env
from helpers import assert_one_line_error, cli

ADDRESS_SPACE = 1536 << 20  # as helpers.cli_bounded's


def _bounded():
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


# --- training ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory, checkpoints):
    """A 3-step `train medusa --heads 2` run, and how to run that command again on a copy of it."""
    root = tmp_path_factory.mktemp("medusa")
    with open(root / "train.jsonl", "w") as f:
        f.writelines(json.dumps({"text": f"def greet(name): return {i} * name"}) + "\n" for i in range(40))

    def medusa(out, *flags):
        return cli("train", "medusa", "--target", checkpoints["qwen3"], "--data", root / "train.jsonl", "-o", out,
                   "--batch-size", "2", "--seq-len", "16", "--warmup", "1", "--quiet", *flags, env=_fast_blas_env())

    proc = medusa(root / "run", "--heads", "2", "--steps", "3")
    assert proc.returncode == 0, proc.stderr
    return root / "run", medusa


@pytest.fixture
def run(trained, tmp_path):
    """A fresh copy of the trained run, to resume (or damage), and the command."""
    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    return out, trained[1]


def test_resume_with_other_heads_names_both_values(run):
    out, medusa = run
    assert_one_line_error(medusa(out, "--resume", "--heads", "3", "--steps", "4"), "--heads 2", "--heads 3")


def test_resume_with_another_lr_is_refused_and_with_the_same_settings_goes_on(run):
    out, medusa = run
    assert_one_line_error(medusa(out, "--resume", "--heads", "2", "--steps", "4", "--lr", "0.5"), "--lr 0.001", "--lr 0.5")
    assert medusa(out, "--resume", "--heads", "2", "--steps", "4").returncode == 0


def test_resume_checks_shapes_where_the_checkpoint_kept_no_settings(run):
    out, medusa = run
    state = out / "checkpoint" / "state.json"
    saved = json.loads(state.read_text())
    del saved["config"]["settings"]  # as a checkpoint from before settings were kept
    state.write_text(json.dumps(saved))
    assert_one_line_error(medusa(out, "--resume", "--heads", "3", "--steps", "4"), "heads.2.", "absent")


def test_resume_refuses_a_state_without_a_step_or_damaged(run):
    out, medusa = run
    state = out / "checkpoint" / "state.json"
    saved = json.loads(state.read_text())
    state.write_text(json.dumps({k: v for k, v in saved.items() if k != "step"}))
    assert_one_line_error(medusa(out, "--resume", "--heads", "2", "--steps", "4"), "state.json", "'step'")
    state.write_text('{"step": ')
    assert_one_line_error(medusa(out, "--resume", "--heads", "2", "--steps", "4"), "checkpoint")


def test_resume_refuses_optimizer_state_of_another_shape(run):
    import mlx.core as mx

    out, medusa = run
    path = out / "checkpoint" / "optimizer.safetensors"
    state = mx.load(str(path))
    key = next(k for k in sorted(state) if k.endswith(".m") and state[k].ndim == 2)
    state[key] = state[key][:, :-1]
    mx.save_safetensors(str(path), state)
    assert_one_line_error(medusa(out, "--resume", "--heads", "2", "--steps", "4"), "optimizer.safetensors", key)


def test_resume_refuses_a_step_beyond_steps(run):
    out, medusa = run
    before = (out / "model.safetensors").read_bytes()
    assert_one_line_error(medusa(out, "--resume", "--heads", "2", "--steps", "2"), "step 3", "--steps 2")
    assert (out / "model.safetensors").read_bytes() == before  # nothing exported as final


# --- chat ------------------------------------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "conversations"


def chat(model, *flags, max_tokens=6) -> subprocess.Popen:
    """`mlx-spec chat` without a terminal (lines on stdin), under the address-space limit."""
    return subprocess.Popen([sys.executable, "-m", "mlx_spec.cli", "chat", "--model", str(model),
                             "--max-tokens", str(max_tokens), *flags],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_bounded)


def messages(path) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in json.loads(path.read_text())["messages"]]


def test_chats_started_in_the_same_second_keep_their_own_files(checkpoints, home):
    """Another chat already holds this minute's names: two chats started together take new ones."""
    home.mkdir(parents=True)
    now = time.time()
    taken = {home / time.strftime("%Y%m%dT%H%M%S.json", time.localtime(now + s)): f"held {s}" for s in range(-2, 60)}
    for path, text in taken.items():
        path.write_text(text)
    procs = [chat(checkpoints["qwen3"]) for _ in range(2)]
    for i, proc in enumerate(procs):
        proc.stdin.write(f"message {i}\n")
        proc.stdin.close()
    for proc in procs:
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
    assert all(path.read_text() == text for path, text in taken.items())
    new = sorted(set(home.glob("*.json")) - taken.keys())
    assert sorted(messages(path)[0] for path in new) == [("user", "message 0"), ("user", "message 1")]


def test_the_message_is_saved_when_sent_and_survives_kill_9(checkpoints, home):
    proc = chat(checkpoints["qwen3"], max_tokens=4000)  # an answer of many seconds
    try:
        proc.stdin.write("remember me\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 120
        while not list(home.glob("*.json")):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        os.read(proc.stdout.fileno(), 1)  # the answer has begun
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    (saved,) = home.glob("*.json")
    assert messages(saved) == [("user", "remember me")]


def test_load_without_a_terminal_goes_on_with_the_conversation(checkpoints, home, tmp_path):
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"model": "x", "messages": [{"role": "user", "content": "first"},
                                                              {"role": "assistant", "content": "an answer"}]}))
    proc = chat(checkpoints["qwen3"], "--load", saved)
    out, err = proc.communicate("second\n", timeout=120)
    assert proc.returncode == 0, err
    roles = [role for role, _ in messages(saved)]
    assert messages(saved)[:3] == [("user", "first"), ("assistant", "an answer"), ("user", "second")]
    assert roles == ["user", "assistant"] * 2 and not home.exists()  # saved where it was loaded from


@pytest.mark.parametrize("content, needle", [
    ('{"messages": [', "invalid JSON"), ('{"messages": "no"}', "'messages'"), ("[" * 100_000, "nested"),
], ids=["truncated", "not-messages", "nested-100k-deep"])
def test_load_refuses_a_damaged_file(checkpoints, home, tmp_path, content, needle):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    proc = chat(checkpoints["qwen3"], "--load", bad)
    out, err = proc.communicate("hello\n", timeout=120)
    assert_one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), "bad.json", needle)
