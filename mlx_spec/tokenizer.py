"""Tokenizers through mlx-lm's wrapper: chat template, EOS set, streaming detokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from mlx_spec.errors import UserError

if TYPE_CHECKING:  # mlx-lm's tokenizers bring transformers, a second to import: not for a run that ends in an error
    from mlx_lm.tokenizer_utils import TokenizerWrapper


def load_tokenizer(path: Path | str, eos_token_ids: Iterable[int] = ()) -> TokenizerWrapper:
    """The tokenizer in `path`; it stops on `eos_token_ids` besides its own EOS token."""
    path = Path(path)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise UserError(f"{path}: no tokenizer (tokenizer.json or tokenizer.model)")
    from mlx_lm.tokenizer_utils import load

    try:
        return load(path, eos_token_ids=list(eos_token_ids) or None)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: tokenizer failed to load ({e})".splitlines()[0]) from None


def model_eos_ids(path: Path) -> list[int]:
    """The EOS ids a checkpoint declares, as mlx-lm reads them: `eos_token_id` (an
    id or a list) of generation_config.json, else of config.json. Qwen3's
    generation config lists `<|im_end|>` and `<|endoftext|>`; its tokenizer names
    only the first."""
    from mlx_spec.models.load import read_json

    for name in ("generation_config.json", "config.json"):
        file = path / name
        if not file.exists():
            continue
        ids = read_json(file).get("eos_token_id")
        if ids is None or ids == []:
            continue
        ids = [ids] if isinstance(ids, int) else ids
        if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            raise UserError(f"{file}: 'eos_token_id' must be a token id or a list of them")
        return ids
    return []


def add_eos_tokens(tokenizer: TokenizerWrapper, tokens: Iterable[str]) -> None:
    """Stop also on each of `tokens`: a token of the vocabulary, or its id (as mlx-lm's flag takes them)."""
    vocab = tokenizer.get_vocab()
    ids = set()
    for token in tokens:
        if token in vocab:
            ids.add(vocab[token])
        elif token.isdigit() and int(token) < len(vocab):
            ids.add(int(token))
        else:
            raise UserError(f"--extra-eos-token {token!r}: not a token of the model's vocabulary (nor a token id)")
    tokenizer.eos_token_ids = tokenizer.eos_token_ids | ids


def has_thinking_switch(tokenizer: TokenizerWrapper) -> bool:
    """Whether the chat template reads `enable_thinking` (Qwen3's and its kin's do)."""
    return "enable_thinking" in str(tokenizer.chat_template or "")


def thinking_args(think: bool | None, template_args: dict | None = None) -> dict:
    """The chat template's arguments: `template_args` (`--chat-template-args`) with
    `enable_thinking` as `--think/--no-think` set it (None: as they leave it)."""
    return {**(template_args or {}), **({} if think is None else {"enable_thinking": think})}


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
                  template_args: dict | None = None, system: str = "") -> list[int]:
    """Token ids of `prompt`: the user's message under the chat template (after
    the `system` message, if any), or raw text."""
    if chat_template and tokenizer.chat_template is not None:
        messages = [{"role": "system", "content": system}] if system else []
        return render_chat(tokenizer, messages + [{"role": "user", "content": prompt}], template_args)
    bos = tokenizer.bos_token
    ids = tokenizer.encode(prompt, add_special_tokens=bos is not None and not prompt.startswith(bos))
    return list(ids)


def check_same_vocab(ours: TokenizerWrapper, theirs: TokenizerWrapper, where: str, whose: str) -> None:
    """Refuse two models whose tokenizers map tokens to ids differently."""
    if ours.get_vocab() != theirs.get_vocab():
        raise UserError(f"{where}: its tokenizer differs from {whose}'s; they must share one vocabulary")
