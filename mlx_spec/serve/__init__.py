"""`mlx-spec serve`: an OpenAI-compatible server with batched speculative decoding.

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (both with
`"stream": true` as server-sent events), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus). A prompt cache keeps what each request leaves in
the target's cache for the next one that begins alike (`mlx_spec.prefix`).

The package in four layers, each a module:
- `http`: the transport (the standard library's threaded server, timeouts, SSE, clients that go away);
- `openai`: the schema (requests checked field by field, response bodies and stream chunks);
- `tools`: tool calls in the answer's text, in the format of the model's family (mlx-lm's parsers);
- `engine`: continuous batching on the one MLX thread (`mlx_spec.worker`), under --shard on every rank.

SIGINT and SIGTERM stop the server: requests in flight end with a 503 error, the
engine finishes its round, `serve` returns.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Sequence

import mlx.core as mx

from mlx_spec import distributed
from mlx_spec.errors import UserError
from mlx_spec.prefix import PrefixCache, default_bytes
from mlx_spec.weights import checkpoint_digest
from mlx_spec.serve.engine import BatchEngine, log
from mlx_spec.serve.http import READ_TIMEOUT, Server, Site, handler_for
from mlx_spec.serve.openai import Defaults

__all__ = ["READ_TIMEOUT", "serve"]


def _engine(model_name: str, drafter_spec: str, revision: str | None, drafter_revision: str | None,
            extra_eos: Sequence[str], adapter_path: str | None, exact: bool, max_batch: int,
            max_queue: int, prompt_cache_bytes: int | None = None, prompt_cache_dir: str | None = None) -> BatchEngine:
    """The model and drafter loaded, and the engine that decodes with them running."""
    from mlx_spec import api

    api.check_published(drafter_spec, model_name)
    target = api.load(model_name, revision, extra_eos=extra_eos, adapter_path=adapter_path)
    drafter = api.drafter(drafter_spec, target, revision=drafter_revision)
    if drafter is not None and drafter.one_row:
        raise UserError(f"--drafter {drafter_spec}: it drafts into the target's own cache and decodes one "
                        "sequence at a time; serve another drafter")
    width = api.exact_width(target, [drafter]) if exact else None
    bound = default_bytes() if prompt_cache_bytes is None else prompt_cache_bytes
    if distributed.active():  # each rank holds its own share of an entry: their bytes, and so evictions, differ
        bound = 0
    cache = None
    if bound:  # entries on disk are of this checkpoint (and adapters) only
        model = checkpoint_digest(target.path).hex() + (f" {Path(adapter_path).resolve()}" if adapter_path else "")
        cache = PrefixCache(bound, prompt_cache_dir, model)
    return BatchEngine(target.model, target.tokenizer, drafter, max_batch, max_queue, width, cache, drafter_spec)


def serve(model_name: str, drafter_spec: str, host: str, port: int, revision: str | None = None,
          max_batch: int = 16, max_queue: int = 64, max_tokens: int = 4096, timeout: float = 600.0,
          ready: threading.Event | None = None, servers: list | None = None, *, drafter_revision: str | None = None,
          extra_eos: Sequence[str] = (), adapter_path: str | None = None, system: str = "",
          template_args: dict | None = None, read_timeout: float = READ_TIMEOUT, exact: bool = False,
          prompt_cache_bytes: int | None = None, prompt_cache_dir: str | None = None) -> None:
    """Load the model and drafter, then serve until SIGINT or SIGTERM (or `shutdown()` of the server
    appended to `servers`). `system` and `template_args` are what a request gets where it says nothing
    else (a system message first; the chat template's arguments under the request's own). `exact`:
    exact verification (`mlx_spec.exact`): a request's answer is, bit for bit, the one it gets alone.
    `prompt_cache_bytes`: the prompt cache's bound (None: an eighth of the machine's memory; 0: no cache);
    `prompt_cache_dir`: where its entries are kept for the next start too."""
    engine = _engine(model_name, drafter_spec, revision, drafter_revision, extra_eos, adapter_path, exact,
                     max_batch, max_queue, prompt_cache_bytes, prompt_cache_dir)
    main = threading.current_thread() is threading.main_thread()  # (only there can handlers be set)
    if not distributed.leading():  # under --shard: rank 0 listens, and says when to stop (Ctrl-C reaches every rank)
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        engine.thread.join()
        if main:
            signal.signal(signal.SIGINT, previous)
        return
    site = Site(engine, model_name, engine.tokenizer, engine.model.args.max_position_embeddings, max_tokens,
                timeout, Defaults(system, template_args or {}))
    try:
        # Room for every request the engine holds, and some for health checks and idle keep-alive clients.
        server = Server((host, port), handler_for(site, read_timeout), max_connections=max_batch + max_queue + 64)
    except OSError as e:
        engine.stop()
        raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    if servers is not None:
        servers.append(server)
    exactly = f"; exact, {engine.width} tokens wide" if engine.width else ""
    _run(server, engine, main, ready,
         f"mlx-spec serving {model_name} (drafter: {drafter_spec}{exactly}) on http://{host}:{server.server_port}/v1")


def _run(server: Server, engine: BatchEngine, main: bool, ready: threading.Event | None, banner: str) -> None:
    """Serve until a signal (or `server.shutdown()`), then stop the engine and let the answers in flight end."""
    def on_signal(number: int, frame) -> None:
        log(f"{signal.Signals(number).name}: stopping; requests in flight end with an error")
        threading.Thread(target=server.shutdown).start()  # it waits for serve_forever, on this very thread

    signals = (signal.SIGINT, signal.SIGTERM)
    previous = [signal.signal(s, on_signal) for s in signals] if main else []
    if ready is not None:
        ready.set()
    print(banner, flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()  # no new connections
        for s, old in zip(signals, previous):  # a second signal interrupts at once
            signal.signal(s, old)
        engine.stop()
        waited = time.monotonic() + 5  # the last words of the answers in flight (bounded: a client may not read)
        while server.answering and time.monotonic() < waited:
            time.sleep(0.01)
        if not main:  # the model was loaded on this thread, which ends (the main thread's are MLX's own to clear)
            mx.clear_streams()
