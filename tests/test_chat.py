"""`mlx-spec chat`: what the Textual app draws (read from the rendered screen,
never from the app's state), the engine's turns, the line mode, and the real
program in a terminal.

The answers drawn are checked against what `mlx-spec generate` prints for the
same message at temperature 0, on the demo (whose answers are bare Python)."""

import asyncio
import json
import os
import pty
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import screen
from helpers import cli_here
from mlx_spec.tui import engine, store
from mlx_spec.tui.app import ChatApp

MESSAGE = "Write a Python function `is_prime`: Return True if n is a prime number."
MAX_TOKENS = 60
QWEN3_TEMPLATE = Path(__file__).parent / "fixtures" / "qwen3-template" / "chat_template.jinja"


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def generated() -> str:
    """What `mlx-spec generate` prints for MESSAGE on the demo, greedy."""
    proc = cli_here("generate", "--prompt", MESSAGE, "--max-tokens", MAX_TOKENS)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") > 3  # several lines of code
    return proc.stdout.removesuffix("\n")


async def until(pilot, predicate, what: str = "timed out", timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what() if callable(what) else what
        await pilot.pause(0.05)


async def send(pilot, app, text: str) -> None:
    await until(pilot, lambda: app.engine.idle())
    app.query_one("#prompt").insert(text)
    await pilot.press("enter")
    await until(pilot, lambda: not app.busy and app.engine.idle())


async def drawn(pilot, app, text: str, exact_lines: bool = True) -> None:
    """Wait until the conversation pane draws `text` (each of its lines as it
    is, indentation included, when `exact_lines`)."""
    def ok():
        rows = screen.lines(app)
        return screen.shows(rows, text) and (not exact_lines or not screen.shows_lines(rows, text))
    await until(pilot, ok, lambda: "not drawn:\n" + text + "\n--- the pane:\n" + "\n".join(screen.lines(app)),
                timeout=20)


def answers(app) -> list[str]:
    return [m["content"] for m in app.conversation.messages if m["role"] == "assistant"]


def run_app(app, script, size=(120, 40)):
    async def main():
        async with app.run_test(size=size) as pilot:
            await until(pilot, lambda: app.engine.idle())
            await script(pilot)
    asyncio.run(main())


def hold_after(app, pieces: int) -> tuple[list, threading.Event]:
    """Stop the engine after it has sent `pieces` pieces (until the event is set);
    returns the events sent so far and the event."""
    events, gate = [], threading.Event()
    emit = app.engine.emit

    def held(event):
        emit(event)
        events.append(event)
        if isinstance(event, engine.Piece) and sum(isinstance(e, engine.Piece) for e in events) == pieces:
            gate.wait(120)
    app.engine.emit = held
    return events, gate


def text_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, engine.Piece))


# --- what the conversation pane draws ---------------------------------------------

@pytest.mark.parametrize("colors", [False, True], ids=["plain", "colours"])
def test_the_answer_is_drawn_while_it_streams(generated, colors):
    app = ChatApp("demo", "eagle3", max_tokens=MAX_TOKENS)

    async def script(pilot):
        if colors:
            await pilot.press("f2")
        events, gate = hold_after(app, 25)
        app.query_one("#prompt").insert(MESSAGE)
        await pilot.press("enter")
        await until(pilot, lambda: sum(isinstance(e, engine.Piece) for e in events) >= 25)
        so_far = text_of(events)
        assert generated.startswith(so_far) and len(so_far) < len(generated)
        complete = so_far[:so_far.rfind("\n")]  # its finished lines, drawn as they are
        await drawn(pilot, app, complete)
        await drawn(pilot, app, so_far, exact_lines=False)
        gate.set()
        await until(pilot, lambda: not app.busy)
        await drawn(pilot, app, generated)

    run_app(app, script)


def test_the_finished_answer_is_drawn_with_colours_off_on_and_off_again(generated):
    app = ChatApp("demo", "eagle3", max_tokens=MAX_TOKENS)

    async def script(pilot):
        await send(pilot, app, MESSAGE)
        await drawn(pilot, app, generated)  # as Markdown: the bare code as a code block
        await pilot.press("f2")
        await drawn(pilot, app, generated)
        await pilot.press("f2")
        await drawn(pilot, app, generated)

    run_app(app, script)


