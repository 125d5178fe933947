"""Tool calls out of an answer's text, for the families whose formats differ: Qwen3's
`<tool_call>` JSON and Mistral's `[TOOL_CALLS]` (parsed by mlx-lm's parsers) and
gpt-oss's harmony channels (which mlx-lm does not parse). Each family's tokenizer
is a tiny one laid out as its repository publishes it: the same special tokens,
the same chat template in the same file, the same end-of-sequence tokens, the same
kind of decoder (byte-level BPE, or SentencePiece-style with byte fallback)."""

import json
import math
from pathlib import Path

import pytest

from mlx_spec.sampling import SamplingParams
from mlx_spec.serve.engine import InFlight
from mlx_spec.serve.openai import Request, Response
from mlx_spec.serve.tools import HARMONY, ToolCalls, ToolFormat, tool_format
from tiny import CORPUS
from mlx_spec.tokenizer import load_tokenizer, model_eos_ids, render_chat

FIXTURES = Path(__file__).parent / "fixtures"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# family: (the repository mirrored, its special tokens, its end-of-sequence tokens, where its chat template is kept,
#          its tokenizer_config.json fields but the template, its decoder's kind)
FAMILIES = {
    "qwen3": ("Qwen/Qwen3-0.6B",
              ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"],
              ["<|im_end|>", "<|endoftext|>"], "tokenizer_config.json",
              {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
               "bos_token": None, "model_max_length": 131072}, "byte-level"),
    "gpt-oss": ("openai/gpt-oss-20b",
                ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                 "<|end|>", "<|message|>", "<|call|>"],
                ["<|return|>", "<|endoftext|>", "<|call|>"], "chat_template.jinja",
                {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
                 "pad_token": "<|endoftext|>", "model_max_length": 1000000000000000019884624838656}, "byte-level"),
    "mistral": ("mistralai/Mistral-7B-Instruct-v0.3",
                ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                 "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
                ["</s>"], "tokenizer_config.json",
                {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                 "add_bos_token": True, "add_eos_token": False, "legacy": False, "model_max_length": 1000000000000000019884624838656},
                "sentencepiece"),
}
TEMPLATES = {"qwen3": "qwen3-template", "gpt-oss": "gpt-oss-template", "mistral": "mistral-template"}

# A call to get_weather(city="Paris") as each family's model writes it, up to its end-of-sequence token.
ANSWERS = {
    "qwen3": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
    "gpt-oss": ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'),
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>',
}


def write_tokenizer(out: Path, family: str) -> Path:
    """A tiny tokenizer in `family`'s published layout (see FAMILIES)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    _, special, eos, template_file, config, kind = FAMILIES[family]
    if kind == "byte-level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # Mistral's: SentencePiece pieces with "▁" for spaces and bytes as <0xNN> tokens
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        alphabet = []
        special = special + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400 + len(special), special_tokens=special, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator([CORPUS + ANSWERS[family]] * 4, trainer)
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    template = (FIXTURES / TEMPLATES[family] / "chat_template.jinja").read_text()
    if template_file == "chat_template.jinja":
        (out / template_file).write_text(template)
    else:
        config = {**config, "chat_template": template}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    ids = [tok.token_to_id(t) for t in eos]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids if len(ids) > 1 else ids[0]}))
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = write_tokenizer(tmp_path_factory.mktemp("tokenizers") / request.param, request.param)
    return request.param, load_tokenizer(path, model_eos_ids(path))


def answer(tokenizer, text: str, stream: bool, tools=(WEATHER,)) -> dict | list[dict]:
    """The response (or the stream's chunks) for a model that wrote `text`, token by token as decoded."""
    request = Request(True, [1], SamplingParams(), 256, [], stream, None, math.inf, tools=list(tools) or None)
    flight = InFlight(request, tokenizer)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    reason = next((r for token in tokens if (r := flight.feed([token])) is not None), None)
    flight.finish(reason or "length")
    messages = []
    while not request.out.empty():
        messages.append(request.out.get())
    response = Response(request, "m", tokenizer)
    return list(response.chunks(messages)) if stream else response.whole(messages)


def test_each_familys_tool_call_comes_back_as_openai_tool_calls(family):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    name, tokenizer = family
    assert tool_format(tokenizer) is not None and (tool_format(tokenizer) is HARMONY) == (name == "gpt-oss")
    prompt = tokenizer.decode(render_chat(tokenizer, [{"role": "user", "content": "Weather in Paris?"}],
                                          {"tools": [WEATHER]}))
    assert "get_weather" in prompt  # the template shows the model its tools

    reply = ChatCompletion.model_validate(answer(tokenizer, ANSWERS[name], stream=False))
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("function", "get_weather", {"city": "Paris"})]
    assert "get_weather" not in (choice.message.content or "")

    chunks = [ChatCompletionChunk.model_validate(c) for c in answer(tokenizer, ANSWERS[name], stream=True)]
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_without_tools_the_call_stays_text(family):
    name, tokenizer = family
    body = answer(tokenizer, ANSWERS[name], stream=False, tools=())
    assert body["choices"][0]["finish_reason"] == "stop" and "get_weather" in body["choices"][0]["message"]["content"]


