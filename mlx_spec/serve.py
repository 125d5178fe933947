"""`mlx-spec serve`: an OpenAI-compatible server with batched speculative decoding.

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (both with
`"stream": true` as server-sent events), `GET /v1/models`, `GET /health`.
Request fields: `temperature`, `top_p`, `top_k`, `min_p`, `max_tokens` (or
`max_completion_tokens`), `stop`, `seed`, `stream`, `logprobs` (and, for chat,
`top_logprobs`); for chat also message content as a list of text parts,
`tools` and `tool_choice` ("auto" or "none"), `chat_template_kwargs` and
`enable_thinking`. Other fields are accepted and ignored, as OpenAI's clients
send several, but those that would change the answer (`n`, `best_of`, `echo`,
`suffix`, the penalties, `logit_bias`, `response_format`) are refused unless
neutral. Responses carry `usage` and, in `mlx_spec`, how the drafter did.

HTTP requests are handled on threads; every MLX call runs on one engine thread
that owns the model and a `Decoder`: requests join the batch between
rounds and leave as they finish (continuous batching), each row with its own
drafter session. The waiting queue is bounded (503 when full) and each request
has a deadline (`--timeout`), after which it ends with what it has
(`finish_reason` "length", `mlx_spec.timed_out`); a client that goes away
(streaming or not) ends its request at the next round. A `seed` seeds the sampler when its request joins:
reproducible when it runs alone.

Hostile clients: a read timeout on every connection (half-open ones are closed),
a bounded number of connections (then 503), a body that must come whole with a
truthful Content-Length, and every field checked before the engine sees it. A
row that fails ends alone with an error; the batch goes on. SIGINT and SIGTERM
stop the server: requests in flight end with a 503 error, the engine finishes
its round, `serve` returns.
"""

from __future__ import annotations

import bisect
import json
import math
import queue
import re
import select
import signal
import socket
import sys
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterable, Iterator, Sequence

import mlx.core as mx

from mlx_spec import distributed
from mlx_spec.errors import UserError
from mlx_spec.metrics import Metrics, TokenLogprob
from mlx_spec.sampling import SamplingParams

MAX_TOP_LOGPROBS = 20
MAX_BODY = 8 * 2**20
READ_TIMEOUT = 30.0  # seconds a connection may keep the server waiting for its next bytes
POLL = 0.25  # seconds between checks that a client waiting for its answer is still connected
# OpenAI fields this server does not implement, accepted only at the value that changes nothing
NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "suffix": "", "presence_penalty": 0, "frequency_penalty": 0,
           "logit_bias": {}, "response_format": {"type": "text"}}
