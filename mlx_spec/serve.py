"""`mlx-spec serve`: an OpenAI-compatible server with batched speculative decoding.

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (both with
`"stream": true` as server-sent events), `GET /v1/models`, `GET /health`.
Request fields: `temperature`, `top_p`, `max_tokens`, `stop`, `seed`,
`stream`; other fields are accepted and ignored, as OpenAI's clients send
several. Responses carry `usage` and, in `mlx_spec`, how the drafter did.

HTTP requests are handled on threads; every MLX call runs on one engine thread
that owns the model and a `Decoder`: requests join the batch between
rounds and leave as they finish (continuous batching), each row with its own
drafter session. The waiting queue is bounded (503 when full) and each request
has a deadline (`--timeout`), after which it ends with what it has
(`finish_reason` "length", `mlx_spec.timed_out`). A `seed` seeds the sampler
when its request joins: reproducible when it runs alone.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import mlx.core as mx

from mlx_spec.errors import UserError
from mlx_spec.metrics import Metrics
from mlx_spec.sampling import SamplingParams


class BadRequest(Exception):
    """A request we refuse, with its HTTP status."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Request:
    chat: bool
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop: list[str]
    stream: bool
    seed: int | None
    deadline: float
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    out: queue.Queue = field(default_factory=queue.Queue)  # ("text", str) ... then ("done", dict)


def _number(body: dict, name: str, default, low: float, high: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"'{name}' must be {kind} in [{low}, {high}], got {json.dumps(value)}")
    return value


def parse_request(body, chat: bool, tokenizer, context: int, max_tokens_limit: int, timeout: float) -> Request:
    """A request body checked field by field; a `BadRequest` names the field."""
    from mlx_spec.tokenizer import encode_prompt

    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if chat:
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )):
            raise BadRequest("'messages' must be a non-empty list of {'role', 'content'} objects with string content")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    else:
        text = body.get("prompt")
        if not isinstance(text, str) or not text:
            raise BadRequest("'prompt' must be a non-empty string")
        prompt = encode_prompt(tokenizer, text, chat_template=False)
    max_tokens = _number(body, "max_tokens", 256, 1, max_tokens_limit, integer=True)
    if len(prompt) + max_tokens > context:
        raise BadRequest(f"the prompt ({len(prompt)} tokens) plus 'max_tokens' ({max_tokens}) exceeds the "
                         f"context of {context} tokens")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)):
        raise BadRequest("'stop' must be a string or a list of up to 4 non-empty strings")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise BadRequest("'seed' must be an integer")
    params = SamplingParams(temp=_number(body, "temperature", 0.0, 0, 2),
                            top_p=_number(body, "top_p", 1.0, 1e-6, 1))
    return Request(chat, prompt, params, max_tokens, stop, stream, seed, time.monotonic() + timeout)


class Live:
    """A request being decoded: its text so far, stop strings, stats."""

    def __init__(self, request: Request, tokenizer):
        self.request = request
        self.tokenizer = tokenizer
        self.detok = tokenizer.detokenizer
        self.text = ""
        self.sent = 0  # characters of `text` sent
        self.tokens = 0
        self.metrics = Metrics()

    def feed(self, tokens: list[int]) -> str | None:
        """Add tokens; the finish reason when this request is done."""
        for token in tokens:
            if token in self.tokenizer.eos_token_ids:
                return "stop"
            self.tokens += 1
            self.detok.add_token(token)
            last = self.tokens >= self.request.max_tokens
            if last:
                self.detok.finalize()
            self.text += self.detok.last_segment
            hit = min((i for i in (self.text.find(s) for s in self.request.stop) if i >= 0), default=-1)
            if hit >= 0:
                self.text = self.text[:hit]
                return "stop"
            if last:
                return "length"
        return None

    def flush(self, final: bool) -> None:
        """Send the text not sent yet; while going, hold back what might begin a stop string."""
        hold = 0 if final else max((len(s) - 1 for s in self.request.stop), default=0)
        end = max(self.sent, len(self.text) - hold)
        if end > self.sent:
            self.request.out.put(("text", self.text[self.sent : end]))
            self.sent = end

    def finish(self, reason: str, timed_out: bool = False) -> None:
        self.flush(final=True)
        m = self.metrics
        self.request.out.put(("done", {
            "finish_reason": reason,
            "usage": {"prompt_tokens": len(self.request.prompt), "completion_tokens": self.tokens,
                      "total_tokens": len(self.request.prompt) + self.tokens},
            "mlx_spec": {"tau": m.tau, "acceptance_by_position": m.acceptance_by_position,
                         "target_forwards": m.steps, "drafted_tokens": m.drafted, "accepted_tokens": m.accepted,
                         "timed_out": timed_out},
        }))