# --- the splitter, on Qwen3's format ---------------------------------------------------------

def json_tools() -> ToolFormat:
    from mlx_lm.tool_parsers import json_tools

    return ToolFormat(json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call)


ANSWER = ('Let me look that up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>')
CALLS = [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
         {"name": "get_weather", "arguments": '{"city": "Zürich"}'}]


def split(pieces: list[str], format: ToolFormat | None = None) -> list[tuple[str, object]]:
    """What `ToolCalls` gives for text fed in these pieces, consecutive content joined."""
    parser, events = ToolCalls(format or json_tools()), []
    for piece in pieces:
        events += parser.feed(piece)
    merged = []
    for what, value in events + parser.finish():
        if what == "content" and merged and merged[-1][0] == "content":
            merged[-1] = ("content", merged[-1][1] + value)
        else:
            merged.append((what, value))
    return merged


def test_tool_call_blocks_are_parsed_whole_or_in_tiny_pieces():
    whole = split([ANSWER])
    assert whole == [("content", "Let me look that up."), ("call", CALLS[0]), ("call", CALLS[1])]
    assert split(list(ANSWER)) == whole  # one character at a time
    for cut in range(len(ANSWER)):
        assert split([ANSWER[:cut], ANSWER[cut:]]) == whole, cut
    # Text that only looks like a block, a malformed block, an unclosed one: content as written.
    for text in ["a <tool b < c", 'x <tool_call>{"name": </tool_call> y', 'so <tool_call>\n{"name": "get_we']:
        assert split(list(text)) == [("content", text)]
    # Nothing is held back that cannot begin a block.
    parser = ToolCalls(json_tools())
    assert parser.feed("It is <") == [("content", "It is")]
    assert parser.feed("b> ") == [("content", " <b>")]


def test_a_call_that_runs_to_the_end_of_the_answer():
    """Formats with no end marker (Mistral's, harmony's): the call is read when the answer ends,
    and stays content when it cannot be read (an answer cut short)."""
    text = 'Sure. to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    assert split(list(text), HARMONY) == [("content", "Sure."), ("call", CALLS[0])]
    assert split([text[:-3]], HARMONY) == [("content", text[:-3])]


def scripted(pieces: list[str], reason: str = "stop") -> list[tuple]:
    """The engine's messages for an answer of these text pieces."""
    done = {"finish_reason": reason, "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14},
            "mlx_spec": {"tau": 1.5}}
    return [("text", p, []) for p in pieces] + [("done", done)]


def tool_request(stream: bool) -> Request:
    return Request(True, [1, 2], SamplingParams(), 64, [], stream, None, 0.0, tools=[WEATHER])


def test_a_tool_call_answer_in_openai_form_whole_and_streamed(tmp_path):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    tokenizer = load_tokenizer(write_tokenizer(tmp_path / "qwen3", "qwen3"))
    body = Response(tool_request(False), "m", tokenizer).whole(scripted([ANSWER]))
    reply = ChatCompletion.model_validate(body)  # OpenAI's own types read it
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content == "Let me look that up."
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_weather", {"city": "Zürich"})]
    assert len({c.id for c in message.tool_calls}) == 2 and message.tool_calls[0].id.startswith("call_")

    chunks = [ChatCompletionChunk.model_validate(c)
              for c in Response(tool_request(True), "m", tokenizer).chunks(scripted(list(ANSWER)))]
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == "Let me look that up."
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert [(c.index, c.type, c.function.name, c.function.arguments) for c in calls] == [
        (0, "function", "get_weather", CALLS[0]["arguments"]), (1, "function", "get_weather", CALLS[1]["arguments"])]
    # each call comes in one chunk, after the content, and the last chunk says why it finished
    assert all(len(d.tool_calls or []) <= 1 for d in deltas) and not any(d.content for d in deltas[-3:])
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and chunks[-1].usage.total_tokens == 14

    # An answer cut short keeps "length"; no call: content as it is, and its finish reason.
    cut = Response(tool_request(False), "m", tokenizer).whole(scripted([ANSWER], "length"))
    assert cut["choices"][0]["finish_reason"] == "length"
    plain = Response(tool_request(False), "m", tokenizer).whole(scripted(["no ", "tools ", "needed"]))
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "no tools needed"}
    assert plain["choices"][0]["finish_reason"] == "stop"


def test_tools_for_a_model_whose_call_format_is_unknown_are_refused():
    """A template that shows the model its tools, in no format mlx-lm (or harmony) reads: a 400 naming 'tools'."""
    from types import SimpleNamespace

    from mlx_spec.serve.openai import BadRequest, parse_request

    tokenizer = SimpleNamespace(chat_template="{% for t in tools %}{{ t }}{% endfor %}", has_tool_calling=False)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    with pytest.raises(BadRequest, match="'tools': no tool-call format is known") as refused:
        parse_request(body, True, tokenizer, 4096, 256, 60.0)
    assert refused.value.status == 400
