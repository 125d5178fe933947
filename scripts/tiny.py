"""Tiny checkpoints in Hugging Face layout, made offline, for tests and examples.

`make_checkpoint(dir, "qwen3")` writes `config.json`, `model*.safetensors`
(random weights from a seeded NumPy generator, so they are the same on every
machine), and a real byte-level BPE tokenizer trained here with `tokenizers`,
with a ChatML chat template. `train_copy_model(dir)` writes one whose weights
are trained (`mlx_spec.train.lm`) to copy earlier text, for tests that need a
model with predictable output.

    python3 scripts/tiny.py OUT --arch qwen3 --hidden 768 --layers 12
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterable, Iterator

import mlx_spec  # noqa: F401  (first: it preloads a system OpenBLAS before mlx.core loads)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from mlx_spec.models.config import parse_config
from mlx_spec.models.llama import Model
from mlx_spec.train.lm import train_lm

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = """\
Speculative decoding lets a small draft model propose several tokens that the
large target model then checks in a single forward pass. When the target agrees,
many tokens are produced for the price of one step; when it disagrees, the first
wrong token is replaced by the target's own choice, so the output is exactly what
the target alone would have written. The quick brown fox jumps over the lazy dog.
def greet(name):
    return f"Hello, {name}!"
for i in range(10):
    print(i * i)
Knowledge distillation trains a small student to imitate a large teacher by
matching its softened output distribution rather than only the hard labels.
"""

# model_type -> config fields that differ from the shared defaults
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"attention_bias": False, "tie_word_embeddings": False, "rope_theta": 10000.0},
    "qwen2": {"tie_word_embeddings": True, "rope_theta": 1000000.0},
    "qwen3": {"attention_bias": False, "tie_word_embeddings": True, "rope_theta": 1000000.0},
}


def make_tokenizer(out: Path, vocab_size: int = 384, corpus: Iterable[str] | None = None) -> int:
    """Train a byte-level BPE on `corpus` (default: `CORPUS`), write
    `tokenizer.json` and `tokenizer_config.json` to `out`; return its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4 if corpus is None else corpus, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 32768,
            },
            indent=2,
        )
    )
    return tok.get_vocab_size()


def make_config(arch: str = "qwen3", **overrides: Any) -> dict:
    """A Hugging Face `config.json` dict for a tiny model (transformers 4 style)."""
    if arch not in ARCH_DEFAULTS:
        raise ValueError(f"arch must be one of {sorted(ARCH_DEFAULTS)}")
    config = {
        "model_type": arch,
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 384,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": 2,
        **ARCH_DEFAULTS[arch],
    }
    config.update(overrides)
    return config


def random_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Weights for `config`, drawn so logits are well spread (no near-ties)."""
    model = Model(parse_config(config))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, p in sorted(tree_flatten(model.parameters())):
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(p.shape)
        elif name.endswith(".bias"):
            w = 0.1 * rng.standard_normal(p.shape)
        elif name.endswith("embed_tokens.weight"):
            w = 0.3 * rng.standard_normal(p.shape)
        else:
            w = rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])
        weights[name] = w.astype(np.float32)
    return weights


def write_checkpoint(
    out: Path,
    config: dict,
    weights: dict[str, mx.array],
    shards: int = 1,
) -> None:
    """Write `config.json` and safetensors (sharded with an index when `shards > 1`)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(weights)
    if shards == 1:
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
        return
    weight_map = {}
    for i, part in enumerate(np.array_split(np.array(names, dtype=object), shards)):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(out / fname), {n: weights[n] for n in part}, metadata={"format": "mlx"})
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2)
    )


def make_checkpoint(
    out: str | Path,
    arch: str = "qwen3",
    seed: int = 0,
    shards: int = 1,
    quantize_bits: int | None = None,
    group_size: int = 32,
    **overrides: Any,
) -> Path:
    """A complete tiny checkpoint directory: config, weights, tokenizer."""
    out = Path(out)
    vocab = make_tokenizer(out)
    overrides.setdefault("vocab_size", vocab)
    if overrides["vocab_size"] < vocab:
        raise ValueError(f"vocab_size must be at least the tokenizer's {vocab}")
    overrides.setdefault("eos_token_id", SPECIAL_TOKENS.index("<|im_end|>"))
    config = make_config(arch, **overrides)
    weights = {k: mx.array(v) for k, v in random_weights(config, seed).items()}
    if quantize_bits:
        model = Model(parse_config(config))
        model.load_weights(list(weights.items()))
        nn.quantize(model, group_size, quantize_bits)
        weights = dict(tree_flatten(model.parameters()))
        config["quantization"] = {"group_size": group_size, "bits": quantize_bits}
    write_checkpoint(out, config, weights, shards)
    return out


