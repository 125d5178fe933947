"""Tokenizers through mlx-lm's wrapper: chat template, EOS set, streaming detokenizer."""

from __future__ import annotations

from pathlib import Path

from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as _load

from mlx_spec.errors import UserError


def load_tokenizer(path: Path | str) -> TokenizerWrapper:
    path = Path(path)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise UserError(f"{path}: no tokenizer (tokenizer.json or tokenizer.model)")
    try:
        return _load(path)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: tokenizer failed to load ({e})".splitlines()[0]) from None


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str, chat_template: bool = True) -> list[int]:
    """Token ids of `prompt`: the user's message under the chat template, or raw text."""
    if chat_template and tokenizer.chat_template is not None:
        messages = [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    bos = tokenizer.bos_token
    ids = tokenizer.encode(prompt, add_special_tokens=bos is not None and not prompt.startswith(bos))
    return list(ids)


def check_same_vocab(ours: TokenizerWrapper, theirs: TokenizerWrapper, where: str, whose: str) -> None:
    """Refuse two models whose tokenizers map tokens to ids differently."""
    if ours.get_vocab() != theirs.get_vocab():
        raise UserError(f"{where}: its tokenizer differs from {whose}'s; they must share one vocabulary")
