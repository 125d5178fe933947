"""`mlx-spec chat` without a terminal: one message a line on stdin, each answer
on stdout, followed by an empty line; so a chat can be scripted. Under mlx.launch
(`--shard`), every rank reads the lines mlx.launch passes them all, and decodes alike."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from mlx_spec import distributed
from mlx_spec.errors import UserError
from mlx_spec.tui import engine, store
from mlx_spec.tui.answer import reasoning_and_content


def run_lines(model: str, drafter: str, system: str, temp: float, top_p: float, max_tokens: int,
              think: bool | None = None, template_args: dict | None = None, saved: Path | None = None,
              **loading) -> int:
    """The chat over piped lines, going on with the conversation in the file `saved` where given
    (and saved there); `loading`: `engine.Load`'s options."""
    finished = threading.Event()
    failure: list[str] = []
    answer: list[str] = []  # the pieces of the answer being written
    opened = [False]  # the prompt opened a <think> block

    def emit(event) -> None:
        if isinstance(event, engine.Piece):
            answer.append(event.text)
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, engine.Notice):
            print(f"mlx-spec: {event.text}", file=sys.stderr, flush=True)
        elif isinstance(event, engine.Begin):
            opened[0] = event.reasoning
        elif isinstance(event, engine.Failed):
            failure.append(event.text)
            finished.set()
        elif isinstance(event, (engine.Done, engine.Loaded)):
            finished.set()

    def wait() -> None:
        finished.wait()
        finished.clear()
        if failure:
            raise UserError(failure.pop())

    path = saved
    conversation = store.load(saved) if saved is not None else store.Conversation(model, drafter, system)
    conversation.model, conversation.drafter = model, drafter
    eng = engine.ChatEngine(emit)
    eng.submit(engine.Load(model, drafter, **loading))
    wait()
    for line in sys.stdin:
        text = line.strip()
        if not text:
            continue
        conversation.messages.append(store.message("user", text))
        if distributed.leading():  # (under --shard, rank 0 keeps the conversation)
            path = store.save(conversation, path)  # kept even if the answer never comes
        answer.clear()
        eng.submit(engine.Generate(conversation.chat(), temp, top_p, max_tokens, think, template_args))
        wait()
        reasoning, content = reasoning_and_content("".join(answer), opened[0])
        conversation.messages.append(store.message("assistant", content, reasoning))
        if distributed.leading():
            store.save(conversation, path)
        sys.stdout.write("\n\n")
        sys.stdout.flush()
    return 0
