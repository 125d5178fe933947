"""What a checkpoint family provides: one module per family (convert/llama.py, ...),
listed in `pipeline.FAMILIES`, implements `Family` with module-level names."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Protocol

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class Source:
    """The SOURCE argument, as far as its config tells."""

    name: str  # as given: a directory or a Hub repo id
    revision: str | None
    config: dict  # its config.json ({} when it has none)


@dataclass
class Converted:
    config: dict  # config.json to write; the pipeline adds the "mlx_spec" section
    weights: Mapping[str, mx.array]  # named as in `build(config)`
    origin: dict[str, Path]  # the file each weight came from, for messages
    copy: list[Path] = field(default_factory=list)  # files written out as they are (tokenizer, ...)


class Family(Protocol):
    NAME: str  # recorded as config.json's "mlx_spec": {"family": NAME}
    DESCRIPTION: str  # what it converts, for the "not recognised" message

    def detect(self, source: Source) -> bool:
        """Whether SOURCE is this family's, from its config.json (nothing big is fetched yet)."""

    def fetch(self, source: Source) -> Path:
        """A local directory with the files `convert` needs (downloads just those)."""

    def convert(self, path: Path, source: Source) -> Converted:
        """Read, rename and check the weights; raise UserError naming file and tensor."""

    def build(self, config: dict) -> nn.Module:
        """The module the converted weights load into (quantization runs on it)."""

    def check_target(self, converted: Converted, path: Path, target: str) -> None:
        """`--target`: raise UserError naming the flag if SOURCE cannot serve that target."""