def test_accepted_draft_tokens_are_drawn_green_and_the_targets_own_are_not(generated):
    app = ChatApp("demo", "eagle3", max_tokens=MAX_TOKENS)

    async def script(pilot):
        events, gate = hold_after(app, 10**9)  # records, never holds
        await pilot.press("f2")
        await send(pilot, app, MESSAGE)
        pieces = [e for e in events if isinstance(e, engine.Piece)]
        drafted = screen.squeeze("".join(e.text for e in pieces if e.from_draft))
        own = screen.squeeze("".join(e.text for e in pieces if not e.from_draft))
        assert drafted and own  # EAGLE-3 drafts some of it, the target writes the rest

        def colours():
            rows = screen.segments(app, "#conversation")
            start = next(i for i, row in enumerate(rows) if "def " in "".join(s.text for s in row))
            answer = [s for row in rows[start:] for s in row]
            return (screen.squeeze("".join(s.text for s in answer if screen.is_green(s))),
                    screen.squeeze("".join(s.text for s in answer if not screen.is_green(s))))
        await until(pilot, lambda: colours() == (drafted, own),
                    lambda: f"green drawn: {colours()[0]!r}\nexpected:    {drafted!r}", timeout=20)

    run_app(app, script)


def test_a_loaded_conversation_shows_its_answers(tmp_path, generated):
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"model": "demo", "messages": [{"role": "user", "content": MESSAGE},
                                                                {"role": "assistant", "content": generated}]}))

    at_start = ChatApp("demo", conversation=saved)

    async def loaded_at_start(pilot):
        await drawn(pilot, at_start, MESSAGE, exact_lines=False)
        await drawn(pilot, at_start, generated)

    run_app(at_start, loaded_at_start)

    by_command = ChatApp("demo", max_tokens=8)

    async def loaded_later(pilot):
        await send(pilot, by_command, "something else first")
        by_command.query_one("#prompt").insert(f"/load {saved}")
        await pilot.press("enter")
        await drawn(pilot, by_command, generated)
        assert not screen.shows(screen.lines(by_command), "something else first")

    run_app(by_command, loaded_later)


def test_a_long_answer_follows_the_end_unless_the_user_scrolls_up():
    app = ChatApp("demo", max_tokens=200)

    async def script(pilot):
        events, gate = hold_after(app, 10**9)
        await send(pilot, app, MESSAGE)
        tail = text_of(events)[-40:]
        await drawn(pilot, app, tail, exact_lines=False)  # the end is in view
        pane = app.query_one("#conversation")
        assert pane.max_scroll_y > 0  # it did not fit
        events.clear()
        app.query_one("#prompt").insert("Write a Python function `parse_args`: Parse the command line arguments.")
        await pilot.press("enter")
        await until(pilot, lambda: len(text_of(events)) > 20)
        pane.scroll_page_up(animate=False)  # the user reads back while it streams (as the mouse wheel does)
        top = pane.scroll_y
        await until(pilot, lambda: not app.busy)
        await pilot.pause(0.3)
        assert pane.scroll_y <= top and pane.scroll_y < pane.max_scroll_y
        assert not screen.shows(screen.lines(app), text_of(events)[-40:])

    run_app(app, script, size=(100, 20))


def test_at_80x24_the_answer_has_the_width_and_f3_brings_the_stats_back(generated):
    app = ChatApp("demo", "eagle3", max_tokens=MAX_TOKENS)

    async def script(pilot):
        await send(pilot, app, MESSAGE)
        first_lines = "\n".join(generated.splitlines()[:3])
        pane = app.query_one("#conversation")
        pane.scroll_home(animate=False)
        await drawn(pilot, app, first_lines)
        assert not app.query_one("#stats").display
        await pilot.press("f3")
        await until(pilot, lambda: "tok/s" in "\n".join(screen.lines(app, "#stats")))
        await pilot.press("f3")
        await until(pilot, lambda: not app.query_one("#stats").display)

    run_app(app, script, size=(80, 24))


