"""An assistant's message on screen.

The answer streams in as Markdown, so it never changes form when it is
complete; with colours on it is drawn instead as the text as generated, each
token coloured by where it came from. Reasoning (a Qwen3-style `<think>`
block) is drawn apart, dimmed, and folds to one line once the answer starts.
An answer that is bare code, as the demo's are, is shown as a code block
rather than reflowed as prose.
"""

from __future__ import annotations

import re

from rich.text import Text
from textual.containers import Vertical
from textual.widgets import Collapsible, Markdown, Static

THINK, END_THINK = "<think>", "</think>"
DRAFT_STYLE = "bold green"
REASONING_STYLE = "dim"
# The first line of a bare Python answer.
CODE_LINE = re.compile(r"(async\s+)?def \w+\s*\(|class \w+\s*[(:]|import \w|from [\w.]+ import |@\w")


def _prefix(word: str) -> str:
    return "|".join(re.escape(word[:n]) for n in range(len(word), 0, -1))


# The start of a line that may still become one CODE_LINE matches.
CODE_START = re.compile(
    rf"(?:{_prefix('async')})|(?:async\s+)?(?:{_prefix('def')}|{_prefix('class')})(?:\s+\w*)?"
    rf"|(?:{_prefix('import')})(?:\s+\w*)?|(?:{_prefix('from')})(?:\s+[\w.]*(?:\s+(?:{_prefix('import')}))?)?|@"
)

Pieces = list[tuple[str, bool]]  # (text, drawn from an accepted draft token)


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


def split(text: str, opened: bool, done: bool) -> tuple[tuple[int, int] | None, int | None]:
    """Where the reasoning and the answer are in `text`: the reasoning's span (None:
    there is none) and the offset the answer starts at (None: not yet). `opened`:
    the prompt opened the `<think>` block itself. While streaming, a tag still
    arriving is held back."""
    start = 0
    if not opened:
        head = text.lstrip()
        if head.startswith(THINK):
            start = len(text) - len(head) + len(THINK)
        elif head and THINK.startswith(head) and not done:
            return None, None
        else:
            return None, 0
    end = text.find(END_THINK, start)
    if end < 0:
        return (start, len(text) if done else len(text) - _held_back(text, END_THINK)), None
    return (start, end), end + len(END_THINK)


def reasoning_and_content(text: str, opened: bool = False) -> tuple[str, str]:
    """A complete answer's reasoning and content, as chat templates take them back
    (`reasoning_content` and `content`)."""
    span, at = split(text, opened, done=True)
    reasoning = text[span[0]:span[1]].strip("\n") if span else ""
    return reasoning, ("" if at is None else text[at:].lstrip("\n"))


def with_reasoning(reasoning: str, content: str) -> str:
    """The text a model writes for this reasoning and content (for a loaded message)."""
    return f"{THINK}\n{reasoning}\n{END_THINK}\n\n{content}" if reasoning else content


def code_fence(content: str, done: bool) -> str | None:
    """How to show an answer as Markdown: the fence that opens a bare-code answer
    as a code block, "" for an answer that is Markdown already, None while its
    first line is still too short to tell."""
    if "```" in content:
        return ""
    first, newline, _ = content.partition("\n")
    if CODE_LINE.match(first):
        return "```python\n"
    start = first.lstrip()
    may_be_code = not start or CODE_START.fullmatch(start)
    return None if may_be_code and not (newline or done) else ""


def last_code_block(content: str) -> str:
    """The last fenced code block of an answer (a bare-code answer is one)."""
    if code_fence(content, done=True):
        return content
    blocks = re.findall(r"```[^\n]*\n(.*?)(?:```|\Z)", content, flags=re.S)
    return blocks[-1] if blocks else ""


