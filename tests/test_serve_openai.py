"""`mlx-spec serve` as OpenAI's clients drive it: content parts, sampling fields,
chat template arguments, tools and tool calls, log-probabilities (and that
they are the target's own, gathered by the decoder from its verification)."""

import json
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import openai
import pytest

from mlx_spec import api
from mlx_spec.decoding import Decoder
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams
from mlx_spec.serve import serve
from mlx_spec.tokenizer import load_tokenizer, render_chat

QWEN3_TEMPLATE = Path(__file__).parent / "fixtures" / "qwen3-template" / "chat_template.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HELLO = [{"role": "user", "content": "hello"}]


# --- log-probabilities from the decoder -------------------------------------------------

@pytest.mark.parametrize("temp", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["lookup", "eagle3"])
def test_logprobs_are_the_targets_log_softmax_at_each_token(kind, temp):
    """With a drafter, each committed token's log-probability and its top 3 are those of
    a plain forward of the target over prompt + answer (its logits over the
    temperature when sampling); a row that did not ask gets none."""
    target = api.load("demo")
    drafter = api.drafter(kind, target)
    prompt = api.prompt_ids(target, "Write a Python function `is_prime`: Return True if n is a prime number.")
    params = SamplingParams(temp=temp)
    mx.random.seed(0)
    decoder = Decoder(target.model, num_draft=4)
    decoder.add("asked", prompt, params, 40, drafter, logprobs=3)
    decoder.add("not", prompt[:-3], params, 40, drafter)
    tokens, entries, drafted, accepted = [], [], 0, 0
    while decoder.rows:
        for key, event in decoder.step().items():
            if key == "not":
                assert event.logprobs is None
                continue
            assert len(event.logprobs) == len(event.tokens)
            tokens += event.tokens
            entries += event.logprobs
            drafted, accepted = drafted + len(event.drafted), accepted + event.accepted
    assert len(tokens) == 40 and drafted > 0 and (accepted > 0 or temp > 0)  # drafts were verified (greedy: kept)
    logits, _ = target.model(mx.array([prompt + tokens]), target.model.make_cache())
    x = logits[0, len(prompt) - 1 : -1].astype(mx.float32) / (temp or 1.0)
    reference = np.array(x - mx.logsumexp(x, axis=-1, keepdims=True))
    for i, (token, entry) in enumerate(zip(tokens, entries)):
        assert entry.token == token
        assert abs(entry.logprob - reference[i, token]) < 1e-4, i
        best = np.argsort(-reference[i])[:3]
        assert [t for t, _ in entry.top] == best.tolist(), i
        assert np.allclose([lp for _, lp in entry.top], reference[i, best], atol=1e-4)


# --- the server, driven by the openai client --------------------------------------------

@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> Path:
    """A tiny Qwen3 with Qwen3's own chat template (tools, tool calls, `enable_thinking`)."""
    from tiny import make_checkpoint

    path = make_checkpoint(tmp_path_factory.mktemp("qwen3-tools") / "qwen3", "qwen3", seed=3)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_TEMPLATE.read_text()
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def client(qwen3):
    ready, servers = threading.Event(), []
    threading.Thread(target=serve, args=(str(qwen3), "lookup", "127.0.0.1", 0),
                     kwargs=dict(max_batch=4, ready=ready, servers=servers), daemon=True).start()
    assert ready.wait(120)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{servers[0].server_port}/v1", api_key="none", max_retries=0)
    servers[0].shutdown()


def chat(client, messages=HELLO, **fields):
    return client.chat.completions.create(model="m", messages=messages, **{"max_tokens": 6, "temperature": 0, **fields})


