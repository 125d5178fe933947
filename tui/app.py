"""`mlx-spec chat`: a terminal chat that shows the drafter at work.

Answers stream in as the target accepts tokens, as Markdown (a bare-code
answer as a code block); `/colors` (or F2) draws each token coloured by where
it came from instead (green: a draft the target accepted; plain: the target's
own). A model's reasoning is drawn apart and folds away once the answer
starts. The panel on the right (F3 hides it) shows tokens/s, tokens per target
forward, acceptance by draft position and the estimated speedup, for the last
answer and the session. Enter sends, Ctrl+J adds a new line, Esc stops the
answer (keeping it), slash commands do the rest (`/help`).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from rich.text import Text
from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Header, Label, Markdown, ProgressBar, Static, TextArea

from mlx_spec.errors import UserError
from mlx_spec.metrics import Metrics
from mlx_spec.tui import engine, stats, store
from mlx_spec.tui.answer import Answer, last_code_block, reasoning_and_content, with_reasoning

HELP = """\
**Commands**

- `/drafter SPEC`: switch the drafter (`dflash`, `lookup`, `draft=PATH`, `none`, ...)
- `/temp T`, `/top-p P`, `/max-tokens N`: sampling
- `/think on|off`: the model's reasoning, where its chat template has the switch
- `/system TEXT`: the system prompt (`/system` alone clears it)
- `/retry`: answer the last message again
- `/copy`, `/copy code`: the last answer, or its last code block, to the clipboard
- `/colors`: colour tokens by origin (F2); F3 shows or hides the stats
- `/clear`: a new conversation
- `/export FILE.md|FILE.json`, `/load FILE.json`
- `/help`

