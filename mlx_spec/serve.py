"""`mlx-spec serve`: an OpenAI-compatible server with batched speculative decoding.

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (both with
`"stream": true` as server-sent events), `GET /v1/models`, `GET /health`.
Request fields: `temperature`, `top_p`, `top_k`, `min_p`, `max_tokens` (or
`max_completion_tokens`), `stop`, `seed`, `stream`, `logprobs` (and, for chat,
`top_logprobs`); for chat also message content as a list of text parts,
`tools` and `tool_choice` ("auto" or "none"), `chat_template_kwargs` and
`enable_thinking`. Other fields are accepted and ignored, as OpenAI's clients
send several. Responses carry `usage` and, in `mlx_spec`, how the drafter did.

HTTP requests are handled on threads; every MLX call runs on one engine thread
that owns the model and a `Decoder`: requests join the batch between
rounds and leave as they finish (continuous batching), each row with its own
drafter session. The waiting queue is bounded (503 when full) and each request
has a deadline (`--timeout`), after which it ends with what it has
(`finish_reason` "length", `mlx_spec.timed_out`); a streaming client that goes
away ends its request. A `seed` seeds the sampler when its request joins:
reproducible when it runs alone.
"""

from __future__ import annotations

import bisect
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterable, Iterator, Sequence

import mlx.core as mx

from mlx_spec.errors import UserError
from mlx_spec.metrics import Metrics, TokenLogprob
from mlx_spec.sampling import SamplingParams

MAX_TOP_LOGPROBS = 20
# apply_chat_template's own parameters: set by the server, not template variables a request may pass
TEMPLATE_PARAMETERS = {"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                       "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


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
    logprobs: int | None = None  # alternatives reported with each token's log-probability (None: not asked)
    tools: bool = False  # tool calls are parsed out of the answer
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    # ("text", str, [(offset, TokenLogprob)]) ... then ("done", dict), or ("error", str)
    out: queue.Queue = field(default_factory=queue.Queue)
    cancelled: bool = False  # its client went away


def _number(body: dict, name: str, default, low: float, high: float | None, integer: bool = False):
    """`body[name]` checked to be a number in [low, high] (no upper bound when `high` is None)."""
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or value < low or (high is not None and value > high):
        kind = "an integer" if integer else "a number"
        where = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise BadRequest(f"'{name}' must be {kind} {where}, got {json.dumps(value)}")
    return value


def _flag(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false")
    return value


def _objects(value, where: str, what: str) -> Iterator[tuple[str, dict]]:
    """The entries of a list of objects, each with the name an error gives it (`where[j]`)."""
    if not isinstance(value, list):
        raise BadRequest(f"'{where}' must be {what}")
    for j, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise BadRequest(f"'{where}[{j}]' must be an object")
        yield f"{where}[{j}]", entry


def _text(content, where: str) -> str:
    """A message's content: a string, or OpenAI's list of parts of which only text ones are read."""
    if isinstance(content, str):
        return content
    texts = []
    for name, part in _objects(content, where, "a string or a list of {'type': 'text', 'text': ...} parts"):
        if part.get("type") != "text":
            raise BadRequest(f"'{name}.type' must be 'text', got {json.dumps(part.get('type'))}: "
                             "this server reads text only")
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"'{name}.text' must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _function(fn, where: str) -> dict:
    if not isinstance(fn, dict):
        raise BadRequest(f"'{where}' must be an object")
    if not (isinstance(fn.get("name"), str) and fn["name"]):
        raise BadRequest(f"'{where}.name' must be a non-empty string")
    return fn


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's earlier tool calls, arguments as objects (as templates such as Qwen3's read them)."""
    out = []
    for name, call in _objects(calls, where, "a list of tool calls"):
        fn = _function(call.get("function"), f"{name}.function")
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                raise BadRequest(f"'{name}.function.arguments' is not valid JSON") from None
        out.append({**call, "function": {**fn, "arguments": arguments}})
    return out


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages):
        raise BadRequest("'messages' must be a non-empty list of {'role', 'content'} objects")
    out = []
    for name, m in _objects(messages, "messages", "a list of messages"):
        if not isinstance(m.get("role"), str):
            raise BadRequest(f"'{name}.role' must be a string")
        m = dict(m)
        if m.get("tool_calls") is not None:
            m["tool_calls"] = _tool_calls(m["tool_calls"], f"{name}.tool_calls")
            m["content"] = m.get("content") or ""  # None beside tool calls; templates read a string
        m["content"] = _text(m.get("content"), f"{name}.content")
        out.append(m)
    return out


def _tools(body: dict) -> list[dict] | None:
    """The request's function tools, checked; None when none are to be offered (`tool_choice` "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise BadRequest(f"'tool_choice' must be 'auto' or 'none', got {json.dumps(choice)}: "
                         "this server does not force tool calls")
    if tools is None:
        return None
    for name, tool in _objects(tools, "tools", "a list of {'type': 'function', 'function': {...}} objects"):
        if tool.get("type") != "function":
            raise BadRequest(f"'{name}.type' must be 'function', got {json.dumps(tool.get('type'))}")
        fn = _function(tool.get("function"), f"{name}.function")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise BadRequest(f"'{name}.function.parameters' must be a JSON Schema object")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise BadRequest(f"'{name}.function.description' must be a string")
    return tools if tools and choice != "none" else None


