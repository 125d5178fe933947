"""Resolving a local directory or a Hugging Face Hub repo id to a local path."""

from __future__ import annotations

import io
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from mlx_spec import demo
from mlx_spec.errors import UserError

MODEL_PATTERNS = (
    "*.json",
    "model*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
)


# Short names for --model: the demo that ships with mlx-spec, and Hub repos
# that have published drafters (mlx-community's 4-bit conversions: they fit a Mac).
ALIASES = {
    "qwen3": "mlx-community/Qwen3-8B-4bit",
    "qwen3-4b": "mlx-community/Qwen3-4B-4bit",
    "qwen3-8b": "mlx-community/Qwen3-8B-4bit",
    "qwen3-32b": "mlx-community/Qwen3-32B-4bit",
    "qwen3-30b-a3b": "mlx-community/Qwen3-30B-A3B-4bit",
    "qwen3-coder": "mlx-community/Qwen3-Coder-30B-A3B-Instruct-4bit",
    "llama3.1": "mlx-community/Llama-3.1-8B-Instruct-4bit",
    "vicuna": "lmsys/vicuna-7b-v1.3",
    # 2026 models with published DFlash drafters, as their makers publish them (bfloat16;
    # mlx-lm's `mlx_lm.convert -q` makes 4-bit copies, which load the same way)
    "gemma4": "google/gemma-4-26B-A4B-it",
    "qwen3.5": "Qwen/Qwen3.5-9B",
    "qwen3.6": "Qwen/Qwen3.6-27B",
}


def expand(name: str) -> str:
    """`--model` as given, with a short name replaced by what it stands for
    (a local directory of that name wins)."""
    if Path(name).expanduser().is_dir():
        return name
    if name in demo.MODELS:
        return str(demo.path(demo.MODELS[name]))
    return ALIASES.get(name.lower(), name)


@dataclass
class Download:
    """How far a Hub download has come (totals grow as huggingface_hub learns them)."""

    repo: str
    done_bytes: int
    total_bytes: int
    done_files: int
    total_files: int


_reporter: ContextVar[Callable[[Download], None] | None] = ContextVar("mlx_spec_download_reporter", default=None)


@contextmanager
def reporting(callback: Callable[[Download], None]) -> Iterator[None]:
    """Hub downloads made inside this block report their progress to `callback`
    (from huggingface_hub's download threads)."""
    token = _reporter.set(callback)
    try:
        yield
    finally:
        _reporter.reset(token)


def _progress_bars(repo: str, callback: Callable[[Download], None]) -> type:
    """A tqdm class for `snapshot_download` that draws nothing and sends its
    bars' counts to `callback`: bytes (the bars counted in bytes) and files."""
    from tqdm import tqdm

    bars: list[tqdm] = []

    def report() -> None:
        in_bytes = [b for b in bars if b.unit == "B"]
        in_files = [b for b in bars if b.unit != "B"]
        callback(Download(
            repo,
            int(max((b.n for b in in_bytes), default=0)), int(max((b.total or 0 for b in in_bytes), default=0)),
            int(max((b.n for b in in_files), default=0)), int(max((b.total or 0 for b in in_files), default=0)),
        ))

    class Bars(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            super().__init__(*args, **{**kwargs, "disable": False, "file": io.StringIO()})
            bars.append(self)

        def update(self, n: float | None = 1) -> bool | None:
            # Every update, not tqdm's throttled refresh: files finish in bursts.
            out = super().update(n)
            report()
            return out

        def display(self, msg=None, pos=None) -> bool:
            report()
            return True

    return Bars


def resolve(
    path_or_repo: str,
    revision: str | None = None,
    allow_patterns: Sequence[str] = MODEL_PATTERNS,
) -> Path:
    """A local directory as is; otherwise a Hub snapshot (downloaded or cached).

    Honours HF_HUB_OFFLINE and the Hugging Face cache (HF_HOME, HF_HUB_CACHE).
    """
    given, path_or_repo = path_or_repo, expand(path_or_repo)
    named = f"{given} ({path_or_repo})" if given != path_or_repo else path_or_repo
    local = Path(path_or_repo).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise UserError(f"{path_or_repo}: expected a directory holding config.json")
    if path_or_repo.startswith((".", "/", "~")) or path_or_repo.count("/") != 1:
        raise UserError(f"{path_or_repo}: no such directory, and not a Hub repo id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hf_errors

    callback = _reporter.get()
    bars = {} if callback is None else {"tqdm_class": _progress_bars(path_or_repo, callback)}
    try:
        return Path(
            snapshot_download(path_or_repo, revision=revision, allow_patterns=list(allow_patterns), **bars)
        )
    except hf_errors.LocalEntryNotFoundError:
        at = f" at revision '{revision}'" if revision else ""
        raise UserError(
            f"{named}{at}: not in the Hugging Face cache and the Hub cannot be reached "
            "(offline: HF_HUB_OFFLINE is set or there is no network); download it once online, "
            "or try --model demo, which ships with mlx-spec"
        ) from None
    except hf_errors.RepositoryNotFoundError:
        raise UserError(f"{named}: no such repo on the Hugging Face Hub (or it is private)") from None
    except hf_errors.RevisionNotFoundError:
        raise UserError(f"{path_or_repo}: revision '{revision}' not found (--revision)") from None
    except hf_errors.HFValidationError as e:
        raise UserError(f"{path_or_repo}: not a valid Hub repo id ({e})") from None
    except (OSError, hf_errors.HfHubHTTPError) as e:
        raise UserError(f"{named}: download from the Hub failed: {e}".splitlines()[0]) from None