def test_copy_puts_the_answer_on_the_clipboard_and_retry_answers_again(generated):
    app = ChatApp("demo", max_tokens=MAX_TOKENS)

    async def script(pilot):
        await send(pilot, app, MESSAGE)
        for line in ("/copy", "/copy code"):  # the answer is bare code: its code block is all of it
            app.query_one("#prompt").insert(line)
            await pilot.press("enter")
            assert app.clipboard == generated
        app.query_one("#prompt").insert("/retry")
        await pilot.press("enter")
        await until(pilot, lambda: not app.busy and app.engine.idle())
        await drawn(pilot, app, generated)
        # one question, one answer: the retried answer replaced the first
        assert screen.squeeze("\n".join(screen.lines(app))).count(screen.squeeze(generated.splitlines()[0])) == 1
        saved = json.loads(app.path.read_text())
        assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]

    run_app(app, script)


def test_engine_reuses_the_cache_across_turns(checkpoints):
    events = []
    done = []
    eng = engine.ChatEngine(lambda e: (events.append(e), isinstance(e, (engine.Done, engine.Failed, engine.Loaded))
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


# --- the rest of the chat ----------------------------------------------------------

def test_a_message_streams_in_and_the_stats_update(checkpoints, home):
    app = ChatApp(str(checkpoints["qwen3"]), "lookup", max_tokens=24)

    async def script(pilot):
        events, _ = hold_after(app, 10**9)
        await send(pilot, app, "hello there")
        assert sum(isinstance(e, engine.Piece) for e in events) > 1  # token by token
        stats = "\n".join(screen.lines(app, "#stats"))
        assert "tok/s" in stats and "Last answer" in stats and "Session" in stats
        # saved, atomically, after the answer
        saved = json.loads(app.path.read_text())
        assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]

    run_app(app, script)


def test_escape_stops_the_answer_and_keeps_it(checkpoints):
    app = ChatApp(str(checkpoints["qwen3"]), max_tokens=4000)  # within the context of 4096

    async def script(pilot):
        app.query_one("#prompt").insert("write forever")
        await pilot.press("enter")
        await until(pilot, lambda: app.answer is not None and len(app.answer.pieces) >= 3)
        await pilot.press("escape")
        await until(pilot, lambda: not app.busy)
        kept = answers(app)
        assert len(kept) == 1 and kept[0] and len(kept[0]) < 4000
        assert "stopped" in "\n".join(screen.lines(app, "#stats"))
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
        await drawn(pilot, app, "a question", exact_lines=False)

    run_app(app, script)
    text = md.read_text()
    assert "## User" in text and "a question" in text and "## Assistant" in text
    loaded = store.load(js)
    assert loaded.messages[0]["content"] == "a question"


def test_errors_show_in_the_app(checkpoints, tmp_path):
    app = ChatApp(str(checkpoints["qwen3"]), max_tokens=12)

    async def script(pilot):
        for line in ("/drafter nosuch", "/temp hot", f"/load {tmp_path / 'missing.json'}", "/frobnicate",
                     "/copy", "/think maybe"):
            app.query_one("#prompt").insert(line)
            await pilot.press("enter")
            await until(pilot, lambda: app.engine.idle())
            await pilot.pause(0.1)
        rows = screen.lines(app)
        for needle in ("unknown kind 'nosuch'", "/temp", "missing.json", "/frobnicate", "no answer yet",
                       "/think: give on or off"):
            assert screen.shows(rows, needle), (needle, "\n".join(rows))
        await send(pilot, app, "still works")
        assert len(answers(app)) == 1

    run_app(app, script)


def test_unknown_model_shows_an_error_in_the_app(tmp_path):
    app = ChatApp(str(tmp_path / "nosuch"))

    async def script(pilot):
        await until(pilot, lambda: "nosuch" in "\n".join(screen.lines(app)))

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


# --- reasoning models ----------------------------------------------------------------

@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    """A tiny Qwen3 whose tokenizer is laid out as Qwen/Qwen3-8B's: its chat template
    (tokenizer_config.json's `chat_template`: `enable_thinking`, `reasoning_content`)
    and `<think>`, `</think>` as added tokens that are not special."""
    from tokenizers import AddedToken, Tokenizer

    from tiny import make_checkpoint

    path = make_checkpoint(tmp_path_factory.mktemp("thinking") / "qwen3", "qwen3", seed=3, vocab_size=400)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_TEMPLATE.read_text()
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_no_think_renders_the_prompt_exactly_as_the_template_does(thinking_model):
    from transformers import AutoTokenizer

    from mlx_spec.tokenizer import encode_prompt, load_tokenizer, thinking_args

    reference = AutoTokenizer.from_pretrained(str(thinking_model))
    messages = [{"role": "user", "content": "hello"}]
    ours = load_tokenizer(thinking_model)
    for think in (None, True, False):
        expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False, **thinking_args(think))
        assert encode_prompt(ours, "hello", template_args=thinking_args(think)) == expected
    off = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")
    assert encode_prompt(ours, "hello", template_args=thinking_args(False)) != encode_prompt(ours, "hello")

    # The chat renders the same prompt: its engine's cache holds those tokens first.
    app = ChatApp(str(thinking_model), max_tokens=4, think=False)

    async def script(pilot):
        await send(pilot, app, "hello")
        expected = encode_prompt(ours, "hello", template_args={"enable_thinking": False})
        assert app.engine.state.context[:len(expected)] == expected

    run_app(app, script)


