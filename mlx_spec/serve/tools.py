"""Tool calls in an answer's text, in the format of the model's family.

mlx-lm's tokenizer wrapper knows each family's format from its chat template or
tokenizer config: where a call starts and ends (`tool_call_start`,
`tool_call_end`) and a parser of what lies between (`tool_parser`: Qwen3 and
Hermes' JSON, Mistral's `[TOOL_CALLS]`, Gemma, GLM, Kimi, pythonic calls, ...).
The one family it leaves out is gpt-oss, whose harmony format is read here:
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`,
`<|call|>` ending the answer (it is one of the model's end-of-sequence tokens).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ToolFormat:
    start: str
    end: str  # "": a call runs to the end of the answer
    parse: Callable[[str, list | None], dict | list]  # mlx-lm's `parse_tool_call(text, tools)`


HARMONY_NAME = re.compile(r"\s*([\w.-]+)")


def parse_harmony(text: str, tools: list | None = None) -> dict:
    """`get_weather <|constrain|>json<|message|>{"city": "Paris"}`: the text after `to=functions.`."""
    name = HARMONY_NAME.match(text)
    body = text.rfind("<|message|>")
    if name is None or body < 0:
        raise ValueError(f"not a harmony tool call: {text[:60]!r}")
    arguments = text[body + len("<|message|>"):].strip()
    return {"name": name.group(1), "arguments": json.loads(arguments) if arguments else {}}


HARMONY = ToolFormat(" to=functions.", "", parse_harmony)


def tool_format(tokenizer) -> ToolFormat | None:
    """How `tokenizer`'s model writes a tool call; None where no format is known."""
    if getattr(tokenizer, "has_tool_calling", False):
        return ToolFormat(tokenizer.tool_call_start, tokenizer.tool_call_end or "", tokenizer.tool_parser)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "<|call|>" in template and "<|channel|>" in template:
        return HARMONY
    return None


def _functions(parsed) -> list[dict] | None:
    """A parser's result as OpenAI's `function`s ({name, arguments as a JSON string}); None if malformed."""
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for call in calls:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]):
            return None
        arguments = call.get("arguments", {})
        out.append({"name": call["name"], "arguments": arguments if isinstance(arguments, str)
                    else json.dumps(arguments, ensure_ascii=False)})
    return out or None


class ToolCalls:
    """Splits an answer's text, as it streams, into content and tool calls.

    `feed` and `finish` return events, ("content", text) or ("call", function). Text that may begin
    a call is held back until it cannot; a call is held until it ends (at its end marker, or with
    the answer where its format has none). Whitespace next to a call is dropped; a call its
    parser cannot read stays content, and so does one the answer cut short."""

    def __init__(self, format: ToolFormat, tools: list | None = None):
        self.format, self.tools = format, tools
        self.buffer = ""  # text not given out yet
        self.after_call = False  # the whitespace that follows a call is dropped

    def _parse(self, text: str) -> list[dict] | None:
        try:
            return _functions(self.format.parse(text, self.tools))
        except Exception:  # each family's parser raises its own kind on text it cannot read
            return None

    def _content_before(self, start: int, out: list) -> None:
        """Give out what precedes a call, or what cannot begin one (`start`: where it may begin)."""
        n = len(self.buffer[:start].rstrip())
        if n:
            out.append(("content", self.buffer[:n]))
            self.buffer = self.buffer[n:]

    def feed(self, text: str) -> list[tuple[str, object]]:
        self.buffer += text
        out: list[tuple[str, object]] = []
        opening, closing = self.format.start, self.format.end
        while True:
            if self.after_call:
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    return out
                self.after_call = False
            start = self.buffer.find(opening)
            end = self.buffer.find(closing, start + len(opening)) if start >= 0 and closing else -1
            if end < 0:  # no whole call: give out what cannot belong to one, nor be the whitespace before one
                if start < 0:  # the end may be the beginning of an opening marker
                    start = len(self.buffer) - next(
                        (k for k in range(len(opening) - 1, 0, -1) if self.buffer.endswith(opening[:k])), 0)
                self._content_before(start, out)
                return out
            self._block(start, end + len(closing), out)

    def _block(self, start: int, close: int, out: list) -> None:
        """The call in `buffer[start:close]`, given out as calls or, unreadable, as content."""
        calls = self._parse(self.buffer[start + len(self.format.start) : close - len(self.format.end)])
        if calls is None:
            out.append(("content", self.buffer[:close]))
        else:
            if self.buffer[:start].strip():
                out.append(("content", self.buffer[:start].rstrip()))
            out += [("call", call) for call in calls]
            self.after_call = True
        self.buffer = self.buffer[close:]

    def finish(self) -> list[tuple[str, object]]:
        """The rest, at the end of the answer: a call that runs to the end is read now; one cut short is content."""
        out: list[tuple[str, object]] = []
        if self.after_call:
            self.buffer = self.buffer.lstrip()
        start = self.buffer.find(self.format.start)
        if start >= 0 and not self.format.end:
            self._block(start, len(self.buffer), out)
        if self.buffer:
            out.append(("content", self.buffer))
        self.buffer = ""
        return out


def openai_call(function: dict) -> dict:
    """A tool call as OpenAI's responses carry it."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}