# The copy task: a segment of distinct letters, then the same segment again.
# A small alphabet keeps training short: with 24 or 40 letters the induction
# head forms 1.5-3x later.
COPY_ALPHABET = "abcdefghijklmnop"
COPY_LENGTHS = (8, 16)  # shortest and longest segment


def copy_token_ids(model_dir: str | Path) -> list[int]:
    """Token ids of `COPY_ALPHABET`'s letters (one byte-level token each)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return [tok.token_to_id(c) for c in COPY_ALPHABET]


def copy_segment(rng: np.random.Generator, ids: list[int], lengths: tuple[int, int] = COPY_LENGTHS) -> list[int]:
    """A random segment of distinct tokens from `ids`, its length in `lengths`."""
    n = int(rng.integers(lengths[0], lengths[1] + 1))
    return [int(t) for t in rng.choice(ids, n, replace=False)]


def _copy_batches(rng: np.random.Generator, ids: list[int], batch: int, seq_len: int) -> Iterator[mx.array]:
    """Endless `[batch, seq_len]` batches: segment, segment, next segment, ..."""
    while True:
        rows = []
        for _ in range(batch):
            row: list[int] = []
            while len(row) < seq_len:
                segment = copy_segment(rng, ids)
                row += segment + segment
            rows.append(row[:seq_len])
        yield mx.array(np.array(rows, dtype=np.int32))


def stride_row(rng: np.random.Generator, ids: list[int], length: int) -> list[int]:
    """Letters walked with a fixed stride (1, 2 or 3) from a random start, cyclically."""
    start, stride = int(rng.integers(len(ids))), int(rng.integers(1, 4))
    return [ids[(start + i * stride) % len(ids)] for i in range(length)]


def _stride_batches(rng: np.random.Generator, ids: list[int], batch: int, seq_len: int) -> Iterator[mx.array]:
    while True:
        yield mx.array(np.array([stride_row(rng, ids, seq_len) for _ in range(batch)], dtype=np.int32))


def train_copy_model(out: str | Path, steps: int = 400, seed: int = 0, task: str = "copy") -> Path:
    """A tiny Qwen3 checkpoint trained to copy: after a segment of distinct
    letters and the segment's first tokens again, greedy decoding continues
    the segment (two layers are enough for an induction head).

    `task="stride"` trains it on `stride_row`s instead: every later token
    follows from the last two, so tokens several steps ahead are predictable
    from one position's hidden state (what Medusa's heads need).

    The model is wider than `make_checkpoint`'s: at width 64 the induction
    head forms several times later. About 20 s on 2 CPU cores with OpenBLAS;
    almost 3 minutes with MLX's reference BLAS.
    """
    out = Path(out)
    vocab = make_tokenizer(out)
    config = make_config(
        "qwen3",
        vocab_size=vocab,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=256,
    )
    mx.random.seed(seed)
    model = Model(parse_config(config))
    make_batches = _copy_batches if task == "copy" else _stride_batches
    batches = make_batches(np.random.default_rng(seed), copy_token_ids(out), batch=16, seq_len=48)
    train_lm(model, batches, steps, lr=3e-3, warmup=30)
    write_checkpoint(out, config, dict(tree_flatten(model.parameters())))
    return out


def write_stride_data(folder: str | Path, model_dir: str | Path, train: int = 400, valid: int = 32,
                      length: int = 48) -> Path:
    """`folder/{train,valid}.jsonl`: `stride_row`s as token ids of the stride
    model in `model_dir` (as text, its BPE would merge some letter pairs)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    ids = copy_token_ids(model_dir)
    for name, n in (("train", train), ("valid", valid)):
        rows = (stride_row(rng, ids, length) for _ in range(n))
        (folder / f"{name}.jsonl").write_text("".join(json.dumps({"tokens": r}) + "\n" for r in rows))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Write a random checkpoint in Hugging Face layout, or with --task one trained on a toy task."
    )
    parser.add_argument("out")
    parser.add_argument("--task", choices=("copy", "stride"), default=None,
                        help="train a tiny model on the task instead (and, for stride, write OUT/data for its drafters)")
    parser.add_argument("--arch", default="qwen3", choices=sorted(ARCH_DEFAULTS))
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantize-bits", type=int, default=None)
    a = parser.parse_args()
    if a.task:
        train_copy_model(a.out, 400 if a.task == "copy" else 200, a.seed, a.task)
        if a.task == "stride":
            write_stride_data(Path(a.out) / "data", a.out)
        print(a.out)
        return
    overrides = dict(
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.hidden // a.heads,
        intermediate_size=a.intermediate or 4 * a.hidden,
    )
    if a.vocab:
        overrides["vocab_size"] = a.vocab
    path = make_checkpoint(a.out, a.arch, seed=a.seed, quantize_bits=a.quantize_bits, **overrides)
    print(path)


if __name__ == "__main__":
    main()
