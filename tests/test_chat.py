"""`mlx-spec chat`: the Textual app driven by Pilot, the engine's turns, the
line mode, and the real program in a terminal."""

import asyncio
import json
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from mlx_spec.tui import engine, store
from mlx_spec.tui.app import Answer, ChatApp


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


async def until(pilot, predicate, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await pilot.pause(0.05)


async def send(pilot, app, text: str) -> None:
    await until(pilot, lambda: app.engine.idle())
    app.query_one("#prompt").insert(text)
    await pilot.press("enter")
    await until(pilot, lambda: not app.busy and app.engine.idle())


def answers(app) -> list[str]:
    return [m["content"] for m in app.conversation.messages if m["role"] == "assistant"]


def run_app(app, script):
    async def main():
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.engine.idle())
            await script(pilot)
    asyncio.run(main())


def test_a_message_streams_in_and_the_stats_update(checkpoints, home):
    app = ChatApp(str(checkpoints["qwen3"]), "lookup", max_tokens=24)
    streamed = []

    async def script(pilot):
        original = app.on_engine
        app.on_engine = lambda event: (streamed.append(event), original(event))[1]
        await send(pilot, app, "hello there")
        assert sum(isinstance(e, engine.Piece) for e in streamed) > 1  # token by token
        stats = str(app.query_one("#stats").render())
        assert "tok/s" in stats and "Last answer" in stats and "Session" in stats
        assert len(answers(app)) == 1 and answers(app)[0]
        # saved, atomically, after the answer
        saved = json.loads(app.path.read_text())
        assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]

    run_app(app, script)


def test_escape_stops_the_answer_and_keeps_it(checkpoints):
    app = ChatApp(str(checkpoints["qwen3"]), max_tokens=5000)

    async def script(pilot):
        app.query_one("#prompt").insert("write forever")
        await pilot.press("enter")
        await until(pilot, lambda: app.answer is not None and len(app.answer.pieces) >= 3)
        await pilot.press("escape")
        await until(pilot, lambda: not app.busy)
        kept = answers(app)
        assert len(kept) == 1 and kept[0] and len(kept[0]) < 5000
        assert "stopped" in str(app.query_one("#stats").render())
        app.max_tokens = 12
        await send(pilot, app, "and again")  # the chat goes on after a stop
        assert len(answers(app)) == 2

    run_app(app, script)


def test_switching_drafter_mid_conversation_keeps_the_plain_output(checkpoints):
    turns = ["first question", "second one", "third"]
    switches = [None, "lookup", f"draft={checkpoints['llama']}"]

    def conversation(switch: bool) -> list[str]:
        app = ChatApp(str(checkpoints["qwen3"]), max_tokens=20)

        async def script(pilot):
            for text, drafter in zip(turns, switches):
                if switch and drafter:
                    app.query_one("#prompt").insert(f"/drafter {drafter}")
                    await pilot.press("enter")
                    await until(pilot, lambda: app.engine.idle() and app.conversation.drafter == drafter)
                await send(pilot, app, text)

        run_app(app, script)
        return answers(app)

    assert conversation(switch=True) == conversation(switch=False)


def test_engine_reuses_the_cache_across_turns(checkpoints):
    events = []
    done = []
    eng = engine.Engine(lambda e: (events.append(e), isinstance(e, (engine.Done, engine.Failed, engine.Loaded))
                                   and done.append(e)))
    eng.submit(engine.Load(str(checkpoints["qwen3"])))
    messages = [{"role": "user", "content": "hello"}]
    eng.submit(engine.Generate(messages, max_tokens=12))
    deadline = time.monotonic() + 60
    while len(done) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first = done[-1]
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}]
    eng.submit(engine.Generate(messages, max_tokens=12))
    while len(done) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    second = done[-1]
    assert isinstance(second, engine.Done) and second.reused_tokens > first.prompt_tokens // 2