class Engine:
    """The one thread that runs MLX: admits requests, steps the batch, answers."""

    def __init__(self, model, tokenizer, drafter, max_batch: int, max_queue: int):
        from mlx_spec.decoding import Decoder

        self.model, self.tokenizer, self.drafter = model, tokenizer, drafter  # one drafter: a row per request
        self.max_batch = max_batch
        self.waiting: queue.Queue = queue.Queue(max_queue)
        self.decoder = Decoder(model)
        self.live: dict[str, Live] = {}
        threading.Thread(target=self._loop, name="mlx-engine", daemon=True).start()

    def submit(self, request: Request) -> None:
        try:
            self.waiting.put_nowait(request)
        except queue.Full:
            raise BadRequest("the server is busy: too many requests waiting, try again", 503) from None

    def _admit(self) -> None:
        while len(self.live) < self.max_batch:
            try:
                request = self.waiting.get(block=not self.live)
            except queue.Empty:
                return
            if request.seed is not None:
                mx.random.seed(request.seed)
            self.decoder.add(request.id, request.prompt, request.params, request.max_tokens, self.drafter)
            self.live[request.id] = Live(request, self.tokenizer)

    def _end(self, key: str, reason: str, timed_out: bool = False) -> None:
        live = self.live.pop(key)
        if any(r.key == key for r in self.decoder.rows):
            self.decoder.remove(key)
        live.finish(reason, timed_out)

    def _loop(self) -> None:
        while True:
            try:
                self._admit()
                events = self.decoder.step()
                now = time.monotonic()
                for key, event in events.items():
                    live = self.live[key]
                    live.metrics.add(event)
                    reason = live.feed(event.tokens)
                    if reason is not None:
                        self._end(key, reason)
                    elif now > live.request.deadline:
                        self._end(key, "length", timed_out=True)
                    else:
                        live.flush(final=False)
            except Exception as e:  # fail the requests in flight, keep serving
                for key in list(self.live):
                    live = self.live.pop(key)
                    live.request.out.put(("error", f"{type(e).__name__}: {e}".splitlines()[0]))
                self.decoder = type(self.decoder)(self.model)
                self.drafter = self.drafter.new_session() if self.drafter is not None else None


def make_handler(engine: Engine, model_name: str, tokenizer, context: int, max_tokens: int, timeout: float):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args) -> None:  # quiet: one line per request is noise here
            pass

        def _json(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            kind = "invalid_request_error" if status < 500 else "server_error"
            self._json(status, {"error": {"message": message, "type": kind, "code": status}})

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [
                    {"id": model_name, "object": "model", "created": 0, "owned_by": "mlx-spec"}]})
            else:
                self._error(404, f"no such endpoint: GET {self.path}")

        def do_POST(self) -> None:
            chat = self.path == "/v1/chat/completions"
            if not chat and self.path != "/v1/completions":
                self._error(404, f"no such endpoint: POST {self.path}")
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if length > 8 * 2**20:
                    raise BadRequest("the body is larger than 8 MiB", 413)
                try:
                    body = json.loads(self.rfile.read(length) or b"null")
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise BadRequest(f"the body is not valid JSON ({e})") from None
                request = parse_request(body, chat, tokenizer, context, max_tokens, timeout)
                engine.submit(request)
            except BadRequest as e:
                self._error(e.status, str(e))
                return
            if request.stream:
                self._stream(request)
            else:
                self._whole(request)

        def _chunk(self, request: Request, text: str | None, done: dict | None) -> dict:
            if request.chat:
                delta = {"content": text} if text is not None else {}
                choice = {"index": 0, "delta": delta, "finish_reason": done and done["finish_reason"]}
                kind = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": done and done["finish_reason"]}
                kind = "text_completion"
            chunk = {"id": request.id, "object": kind, "created": request.created, "model": model_name,
                     "choices": [choice]}
            if done:
                chunk.update(usage=done["usage"], mlx_spec=done["mlx_spec"])
            return chunk

        def _stream(self, request: Request) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            if request.chat:
                first = self._chunk(request, None, None)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                self._event(first)
            while True:
                kind, value = request.out.get()
                if kind == "text":
                    self._event(self._chunk(request, value, None))
                elif kind == "done":
                    self._event(self._chunk(request, None, value))
                    break
                else:
                    self._event({"error": {"message": value, "type": "server_error", "code": 500}})
                    break
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

        def _event(self, payload: dict) -> None:
            self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            self.wfile.flush()

        def _whole(self, request: Request) -> None:
            parts = []
            while True:
                kind, value = request.out.get()
                if kind == "text":
                    parts.append(value)
                elif kind == "error":
                    self._error(500, value)
                    return
                else:
                    break
            text = "".join(parts)
            if request.chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text},
                          "finish_reason": value["finish_reason"]}
                kind = "chat.completion"
            else:
                choice = {"index": 0, "text": text, "finish_reason": value["finish_reason"]}
                kind = "text_completion"
            self._json(200, {"id": request.id, "object": kind, "created": request.created, "model": model_name,
                             "choices": [choice], "usage": value["usage"], "mlx_spec": value["mlx_spec"]})

    return Handler


class Server(ThreadingHTTPServer):
    # Clients that connect at once wait in the listen backlog (socketserver's 5 drops some).
    request_queue_size = 256
    daemon_threads = True


def serve(model_name: str, drafter_spec: str, host: str, port: int, revision: str | None = None,
          max_batch: int = 16, max_queue: int = 64, max_tokens: int = 4096, timeout: float = 600.0,
          ready: threading.Event | None = None, servers: list | None = None) -> None:
    """Load the model and drafter, then serve until interrupted."""
    from mlx_spec import api

    target = api.load(model_name, revision)
    model, tokenizer = target.model, target.tokenizer
    drafter = api.drafter(drafter_spec, target, revision=revision)
    if drafter is not None and drafter.one_row:
        raise UserError(f"--drafter {drafter_spec}: it drafts into the target's own cache and decodes one "
                        "sequence at a time; serve another drafter")
    engine = Engine(model, tokenizer, drafter, max_batch, max_queue)
    context = model.args.max_position_embeddings
    handler = make_handler(engine, model_name, tokenizer, context, max_tokens, timeout)
    try:
        server = Server((host, port), handler)
    except OSError as e:
        raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    if servers is not None:
        servers.append(server)
    if ready is not None:
        ready.set()
    print(f"mlx-spec serving {model_name} (drafter: {drafter_spec}) on http://{host}:{server.server_port}/v1",
          flush=True)
    server.serve_forever()
