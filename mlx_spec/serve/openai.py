"""The OpenAI schema of `mlx-spec serve`: requests checked field by field, answers as
response bodies and stream chunks.

Request fields: `temperature`, `top_p`, `top_k`, `min_p`, `max_tokens` (or
`max_completion_tokens`), `stop`, `seed`, `stream`, `logprobs` (and, for chat,
`top_logprobs`); for chat also message content as a list of text parts,
`tools` and `tool_choice` ("auto" or "none"), `chat_template_kwargs` and
`enable_thinking`. Other fields are accepted and ignored, as OpenAI's clients
send several, but those that would change the answer (`n`, `best_of`, `echo`,
`suffix`, the penalties, `logit_bias`, `response_format`) are refused unless
neutral. Responses carry `usage` and, in `mlx_spec`, how the drafter did.
"""

from __future__ import annotations

import json
import math
import queue
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from mlx_spec.metrics import TokenLogprob
from mlx_spec.sampling import SamplingParams
from mlx_spec.serve.tools import ToolCalls, openai_call, tool_format

MAX_TOP_LOGPROBS = 20
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
    tools: list[dict] | None = None  # offered to the model: tool calls are parsed out of the answer
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    # ("text", str, [(offset, TokenLogprob)]) ... then ("done", dict), or ("error", str, HTTP status)
    out: queue.Queue = field(default_factory=queue.Queue)
    cancelled: bool = False  # its client went away


def shown(value) -> str:
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
        raise BadRequest(f"'{name}' must be {kind} {where}, got {shown(value)}")
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
            raise BadRequest(f"'{name}.type' must be 'text', got {shown(part.get('type'))}: "
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
        raise BadRequest(f"'tool_choice' must be 'auto' or 'none', got {shown(choice)}: "
                         "this server does not force tool calls")
    if tools is None:
        return None
    for name, tool in _objects(tools, "tools", "a list of {'type': 'function', 'function': {...}} objects"):
        if tool.get("type") != "function":
            raise BadRequest(f"'{name}.type' must be 'function', got {shown(tool.get('type'))}")
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
                  defaults: Defaults = Defaults(), vocab: int = 0) -> Request:
    """A request body checked field by field; a `BadRequest` names the field. A completion's prompt
    is text, or token ids (below `vocab`), as OpenAI's API takes it."""
    from mlx_spec.tokenizer import encode_prompt, render_chat

    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    for name, neutral in NEUTRAL.items():
        if body.get(name) is not None and body[name] != neutral:
            raise BadRequest(f"'{name}' is not supported by this server: leave it out (or at {shown(neutral)})")
    tools = None
    if chat:
        messages, tools = _messages(body), _tools(body)
        if tools and "tools" not in str(tokenizer.chat_template or "tools"):  # (None: mlx-lm renders it itself)
            raise BadRequest("'tools': this model's chat template shows the model no tools")
        if tools and tool_format(tokenizer) is None:
            raise BadRequest("'tools': no tool-call format is known for this model's chat template "
                             "(mlx-lm's tool parsers, and gpt-oss's harmony)")
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
        if isinstance(text, list) and text and all(type(t) is int and 0 <= t < vocab for t in text):
            prompt = list(text)
        elif isinstance(text, str) and text:
            prompt = encode_prompt(tokenizer, text, chat_template=False)
        else:
            raise BadRequest(f"'prompt' must be a non-empty string, or a list of token ids (0..{vocab - 1})")
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
                   _logprobs(body, chat), tools)



class Response:
    """A request's answer in OpenAI's form, built from the engine's messages: the whole body
    (`whole`) or the stream's chunks (`chunks`)."""

    def __init__(self, request: Request, model_name: str, tokenizer):
        self.request, self.model_name, self.tokenizer = request, model_name, tokenizer
        self.tools = ToolCalls(tool_format(tokenizer), request.tools) if request.tools else None
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
        return openai_call(function)

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