def test_think_flags_say_so_when_the_template_has_no_switch(checkpoints, thinking_model):
    proc = cli_here("generate", "--model", checkpoints["qwen3"], "--prompt", "hi", "--max-tokens", 2, "--no-think")
    assert proc.returncode == 0 and "no thinking switch" in proc.stderr, proc.stderr
    proc = cli_here("generate", "--model", thinking_model, "--prompt", "hi", "--max-tokens", 2, "--no-think")
    assert proc.returncode == 0 and "no thinking switch" not in proc.stderr, proc.stderr

    app = ChatApp(str(checkpoints["qwen3"]), max_tokens=4, think=False)

    async def script(pilot):
        await drawn(pilot, app, "no thinking switch", exact_lines=False)
        app.query_one("#prompt").insert("/think on")
        await pilot.press("enter")
        await until(pilot, lambda: "/think changes nothing" in "\n".join(screen.lines(app)))

    run_app(app, script)


class ScriptedEngine:
    """Answers every message with the same pieces, as a reasoning model's engine
    would send them (a `<think>` block, then the answer)."""

    def __init__(self, app, pieces, pause: threading.Event):
        self.app, self.pieces, self.pause = app, pieces, pause
        self.real = app.engine.submit

    def submit(self, job):
        if not isinstance(job, engine.Generate):
            return self.real(job)

        def run():
            emit = self.app.engine.emit
            emit(engine.Begin(reasoning=False))
            for i, piece in enumerate(self.pieces):
                if piece.startswith("\n</think>"):  # the test looks while it thinks
                    self.pause.wait(60)
                emit(engine.Piece(piece, i % 2 == 0))
            from mlx_spec.metrics import Metrics
            emit(engine.Done("".join(self.pieces), Metrics(), 10, 0, 0.01, 0.01, len(self.pieces), "stop"))
        threading.Thread(target=run, daemon=True).start()