def _template_args(body: dict, tools: list[dict] | None) -> dict:
    """What the chat template is given besides the messages."""
    args = body.get("chat_template_kwargs")
    args = {} if args is None else args
    if not isinstance(args, dict):
        raise BadRequest("'chat_template_kwargs' must be an object")
    for name in args:
        if name in TEMPLATE_PARAMETERS:
            raise BadRequest(f"'chat_template_kwargs.{name}' is set by the server; pass template variables only")
    thinking = _flag(body, "enable_thinking")
    return {**args, **({} if thinking is None else {"enable_thinking": thinking}),
            **({"tools": tools} if tools else {})}


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's log-probability comes with (None: not asked)."""
    if not chat:
        return _number(body, "logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
    top = _number(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
    if not _flag(body, "logprobs"):
        if top is not None:
            raise BadRequest("'top_logprobs' needs 'logprobs': true")
        return None
    return top or 0


@dataclass(frozen=True)
class Defaults:
    """What `mlx-spec serve` was started with for requests that do not say."""

    system: str = ""  # `--system`: a system message before a conversation that has none
    template_args: dict = field(default_factory=dict)  # `--chat-template-args`, `--think/--no-think`


def parse_request(body, chat: bool, tokenizer, context: int, max_tokens_limit: int, timeout: float,
                  defaults: Defaults = Defaults()) -> Request:
    """A request body checked field by field; a `BadRequest` names the field."""
    from mlx_spec.tokenizer import encode_prompt, render_chat

    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    tools = None
    if chat:
        messages, tools = _messages(body), _tools(body)
        if tools and "tools" not in str(tokenizer.chat_template or "tools"):  # (None: mlx-lm renders it itself)
            raise BadRequest("'tools': this model's chat template shows the model no tools")
        if defaults.system and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": defaults.system}, *messages]
        args = {**defaults.template_args, **_template_args(body, tools)}
        try:
            prompt = render_chat(tokenizer, messages, args)
        except Exception as e:  # a template is code: what it raises on these messages is the request's fault
            raise BadRequest(f"the chat template cannot render these messages ({type(e).__name__}: {e})"
                             .splitlines()[0]) from None
    else:
        text = body.get("prompt")
        if not isinstance(text, str) or not text:
            raise BadRequest("'prompt' must be a non-empty string")
        prompt = encode_prompt(tokenizer, text, chat_template=False)
    newer = body.get("max_tokens") is None and "max_completion_tokens" in body  # what newer OpenAI clients send
    name = "max_completion_tokens" if newer else "max_tokens"
    max_tokens = _number(body, name, 256, 1, max_tokens_limit, integer=True)
    if len(prompt) + max_tokens > context:
        raise BadRequest(f"the prompt ({len(prompt)} tokens) plus '{name}' ({max_tokens}) exceeds the "
                         f"context of {context} tokens")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)):
        raise BadRequest("'stop' must be a string or a list of up to 4 non-empty strings")
    stream = bool(_flag(body, "stream"))
    seed = _number(body, "seed", None, 0, 2**64 - 1, integer=True)
    params = SamplingParams(temp=_number(body, "temperature", 0.0, 0, 2), top_p=_number(body, "top_p", 1.0, 1e-6, 1),
                            top_k=_number(body, "top_k", 0, 0, None, integer=True),
                            min_p=_number(body, "min_p", 0.0, 0, 1))
    return Request(chat, prompt, params, max_tokens, stop, stream, seed, time.monotonic() + timeout,
                   _logprobs(body, chat), tools is not None)