# apply_chat_template's own parameters: set by the server, not template variables a request may pass
TEMPLATE_PARAMETERS = {"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                       "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


class BadRequest(Exception):
    """A request we refuse (or, status 5xx, cannot answer), with its HTTP status."""

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
    # ("text", str, [(offset, TokenLogprob)]) ... then ("done", dict), or ("error", str, HTTP status)
    out: queue.Queue = field(default_factory=queue.Queue)
    cancelled: bool = False  # its client went away


def _shown(value) -> str:
    """A client's value in an error message, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _number(body: dict, name: str, default, low: float, high: float | None, integer: bool = False):
    """`body[name]` checked to be a finite number in [low, high] (no upper bound when `high` is None)."""
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or isinstance(value, bool) or value < low or (high is not None and value > high):
        kind = "an integer" if integer else "a number"
        where = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise BadRequest(f"'{name}' must be {kind} {where}, got {_shown(value)}")
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
            raise BadRequest(f"'{name}.type' must be 'text', got {_shown(part.get('type'))}: "
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
        raise BadRequest(f"'tool_choice' must be 'auto' or 'none', got {_shown(choice)}: "
                         "this server does not force tool calls")
    if tools is None:
        return None
    for name, tool in _objects(tools, "tools", "a list of {'type': 'function', 'function': {...}} objects"):
        if tool.get("type") != "function":
            raise BadRequest(f"'{name}.type' must be 'function', got {_shown(tool.get('type'))}")
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
    for name, neutral in NEUTRAL.items():
        if body.get(name) is not None and body[name] != neutral:
            raise BadRequest(f"'{name}' is not supported by this server: leave it out (or at {_shown(neutral)})")
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
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
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


def _log(message: str) -> None:
    print(f"mlx-spec serve: {message}", file=sys.stderr, flush=True)


def _one_line(error: Exception) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0]


SHUTTING_DOWN = ("error", "the server is shutting down", 503)


class _Nowhere:
    """The answers of a rank but 0 under --shard: rank 0 sends them."""

    def put(self, message) -> None:
        pass


@dataclass
class Plan:
    """What rank 0's engine decided before a round, which every rank applies alike under --shard (the
    others decode rank 0's requests and end them where it does: a client gone and a deadline are its alone;
    the ends a row's own tokens make, every rank finds)."""
    joining: list[Request]
    ending: list[tuple[str, str, bool]]  # (request id, finish reason, timed out)
    stop: bool = False
    digest: int = 0  # of the tokens of every round so far: a rank that parted from rank 0 stops

    FIELDS = ("prompt", "max_tokens", "stop", "seed", "logprobs", "id")  # what decoding a request reads, with params

    def encode(self) -> bytes:
        joining = [{name: getattr(r, name) for name in self.FIELDS} | {"params": vars(r.params)} for r in self.joining]
        plan = {"joining": joining, "ending": self.ending, "stop": self.stop, "digest": self.digest}
        return json.dumps(plan).encode()

    @classmethod
    def decode(cls, data: bytes) -> Plan:
        plan = json.loads(data)
        joining = [Request(False, r["prompt"], SamplingParams(**r["params"]), r["max_tokens"], r["stop"], False,
                           r["seed"], math.inf, r["logprobs"], id=r["id"], out=_Nowhere()) for r in plan["joining"]]
        return cls(joining, [tuple(e) for e in plan["ending"]], plan["stop"], plan["digest"])


class Engine:
    """The one thread that runs MLX: admits requests, steps the batch, answers. Under --shard every rank
    runs one, rank 0's planning each round for all (`Plan`)."""

    def __init__(self, model, tokenizer, drafter, max_batch: int, max_queue: int, width: int | None = None):
        from mlx_spec.decoding import Decoder

        self.model, self.tokenizer, self.drafter = model, tokenizer, drafter  # one drafter: a row per request
        self.max_batch = max_batch
        self.waiting: queue.Queue = queue.Queue(max_queue)
        self.decoder = Decoder(model, width=width)  # width: exact verification, each row a forward of its own
        self.live: dict[str, Live] = {}
        self.stopping = False
        self.digest = 0  # `Plan.digest`
        self.lock = threading.Lock()  # no request is queued once the engine has stopped taking them
        self.thread = threading.Thread(target=self._loop, name="mlx-engine", daemon=True)
        self.thread.start()

    def submit(self, request: Request) -> None:
        with self.lock:
            if self.stopping:
                raise BadRequest("the server is shutting down", 503)
            try:
                self.waiting.put_nowait(request)
            except queue.Full:
                raise BadRequest("the server is busy: too many requests waiting, try again", 503) from None

    def stop(self) -> None:
        """End every request with a 503 and wait for the engine thread, which stops between rounds:
        a thread killed inside an MLX call at interpreter exit aborts the process."""
        with self.lock:
            self.stopping = True
        try:
            self.waiting.put_nowait(None)  # wakes an idle engine (a full queue: it is not waiting)
        except queue.Full:
            pass
        self.thread.join()

    def _plan(self) -> Plan:
        """The requests that join the batch now and the rows that end; rank 0's, under --shard."""
        if not distributed.leading():
            plan = Plan.decode(distributed.from_rank0(b""))
            if plan.digest != self.digest:
                distributed.parted()
            return plan
        joining = []
        while len(self.live) + len(joining) < self.max_batch and not self.stopping:
            try:  # (an idle engine under --shard says it is there now and then)
                request = self.waiting.get(block=not (self.live or joining), timeout=distributed.heartbeat())
            except queue.Empty:
                break
            if request is not None and not request.cancelled:
                joining.append(request)
        now = time.monotonic()
        ending = [(key, "cancelled", False) if live.request.cancelled else (key, "length", True)
                  for key, live in self.live.items() if live.request.cancelled or now > live.request.deadline]
        plan = Plan(joining, ending, self.stopping, self.digest)
        if distributed.active():
            distributed.from_rank0(plan.encode())
        return plan

    def _join(self, request: Request) -> None:
        try:
            if request.seed is not None:
                mx.random.seed(request.seed)
            live = Live(request, self.tokenizer)
            self.decoder.add(request.id, request.prompt, request.params, request.max_tokens, self.drafter,
                             logprobs=request.logprobs)
            self.live[request.id] = live
        except Exception as e:
            self._fail(request, e)

    def _end(self, key: str, reason: str, timed_out: bool = False) -> None:
        live = self.live.pop(key)
        if any(r.key == key for r in self.decoder.rows):
            self.decoder.remove(key)
        live.finish(reason, timed_out)

    def _answer(self, key: str, event) -> None:
        live = self.live[key]
        live.metrics.add(event)
        reason = live.feed(event.tokens, event.logprobs)
        if reason is not None:
            self._end(key, reason)
        else:
            live.flush(final=False)

    def _loop(self) -> None:
        distributed.seed_thread()
        while True:
            try:
                if self._round():
                    break
            except Exception as e:
                distributed.check(e)  # a rank lost ends this one
                # The batched step: one forward for every row, one cache, the drafters' shared state.
                # Whose fault it was cannot be told, nor what it left behind: every row fails, the batch starts anew.
                self._reset(e)
        for key in list(self.live):
            self.live.pop(key).request.out.put(SHUTTING_DOWN)
        while not self.waiting.empty():
            request = self.waiting.get_nowait()
            if request is not None:
                request.out.put(SHUTTING_DOWN)
        mx.clear_streams()  # a thread that ran MLX and ends without this may abort the process at exit

    def _round(self) -> bool:
        """One round; whether the engine stops instead."""
        plan = self._plan()
        if plan.stop:
            for request in plan.joining:
                request.out.put(SHUTTING_DOWN)
            return True
        for request in plan.joining:
            self._join(request)
        for key, reason, timed_out in plan.ending:
            if key in self.live:
                self._guarded(key, self._end, reason, timed_out)
        if self.live:
            for key, event in self.decoder.step().items():
                if distributed.active():
                    self.digest = zlib.crc32(f"{key} {event.tokens}".encode(), self.digest)
                self._guarded(key, self._answer, event)
        return False

    def _guarded(self, key: str, work, *args) -> None:
        """`work(key, *args)`: what it raises ends that row alone."""
        request = self.live[key].request
        try:
            work(key, *args)
        except Exception as e:
            self._fail(request, e)

    def _fail(self, request: Request, error: Exception) -> None:
        """`request` ends with a 500 error; the batch goes on without its row where the decoder
        and drafter are left consistent, and starts anew where they are not."""
        _log(f"request {request.id} failed: {_one_line(error)}")
        self.live.pop(request.id, None)
        request.out.put(("error", f"the server failed on this request ({_one_line(error)})", 500))
        try:
            if any(r.key == request.id for r in self.decoder.rows):
                self.decoder.remove(request.id)
            intact = self._intact()
        except Exception:
            intact = False
        if not intact:
            self._reset(error)

    def _intact(self) -> bool:
        """Whether the decoder's rows, its cache's and the drafter's agree; a row that failed to
        join may have left the drafter a last row of its own, dropped here."""
        n, drafter = len(self.decoder.rows), self.drafter
        if drafter is not None:
            if drafter.rows > max(n, 1):
                drafter.remove(drafter.rows - 1)
            drafter.bind(self.decoder.cache)
        return ((n == 0 or all(c.rows == n for c in self.decoder.cache))
                and (drafter is None or drafter.rows == n or (n == 0 and drafter.rows <= 1)))

    def _reset(self, error: Exception) -> None:
        """Every request in flight fails; a new batch and drafter session serve the next ones."""
        _log(f"the batch failed, {len(self.live)} requests with it: {_one_line(error)}")
        for key in list(self.live):
            self.live.pop(key).request.out.put(("error", f"the server failed on this batch ({_one_line(error)})", 500))
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
                yield {"error": {"message": message[1], "type": "server_error", "code": message[2]}}
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
        """The response body; an error from the engine raises `BadRequest` with its message and status."""
        text, calls, entries = [], [], []
        for message in messages:
            if message[0] == "error":
                raise BadRequest(message[1], message[2])
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


def make_handler(engine: Engine, model_name: str, tokenizer, context: int, max_tokens: int, timeout: float,
                 defaults: Defaults = Defaults(), read_timeout: float = READ_TIMEOUT):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = read_timeout  # of every read and write on the connection: a half-open one is closed, not kept

        def log_request(self, code="-", size="-") -> None:  # quiet: one line per request is noise here
            pass

        def log_message(self, format, *args) -> None:  # what went wrong (a timeout, a malformed request line)
            _log(f"{self.address_string()}: {format % args}")

        def _json(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
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

        def _body(self):
            """The JSON body, read whole."""
            if self.headers.get("Transfer-Encoding") is not None:
                raise BadRequest("'Transfer-Encoding' is not read: send the body with a 'Content-Length'", 411)
            lengths = set(self.headers.get_all("Content-Length") or [])
            if not lengths:
                raise BadRequest("'Content-Length' is required", 411)
            value = lengths.pop().strip()
            if lengths or not re.fullmatch(r"[0-9]{1,12}", value):
                raise BadRequest(f"'Content-Length' must be one non-negative integer, got {_shown(value)}")
            length = int(value)
            if length > MAX_BODY:
                raise BadRequest(f"'Content-Length' is {length}: a body may have at most {MAX_BODY // 2**20} MiB", 413)
            try:
                data = self.rfile.read(length)
            except TimeoutError:
                raise BadRequest(f"the body did not come: 'Content-Length' says {length} bytes, and nothing "
                                 f"came for {self.timeout:g} s", 408) from None
            if len(data) < length:
                raise BadRequest(f"the body has {len(data)} bytes, fewer than its 'Content-Length' of {length}")
            try:
                body = json.loads(data or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadRequest(f"the body is not valid JSON ({e})") from None
            except RecursionError:
                raise BadRequest("the body is nested too deeply") from None
            return body

        def do_POST(self) -> None:
            chat = self.path == "/v1/chat/completions"
            try:
                if not chat and self.path != "/v1/completions":
                    self.close_connection = True  # its body is not read
                    raise BadRequest(f"no such endpoint: POST {self.path}", 404)
                try:
                    body = self._body()
                except BadRequest:
                    self.close_connection = True  # where the next request would begin is unknown
                    raise
                try:
                    request = parse_request(body, chat, tokenizer, context, max_tokens, timeout, defaults)
                except RecursionError:  # a body just shallow enough for json.loads
                    raise BadRequest("the body is nested too deeply") from None
                engine.submit(request)
            except BadRequest as e:
                self._error(e.status, str(e))
                return
            self.server.answering.add(request.id)
            response = Response(request, model_name, tokenizer)
            try:
                if request.stream:
                    self._stream(request, response)
                else:
                    self._json(200, response.whole(self._messages(request)))
            except BadRequest as e:
                self._error(e.status, str(e))
            except (ConnectionError, TimeoutError) as e:
                request.cancelled = True  # the engine ends it at its next round
                self.close_connection = True
                _log(f"{self.address_string()}: the client went away ({type(e).__name__}); request {request.id} ends")
            finally:
                self.server.answering.discard(request.id)

        def _messages(self, request: Request) -> Iterator[tuple]:
            """The engine's messages for `request`, up to its last ("done" or "error"); a client that
            closes its connection meanwhile raises `ConnectionAbortedError`."""
            while True:
                try:
                    message = request.out.get(timeout=POLL)
                except queue.Empty:
                    message = None
                if message is None or message[0] == "text":
                    if self._gone():
                        raise ConnectionAbortedError("the client closed its connection")
                if message is not None:
                    yield message
                    if message[0] != "text":
                        return

        def _gone(self) -> bool:
            """Whether the client has closed its connection (a read would return nothing at once)."""
            if not select.select([self.connection], [], [], 0)[0]:
                return False
            try:
                return not self.connection.recv(1, socket.MSG_PEEK)
            except (BlockingIOError, TimeoutError):
                return False
            except OSError:
                return True

        def _stream(self, request: Request, response: Response) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            for payload in response.chunks(self._messages(request)):
                self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


class Server(ThreadingHTTPServer):
    """A thread per connection, and at most `max_connections` of them: beyond, a 503 at once."""

    # Clients that connect at once wait in the listen backlog (socketserver's 5 drops some).
    request_queue_size = 256
    daemon_threads = True
    BUSY = json.dumps({"error": {"message": "the server is busy: too many connections, try again",
                                 "type": "server_error", "code": 503}}).encode()

    def __init__(self, address: tuple[str, int], handler, max_connections: int):
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(max_connections)
        self.answering: set[str] = set()  # the requests whose answers are being sent

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(self.BUSY), self.BUSY))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):  # a client gone: one line, not a traceback
            _log(f"{client_address[0]}: the client went away ({type(error).__name__})")
        else:
            super().handle_error(request, client_address)