def styled(pieces: Pieces, start: int, end: int, origin: bool, base: str = "") -> Text:
    """Characters `start:end` of the pieces' text, each piece drawn in the draft's
    colour when `origin` and it came from an accepted draft."""
    out, at = Text(style=base), 0
    for piece, drafted in pieces:
        lo, hi = max(start - at, 0), min(end - at, len(piece))
        if lo < hi:
            out.append(piece[lo:hi], DRAFT_STYLE if origin and drafted else "")
        at += len(piece)
        if at >= end:
            break
    return out


class Answer(Vertical):
    """Reasoning (when the model thinks) above the answer: Markdown, or coloured by origin."""

    DEFAULT_CSS = """
    Answer { height: auto; margin: 1 0 0 0; }
    Answer > Collapsible { border-top: none; padding: 0; margin: 0 0 1 0; background: transparent; }
    Answer > Collapsible > Contents { padding: 0 0 0 2; }
    Answer > Markdown { margin: 0; padding: 0; }
    Answer > Markdown > MarkdownFence { margin: 0; }
    Answer > Markdown > MarkdownParagraph:last-child { margin: 0; }
    """

    def __init__(self, pieces: Pieces | None = None, opened: bool = False, done: bool = False,
                 colors: bool = False):
        super().__init__(classes="assistant")
        self.pieces: Pieces = pieces if pieces is not None else []
        self.opened, self.done, self.show_origin = opened, done, colors
        self._scheduled = False
        self._markdown = ""  # the source the Markdown view shows
        self._fence: str | None = None  # decided once: the view never changes form mid-answer
        self._folded = False  # the reasoning folded itself once the answer began

    @property
    def text(self) -> str:
        return "".join(p for p, _ in self.pieces)

    def compose(self):
        with Collapsible(title="Thinking…", collapsed=False, id="thinking"):
            yield Static(id="reasoning")
        yield Markdown(id="md")
        yield Static(id="origin")

    def on_mount(self) -> None:
        for child in self.children:
            child.display = False
        self.redraw()

    def add(self, piece: str, from_draft: bool) -> None:
        self.pieces.append((piece, from_draft))
        self.redraw()

    def finish(self) -> None:
        self.done = True
        self.redraw()

    def set_colors(self, on: bool) -> None:
        self.show_origin = on
        self.redraw()

    def redraw(self) -> None:
        """Draw the pieces after the next refresh: tokens that arrive meanwhile are drawn together."""
        if not self._scheduled:
            self._scheduled = True
            self.call_after_refresh(self._draw)

    async def _draw(self) -> None:
        self._scheduled = False
        if not self.is_attached:  # removed meanwhile (/retry, /clear)
            return
        text = self.text
        span, at = split(text, self.opened, self.done)
        thinking = self.query_one("#thinking", Collapsible)
        if span is not None:
            reasoning = styled(self.pieces, *span, self.show_origin, REASONING_STYLE)
            self.query_one("#reasoning", Static).update(reasoning)
            thinking.title = "Thinking…" if at is None else f"Reasoning ({len(reasoning.plain.split())} words)"
            thinking.display = True
            if at is not None and not self._folded:
                thinking.collapsed, self._folded = True, True
        if at is None:
            return
        at += len(text[at:]) - len(text[at:].lstrip("\n"))
        md, origin = self.query_one("#md", Markdown), self.query_one("#origin", Static)
        if self.show_origin:
            origin.update(styled(self.pieces, at, len(text), True))
            with self.app.batch_update():
                origin.display, md.display = True, False
            return
        if self._fence is None:
            self._fence = code_fence(text[at:], self.done)
            if self._fence is None:
                return
        source = self._fence + text[at:]
        if source != self._markdown:
            grows = bool(self._markdown) and source.startswith(self._markdown)
            self._markdown, old = source, self._markdown
            if not grows:  # Markdown.append after update misplaces a multi-line last block: start empty
                await md.update("")
            await md.append(source[len(old):] if grows else source)
        # Shown only once it holds the answer: switching views never draws a blank frame.
        with self.app.batch_update():
            md.display, origin.display = True, False