def test_export_and_load(checkpoints, tmp_path):
    app = ChatApp(str(checkpoints["qwen3"]), max_tokens=12)
    md, js = tmp_path / "chat.md", tmp_path / "chat.json"

    async def script(pilot):
        await send(pilot, app, "a question")
        for path in (md, js):
            app.query_one("#prompt").insert(f"/export {path}")
            await pilot.press("enter")
        app.query_one("#prompt").insert("/clear")
        await pilot.press("enter")
        assert app.conversation.messages == []
        app.query_one("#prompt").insert(f"/load {js}")
        await pilot.press("enter")
        await until(pilot, lambda: len(app.query(Answer)) == 1)
        assert [m["role"] for m in app.conversation.messages] == ["user", "assistant"]

    run_app(app, script)
    text = md.read_text()
    assert "## User" in text and "a question" in text and "## Assistant" in text
    loaded = store.load(js)
    assert loaded.messages[0]["content"] == "a question"


def test_errors_show_in_the_app(checkpoints, tmp_path):
    app = ChatApp(str(checkpoints["qwen3"]), max_tokens=12)

    async def script(pilot):
        for line in ("/drafter nosuch", "/temp hot", f"/load {tmp_path / 'missing.json'}", "/frobnicate"):
            app.query_one("#prompt").insert(line)
            await pilot.press("enter")
            await until(pilot, lambda: app.engine.idle())
            await pilot.pause(0.1)
        errors = [str(w.render()) for w in app.query(".error")]
        assert len(errors) == 4, errors
        assert "unknown kind 'nosuch'" in errors[0] and "/temp" in errors[1]
        assert "missing.json" in errors[2] and "/frobnicate" in errors[3]
        await send(pilot, app, "still works")
        assert len(answers(app)) == 1

    run_app(app, script)


def test_unknown_model_shows_an_error_in_the_app(tmp_path):
    app = ChatApp(str(tmp_path / "nosuch"))

    async def script(pilot):
        await until(pilot, lambda: len(app.query(".error")) == 1)
        assert "nosuch" in str(app.query_one(".error").render())

    run_app(app, script)


def test_without_a_terminal_it_reads_lines(checkpoints, home):
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_spec.cli", "chat", "--model", str(checkpoints["qwen3"]), "--max-tokens", "8"],
        input="hello\n\nsecond\n", capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n\n") >= 2
    (saved,) = (home / "conversations").iterdir()
    assert [m["role"] for m in json.loads(saved.read_text())["messages"]] == ["user", "assistant"] * 2


ANSI = re.compile(r"\x1b\[[0-9;?<>=]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>NOPMc78]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)")


def _screen_text(raw: bytes) -> str:
    return ANSI.sub("", raw.decode("utf-8", "replace"))


def _chat_in_a_terminal(model: str, home) -> tuple[int, str]:
    pid, fd = pty.fork()
    if pid == 0:  # the child: the real program, in a 120x40 terminal
        os.environ.update(MLX_SPEC_HOME=str(home), COLUMNS="120", LINES="40", TERM="xterm-256color")
        os.execvp(sys.executable, [sys.executable, "-m", "mlx_spec.cli", "chat", "--model", model,
                                   "--max-tokens", "8"])
    raw = b""
    status = None

    def read_until(done, what: str, timeout: float = 60) -> None:
        nonlocal raw
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"{what}; the screen: {_screen_text(raw)[-2000:]}"
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                try:
                    raw += os.read(fd, 65536)
                except OSError:  # the program closed the terminal
                    pass

    def exited() -> bool:
        nonlocal status
        done, status = os.waitpid(pid, os.WNOHANG)
        return done != 0

    read_until(lambda: "drafter: none" in _screen_text(raw), "not loaded")
    os.write(fd, b"hello")
    time.sleep(0.2)
    os.write(fd, b"\r")
    read_until(lambda: "tok/s" in _screen_text(raw), "no answer")  # answered, stats drawn
    os.write(fd, b"\x11")  # Ctrl+Q
    read_until(exited, "did not quit", timeout=30)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), _screen_text(raw)


def test_the_real_program_in_a_terminal_twenty_times(checkpoints, home):
    for i in range(20):
        code, screen = _chat_in_a_terminal(str(checkpoints["qwen3"]), home)
        assert code == 0, (i, code, screen[-2000:])
        assert "Last answer" in screen and "hello" in screen
    assert len(list((home / "conversations").iterdir())) == 20
