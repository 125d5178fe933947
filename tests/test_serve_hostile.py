"""`mlx-spec serve` against hostile and careless clients: lying or missing Content-Length,
half-open connections, bodies nested deep, bad fields beside good streams, rows that fail,
clients that go away, and SIGINT/SIGTERM while decoding. Every check talks HTTP to a real
server (in this process, or the `mlx-spec serve` command)."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from mlx_spec import decoding
from mlx_spec.serve import serve
from mlx_spec.serve.engine import InFlight
from tiny import make_checkpoint

READ_TIMEOUT = 1.0
PROMPTS = [f"{'abcdefghijklmnop'[i:i + 3 + i % 4]} {i}" for i in range(16)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hostile") / "qwen3", "qwen3", seed=2)


def start(model, **kwargs) -> tuple[int, object]:
    """An in-process server on a free loopback port: (port, server)."""
    ready, servers = threading.Event(), []
    threading.Thread(target=serve, args=(str(model), kwargs.pop("drafter", "lookup"), "127.0.0.1", 0),
                     kwargs=dict(ready=ready, servers=servers, **{"read_timeout": READ_TIMEOUT, **kwargs}),
                     daemon=True).start()
    assert ready.wait(120)
    return servers[0].server_port, servers[0]


@pytest.fixture(scope="module")
def port(model):
    port, server = start(model, max_batch=16, max_queue=64)
    yield port
    server.shutdown()


def post(port: int, body) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body if isinstance(body, bytes) else json.dumps(body),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    status, payload = response.status, json.loads(response.read())
    conn.close()
    return status, payload


def raw(port: int, data: bytes, half_close: bool = False) -> tuple[int, dict]:
    """Bytes sent as they are; the status and JSON body of the reply, read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def request_bytes(body: bytes, length: str | None = None, extra: str = "") -> bytes:
    length = str(len(body)) if length is None else length
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode() + body


def stream(port: int, body: dict) -> tuple[str, str | None, dict | None]:
    """A streamed completion read to its end: (text, finish reason, error payload)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}))
    response = conn.getresponse()
    assert response.status == 200
    text, reason, error = "", None, None
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        payload = json.loads(line[6:])
        if "error" in payload:
            error = payload["error"]
            continue
        text += payload["choices"][0]["text"]
        reason = payload["choices"][0]["finish_reason"] or reason
    conn.close()
    return text, reason, error


def open_stream(port: int, body: dict) -> socket.socket:
    """A streamed completion asked for on a raw socket, once its first text has come."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(request_bytes(json.dumps({**body, "stream": True}).encode()))
    seen = b""
    while b'"text": "' not in seen.replace(b'"text": ""', b""):
        chunk = s.recv(65536)
        assert chunk, seen
        seen += chunk
    return s


def alone(port: int, prompt: str, n: int) -> str:
    status, payload = post(port, {"prompt": prompt, "max_tokens": n, "temperature": 0})
    assert status == 200, payload
    return payload["choices"][0]["text"]


# --- the body and its Content-Length ----------------------------------------------------

GOOD = json.dumps({"prompt": "abc", "max_tokens": 2}).encode()


@pytest.mark.parametrize("length,status", [("abc", 400), ("-5", 400), ("1_0", 400), ("+9", 400), ("0x10", 400),
                                           (str(9 * 2**20), 413), ("99999999999999999999", 400)])
def test_a_malformed_content_length_is_named(port, length, status):
    code, payload = raw(port, request_bytes(GOOD, length))
    assert code == status and "'Content-Length'" in payload["error"]["message"]


def test_a_missing_or_doubled_content_length_is_refused(port):
    code, payload = raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    assert code == 411 and "'Content-Length' is required" in payload["error"]["message"]
    code, payload = raw(port, request_bytes(GOOD, extra=f"Content-Length: {len(GOOD) + 1}\r\n"))
    assert code == 400 and "one non-negative integer" in payload["error"]["message"]
    code, payload = raw(port, request_bytes(GOOD, extra="Transfer-Encoding: chunked\r\n"))
    assert code == 411 and "Transfer-Encoding" in payload["error"]["message"]


def test_a_body_shorter_than_its_content_length(port):
    # The client says it is done: a 400 at once.
    code, payload = raw(port, request_bytes(GOOD, str(len(GOOD) + 50)), half_close=True)
    assert code == 400 and f"fewer than its 'Content-Length' of {len(GOOD) + 50}" in payload["error"]["message"]
    # The client stays, silent: a 408 after the read timeout, then the connection closes.
    tic = time.monotonic()
    code, payload = raw(port, request_bytes(GOOD, str(len(GOOD) + 50)))
    assert code == 408 and "'Content-Length' says" in payload["error"]["message"]
    assert READ_TIMEOUT * 0.9 < time.monotonic() - tic < READ_TIMEOUT + 5


