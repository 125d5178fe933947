"""`mlx-spec chat`: a terminal chat that shows the drafter at work.

Answers stream in as the target accepts tokens; `/colors` (or F2) colours each
token by where it came from (green: a draft the target accepted; plain: the
target's own). The panel on the right shows tokens/s, tokens per target
forward, acceptance by draft position and the estimated speedup, for the last
answer and the session. Enter sends, Ctrl+J adds a new line, Esc stops the
answer (keeping it), slash commands do the rest (`/help`).
"""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Header, Markdown, Static, TextArea

from mlx_spec.errors import UserError
from mlx_spec.metrics import Metrics
from mlx_spec.tui import engine, stats, store

DRAFT_STYLE = "bold green"
HELP = """\
**Commands**

- `/drafter SPEC`: switch the drafter (`dflash`, `lookup`, `draft=PATH`, `none`, ...)
- `/temp T`, `/top-p P`, `/max-tokens N`: sampling
- `/system TEXT`: the system prompt (`/system` alone clears it)
- `/colors`: colour tokens by origin (F2)
- `/clear`: a new conversation
- `/export FILE.md|FILE.json`, `/load FILE.json`
- `/help`

Enter sends, Ctrl+J adds a new line, Esc stops the answer, Ctrl+Q quits.
"""


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


class Answer(Static):
    """An assistant message: streamed as coloured text, then shown as Markdown."""

    def __init__(self, text: str = "", pieces: list[tuple[str, bool]] | None = None, colors: bool = False):
        super().__init__(classes="assistant")
        self.pieces = pieces if pieces is not None else ([(text, False)] if text else [])
        self.show_origin = colors
        self.done = bool(text)

    @property
    def text(self) -> str:
        return "".join(p for p, _ in self.pieces)

    def compose(self) -> ComposeResult:
        yield Markdown(id="md")

    def on_mount(self) -> None:
        self.render_answer()

    def add(self, piece: str, from_draft: bool) -> None:
        self.pieces.append((piece, from_draft))
        self.render_answer()

    def finish(self) -> None:
        self.done = True
        self.render_answer()

    def render_answer(self) -> None:
        md = self.query_one("#md", Markdown)
        if self.done and not self.show_origin:
            md.display = True
            md.update(self.text)
            self.update("")
            return
        md.display = False
        self.update(Text.assemble(*((p, DRAFT_STYLE if d and self.show_origin else "") for p, d in self.pieces)))


