"""Time to first token, turn by turn, of a conversation with a long system prompt, through `mlx-spec
serve` on loopback: what the prompt cache saves a chat client or an agent that resends everything.

    python scripts/conversation_ttft.py MODEL [--drafter SPEC] [--system-tokens 2048] [--turns 4]
                                       [--max-tokens 48] [--prompt-cache-bytes N]

The system prompt is a long file to work on (Python's argparse source, cut to about --system-tokens
tokens, as `mlx-spec bench --context` fills prompts); each turn asks about it, streamed, and the
answer joins the conversation. Prints each turn's prompt tokens, the tokens the cache held, the time
to the first token and its ratio to the first turn's; --prompt-cache-bytes 0 measures without the cache.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request

import mlx_spec  # noqa: F401  (OpenBLAS before MLX)
from mlx_spec import api
from mlx_spec.bench.methods import with_file
from mlx_spec.serve import serve

QUESTIONS = ["What does this file define first?", "Which class parses the arguments?",
             "Name one function it defines.", "What would you rename, and why?", "Summarise it in a line."]


def turn(url: str, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
    """One streamed chat completion: seconds to its first token, its text, its usage."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    tic, first, text, usage = time.perf_counter(), None, "", {}
    with urllib.request.urlopen(request, timeout=3600) as response:
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - tic
                text += piece
    return first if first is not None else time.perf_counter() - tic, text, usage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--drafter", default="none")
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-cache-bytes", type=int, default=None)
    args = p.parse_args()
    tokenizer = api.load(args.model).tokenizer
    system = with_file(tokenizer, "Answer questions about it briefly.", args.system_tokens)
    ready, servers = threading.Event(), []
    server = threading.Thread(target=serve, args=(args.model, args.drafter, "127.0.0.1", 0),
                              kwargs=dict(ready=ready, servers=servers, prompt_cache_bytes=args.prompt_cache_bytes))
    server.start()
    ready.wait()
    url = f"http://127.0.0.1:{servers[0].server_port}"
    messages = [{"role": "system", "content": system}]
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT s':>8} {'vs turn 1':>9}")
    first = None
    for i in range(args.turns):
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        seconds, text, usage = turn(url, messages, args.max_tokens)
        messages.append({"role": "assistant", "content": text})
        first = first or seconds
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        print(f"{i + 1:>4} {usage.get('prompt_tokens', 0):>7} {cached:>7} {seconds:>8.3f} {seconds / first:>8.1%}",
              flush=True)
    servers[0].shutdown()
    server.join()


if __name__ == "__main__":
    main()
