"""Draw the chat's main screen for the README: `python scripts/chat_snapshot.py OUT.svg`.

Runs `mlx-spec chat` headless on the demo with a drafter, sends two messages,
turns on the colouring by origin, and saves the screen as SVG.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

from mlx_spec.tui.app import ChatApp

MESSAGES = ("Write a Python function `is_prime`: Return True if n is a prime number.",
            "Write a Python function `parse_args`: Parse the command line arguments.")


async def snapshot(out: Path, model: str, drafter: str) -> None:
    app = ChatApp(model, drafter, max_tokens=120)
    async with app.run_test(size=(132, 44)) as pilot:
        for text in MESSAGES:
            while not app.engine.idle():
                await pilot.pause(0.1)
            app.query_one("#prompt").insert(text)
            await pilot.press("enter")
            while app.busy or not app.engine.idle():
                await pilot.pause(0.1)
        await pilot.press("f2")
        await pilot.pause(0.5)
        app.save_screenshot(filename=out.name, path=str(out.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--drafter", default="eagle3")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as home:  # the conversation is not kept
        os.environ["MLX_SPEC_HOME"] = home
        asyncio.run(snapshot(args.out, args.model, args.drafter))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