Enter sends, Ctrl+J adds a new line, Esc stops the answer, Ctrl+Q quits.
"""
NARROW = 100  # columns below which the stats panel starts hidden


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


class Prompt(TextArea):
    """The message box: Enter sends, Ctrl+J (or Alt+Enter) adds a new line."""

    class Submitted(Message):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text.strip()
            if text:
                self.post_message(self.Submitted(text))
                self.clear()
            return
        if event.key in ("ctrl+j", "alt+enter", "shift+enter"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)


class ChatApp(App):
    TITLE = "mlx-spec chat"
    CSS = """
    #body { height: 1fr; }
    #main { width: 1fr; }
    #conversation { height: 1fr; padding: 0 1; }
    #loading { height: auto; padding: 0 1; display: none; }
    #loading ProgressBar { width: 1fr; }
    #stats { width: 38; border-left: solid $primary; padding: 0 1; overflow-y: auto; }
    .user { margin: 1 0 0 0; padding: 0 1; background: $boost; }
    .error { color: $error; margin: 1 0 0 0; }
    .note { color: $text-muted; margin: 1 0 0 0; }
    Prompt { height: auto; min-height: 3; max-height: 8; }
    """
    BINDINGS = [
        Binding("escape", "stop", "Stop answer"),
        Binding("f2", "colors", "Colours"),
        Binding("f3", "stats", "Stats"),
        Binding("ctrl+q", "quit", "Quit"),
    ]

    def __init__(self, model: str, drafter: str = "none", system: str = "", temp: float = 0.0,
                 top_p: float = 1.0, max_tokens: int = 512, conversation: Path | None = None,
                 think: bool | None = None, template_args: dict | None = None, **loading):
        """`loading`: `engine.Load`'s options (revisions, extra EOS tokens, adapters)."""
        super().__init__()
        self.temp, self.top_p, self.max_tokens, self.think = temp, top_p, max_tokens, think
        self.template_args = template_args
        self.loading_options = loading
        self.conversation = store.Conversation(model, drafter, system)
        self.path: Path | None = None  # the conversation's file, made on its first save
        self.load_from = conversation
        self.show_origin = False
        self.stats_shown: bool | None = None  # None: as wide as the terminal allows
        self.thinking_switch = False
        self.answer: Answer | None = None
        self.busy = False
        self.session = Metrics()
        self.session_time, self.session_tokens = 0.0, 0
        self.last: list[str] = []
        self.engine = engine.ChatEngine(lambda event: self.call_from_thread(self.on_engine, event))

    # --- layout ------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            with Vertical(id="main"):
                with Vertical(id="loading"):
                    yield Label(id="loading-text")
                    yield ProgressBar(show_eta=False, id="download")
                yield VerticalScroll(id="conversation")
            yield Static(id="stats")
        yield Prompt(id="prompt", placeholder="Message (Enter sends, Ctrl+J new line, /help)")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#conversation").anchor()  # it follows what is added, until the user scrolls up
        c = self.conversation
        self.loading(f"loading {c.model}…")
        self.engine.submit(engine.Load(c.model, c.drafter, **self.loading_options))
        if self.load_from is not None:
            self.load_conversation(self.load_from)
        self.show_stats()
        self.query_one("#prompt").focus()

    def on_resize(self, event: events.Resize) -> None:
        self.query_one("#stats").display = self.stats_shown if self.stats_shown is not None else \
            event.size.width >= NARROW

    def loading(self, text: str | None, download: engine.Progress | None = None) -> None:
        """The loading line above the conversation (None hides it), with a download's progress bar."""
        box = self.query_one("#loading")
        box.display = text is not None
        if text is None:
            return
        self.query_one("#loading-text", Label).update(text)
        bar = self.query_one("#download", ProgressBar)
        bar.display = download is not None
        if download is not None:
            bar.update(total=download.total_bytes or None, progress=download.done_bytes)

    # --- the conversation --------------------------------------------------------

    def note(self, text: str, kind: str = "note") -> None:
        widget = Markdown(text, classes=kind) if kind == "note" else Static(Text(text), classes=kind)
        self.query_one("#conversation").mount(widget)

    def add_message(self, message: dict) -> None:
        if message["role"] == "assistant":
            text = with_reasoning(message.get("reasoning_content", ""), message["content"])
            widget = Answer([(text, False)], done=True, colors=self.show_origin)
        else:
            widget = Static(Text(message["content"]), classes="user")
        self.query_one("#conversation").mount(widget)

    def save(self) -> None:
        self.path = store.save(self.conversation, self.path)

    def on_prompt_submitted(self, message: Prompt.Submitted) -> None:
        if message.text.startswith("/"):
            try:
                self.command(message.text)
            except UserError as e:
                self.note(str(e), "error")
            return
        if self.busy:
            self.notify("Still answering: Esc stops it", severity="warning")
            return
        self.conversation.messages.append(store.message("user", message.text))
        self.save()
        self.add_message(self.conversation.messages[-1])
        self.ask()

    def ask(self) -> None:
        """Answer the conversation's last message."""
        self.answer = Answer(colors=self.show_origin)
        pane = self.query_one("#conversation")
        pane.mount(self.answer)
        pane.scroll_end(animate=False)
        self.busy = True
        self.engine.submit(engine.Generate(self.conversation.chat(), self.temp, self.top_p, self.max_tokens,
                                           self.think, self.template_args))

    def on_engine(self, event) -> None:
        """An event from the engine thread, on the UI's."""
        if isinstance(event, engine.Piece) and self.answer is not None:
            self.answer.add(event.text, event.from_draft)
        elif isinstance(event, engine.Begin) and self.answer is not None:
            self.answer.opened = event.reasoning
        elif isinstance(event, engine.Done):
            self.finish_answer(event)
        elif isinstance(event, engine.Progress):
            done = event.total_files and event.done_files == event.total_files
            self.loading(f"loading {event.repo}…" if done else
                         f"downloading {event.repo}: {_size(event.done_bytes)} of {_size(event.total_bytes)}, "
                         f"{event.done_files} of {event.total_files} files", None if done else event)
        elif isinstance(event, engine.Status):
            self.sub_title = event.text
            self.loading(event.text)
        elif isinstance(event, engine.Loaded):
            self.loading(None)
            self.conversation.model, self.conversation.drafter = event.model, event.drafter
            self.thinking_switch = event.thinking_switch
            self.sub_title = f"{event.model} · drafter: {event.drafter}"
            if self.think is not None and not event.thinking_switch:
                self.note("This model's chat template has no thinking switch: --think and --no-think change nothing.")
            self.save()
            self.show_stats()
        elif isinstance(event, engine.Failed):
            self.loading(None)
            self.sub_title = f"{self.conversation.model} · drafter: {self.conversation.drafter}"
            if self.busy:  # the answer failed: keep what it wrote, if anything
                if self.answer is not None and self.answer.pieces:
                    self.finish_answer(None)
                else:
                    if self.answer is not None:
                        self.answer.remove()
                    self.answer, self.busy = None, False
            self.note(event.text, "error")

    def finish_answer(self, done: engine.Done | None) -> None:
        """The answer is complete (`done` None: it failed part way)."""
        answer, self.answer, self.busy = self.answer, None, False
        if answer is None:
            return
        answer.finish()
        reasoning, content = reasoning_and_content(answer.text, answer.opened)
        self.conversation.messages.append(store.message("assistant", content, reasoning))
        self.save()
        if done is None:
            return
        self.session.merge(done.metrics)
        self.session_time += done.generation_time
        self.session_tokens += done.tokens
        reason = {"stopped": " (stopped)", "length": " (max tokens)"}.get(done.finish_reason, "")
        self.last = stats.block(f"Last answer{reason}", done.metrics, done.generation_time, done.tokens)
        self.last.append(f"  {done.prompt_tokens} prompt tokens ({done.reused_tokens} cached)")
        self.show_stats()

    def show_stats(self) -> None:
        c = self.conversation
        think = {None: "", True: "  think on", False: "  think off"}[self.think]
        lines = [f"[b]{c.model}[/b]", f"drafter: {c.drafter}", f"temp {self.temp}  top-p {self.top_p}{think}", ""]
        lines += self.last + [""] if self.last else []
        if self.session_tokens:
            lines += stats.block("Session", self.session, self.session_time, self.session_tokens)
        self.query_one("#stats", Static).update("\n".join(lines))

    def load_conversation(self, path: Path) -> None:
        loaded = store.load(path)
        loaded.model, loaded.drafter = self.conversation.model, self.conversation.drafter
        self.conversation, self.path = loaded, path
        self.query_one("#conversation").remove_children()
        for m in loaded.messages:
            self.add_message(m)
        self.engine.submit(engine.Forget())

    # --- commands ----------------------------------------------------------------

    def command(self, line: str) -> None:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name == "/help":
            self.note(HELP)
        elif name == "/drafter":
            if not arg:
                from mlx_spec.drafters import REGISTRY

                kinds = "\n".join(f"- `{k.usage}`: {k.summary}" + (f" (alone: {k.alone})" if k.alone else "")
                                  for k in REGISTRY.values())
                self.note(f"**Drafters** (`/drafter SPEC`, `/drafter none` for plain decoding)\n\n{kinds}")
            else:
                self.engine.submit(engine.SetDrafter(arg))
        elif name in ("/temp", "/top-p", "/max-tokens"):
            self.set_sampling(name, arg)
        elif name == "/think":
            if arg not in ("on", "off"):
                raise UserError("/think: give on or off")
            self.think = arg == "on"
            self.note(f"thinking {arg}" if self.thinking_switch else
                      "This model's chat template has no thinking switch: /think changes nothing.")
        elif name == "/system":
            self.conversation.system = arg
            self.engine.submit(engine.Forget())
            self.note(f"system prompt: {arg}" if arg else "system prompt cleared")
        elif name == "/retry":
            self.retry()
        elif name == "/copy":
            self.copy(arg)
        elif name == "/colors":
            self.action_colors()
        elif name == "/clear":
            if self.busy:
                raise UserError("/clear: still answering (Esc stops it)")
            c = self.conversation
            self.conversation = store.Conversation(c.model, c.drafter, c.system)
            self.path = None
            self.query_one("#conversation").remove_children()
            self.engine.submit(engine.Forget())
        elif name == "/export":
            if not arg:
                raise UserError("/export: give a file, FILE.md or FILE.json")
            store.export(self.conversation, Path(arg).expanduser())
            self.note(f"exported to {arg}")
        elif name == "/load":
            if self.busy:
                raise UserError("/load: still answering (Esc stops it)")
            self.load_conversation(Path(arg).expanduser())
        else:
            raise UserError(f"{name}: unknown command (/help lists them)")
        self.show_stats()

    def set_sampling(self, name: str, arg: str) -> None:
        try:
            value = float(arg) if name != "/max-tokens" else int(arg)
        except ValueError:
            raise UserError(f"{name}: expected a number, got '{arg}'") from None
        if name == "/temp" and value >= 0:
            self.temp = value
        elif name == "/top-p" and 0 < value <= 1:
            self.top_p = value
        elif name == "/max-tokens" and value >= 1:
            self.max_tokens = int(value)
        else:
            raise UserError(f"{name}: out of range ({arg})")

    def retry(self) -> None:
        """Answer the last user message again (at temperature 0, the same answer)."""
        messages = self.conversation.messages
        if self.busy:
            raise UserError("/retry: still answering (Esc stops it)")
        if not messages:
            raise UserError("/retry: nothing to answer yet")
        if messages[-1]["role"] == "assistant":
            messages.pop()
            answers = self.query(Answer)
            if answers:
                answers.last().remove()
        self.save()
        self.ask()

    def copy(self, what: str) -> None:
        """The last answer (`code`: its last code block) to the clipboard."""
        if what not in ("", "code"):
            raise UserError("/copy: give nothing (the last answer) or code (its last code block)")
        contents = [m["content"] for m in self.conversation.messages if m["role"] == "assistant"]
        if not contents:
            raise UserError("/copy: no answer yet")
        text = last_code_block(contents[-1]) if what else contents[-1]
        if not text:
            raise UserError("/copy code: the last answer has no code block")
        self.copy_to_clipboard(text)  # OSC 52: most terminals
        if sys.platform == "darwin" and shutil.which("pbcopy"):  # Terminal.app ignores OSC 52
            subprocess.run(["pbcopy"], input=text.encode(), check=False)
        self.notify(f"copied {len(text)} characters")

    # --- actions -----------------------------------------------------------------

    def action_stop(self) -> None:
        if self.busy:
            self.engine.stop()

    def action_colors(self) -> None:
        self.show_origin = not self.show_origin
        for answer in self.query(Answer):
            answer.set_colors(self.show_origin)
        self.notify("colours: green = accepted draft tokens" if self.show_origin else "colours off")

    def action_stats(self) -> None:
        stats_panel = self.query_one("#stats")
        self.stats_shown = not stats_panel.display
        stats_panel.display = self.stats_shown

    async def action_quit(self) -> None:
        self.engine.stop()
        if self.answer is not None and self.answer.pieces:  # keep a partial answer
            reasoning, content = reasoning_and_content(self.answer.text, self.answer.opened)
            self.conversation.messages.append(store.message("assistant", content, reasoning))
        self.save()
        self.exit()
