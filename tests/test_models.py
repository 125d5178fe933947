"""Our targets against mlx-lm's implementations and transformers' reference."""

from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import stream_generate as mlx_lm_stream

from mlx_spec.generate import Generation, stream_generate
from mlx_spec.models import load_model
from mlx_spec.sampling import SamplingParams
from mlx_spec.tokenizer import encode_prompt, load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "hf_reference"
PROMPT = "The quick brown fox writes a function"


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "qwen3-4bit", "llama-sharded"])
def test_matches_mlx_lm(checkpoints, name):
    path = checkpoints[name]
    ours, _ = load_model(str(path))
    theirs, tokenizer = mlx_lm.load(str(path))
    ids = encode_prompt(tokenizer, PROMPT)
    x = mx.array(ids)[None]
    logits, hidden = ours(x)
    assert hidden == ()
    assert mx.abs(logits - theirs(x)).max().item() < 1e-4

    # Greedy output, token for token, through each project's own streaming API.
    n = 40
    ref = [r.token for r in mlx_lm_stream(theirs, tokenizer, mx.array(ids), max_tokens=n)]
    result = Generation(prompt_tokens=ids)
    for _ in stream_generate(ours, load_tokenizer(path), ids, SamplingParams(), n, result):
        pass
    ref = [t for t in ref if t not in tokenizer.eos_token_ids]
    assert result.tokens == ref
    assert len(ref) >= 10


def test_quantized_checkpoint_is_quantized(checkpoints):
    model, _ = load_model(str(checkpoints["qwen3-4bit"]))
    proj = model.layers[0].self_attn.q_proj
    assert proj.bits == 4 and proj.group_size == 32
    assert proj.weight.dtype == mx.uint32


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "qwen3"])
def test_matches_transformers(name):
    """Logits and greedy tokens recorded with transformers + torch
    (scripts/make_hf_reference.py); llama uses llama3 RoPE scaling and qwen3
    YaRN, both read from transformers 5's `rope_parameters`."""
    ref = np.load(FIXTURES / name / "reference.npz")
    model, _ = load_model(str(FIXTURES / name))
    logits, _ = model(mx.array(ref["input_ids"]))
    assert np.abs(np.array(logits) - ref["logits"]).max() < 1e-4
    prompt = ref["input_ids"][0].tolist()
    from mlx_spec.decoding import plain_steps

    tokens = [e.tokens[0] for e in plain_steps(model, prompt, SamplingParams(), len(ref["greedy"]))]
    assert tokens == ref["greedy"].tolist()


def test_transformers4_and_5_configs_agree(tmp_path):
    """The same RoPE settings written the transformers 4 way (top-level
    rope_theta, rope_scaling with `type`) load to the same numbers."""
    import json
    import shutil

    src = FIXTURES / "qwen3"
    dst = tmp_path / "qwen3-tf4"
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    (dst / "config.json").write_text(json.dumps(config))
    ids = mx.array(np.load(src / "reference.npz")["input_ids"])
    a, _ = load_model(str(src))[0](ids)
    b, _ = load_model(str(dst))[0](ids)
    assert mx.array_equal(a, b)


def test_weights_are_float32_on_cpu(checkpoints, tmp_path):
    import json

    import tiny as t

    path = t.make_checkpoint(tmp_path / "bf16", "qwen3")
    weights = mx.load(str(path / "model.safetensors"))
    mx.save_safetensors(str(path / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in weights.items()})
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    model, _ = load_model(str(path))
    assert model.model.embed_tokens.weight.dtype == mx.float32


def test_mistrals_sliding_window_decides_and_drafters_keep_it(tmp_path):
    """The window (8 here, 4096 in Mistral-7B-v0.1) is shorter than the text: without it the
    greedy tokens differ from transformers'; with it, a drafter's output is plain decoding's."""
    import json
    import shutil

    from mlx_spec.decoding import plain_steps, speculative_steps
    from mlx_spec.drafters.lookup import PromptLookup

    ref = np.load(FIXTURES / "mistral" / "reference.npz")
    prompt, greedy = ref["input_ids"][0].tolist(), ref["greedy"].tolist()
    unwindowed = tmp_path / "mistral"
    shutil.copytree(FIXTURES / "mistral", unwindowed)
    config = json.loads((unwindowed / "config.json").read_text())
    (unwindowed / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    model, _ = load_model(str(unwindowed))
    assert [t for e in plain_steps(model, prompt, SamplingParams(), len(greedy)) for t in e.tokens] != greedy
    model, _ = load_model(str(FIXTURES / "mistral"))
    prompt = prompt + prompt[:10]
    plain = [t for e in plain_steps(model, prompt, SamplingParams(), 24) for t in e.tokens]
    events = list(speculative_steps(model, prompt, SamplingParams(), 24, PromptLookup(1, 3), num_draft=3))
    assert [t for e in events for t in e.tokens] == plain
    # A tree's mask is its own: past the window it is refused, naming it.
    from mlx_spec.drafters.medusa import Medusa, MedusaHeads
    from mlx_spec.errors import UserError

    heads = MedusaHeads(3, 1, model.args.hidden_size, model.args.vocab_size)
    with pytest.raises(UserError, match="sliding window"):
        list(speculative_steps(model, prompt, SamplingParams(), 8, Medusa(heads, model, None, 8)))
