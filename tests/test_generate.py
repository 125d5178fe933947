import mlx.core as mx

from mlx_spec.decoding import plain_steps
from mlx_spec.generate import Generation, stream_generate
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams
from mlx_spec.tokenizer import encode_prompt, load_tokenizer


def test_plain_steps_equal_full_forward_argmax(checkpoints):
    """Cached decoding equals re-running the whole sequence each step."""
    model, _ = load_model(str(checkpoints["qwen2"]))
    prompt = [3, 14, 15, 92, 65]
    tokens = [e.tokens[0] for e in plain_steps(model, prompt, SamplingParams(), 12)]
    seq = list(prompt)
    for _ in range(12):
        logits, _ = model(mx.array([seq]))
        seq.append(mx.argmax(logits[0, -1]).item())
    assert tokens == seq[len(prompt) :]


def test_stream_stops_at_eos_and_max_tokens(checkpoints):
    path = checkpoints["qwen3"]
    model, _ = load_model(str(path))
    tokenizer = load_tokenizer(path)
    ids = encode_prompt(tokenizer, "Hello")
    full = [e.tokens[0] for e in plain_steps(model, ids, SamplingParams(), 30)]
    eos = full[5]
    tokenizer.add_eos_token(eos)  # pretend the 6th token ends the answer
    result = Generation(prompt_tokens=ids)
    text = "".join(stream_generate(model, tokenizer, ids, SamplingParams(), 30, result))
    assert result.finish_reason == "stop"
    assert result.tokens == full[: full.index(eos)]
    assert text == result.text == tokenizer.decode(result.tokens)

    short = Generation(prompt_tokens=ids)
    list(stream_generate(model, load_tokenizer(path), ids, SamplingParams(), 3, short))
    assert len(short.tokens) == 3 and short.finish_reason == "length"
    assert short.prompt_tps > 0


def test_chat_template_wraps_the_message(checkpoints):
    tokenizer = load_tokenizer(checkpoints["qwen3"])
    ids = encode_prompt(tokenizer, "Hi there")
    assert tokenizer.decode(ids) == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(encode_prompt(tokenizer, "Hi there", chat_template=False)) == "Hi there"