def serve(model_name: str, drafter_spec: str, host: str, port: int, revision: str | None = None,
          max_batch: int = 16, max_queue: int = 64, max_tokens: int = 4096, timeout: float = 600.0,
          ready: threading.Event | None = None, servers: list | None = None, *, drafter_revision: str | None = None,
          extra_eos: Sequence[str] = (), adapter_path: str | None = None, system: str = "",
          template_args: dict | None = None, read_timeout: float = READ_TIMEOUT, exact: bool = False) -> None:
    """Load the model and drafter, then serve until SIGINT or SIGTERM (or `shutdown()` of the server
    appended to `servers`). `system` and `template_args` are what a request gets where it says nothing
    else (a system message first; the chat template's arguments under the request's own). `exact`:
    exact verification (`mlx_spec.exact`): a request's answer is, bit for bit, the one it gets alone."""
    from mlx_spec import api

    api.check_published(drafter_spec, model_name)
    target = api.load(model_name, revision, extra_eos=extra_eos, adapter_path=adapter_path)
    model, tokenizer = target.model, target.tokenizer
    drafter = api.drafter(drafter_spec, target, revision=drafter_revision)
    if drafter is not None and drafter.one_row:
        raise UserError(f"--drafter {drafter_spec}: it drafts into the target's own cache and decodes one "
                        "sequence at a time; serve another drafter")
    width = api.exact_width(target, [drafter]) if exact else None
    engine = Engine(model, tokenizer, drafter, max_batch, max_queue, width)
    main = threading.current_thread() is threading.main_thread()  # (only there can handlers be set)
    if not distributed.leading():  # under --shard: rank 0 listens, and says when to stop (Ctrl-C reaches every rank)
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        engine.thread.join()
        if main:
            signal.signal(signal.SIGINT, previous)
        return
    context = model.args.max_position_embeddings
    handler = make_handler(engine, model_name, tokenizer, context, max_tokens, timeout,
                           Defaults(system, template_args or {}), read_timeout)
    try:
        # Room for every request the engine holds, and some for health checks and idle keep-alive clients.
        server = Server((host, port), handler, max_connections=max_batch + max_queue + 64)
    except OSError as e:
        engine.stop()
        raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None

    def on_signal(number: int, frame) -> None:
        _log(f"{signal.Signals(number).name}: stopping; requests in flight end with an error")
        threading.Thread(target=server.shutdown).start()  # it waits for serve_forever, on this very thread

    signals = (signal.SIGINT, signal.SIGTERM)
    previous = [signal.signal(s, on_signal) for s in signals] if main else []
    if servers is not None:
        servers.append(server)
    if ready is not None:
        ready.set()
    print(f"mlx-spec serving {model_name} (drafter: {drafter_spec}"
          f"{f'; exact, {width} tokens wide' if width else ''}) on http://{host}:{server.server_port}/v1", flush=True)
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