class ChatApp(App):
    TITLE = "mlx-spec chat"
    CSS = """
    #body { height: 1fr; }
    #conversation { width: 1fr; padding: 0 1; }
    #stats { width: 40; border-left: solid $primary; padding: 0 1; }
    .user { margin: 1 0 0 0; padding: 0 1; background: $boost; }
    .assistant { margin: 1 0 0 0; }
    .error { color: $error; margin: 1 0 0 0; }
    .note { color: $text-muted; margin: 1 0 0 0; }
    Prompt { height: 5; }
    """
    BINDINGS = [
        Binding("escape", "stop", "Stop answer"),
        Binding("f2", "colors", "Colours"),
        Binding("ctrl+q", "quit", "Quit"),
    ]

    def __init__(self, model: str, drafter: str = "none", system: str = "", temp: float = 0.0,
                 top_p: float = 1.0, max_tokens: int = 512, conversation: Path | None = None):
        super().__init__()
        self.temp, self.top_p, self.max_tokens = temp, top_p, max_tokens
        self.conversation = store.Conversation(model, drafter, system)
        self.path = self.conversation.default_path()
        self.load_from = conversation
        self.show_origin = False
        self.answer: Answer | None = None
        self.busy = False
        self.session = Metrics()
        self.session_time, self.session_tokens = 0.0, 0
        self.last: list[str] = []
        self.engine = engine.Engine(lambda event: self.call_from_thread(self.on_engine, event))

    # --- layout ------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            yield VerticalScroll(id="conversation")
            yield Static(id="stats")
        yield Prompt(id="prompt", placeholder="Message (Enter sends, Ctrl+J new line, /help)")
        yield Footer()

    def on_mount(self) -> None:
        c = self.conversation
        self.engine.submit(engine.Load(c.model, c.drafter))
        if self.load_from is not None:
            self.load_conversation(self.load_from)
        self.show_stats()
        self.query_one("#prompt").focus()

    # --- the conversation --------------------------------------------------------

    def note(self, text: str, kind: str = "note") -> None:
        widget = Markdown(text, classes=kind) if kind == "note" else Static(Text(text), classes=kind)
        self.query_one("#conversation").mount(widget)
        widget.scroll_visible()

    def add_message(self, role: str, content: str) -> Static:
        log = self.query_one("#conversation")
        widget = Answer(content, colors=self.show_origin) if role == "assistant" else Static(Text(content), classes="user")
        log.mount(widget)
        log.scroll_end(animate=False)
        return widget

    def save(self) -> None:
        store.save(self.conversation, self.path)

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
        self.conversation.messages.append({"role": "user", "content": message.text})
        self.save()
        self.add_message("user", message.text)
        self.answer = Answer(colors=self.show_origin)
        self.query_one("#conversation").mount(self.answer)
        self.busy = True
        self.engine.submit(engine.Generate(self.conversation.chat(), self.temp, self.top_p, self.max_tokens))

    def on_engine(self, event) -> None:
        """An event from the engine thread, on the UI's."""
        log = self.query_one("#conversation")
        if isinstance(event, engine.Piece) and self.answer is not None:
            at_end = log.scroll_offset.y >= log.max_scroll_y - 2
            self.answer.add(event.text, event.from_draft)
            if at_end:
                log.scroll_end(animate=False)
        elif isinstance(event, engine.Done):
            self.finish_answer(event)
        elif isinstance(event, engine.Status):
            self.sub_title = event.text
        elif isinstance(event, engine.Loaded):
            self.conversation.model, self.conversation.drafter = event.model, event.drafter
            self.sub_title = f"{event.model} · drafter: {event.drafter}"
            self.save()
        elif isinstance(event, engine.Failed):
            self.sub_title = f"{self.conversation.model} · drafter: {self.conversation.drafter}"
            if self.busy:  # the answer failed: keep what it wrote, if anything
                if self.answer is not None and self.answer.pieces:
                    self.finish_answer(None)
                else:
                    if self.answer is not None:
                        self.answer.remove()
                    self.answer, self.busy = None, False
                    self.conversation.messages.pop()
                    self.save()
            self.note(event.text, "error")

    def finish_answer(self, done: engine.Done | None) -> None:
        """The answer is complete (`done` None: it failed part way)."""
        answer, self.answer, self.busy = self.answer, None, False
        if answer is None:
            return
        answer.finish()
        self.conversation.messages.append({"role": "assistant", "content": answer.text})
        self.save()
        if done is None:
            return
        self.session.merge(done.metrics)
        self.session_time += done.generation_time
        self.session_tokens += done.tokens
        reason = {"stopped": " (stopped)", "length": " (max tokens)"}.get(done.finish_reason, "")
        self.last = stats.block(f"Last answer{reason}", done.metrics, done.generation_time, done.tokens)
        self.last.append(f"  {done.prompt_tokens} prompt tokens, {done.reused_tokens} from the cache")
        self.show_stats()

    def show_stats(self) -> None:
        c = self.conversation
        lines = [f"[b]{c.model}[/b]", f"drafter: {c.drafter}", f"temp {self.temp}  top-p {self.top_p}", ""]
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
            self.add_message(m["role"], m["content"])
        self.engine.submit(engine.Forget())

    # --- commands ----------------------------------------------------------------

    def command(self, line: str) -> None:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name == "/help":
            self.note(HELP)
        elif name == "/drafter":
            if not arg:
                raise UserError("/drafter: give a drafter, e.g. /drafter dflash or /drafter none")
            self.engine.submit(engine.SetDrafter(arg))
        elif name in ("/temp", "/top-p", "/max-tokens"):
            self.set_sampling(name, arg)
        elif name == "/system":
            self.conversation.system = arg
            self.engine.submit(engine.Forget())
            self.note(f"system prompt: {arg}" if arg else "system prompt cleared")
        elif name == "/colors":
            self.action_colors()
        elif name == "/clear":
            if self.busy:
                raise UserError("/clear: still answering (Esc stops it)")
            c = self.conversation
            self.conversation = store.Conversation(c.model, c.drafter, c.system)
            self.path = self.conversation.default_path()
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

    # --- actions -----------------------------------------------------------------

    def action_stop(self) -> None:
        if self.busy:
            self.engine.stop()

    def action_colors(self) -> None:
        self.show_origin = not self.show_origin
        for answer in self.query(Answer):
            answer.show_origin = self.show_origin
            answer.render_answer()
        self.notify("colours: green = accepted draft tokens" if self.show_origin else "colours off")

    async def action_quit(self) -> None:
        self.engine.stop()
        if self.answer is not None and self.answer.pieces:  # keep a partial answer
            self.conversation.messages.append({"role": "assistant", "content": self.answer.text})
        self.save()
        self.exit()
