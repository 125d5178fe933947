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


def has_thinking_switch(tokenizer: TokenizerWrapper) -> bool:
    """Whether the chat template reads `enable_thinking` (Qwen3's and its kin's do)."""
    return "enable_thinking" in str(tokenizer.chat_template or "")


def thinking_args(think: bool | None) -> dict:
    """The chat template's arguments for `--think/--no-think` (None: the template's default)."""
    return {} if think is None else {"enable_thinking": think}


def render_chat(tokenizer: TokenizerWrapper, messages: list[dict], template_args: dict | None = None) -> list[int]:
    """Token ids of `messages` under the chat template, ready for the assistant's turn;
    `template_args` (e.g. `enable_thinking`) go to the template as it takes them."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **(template_args or {}))
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding where transformers returns one


def opens_reasoning(tokenizer: TokenizerWrapper, prompt: list[int]) -> bool:
    """Whether the rendered prompt ends inside an open `<think>` block (templates
    of thinking-only models open it for the model), so the answer starts with reasoning."""
    return tokenizer.decode(prompt[-8:]).rstrip().endswith("<think>")


def encode_prompt(tokenizer: TokenizerWrapper, prompt: str, chat_template: bool = True,
                  template_args: dict | None = None) -> list[int]:
    """Token ids of `prompt`: the user's message under the chat template, or raw text."""
    if chat_template and tokenizer.chat_template is not None:
        return render_chat(tokenizer, [{"role": "user", "content": prompt}], template_args)
    bos = tokenizer.bos_token
    ids = tokenizer.encode(prompt, add_special_tokens=bos is not None and not prompt.startswith(bos))
    return list(ids)


def check_same_vocab(ours: TokenizerWrapper, theirs: TokenizerWrapper, where: str, whose: str) -> None:
    """Refuse two models whose tokenizers map tokens to ids differently."""
    if ours.get_vocab() != theirs.get_vocab():
        raise UserError(f"{where}: its tokenizer differs from {whose}'s; they must share one vocabulary")