def test_reasoning_is_drawn_apart_folds_away_and_is_saved_apart(thinking_model):
    reasoning = ["<think>", "\nThe user wants", " a function.", " Keep it short.", "\n</think>", "\n\n"]
    answer = ["def", " f", "():\n", "    return", " 1\n"]
    app = ChatApp(str(thinking_model), max_tokens=64)
    pause = threading.Event()

    async def script(pilot):
        app.engine.submit = ScriptedEngine(app, reasoning + answer, pause).submit
        app.query_one("#prompt").insert("hello")
        await pilot.press("enter")
        # while it thinks: the reasoning is drawn (dimmed), under its own title, and no tag is
        await until(pilot, lambda: "Keep it short." in "\n".join(screen.lines(app)))
        rows = screen.segments(app, "#conversation")
        thought = [s for row in rows for s in row if "Keep it short" in s.text]
        asked = [s for row in rows for s in row if "hello" in s.text]
        assert thought and asked and screen.lightness(thought[0]) < screen.lightness(asked[0])  # dimmed
        assert "Thinking" in "\n".join(screen.lines(app)) and "<think>" not in "\n".join(screen.lines(app))
        pause.set()
        await until(pilot, lambda: not app.busy)
        # the answer starts: the reasoning folds to one line; the answer is drawn as code
        await drawn(pilot, app, "def f():\n    return 1")
        drawn_text = "\n".join(screen.lines(app))
        assert "Keep it short." not in drawn_text and "Reasoning" in drawn_text and "</think>" not in drawn_text
        await pilot.click("#thinking CollapsibleTitle")  # it unfolds on a click
        await until(pilot, lambda: "Keep it short." in "\n".join(screen.lines(app)))
        saved = json.loads(app.path.read_text())["messages"][-1]
        assert saved == {"role": "assistant", "content": "def f():\n    return 1\n",
                         "reasoning_content": "The user wants a function. Keep it short."}

    run_app(app, script)

    # On the next turn the template reads the reasoning back as Qwen3's expects.
    from mlx_spec.tokenizer import load_tokenizer
    loaded = store.load(app.path)
    text = load_tokenizer(thinking_model).apply_chat_template(
        loaded.chat() + [{"role": "user", "content": "and?"}], add_generation_prompt=True, tokenize=False)
    # the content alone, its reasoning dropped, as Qwen3's template does for earlier turns
    assert "<|im_start|>assistant\ndef f():\n    return 1\n<|im_end|>" in text


# --- the real program in a terminal ---------------------------------------------------

