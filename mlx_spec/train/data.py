"""Training data: JSONL in mlx-lm's formats, tokenized, masked, batched.

One JSON object a line:
- `{"text": ...}`: raw text, every token is a target;
- `{"messages": [{"role", "content"}, ...]}`: a chat, through the chat template;
- `{"prompt": ..., "completion": ...}`: a user prompt and the answer.
With `mask_prompt`, only the final answer's tokens are targets.

`DATA` is a `.jsonl` file (a held-out fraction becomes the validation set) or a
folder with `train.jsonl` and optionally `valid.jsonl`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_spec.errors import UserError
from mlx_spec.sampling import SamplingParams


@dataclass
class Example:
    tokens: list[int]
    prompt_len: int  # tokens before the first target (0: all are targets)


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) for every non-empty line."""
    if not path.exists():
        raise UserError(f"{path}: no such file")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{lineno}: expected a JSON object")
            rows.append((lineno, row))
    if not rows:
        raise UserError(f"{path}: empty")
    return rows


def _chat(tokenizer, messages: list[dict], prefix: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=prefix, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def encode_example(tokenizer, row: dict, where: str, chat_template: bool = True) -> Example:
    """Tokens of one JSONL row and where its targets start."""
    if "tokens" in row:  # already tokenized, for this tokenizer
        tokens = row["tokens"]
        if not (isinstance(tokens, list) and tokens and all(isinstance(t, int) and t >= 0 for t in tokens)):
            raise UserError(f"{where}: 'tokens' must be a non-empty list of token ids")
        return Example(list(tokens), 0)
    use_chat = chat_template and tokenizer.chat_template is not None
    if "text" in row and isinstance(row["text"], str):
        return Example(list(tokenizer.encode(row["text"])), 0)
    if "messages" in row:
        messages = row["messages"]
        ok = isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
        if not ok:
            raise UserError(f"{where}: 'messages' must be a list of {{'role', 'content'}} objects")
        if not use_chat:
            raise UserError(f"{where}: 'messages' needs a tokenizer with a chat template")
        full = _chat(tokenizer, messages, prefix=False)
        prompt = _chat(tokenizer, messages[:-1], prefix=True) if len(messages) > 1 else []
        return Example(full, len(prompt))
    if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        if use_chat:
            user = [{"role": "user", "content": row["prompt"]}]
            prompt = _chat(tokenizer, user, prefix=True)
            full = _chat(tokenizer, user + [{"role": "assistant", "content": row["completion"]}], prefix=False)
        else:
            prompt = list(tokenizer.encode(row["prompt"]))
            full = prompt + list(tokenizer.encode(row["completion"], add_special_tokens=False))
        return Example(full, len(prompt))
    raise UserError(f"{where}: expected a 'text', 'tokens', 'messages' or 'prompt'/'completion' object")


def load_examples(path: Path, tokenizer, chat_template: bool = True) -> list[Example]:
    return [encode_example(tokenizer, row, f"{path}:{n}", chat_template) for n, row in read_jsonl(path)]


def load_splits(
    data: str | Path, tokenizer, valid_fraction: float = 0.05, chat_template: bool = True
) -> tuple[list[Example], list[Example]]:
    """Train and validation examples from a .jsonl file or a folder."""
    data = Path(data)
    if data.is_dir():
        train = load_examples(data / "train.jsonl", tokenizer, chat_template)
        if (data / "valid.jsonl").exists():
            return train, load_examples(data / "valid.jsonl", tokenizer, chat_template)
    else:
        train = load_examples(data, tokenizer, chat_template)
    # A fixed, seeded hold-out: the same split on every run and every resume.
    order = np.random.default_rng(0).permutation(len(train))
    n_valid = max(1, int(len(train) * valid_fraction)) if len(train) > 1 else 0
    valid = [train[i] for i in sorted(order[:n_valid])]
    train = [train[i] for i in sorted(order[n_valid:])] or valid
    return train, valid


class Batches:
    """Micro-batch i of an endless, reshuffled-every-epoch stream.

    `pack=True` concatenates examples (with an EOS between) and cuts rows of
    `seq_len + 1` tokens; otherwise examples are bucketed by length and padded.
    Each call returns `{"tokens": [B, S], "mask": [B, S]}`, mask True on targets.
    Batch i depends only on i and the seed, which makes resuming exact.
    """

    def __init__(self, examples: list[Example], batch_size: int, seq_len: int, eos: int,
                 pack: bool = True, mask_prompt: bool = False, seed: int = 0):
        if batch_size < 1 or seq_len < 2:
            raise UserError(f"--batch-size must be >= 1 and --seq-len >= 2, got {batch_size}, {seq_len}")
        self.batch_size, self.seed = batch_size, seed
        rows = []
        for ex in examples:
            # Packed rows cut long examples into several; padded rows keep their start.
            toks = ex.tokens if pack else ex.tokens[: seq_len + 1]
            m = [not mask_prompt or i >= ex.prompt_len for i in range(len(toks))]
            rows.append((toks, m))
        if pack:
            flat, flat_mask = [], []
            for toks, m in rows:
                flat += toks + [eos]
                flat_mask += m + [True]
            width = seq_len + 1
            rows = [(flat[i : i + width], flat_mask[i : i + width]) for i in range(0, len(flat) - width + 1, width)]
            if not rows:
                raise UserError(f"the data holds {len(flat)} tokens, fewer than one row of --seq-len {seq_len}")
        else:
            rows.sort(key=lambda r: len(r[0]))  # neighbours have similar lengths
        self.rows = rows
        self.n_batches = max(1, len(rows) // batch_size)
        self.pad = eos

    def __len__(self) -> int:
        return self.n_batches

    def row_ids(self, i: int) -> list[int]:
        """The rows of batch i: epoch by epoch, batches in a seeded random order."""
        epoch, b = divmod(i, self.n_batches)
        first = int(np.random.default_rng([self.seed, epoch]).permutation(self.n_batches)[b]) * self.batch_size
        return [(first + j) % len(self.rows) for j in range(self.batch_size)]

    def __call__(self, i: int) -> dict[str, mx.array]:
        rows = [self.rows[r] for r in self.row_ids(i)]
        width = max(len(t) for t, _ in rows)
        tokens = np.full((len(rows), width), self.pad, dtype=np.int32)
        mask = np.zeros((len(rows), width), dtype=bool)
        for r, (t, m) in enumerate(rows):
            tokens[r, : len(t)] = t
            mask[r, : len(m)] = m
        return {"tokens": mx.array(tokens), "mask": mx.array(mask)}


def regenerate(target, examples: list[Example], seq_len: int, eos: set[int],
               params: SamplingParams | None = None, batch_size: int = 16) -> list[Example]:
    """The examples with their answers rewritten by `target` (greedy unless
    `params` say otherwise; as long as the original, at most the row length),
    so a drafter learns what the target itself says. Examples without a prompt
    stay as they are. `batch_size` answers are written at once (continuous
    batching: a finished row's place goes to the next example)."""
    from mlx_spec.decoding import Decoder

    params = params or SamplingParams()
    decoder = Decoder(target)
    answers: dict[int, list[int]] = {}
    pending = [i for i, ex in enumerate(examples) if ex.prompt_len]
    while pending or decoder.rows:
        while pending and len(decoder.rows) < batch_size:
            i = pending.pop(0)
            ex = examples[i]
            answers[i] = []
            decoder.add(i, ex.tokens[: ex.prompt_len], params,
                        max(1, min(len(ex.tokens), seq_len + 1) - ex.prompt_len))
        for i, event in decoder.step().items():
            answers[i] += event.tokens
            if answers[i][-1] in eos and any(r.key == i for r in decoder.rows):
                decoder.remove(i)
    return [Example(ex.tokens[: ex.prompt_len] + answers[i], ex.prompt_len) if i in answers else ex
            for i, ex in enumerate(examples)]