class Live:
    """A request being decoded: its text so far, stop strings, log-probabilities, stats."""

    def __init__(self, request: Request, tokenizer):
        self.request = request
        self.tokenizer = tokenizer
        self.detok = tokenizer.detokenizer
        self.text = ""
        self.sent = 0  # characters of `text` sent
        self.tokens = 0
        self.logprobs: list[tuple[int, TokenLogprob]] = []  # (where its text starts in `text`, the token's)
        self.given = 0  # entries of `logprobs` sent
        self.metrics = Metrics()

    def feed(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> str | None:
        """Add tokens (with their log-probabilities, if asked for); the finish reason when this request is done."""
        for i, token in enumerate(tokens):
            if token in self.tokenizer.eos_token_ids:
                return "stop"
            self.tokens += 1
            if logprobs is not None:
                self.logprobs.append((len(self.text), logprobs[i]))
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
        """Send the text not sent yet, with its tokens' log-probabilities; while going, hold back
        what might begin a stop string."""
        hold = 0 if final else max((len(s) - 1 for s in self.request.stop), default=0)
        end = max(self.sent, len(self.text) - hold)
        given = len(self.logprobs) if final else bisect.bisect_left(self.logprobs, end, key=lambda e: e[0])
        if end > self.sent or given > self.given:
            self.request.out.put(("text", self.text[self.sent : end], self.logprobs[self.given : given]))
            self.sent, self.given = end, given

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
            self.decoder.add(request.id, request.prompt, request.params, request.max_tokens, self.drafter,
                             logprobs=request.logprobs)
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
                    reason = live.feed(event.tokens, event.logprobs)
                    if reason is not None:
                        self._end(key, reason)
                    elif live.request.cancelled:
                        self._end(key, "cancelled")
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


TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def _tool_call(block: str) -> dict | None:
    """A tool-call block's JSON as OpenAI's `function` ({name, arguments as a JSON string}); None if malformed."""
    try:
        call = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
        return None
    arguments = call.get("arguments", {})
    return {"name": call["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)}


class ToolCalls:
    """Splits an answer's text, as it streams, into content and tool calls written as
    Qwen3's and Hermes' templates ask: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

    `feed` and `finish` return events, ("content", text) or ("call", function). Text that
    may begin a block is held back until it cannot; a block is held until it closes.
    Whitespace next to a tool call is dropped; a malformed block stays content."""

    def __init__(self):
        self.buffer = ""  # text not given out yet
        self.after_call = False  # the whitespace that follows a call is dropped

    def feed(self, text: str) -> list[tuple[str, object]]:
        self.buffer += text
        out: list[tuple[str, object]] = []
        while True:
            if self.after_call:
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    return out
                self.after_call = False
            start = self.buffer.find(TOOL_OPEN)
            end = self.buffer.find(TOOL_CLOSE, start) if start >= 0 else -1
            if end < 0:  # no whole block: give out what cannot belong to one, nor be the whitespace before one
                if start < 0:  # the end may be the beginning of an opening tag
                    start = len(self.buffer) - next(
                        (k for k in range(len(TOOL_OPEN) - 1, 0, -1) if self.buffer.endswith(TOOL_OPEN[:k])), 0)
                n = len(self.buffer[:start].rstrip())
                if n:
                    out.append(("content", self.buffer[:n]))
                    self.buffer = self.buffer[n:]
                return out
            close = end + len(TOOL_CLOSE)
            call = _tool_call(self.buffer[start + len(TOOL_OPEN) : end])
            if call is None:
                out.append(("content", self.buffer[:close]))
            else:
                if self.buffer[:start].strip():
                    out.append(("content", self.buffer[:start].rstrip()))
                out.append(("call", call))
                self.after_call = True
            self.buffer = self.buffer[close:]

    def finish(self) -> list[tuple[str, object]]:
        """The rest, at the end of the answer: an unclosed block is content."""
        rest = self.buffer.lstrip() if self.after_call else self.buffer
        self.buffer = ""
        return [("content", rest)] if rest else []


class Response:
    """A request's answer in OpenAI's form, built from the engine's messages: the whole body
    (`whole`) or the stream's chunks (`chunks`)."""

    def __init__(self, request: Request, model_name: str, tokenizer):
        self.request, self.model_name, self.tokenizer = request, model_name, tokenizer
        self.tools = ToolCalls() if request.tools else None
        self.calls = 0  # tool calls given out

    def _body(self, kind: str, choice: dict) -> dict:
        return {"id": self.request.id, "object": kind, "created": self.request.created, "model": self.model_name,
                "choices": [choice]}

    def _split(self, message: tuple) -> list[tuple[str, object]]:
        """The content and tool calls a message of the engine's brings."""
        if message[0] == "text":
            return self.tools.feed(message[1]) if self.tools else [("content", message[1])]
        return self.tools.finish() if self.tools else []

    def _call(self, function: dict) -> dict:
        self.calls += 1
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}

    def _finish_reason(self, done: dict) -> str:
        return "tool_calls" if self.calls and done["finish_reason"] == "stop" else done["finish_reason"]

    def _token(self, token: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token])
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode())}  # OpenAI's floor

    def _logprobs(self, entries: list[tuple[int, TokenLogprob]]) -> dict:
        """Chat completions' form (`content`, each token with its `top_logprobs`), or the legacy one of completions."""
        if self.request.chat:
            return {"content": [{**self._token(e.token, e.logprob),
                                 "top_logprobs": [self._token(t, lp) for t, lp in e.top]} for _, e in entries],
                    "refusal": None}
        tokens = [self._token(e.token, e.logprob) for _, e in entries]
        tops = [[self._token(t, lp) for t, lp in e.top] for _, e in entries]
        return {"tokens": [t["token"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
                "top_logprobs": [{t["token"]: t["logprob"] for t in top} for top in tops],
                "text_offset": [offset for offset, _ in entries]}

    def chunks(self, messages: Iterable[tuple]) -> Iterator[dict]:
        """The stream's payloads: content as it comes, each tool call once its block closes, then the
        finish reason with `usage` and `mlx_spec` (an error ends the stream with an error payload)."""
        kind = "chat.completion.chunk" if self.request.chat else "text_completion"
        if self.request.chat:
            yield self._body(kind, {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        entries: list = []  # log-probabilities not given out yet: they go with the next chunk
        for message in messages:
            if message[0] == "error":
                yield {"error": {"message": message[1], "type": "server_error", "code": 500}}
                return
            entries += message[2] if message[0] == "text" else []
            for what, value in self._split(message):
                if not self.request.chat:
                    choice = {"index": 0, "text": value, "finish_reason": None}
                elif what == "content":
                    choice = {"index": 0, "delta": {"content": value}, "finish_reason": None}
                else:
                    call = self._call(value)
                    choice = {"index": 0, "delta": {"tool_calls": [{"index": self.calls - 1, **call}]},
                              "finish_reason": None}
                if self.request.logprobs is not None:
                    choice["logprobs"], entries = self._logprobs(entries), []
                yield self._body(kind, choice)
            if message[0] == "done":
                last = {"index": 0, "finish_reason": self._finish_reason(message[1])}
                last.update({"delta": {}} if self.request.chat else {"text": ""})
                if self.request.logprobs is not None and entries:
                    last["logprobs"] = self._logprobs(entries)
                yield {**self._body(kind, last), "usage": message[1]["usage"], "mlx_spec": message[1]["mlx_spec"]}
                return

    def whole(self, messages: Iterable[tuple]) -> dict:
        """The response body; an error from the engine raises `RuntimeError` with its message."""
        text, calls, entries = [], [], []
        for message in messages:
            if message[0] == "error":
                raise RuntimeError(message[1])
            entries += message[2] if message[0] == "text" else []
            for what, value in self._split(message):
                if what == "content":
                    text.append(value)
                else:
                    calls.append(self._call(value))
            if message[0] == "done":
                done = message[1]
        content = "".join(text)
        if self.request.chat:
            answer = {"role": "assistant", "content": content or (None if calls else "")}
            if calls:
                answer["tool_calls"] = calls
            choice, kind = {"index": 0, "message": answer}, "chat.completion"
        else:
            choice, kind = {"index": 0, "text": content}, "text_completion"
        choice["finish_reason"] = self._finish_reason(done)
        if self.request.logprobs is not None:
            choice["logprobs"] = self._logprobs(entries)
        return {**self._body(kind, choice), "usage": done["usage"], "mlx_spec": done["mlx_spec"]}


def messages_of(request: Request) -> Iterator[tuple]:
    """The engine's messages for `request`, up to its last ("done" or "error")."""
    while True:
        message = request.out.get()
        yield message
        if message[0] != "text":
            return


def make_handler(engine: Engine, model_name: str, tokenizer, context: int, max_tokens: int, timeout: float,
                 defaults: Defaults = Defaults()):
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
                request = parse_request(body, chat, tokenizer, context, max_tokens, timeout, defaults)
                engine.submit(request)
            except BadRequest as e:
                self._error(e.status, str(e))
                return
            response = Response(request, model_name, tokenizer)
            if request.stream:
                self._stream(request, response)
            else:
                try:
                    self._json(200, response.whole(messages_of(request)))
                except RuntimeError as e:
                    self._error(500, str(e))

        def _stream(self, request: Request, response: Response) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            try:
                for payload in response.chunks(messages_of(request)):
                    self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                request.cancelled = True  # the engine ends it at its next round

    return Handler


class Server(ThreadingHTTPServer):
    # Clients that connect at once wait in the listen backlog (socketserver's 5 drops some).
    request_queue_size = 256
    daemon_threads = True


def serve(model_name: str, drafter_spec: str, host: str, port: int, revision: str | None = None,
          max_batch: int = 16, max_queue: int = 64, max_tokens: int = 4096, timeout: float = 600.0,
          ready: threading.Event | None = None, servers: list | None = None, *, drafter_revision: str | None = None,
          extra_eos: Sequence[str] = (), adapter_path: str | None = None, system: str = "",
          template_args: dict | None = None) -> None:
    """Load the model and drafter, then serve until interrupted. `system` and
    `template_args` are what a request gets where it says nothing else (a system
    message first; the chat template's arguments under the request's own)."""
    from mlx_spec import api

    api.check_published(drafter_spec, model_name)
    target = api.load(model_name, revision, extra_eos=extra_eos, adapter_path=adapter_path)
    model, tokenizer = target.model, target.tokenizer
    drafter = api.drafter(drafter_spec, target, revision=drafter_revision)
    if drafter is not None and drafter.one_row:
        raise UserError(f"--drafter {drafter_spec}: it drafts into the target's own cache and decodes one "
                        "sequence at a time; serve another drafter")
    engine = Engine(model, tokenizer, drafter, max_batch, max_queue)
    context = model.args.max_position_embeddings
    handler = make_handler(engine, model_name, tokenizer, context, max_tokens, timeout, Defaults(system, template_args or {}))
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