def _terminal(args: list[str], env: dict, size=(120, 40)):
    """The real `mlx-spec ARGS` in a pseudo-terminal, its screen kept by a terminal emulator."""
    import pyte

    pid, fd = pty.fork()
    if pid == 0:  # the child
        os.environ.update(env, COLUMNS=str(size[0]), LINES=str(size[1]), TERM="xterm-256color")
        os.execvp(sys.executable, [sys.executable, "-m", "mlx_spec.cli", *args])
    import fcntl
    import struct
    import termios
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
    term = pyte.Screen(*size)
    stream = pyte.ByteStream(term)
    status = [None]

    def pump(done, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"{what}; the screen:\n" + "\n".join(term.display)
            ready, _, _ = select.select([fd], [], [], 0.05)
            if ready:
                try:
                    stream.feed(os.read(fd, 65536))
                except OSError:  # the program closed the terminal
                    pass

    def exited() -> bool:
        done, status[0] = os.waitpid(pid, os.WNOHANG)
        return done != 0

    def finish() -> int:
        os.write(fd, b"\x11")  # Ctrl+Q
        pump(exited, "did not quit", timeout=30)
        os.close(fd)
        return os.waitstatus_to_exitcode(status[0])

    return term, pump, fd, finish


def test_the_real_program_in_a_terminal_draws_the_answer_every_time(home):
    """Started three times (a race between the answer and the screen would show in some)."""
    proc = cli_here("generate", "--prompt", MESSAGE, "--max-tokens", 24)
    assert proc.returncode == 0, proc.stderr
    expected = proc.stdout.removesuffix("\n")
    for i in range(3):
        term, pump, fd, finish = _terminal(["chat", "--max-tokens", "24"], {"MLX_SPEC_HOME": str(home)})
        pump(lambda: "· drafter: none" in "\n".join(term.display), "not loaded")
        os.write(fd, MESSAGE.encode())
        time.sleep(0.2)
        os.write(fd, b"\r")
        pump(lambda: "Last answer" in "\n".join(term.display), "no stats")
        def answered():
            rows = screen.left_of_stats(term.display)
            return screen.shows(rows, expected) and not screen.shows_lines(rows, expected)
        pump(answered, f"run {i}: the answer is not on the screen:\n{expected}")
        code = finish()
        assert code == 0, (i, code)
    assert len(list((home / "conversations").iterdir())) == 3


def test_a_hub_download_shows_its_progress_in_the_app(tmp_path, checkpoints):
    from fakehub import FakeHub

    with FakeHub({"someone/tiny-qwen3": checkpoints["qwen3"]}, chunk_delay=0.15) as hub:
        env = {"MLX_SPEC_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url,
               "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_DISABLE_XET": "1"}
        term, pump, fd, finish = _terminal(["chat", "--model", "someone/tiny-qwen3", "--max-tokens", "4"], env)
        seen = []

        def progress():
            text = "\n".join(term.display)
            if "downloading someone/tiny-qwen3" in text:
                seen.append(text)
            return "· drafter: none" in text
        pump(progress, "never loaded", timeout=120)
        assert seen, "no download progress was drawn"
        line = next(row for row in seen[len(seen) // 2].splitlines() if "downloading" in row)
        assert " of " in line and "files" in line and ("KB" in line or "MB" in line), line
        assert any("%" in row for row in seen[len(seen) // 2].splitlines())  # the bar's percentage
        assert finish() == 0


def test_the_snapshot_script_draws_a_question_its_green_answer_and_the_stats(tmp_path):
    out = tmp_path / "chat.svg"
    script = Path(__file__).parents[1] / "scripts" / "chat_snapshot.py"
    proc = subprocess.run([sys.executable, str(script), str(out), "--message", MESSAGE, "--max-tokens", "40"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    question = MESSAGE
    reference = cli_here("generate", "--prompt", question, "--max-tokens", 40)
    svg = out.read_text()
    rows = screen.left_of_stats(screen.svg_lines(svg))
    expected = reference.stdout.removesuffix("\n")
    assert screen.shows(rows, question) and screen.shows(rows, expected) and not screen.shows_lines(rows, expected), \
        "\n".join(rows)
    assert "tokens per target forward" in svg.replace("&#160;", " ")
    assert "#98e024" in svg  # green: accepted draft tokens


def test_reasoning_and_answer_are_told_apart_while_they_stream():
    from mlx_spec.tui.answer import code_fence, reasoning_and_content, split

    text = "<think>\nweighing it\n</think>\n\nThe answer."
    assert split(text, opened=False, done=True) == ((7, 20), 28)
    assert split("<thi", opened=False, done=False) == (None, None)  # maybe a tag: held back
    assert split("<thi", opened=False, done=True) == (None, 0)
    assert split("so far </thi", opened=True, done=False) == ((0, 7), None)  # the template opened it
    assert reasoning_and_content(text) == ("weighing it", "The answer.")
    assert reasoning_and_content("plain answer") == ("", "plain answer")
    assert reasoning_and_content("still thinking", opened=True) == ("still thinking", "")
    assert code_fence("def f(x):\n    return x\n", done=False) == "```python\n"
    assert code_fence("from the docs we learn that", done=False) == ""  # prose streams at once
    assert code_fence("de", done=False) is None and code_fence("de", done=True) == ""
    assert code_fence("from os.path imp", done=False) is None and code_fence("", done=False) is None
    assert code_fence("Here is one:\n```python\nx = 1\n```", done=True) == ""


def test_a_think_block_in_a_loaded_answer_is_drawn_apart(tmp_path):
    saved = tmp_path / "saved.json"
    content = "<think>\nLet me see.\n</think>\n\ndef f():\n    return 2\n"
    saved.write_text(json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"},
                                                                {"role": "assistant", "content": content}]}))
    app = ChatApp("demo", conversation=saved)

    async def script(pilot):
        await drawn(pilot, app, "def f():\n    return 2")
        rows = "\n".join(screen.lines(app))
        assert "Reasoning" in rows and "Let me see." not in rows and "<think>" not in rows

    run_app(app, script)


def test_drafter_alone_lists_the_kinds_the_registry_holds(checkpoints):
    from mlx_spec.drafters import REGISTRY

    app = ChatApp(str(checkpoints["qwen3"]))

    async def script(pilot):
        app.query_one("#prompt").insert("/drafter")
        await pilot.press("enter")
        await until(pilot, lambda: all(k.usage in "\n".join(screen.lines(app)) for k in REGISTRY.values()),
                    lambda: "\n".join(screen.lines(app)), timeout=10)

    run_app(app, script, size=(160, 60))