def test_half_open_connections_are_closed(port):
    """40 connections that stop mid-request (in the request line, in the headers, in the
    body) are each closed after the read timeout (the last with a 408), their threads gone."""
    base = threading.active_count()
    stalls = [b"POST /v1/comp", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", request_bytes(GOOD, "500")]
    held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(40)]
    for i, s in enumerate(held):
        s.sendall(stalls[i % 3])
    deadline = time.monotonic() + READ_TIMEOUT + 10
    for i, s in enumerate(held):
        reply = b""
        while chunk := s.recv(65536):  # the server closes it: recv ends (rather than after 30 s, raising)
            reply += chunk
        assert time.monotonic() < deadline
        assert reply == b"" if i % 3 < 2 else reply.startswith(b"HTTP/1.1 408"), (i, reply)
        s.close()
    while threading.active_count() > base and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= base
    assert alone(port, "abc", 2) is not None  # and it serves on


def test_connections_beyond_the_bound_get_a_503(model):
    """Each connection holds a thread: past max-batch + max-queue + 64 of them, a 503 at once."""
    port, server = start(model, max_batch=1, max_queue=1, read_timeout=30)
    held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(66)]
    try:
        code, payload = raw(port, request_bytes(GOOD))
        assert code == 503 and "too many connections" in payload["error"]["message"]
    finally:
        for s in held:
            s.close()
        server.shutdown()


def test_a_body_nested_deep_gets_a_400(port):
    for body in [b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' * 100_000 + b'"a"' + b"}" * 100_000]:
        code, payload = raw(port, request_bytes(body))
        assert code == 400 and "nested too deeply" in payload["error"]["message"]


# --- the fields -------------------------------------------------------------------------

@pytest.mark.parametrize("body,field", [
    (b'{"prompt": "abc", "temperature": NaN}', "'temperature'"),
    (b'{"prompt": "abc", "top_p": Infinity}', "'top_p'"),
    (b'{"prompt": "abc", "min_p": -Infinity}', "'min_p'"),
    ({"prompt": "abc", "seed": -1}, "'seed'"),
    ({"prompt": "abc", "seed": 2**70}, "'seed'"),
    ({"prompt": "abc", "n": 2}, "'n'"),
    ({"prompt": "abc", "best_of": 3}, "'best_of'"),
    ({"prompt": "abc", "echo": True}, "'echo'"),
    ({"prompt": "abc", "presence_penalty": 0.5}, "'presence_penalty'"),
    ({"prompt": "abc", "logit_bias": {"5": 100}}, "'logit_bias'"),
    ({"prompt": "abc", "stop": 0}, "'stop'"),
    ({"prompt": "abc", "stop": ""}, "'stop'"),
    ({"prompt": "abc", "temperature": "x" * 10**6}, "'temperature'"),
])
def test_every_field_is_checked_before_the_engine(port, body, field):
    code, payload = post(port, body)
    message = payload["error"]["message"]
    assert code == 400 and field in message and len(message) < 200, message


def test_neutral_values_of_unsupported_fields_are_accepted(port):
    """What some clients always send (`n: 1`, penalties 0, a text response format) changes nothing."""
    body = {"prompt": "abc", "max_tokens": 3, "temperature": 0, "n": 1, "presence_penalty": 0,
            "frequency_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"}, "stop": None}
    code, payload = post(port, body)
    assert code == 200 and payload["choices"][0]["text"] == alone(port, "abc", 3)


def test_bad_requests_beside_a_good_stream(port):
    """A good stream goes on, identical to its answer alone, while bad requests of every
    kind come in beside it."""
    good = {"prompt": PROMPTS[0], "max_tokens": 300, "temperature": 0}
    answer = alone(port, PROMPTS[0], 300)
    result = {}
    s = threading.Thread(target=lambda: result.update(zip(("text", "reason", "error"), stream(port, good))))
    s.start()
    bad = [{**good, "seed": -1}, {**good, "seed": 2**70}, {**good, "max_tokens": 10**9}, {**good, "top_k": 1.5}]
    for body in bad:
        assert post(port, body)[0] == 400
    assert raw(port, request_bytes(GOOD, "abc"))[0] == 400
    assert raw(port, request_bytes(b"[" * 100_000))[0] == 400
    assert raw(port, request_bytes(b'{"prompt": "a", "temperature": NaN}'))[0] == 400
    s.join(60)
    assert result == {"text": answer, "reason": "length", "error": None}


# --- the engine isolates a failing row --------------------------------------------------

