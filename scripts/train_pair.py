"""Train a small target/draft pair on the Python standard library's source.

    python scripts/train_pair.py OUT [--target-steps N] [--draft-steps N] [--distill-steps N]

For speculative-decoding benchmarks on real text, offline: a byte-level BPE
and two Qwen3-architecture models, a 6.8M-parameter target and a 0.66M draft.
Both first train as plain language models on the same data, side by side;
then `mlx-spec distill` teaches the draft the target's own distributions,
which is what a drafter needs (its tokens are accepted when they agree with
the target, right or wrong). Writes `OUT/target` and `OUT/draft` (each a full
model directory: config, float32 safetensors, tokenizer), `OUT/draft-lm` (the
draft before distillation) and `OUT/data` (the JSONL the distillation read),
and prints each model's loss on held-out modules. About 15 minutes on a
2-core CPU with OpenBLAS.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterator

import mlx_spec  # noqa: F401  (preloads OpenBLAS before mlx.core)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import Tokenizer

from mlx_spec.models.config import parse_config
from mlx_spec.models.llama import Model
from mlx_spec.testing import SPECIAL_TOKENS, make_config, make_tokenizer, write_checkpoint
from mlx_spec.train.lm import lm_loss, train_lm

VOCAB_SIZE = 2048
SEQ_LEN = 256
TOKENS_PER_STEP = 1024
# Module names (file stems) kept out of training, for the held-out loss.
HELD_OUT = {"difflib", "textwrap", "fractions", "shlex", "heapq", "calendar"}
# Not code: the stdlib's tests (data blobs, deliberately odd code), codec
# tables (`encodings`), and the help texts of `pydoc_data`.
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "encodings", "pydoc_data"}

# On a CPU small models are bound by the number of operations per step, not
# by arithmetic: a step costs about the same per layer whatever the width. So
# the target is deep and narrow, the draft shallow: the draft's cost per token
# is then a small fraction of a target step.
TARGET = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, intermediate_size=768)
DRAFT = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, intermediate_size=384)


def stdlib_sources() -> tuple[list[str], list[str]]:
    """The stdlib's *.py files as text: (train, held out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held_out = [], []
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS.intersection(path.relative_to(root).parts):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        (held_out if path.stem in HELD_OUT else train).append(text)
    return train, held_out


def encode(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """One token stream, files separated by <|endoftext|>."""
    eot = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.array(ids, dtype=np.int32)


def random_windows(ids: np.ndarray, steps: int, seed: int) -> Iterator[mx.array]:
    """`steps` batches of random windows of the stream, `TOKENS_PER_STEP` each.

    The first three quarters use windows of `SEQ_LEN // 2` (attention's cost
    grows with length), the last quarter `SEQ_LEN`, to learn the positions
    up to it.
    """
    rng = np.random.default_rng(seed)
    for step in range(steps):
        length = SEQ_LEN // 2 if step < 3 * steps // 4 else SEQ_LEN
        starts = rng.integers(0, len(ids) - length, TOKENS_PER_STEP // length)
        yield mx.array(np.stack([ids[s : s + length + 1] for s in starts]))  # [B, length + 1]


def held_out_loss(model: Model, ids: np.ndarray, length: int, batch: int = 16) -> float:
    """Mean next-token loss over consecutive windows of the held-out stream."""
    n = len(ids) // length
    windows = ids[: n * length].reshape(n, length)  # [N, length]
    total = 0.0
    for i in range(0, n, batch):
        chunk = mx.array(windows[i : i + batch])
        total += lm_loss(model, chunk).item() * len(chunk)
    return total / n


def train_and_save(name: str, arch: dict, vocab: int, train_ids: np.ndarray, held_ids: np.ndarray,
                   steps: int, lr: float, seed: int, out: Path) -> float:
    """Train one model, write its checkpoint to `out`; return its held-out loss."""
    # eos is <|im_end|> as in mlx_spec.testing: raw-text generation runs on past
    # file boundaries, which keeps benchmark runs at their full length.
    config = make_config("qwen3", vocab_size=vocab, eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"), **arch)
    mx.random.seed(seed)
    model = Model(parse_config(config))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"{name}: {n_params / 1e6:.2f}M parameters, {steps} steps of {TOKENS_PER_STEP} tokens", flush=True)
    tic = time.perf_counter()

    def log(step: int, loss: float) -> None:
        print(f"  {name:6s} step {step:4d}  loss {loss:.3f}  {time.perf_counter() - tic:4.0f}s", flush=True)

    batches = random_windows(train_ids, steps, seed)
    train_lm(model, batches, steps, lr, warmup=min(100, steps // 10), log_every=100, on_log=log)
    write_checkpoint(out, config, dict(tree_flatten(model.parameters())))
    return held_out_loss(model, held_ids, SEQ_LEN + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--target-steps", type=int, default=560)
    parser.add_argument("--draft-steps", type=int, default=300)
    parser.add_argument("--distill-steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()

    train_texts, held_texts = stdlib_sources()
    target_dir, draft_dir, lm_dir = args.out / "target", args.out / "draft", args.out / "draft-lm"
    vocab = make_tokenizer(target_dir, VOCAB_SIZE, corpus=train_texts)
    lm_dir.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target_dir / f, lm_dir / f)
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    train_ids, held_ids = encode(tokenizer, train_texts), encode(tokenizer, held_texts)
    print(f"corpus: {len(train_texts)} files, {len(train_ids)} tokens; held out: "
          f"{len(held_texts)} files, {len(held_ids)} tokens; vocab {vocab}", flush=True)

    # Both models train at once, one process each: MLX's CPU backend runs
    # elementwise ops (exp, in softmax and SiLU, dominates) on one core, so
    # two processes use the two cores; one BLAS thread each keeps them apart.
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    jobs = (("target", TARGET, args.target_steps, 3e-3, target_dir), ("draft", DRAFT, args.draft_steps, 3e-3, lm_dir))
    with ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {name: pool.submit(train_and_save, name, arch, vocab, train_ids, held_ids, steps, lr, args.seed, out)
                   for name, arch, steps, lr, out in jobs}
        losses = {name: f.result() for name, f in futures.items()}
    for name, loss in losses.items():
        print(f"{name}: held-out loss {loss:.3f} (perplexity {np.exp(loss):.1f})", flush=True)

    data = args.out / "data"
    data.mkdir(exist_ok=True)
    for name, texts in (("train", train_texts), ("valid", held_texts)):
        with open(data / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    del os.environ["OPENBLAS_NUM_THREADS"]
    # Forward KL at temperature 1 (the distribution speculative sampling
    # compares against) with a little of the labels' cross-entropy.
    subprocess.run(
        [sys.executable, "-m", "mlx_spec", "distill", "--teacher", str(target_dir), "--student", str(lm_dir),
         "--data", str(data), "-o", str(draft_dir), "--steps", str(args.distill_steps), "--batch-size", "16",
         "--seq-len", "128", "--lr", "1e-3", "--warmup", "20", "--temperature", "1", "--alpha", "0.1",
         "--save-every", "100", "--eval-batches", "16", "--seed", str(args.seed)],
        check=True,
    )
    valid = [json.loads(line) for line in open(draft_dir / "train_log.jsonl") if "valid_loss" in line]
    print(f"draft after distillation: {valid[-1]}")
    print(f"wrote {target_dir} and {draft_dir} in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