def test_tools_and_template_arguments_reach_the_chat_template(client, qwen3):
    tokenizer = load_tokenizer(qwen3)

    def rendered(messages=HELLO, **args) -> int:
        return len(render_chat(tokenizer, messages, args))

    assert "get_weather" in tokenizer.decode(render_chat(tokenizer, HELLO, {"tools": [WEATHER]}))
    assert chat(client).usage.prompt_tokens == rendered()
    assert chat(client, tools=[WEATHER]).usage.prompt_tokens == rendered(tools=[WEATHER]) > rendered()
    assert chat(client, tools=[WEATHER], tool_choice="none").usage.prompt_tokens == rendered()
    # (mlx-lm turns thinking off by default for a vocabulary without <think>: on differs)
    on = rendered(enable_thinking=True)
    assert on != rendered()
    assert chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": True}}).usage.prompt_tokens == on
    assert chat(client, extra_body={"enable_thinking": True}).usage.prompt_tokens == on
    # An earlier tool call (arguments as a JSON string) and its result go to the template as Qwen3's reads them.
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = HELLO + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    parsed = HELLO + [{"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, turns[-1]]
    assert '"arguments": {"city": "Paris"}' in tokenizer.decode(render_chat(tokenizer, parsed, {"tools": [WEATHER]}))
    assert chat(client, turns, tools=[WEATHER]).usage.prompt_tokens == rendered(parsed, tools=[WEATHER])


def test_content_parts_and_sampling_fields(client):
    greedy = chat(client).choices[0].message.content
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    assert chat(client, [{"role": "user", "content": parts}]).choices[0].message.content == greedy
    # One token left to draw from, at any temperature: the greedy answer.
    assert chat(client, temperature=1.5, extra_body={"top_k": 1}).choices[0].message.content == greedy
    assert chat(client, temperature=1.5, extra_body={"min_p": 1.0}).choices[0].message.content == greedy


def test_logprobs_whole_and_streamed(client, qwen3):
    reply = chat(client, logprobs=True, top_logprobs=3, max_tokens=8)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    # the decoder's own, for the prompt alone
    model, tokenizer = load_model(str(qwen3))[0], load_tokenizer(qwen3)
    decoder = Decoder(model)
    decoder.add(0, render_chat(tokenizer, HELLO), SamplingParams(), len(content), logprobs=3)
    alone = []
    while decoder.rows:
        alone += decoder.step()[0].logprobs
    for entry, own in zip(content, alone):
        assert entry.token == tokenizer.decode([own.token]) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(own.logprob, abs=1e-5)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([lp for _, lp in own.top], abs=1e-5)
    streamed = [t for chunk in chat(client, logprobs=True, top_logprobs=3, max_tokens=8, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    assert chat(client).choices[0].logprobs is None

    text = client.completions.create(model="m", prompt="abc", max_tokens=6, temperature=0, logprobs=2)
    legacy = text.choices[0].logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs) == len(legacy.text_offset)
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(lp)  # greedy: each token is the likeliest
               for top, lp in zip(legacy.top_logprobs, legacy.token_logprobs))
    pieces = [c.choices[0].logprobs for c in client.completions.create(
        model="m", prompt="abc", max_tokens=6, temperature=0, logprobs=2, stream=True) if c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens] == legacy.tokens


@pytest.mark.parametrize("fields,needle", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": {"type": "function"}}, "'tools'"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[1].type"),
    ({"messages": HELLO + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"extra_body": {"chat_template_kwargs": {"tokenize": False}}}, "chat_template_kwargs.tokenize"),
    ({"extra_body": {"top_k": -1}}, "'top_k'"),
    ({"logprobs": True, "top_logprobs": 21}, "'top_logprobs'"),
    ({"seed": -1}, "'seed'"),
])
def test_bad_fields_are_named_in_the_clients_error(client, fields, needle):
    fields = {"messages": HELLO, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, **fields)
    assert needle in caught.value.message
    assert chat(client).choices[0].finish_reason in ("stop", "length")  # and it keeps serving


def test_the_servers_own_system_prompt_and_template_arguments(qwen3):
    """`mlx-spec serve --system TEXT --think`: what a request gets where it says nothing
    else; a request's own system message and template arguments win."""
    ready, servers = threading.Event(), []
    threading.Thread(target=serve, args=(str(qwen3), "none", "127.0.0.1", 0),
                     kwargs=dict(ready=ready, servers=servers, system="Be brief.",
                                 template_args={"enable_thinking": True}), daemon=True).start()
    assert ready.wait(120)
    own = openai.OpenAI(base_url=f"http://127.0.0.1:{servers[0].server_port}/v1", api_key="none", max_retries=0)
    tokenizer = load_tokenizer(qwen3)
    system = [{"role": "system", "content": "Be brief."}]
    try:
        assert chat(own).usage.prompt_tokens == len(render_chat(tokenizer, system + HELLO, {"enable_thinking": True}))
        off = chat(own, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert off.usage.prompt_tokens == len(render_chat(tokenizer, system + HELLO, {"enable_thinking": False}))
        theirs = [{"role": "system", "content": "You are a pirate, and you talk like one."}] + HELLO
        assert chat(own, theirs).usage.prompt_tokens == len(render_chat(tokenizer, theirs, {"enable_thinking": True}))
    finally:
        servers[0].shutdown()


def test_a_tool_call_the_model_writes_reaches_the_client(qwen3, monkeypatch):
    """End to end through the server: the model's tokens are scripted (a tiny model
    does not write tool calls) by replacing each round's tokens with the script's
    next ones; everything after them (detokenising, the tool-call splitter, the
    OpenAI forms, the HTTP stream) is the server's own."""
    from mlx_spec.decoding import Decoder

    tokenizer = load_tokenizer(qwen3)
    said = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    script = tokenizer.encode(said, add_special_tokens=False) + [min(tokenizer.eos_token_ids)]
    step, written = Decoder.step, {}

    def scripted_step(self):
        events = step(self)
        for key, event in events.items():
            done = written.setdefault(key, 0)
            event.tokens = script[done : done + len(event.tokens)]
            written[key] = done + len(event.tokens)
        return events

    monkeypatch.setattr(Decoder, "step", scripted_step)
    ready, servers = threading.Event(), []
    threading.Thread(target=serve, args=(str(qwen3), "none", "127.0.0.1", 0),
                     kwargs=dict(ready=ready, servers=servers), daemon=True).start()
    assert ready.wait(120)
    own = openai.OpenAI(base_url=f"http://127.0.0.1:{servers[0].server_port}/v1", api_key="none", max_retries=0)
    try:
        whole = chat(own, tools=[WEATHER], max_tokens=len(script) + 4).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
        (call,) = whole.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        content, calls, reasons = "", [], []
        for chunk in chat(own, tools=[WEATHER], max_tokens=len(script) + 4, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                calls += choice.delta.tool_calls or []
                reasons += [choice.finish_reason] if choice.finish_reason else []
        assert content == "Let me check." and reasons == ["tool_calls"]
        (streamed,) = calls
        assert streamed.index == 0 and streamed.id and streamed.function.name == "get_weather"
        assert json.loads(streamed.function.arguments) == {"city": "Paris"}
    finally:
        servers[0].shutdown()
