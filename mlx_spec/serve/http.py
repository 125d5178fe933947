"""The transport of `mlx-spec serve`: the standard library's threaded HTTP server,
made safe for clients that misbehave.

A read timeout on every connection (half-open ones are closed), a bounded
number of connections (then 503), a body that must come whole with a truthful
Content-Length, server-sent events for streams, and a client that goes away
(streaming or not) noticed while its answer is being decoded: its request ends
at the engine's next round.
"""

from __future__ import annotations

import json
import queue
import re
import select
import socket
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

from mlx_spec.serve.engine import BatchEngine, log
from mlx_spec.serve.openai import BadRequest, Defaults, Request, Response, parse_request, shown

MAX_BODY = 8 * 2**20
READ_TIMEOUT = 30.0  # seconds a connection may keep the server waiting for its next bytes
POLL = 0.25  # seconds between checks that a client waiting for its answer is still connected


@dataclass
class Site:
    """What the server's requests reach: the engine, the model's name and tokenizer, the limits."""

    engine: BatchEngine
    model_name: str
    tokenizer: object
    context: int  # tokens a request's prompt and answer may fill
    max_tokens: int  # the most a request may ask for
    timeout: float  # seconds a request may take
    defaults: Defaults = field(default_factory=Defaults)

    def parse(self, body, chat: bool) -> Request:
        return parse_request(body, chat, self.tokenizer, self.context, self.max_tokens, self.timeout, self.defaults,
                             self.engine.model.args.vocab_size)


def handler_for(site: Site, read_timeout: float = READ_TIMEOUT) -> type[BaseHTTPRequestHandler]:
    """The handler class of a server in front of `site`."""
    return type("SiteHandler", (Handler,), {"site": site, "timeout": read_timeout})


class Handler(BaseHTTPRequestHandler):
    """One connection's requests; `site` says what they reach (`handler_for` makes the class for one)."""

    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT  # of every read and write on the connection: a half-open one is closed, not kept
    site: Site

    def log_request(self, code="-", size="-") -> None:  # quiet: one line per request is noise here
        pass

    def log_message(self, format, *args) -> None:  # what went wrong (a timeout, a malformed request line)
        log(f"{self.address_string()}: {format % args}")

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
        elif self.path == "/metrics":
            engine = self.site.engine
            text = engine.stats.render(len(engine.running), engine.waiting.qsize(), engine.prompt_cache).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [
                {"id": self.site.model_name, "object": "model", "created": 0, "owned_by": "mlx-spec"}]})
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
            raise BadRequest(f"'Content-Length' must be one non-negative integer, got {shown(value)}")
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
                request = self.site.parse(body, chat)
            except RecursionError:  # a body just shallow enough for json.loads
                raise BadRequest("the body is nested too deeply") from None
            self.site.engine.submit(request)
        except BadRequest as e:
            self._error(e.status, str(e))
            return
        self.server.answering.add(request.id)
        response = Response(request, self.site.model_name, self.site.tokenizer)
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
            log(f"{self.address_string()}: the client went away ({type(e).__name__}); request {request.id} ends")
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
            log(f"{client_address[0]}: the client went away ({type(error).__name__})")
        else:
            super().handle_error(request, client_address)


