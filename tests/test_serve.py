"""`mlx-spec serve`: the official `openai` client, a load test on loopback, bad requests."""

import functools
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from mlx_spec.decoding import plain_steps
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams
from mlx_spec.serve import serve
from mlx_spec.tokenizer import encode_prompt, load_tokenizer


@pytest.fixture(scope="module")
def server(copy_model):
    """A server on a free loopback port for a tiny model trained to copy, with
    prompt lookup as the drafter."""
    ready, servers = threading.Event(), []
    model = str(copy_model)
    threading.Thread(target=serve, args=(model, "lookup", "127.0.0.1", 0),
                     kwargs=dict(max_batch=8, max_queue=64, ready=ready, servers=servers), daemon=True).start()
    assert ready.wait(120)
    yield f"http://127.0.0.1:{servers[0].server_port}", model
    servers[0].shutdown()


@functools.lru_cache(maxsize=None)
def loaded(model_path: str):
    model, path = load_model(model_path)
    return model, load_tokenizer(path)


def expected(model_path: str, text: str, n: int, chat: bool) -> str:
    """What plain greedy decoding of the prompt alone gives."""
    model, tokenizer = loaded(model_path)
    ids = encode_prompt(tokenizer, text, chat_template=chat)
    tokens = []
    for e in plain_steps(model, ids, SamplingParams(), n):
        for t in e.tokens:
            if t in tokenizer.eos_token_ids or len(tokens) == n:
                return tokenizer.decode(tokens)
            tokens.append(t)
    return tokenizer.decode(tokens[:n])


def client(url):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_the_openai_client_streaming_and_not(server):
    url, model = server
    c = client(url)
    assert [m.id for m in c.models.list().data] == [model]
    chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=12,
                                     temperature=0)
    assert chat.choices[0].message.content == expected(model, "hello", 12, chat=True)
    assert chat.usage.completion_tokens <= 12 and chat.model_extra["mlx_spec"]["target_forwards"] >= 1
    pieces, last = [], None
    for chunk in c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                           max_tokens=12, temperature=0, stream=True):
        pieces.append(chunk.choices[0].delta.content or "")
        last = chunk
    assert "".join(pieces) == chat.choices[0].message.content
    assert last.choices[0].finish_reason in ("stop", "length") and last.usage.completion_tokens and last.model_extra["mlx_spec"]["tau"] >= 1
    text = c.completions.create(model=model, prompt="abcdefg abcd", max_tokens=10, temperature=0)
    assert text.choices[0].text == expected(model, "abcdefg abcd", 10, chat=False)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=model, prompt="abcdefg abcd", max_tokens=10, temperature=0, stream=True))
    assert streamed == text.choices[0].text


def test_stop_strings_cut_the_answer(server):
    url, model = server
    full = client(url).completions.create(model=model, prompt="abcdefg abcd", max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[5:7]
    cut = client(url).completions.create(model=model, prompt="abcdefg abcd", max_tokens=16, temperature=0, stop=stop)
    assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_thirty_two_streaming_clients_get_their_own_answers(server):
    url, model = server
    letters = "abcdefghijklmnop"
    prompts = [letters[i % 9 : i % 9 + 4 + i % 5] + " " + letters[i % 9 : i % 9 + 2] for i in range(32)]
    answers: dict[int, str] = {}

    def ask(i):
        c = client(url)
        answers[i] = "".join(ch.choices[0].text for ch in c.completions.create(
            model=model, prompt=prompts[i], max_tokens=16, temperature=0, stream=True))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(answers) == 32
    for i, prompt in enumerate(prompts):  # none lost, none mixed up: each is its prompt's greedy answer
        assert answers[i] == expected(model, prompt, 16, chat=False), i


def post(url: str, body: bytes, path: str = "/v1/chat/completions"):
    request = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("body,needle", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({"messages": "hi"}).encode(), "'messages'"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"}).encode(), "'max_tokens'"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}).encode(), "'temperature'"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}).encode(), "'max_tokens'"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "stop": [1]}).encode(), "'stop'"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "min_p": 1.5}).encode(), "'min_p'"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}).encode(), "'top_logprobs'"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "enable_thinking": "no"}).encode(),
     "'enable_thinking'"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": []}).encode(),
     "'chat_template_kwargs'"),
    (json.dumps({"messages": [{"role": "user", "content": None}]}).encode(), "'messages[0].content'"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "text"}]}]}).encode(),
     "'messages[0].content[0].text'"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
        "name": "f"}}]}).encode(), "no tools"),
])
def test_bad_requests_get_a_4xx_and_the_server_keeps_serving(server, body, needle):
    url, _ = server
    status, payload = post(url, body)
    assert 400 <= status < 500 and needle in payload["error"]["message"]
    status, payload = post(url, json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode())
    assert status == 200 and payload["choices"][0]["message"]["role"] == "assistant"
    with urllib.request.urlopen(url + "/health") as r:
        assert json.loads(r.read()) == {"status": "ok"}


def test_bad_completion_fields_get_a_4xx(server):
    url, _ = server
    for body, needle in [({"prompt": "abc", "logprobs": 21}, "'logprobs'"), ({"prompt": "abc", "top_k": 1.5}, "'top_k'"),
                         ({"prompt": "abc", "seed": 2**64}, "'seed'"), ({"prompt": [1, 10**6]}, "'prompt'"),
                         ({"prompt": [1, True]}, "'prompt'"), ({"prompt": []}, "'prompt'")]:
        status, payload = post(url, json.dumps(body).encode(), "/v1/completions")
        assert status == 400 and needle in payload["error"]["message"], body


def test_a_request_whose_client_went_away_ends(checkpoints):
    """A streaming client that disconnects marks its request cancelled: the engine ends it
    at its next round rather than decoding to `max_tokens`."""
    from mlx_spec.serve.engine import BatchEngine
    from mlx_spec.serve.openai import Request

    model, tokenizer = loaded(str(checkpoints["qwen3"]))
    engine = BatchEngine(model, tokenizer, None, max_batch=2, max_queue=2)
    request = Request(False, encode_prompt(tokenizer, "hello", chat_template=False), SamplingParams(), 3000, [],
                      True, None, time.monotonic() + 600)
    engine.submit(request)
    while (message := request.out.get())[0] == "text":
        request.cancelled = True  # from its first piece on
    assert message[1]["finish_reason"] == "cancelled" and message[1]["usage"]["completion_tokens"] < 3000
    assert not engine.running
    engine.stop()


def test_self_speculation_is_refused_at_start(checkpoints):
    from mlx_spec.errors import UserError

    with pytest.raises(UserError, match="--drafter layerskip"):
        serve(str(checkpoints["qwen3"]), "layerskip", "127.0.0.1", 0)
