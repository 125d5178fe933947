"""Conversations on disk: saved after every change, whole or not at all.

A conversation is JSON: `{"model", "drafter", "system", "created", "messages":
[{"role", "content"}, ...]}`; an assistant's reasoning (a `<think>` block) is
kept apart from its content as `reasoning_content`, which chat templates that
think (Qwen3's) read back on the next turn. They live in the user's data folder
(`$MLX_SPEC_HOME/conversations` when set), one file per conversation, named by
when it began (`-2`, `-3`, ... after the name where another chat began in the
same second: a file is never another conversation's); export writes Markdown
(`.md`) or the same JSON (`.json`).
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlx_spec.errors import UserError
from mlx_spec.files import data_dir, write_text_atomic


def message(role: str, content: str, reasoning: str = "") -> dict:
    """One message as chat templates take it: reasoning, where there is some, apart."""
    return {"role": role, "content": content, **({"reasoning_content": reasoning} if reasoning else {})}


@dataclass
class Conversation:
    model: str
    drafter: str = "none"
    system: str = ""
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))
    messages: list[dict] = field(default_factory=list)

    def chat(self) -> list[dict]:
        """The messages as the chat template takes them, the system prompt first."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [dict(m) for m in self.messages]


def save(conversation: Conversation, path: Path | None = None) -> Path:
    """Write `conversation` to `path`, whole or not at all; None: to a new file of its own in the
    conversations folder. Returns the file written."""
    text = json.dumps(asdict(conversation), indent=2, ensure_ascii=False)
    if path is not None:
        write_text_atomic(path, text)
        return path
    folder = data_dir() / "conversations"
    folder.mkdir(parents=True, exist_ok=True)
    stamp = conversation.created.replace(":", "").replace("-", "")
    whole = folder / f".{stamp}.{secrets.token_hex(4)}.partial"
    whole.write_text(text, encoding="utf-8")
    try:
        for n in itertools.count(1):
            path = folder / (f"{stamp}.json" if n == 1 else f"{stamp}-{n}.json")
            try:
                os.link(whole, path)  # the whole file under a name no one holds (else FileExistsError)
            except FileExistsError:
                continue
            return path
    finally:
        whole.unlink()


def load(path: Path) -> Conversation:
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not a conversation (invalid JSON: {e})") from None
    except RecursionError:
        raise UserError(f"{path}: not a conversation (nested too deeply)") from None
    messages = data.get("messages") if isinstance(data, dict) else None
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and m.get("role") in ("user", "assistant") and isinstance(m.get("content"), str)
        and isinstance(m.get("reasoning_content", ""), str)
        for m in messages
    ):
        raise UserError(f"{path}: 'messages' must be a list of {{'role': user|assistant, 'content'}} objects "
                        "('reasoning_content', where there is one, a string)")
    strings = {k: data.get(k, "") for k in ("model", "drafter", "system", "created")}
    if not all(isinstance(v, str) for v in strings.values()):
        raise UserError(f"{path}: 'model', 'drafter', 'system' and 'created' must be strings")
    return Conversation(strings["model"], strings["drafter"] or "none", strings["system"],
                        strings["created"] or time.strftime("%Y-%m-%dT%H:%M:%S"),
                        [message(m["role"], m["content"], m.get("reasoning_content", "")) for m in messages])


def markdown(conversation: Conversation) -> str:
    lines = [f"# Conversation with {conversation.model}", "",
             f"*{conversation.created}, drafter: {conversation.drafter}*", ""]
    if conversation.system:
        lines += ["**System:** " + conversation.system, ""]
    for m in conversation.messages:
        lines += [f"## {m['role'].capitalize()}", ""]
        if m.get("reasoning_content"):
            lines += ["> " + line for line in m["reasoning_content"].splitlines()] + [""]
        lines += [m["content"], ""]
    return "\n".join(lines)


def export(conversation: Conversation, path: Path) -> None:
    """Markdown for `.md`, JSON for `.json`."""
    if path.suffix == ".md":
        write_text_atomic(path, markdown(conversation))
    elif path.suffix == ".json":
        save(conversation, path)
    else:
        raise UserError(f"/export {path}: the file must end in .md or .json")