def test_a_row_that_fails_ends_alone(model, port, monkeypatch):
    """A row whose text cannot be handled, and one whose prompt cannot be read (after the
    drafter gave it a row), each end with a 500 naming the failure; the streams beside them
    complete, identical to their answers alone, and the server serves on."""
    from mlx_spec.tokenizer import encode_prompt, load_tokenizer

    answers = [alone(port, p, 300) for p in PROMPTS[:3]]
    bad_prompt = "this prompt cannot be read"
    bad_ids = encode_prompt(load_tokenizer(model), bad_prompt, chat_template=False)
    feed, prefill = InFlight.feed, decoding.prefill

    def failing_feed(self, tokens, logprobs=None):
        if self.request.max_tokens == 13:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a detokenizer fault")
        return feed(self, tokens, logprobs)

    def failing_prefill(model, tokens, *args, **kwargs):
        if list(tokens) == bad_ids[:-1]:
            raise MemoryError("a prefill fault")
        return prefill(model, tokens, *args, **kwargs)

    monkeypatch.setattr(InFlight, "feed", failing_feed)
    monkeypatch.setattr(decoding, "prefill", failing_prefill)
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.update({i: stream(port, {
        "prompt": PROMPTS[i], "max_tokens": 300, "temperature": 0})})) for i in range(3)]
    for t in threads:
        t.start()
    code, payload = post(port, {"prompt": PROMPTS[5], "max_tokens": 13, "temperature": 0})
    assert code == 500 and "UnicodeDecodeError" in payload["error"]["message"]
    text, reason, error = stream(port, {"prompt": bad_prompt, "max_tokens": 20, "temperature": 0})
    assert error["code"] == 500 and "MemoryError: a prefill fault" in error["message"] and reason is None
    for t in threads:
        t.join(60)
    assert [results[i] for i in range(3)] == [(a, "length", None) for a in answers]
    monkeypatch.undo()
    assert alone(port, PROMPTS[0], 300) == answers[0]


def test_a_failing_batched_step_fails_its_rows_and_the_server_recovers(port, monkeypatch):
    """The batched step itself failing cannot be pinned on one row: the rows in flight end
    with a 500, and the next request is served by a fresh batch."""
    step, calls = decoding.Decoder.step, []

    def failing_step(self):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a step fault")
        return step(self)

    answer = alone(port, PROMPTS[1], 30)
    monkeypatch.setattr(decoding.Decoder, "step", failing_step)
    text, reason, error = stream(port, {"prompt": PROMPTS[1], "max_tokens": 30, "temperature": 0})
    assert error["code"] == 500 and "RuntimeError: a step fault" in error["message"]
    assert alone(port, PROMPTS[1], 30) == answer


# --- clients that go away ---------------------------------------------------------------

@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "whole"])
def test_a_client_that_disconnects_frees_its_row(model, streaming):
    """With one row, a request abandoned with 4000 tokens to go (seconds of decoding) is
    cancelled at the next round: the next request is served as quickly as alone."""
    port, server = start(model, drafter="none", max_batch=1, max_queue=4)
    try:
        tic = time.monotonic()
        alone(port, "abc", 8)
        quick = time.monotonic() - tic
        body = {"prompt": "hello", "max_tokens": 4000, "temperature": 0}
        if streaming:
            s = open_stream(port, body)
        else:
            s = socket.create_connection(("127.0.0.1", port), timeout=60)
            s.sendall(request_bytes(json.dumps(body).encode()))
            time.sleep(0.3)  # decoding
        s.close()
        tic = time.monotonic()
        alone(port, "abc", 8)
        assert time.monotonic() - tic < quick + 1.0  # 4000 tokens take ~7 s
    finally:
        server.shutdown()


def test_64_streams_a_quarter_of_them_abandoned(port):
    """64 concurrent streams (16 prompts, 4 clients each); every fourth client goes away after
    its first text; every other stream completes, equal to its prompt's answer alone."""
    answers = [alone(port, p, 24) for p in PROMPTS]
    results, errors = {}, []

    def client(i):
        body = {"prompt": PROMPTS[i % 16], "max_tokens": 24, "temperature": 0}
        try:
            if i % 4 == 3:
                open_stream(port, body).close()
            else:
                results[i] = stream(port, body)
        except Exception as e:  # reported below, with the client's number
            errors.append((i, e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert sorted(results) == [i for i in range(64) if i % 4 != 3]
    for i, (text, reason, error) in results.items():
        assert (text, error) == (answers[i % 16], None) and reason in ("length", "stop"), i
    assert alone(port, PROMPTS[0], 24) == answers[0]


# --- signals ----------------------------------------------------------------------------

@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_decoding_ends_the_requests_and_exits_0(model, signum):
    """`mlx-spec serve`, two streams decoding and a client gone: SIGINT (Ctrl-C) or SIGTERM
    ends the streams with a 503 error, and the process exits 0 with no traceback; the client
    that went away is one line of the log."""
    proc = subprocess.Popen([sys.executable, "-m", "mlx_spec.cli", "serve", "--model", str(model), "--port", "0",
                             "--max-batch", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        body = {"prompt": "hello", "max_tokens": 4000, "temperature": 0}
        open_stream(port, body).close()
        result = {}
        s = threading.Thread(target=lambda: result.update(zip(("text", "reason", "error"), stream(port, body))))
        s.start()
        kept = open_stream(port, body)
        time.sleep(0.3)
        proc.send_signal(signum)
        s.join(30)
        assert result["error"] == {"message": "the server is shutting down", "type": "server_error", "code": 503}
        assert result["text"] and result["reason"] is None
        rest = b""
        while chunk := kept.recv(65536):
            rest += chunk
        assert b"shutting down" in rest and rest.endswith(b"data: [DONE]\n\n")
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
    stderr = proc.stderr.read()
    assert "Traceback" not in stderr and "terminate called" not in stderr, stderr
    assert stderr.count("the client went away") == 1, stderr
    assert f"{signal.Signals(signum).name}: stopping" in stderr
