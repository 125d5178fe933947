"""Draw the chat's main screen for the README: `python scripts/chat_snapshot.py OUT.svg`.

Runs `mlx-spec chat` headless on the demo with a drafter, turns on the
colouring by origin (F2), asks one question and saves the screen, with its
answer and the stats, as SVG.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

from mlx_spec.tui.app import ChatApp

MESSAGE = "Write a Python function `is_prime`: Return True if n is a prime number."


async def snapshot(out: Path, model: str, drafter: str, message: str, max_tokens: int) -> None:
    app = ChatApp(model, drafter, max_tokens=max_tokens)
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("f2")
        while not app.engine.idle():
            await pilot.pause(0.1)
        app.query_one("#prompt").insert(message)
        await pilot.press("enter")
        while app.busy or not app.engine.idle():
            await pilot.pause(0.1)
        app.clear_notifications()
        await pilot.pause(0.5)
        app.save_screenshot(filename=out.name, path=str(out.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--drafter", default="eagle3")
    parser.add_argument("--message", default=MESSAGE)
    parser.add_argument("--max-tokens", type=int, default=120)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as home:  # the conversation is not kept
        os.environ["MLX_SPEC_HOME"] = home
        asyncio.run(snapshot(args.out, args.model, args.drafter, args.message, args.max_tokens))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
