"""Writing a converted model directory: all of it or none of it.

OUT is built in a hidden temporary sibling and renamed into place only when
complete, so an interruption (an error, Ctrl-C, a full disk) never leaves a
half-written OUT. An existing OUT is replaced only with `--force`, and only if
it is an earlier conversion (its config.json has an "mlx_spec" section) or an
empty directory, so a slip of `-o` cannot delete unrelated files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from mlx_spec.errors import UserError
from mlx_spec.files import replace_atomically


def _is_conversion(out: Path) -> bool:
    try:
        return "mlx_spec" in json.loads((out / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def check_out(out: Path, force: bool) -> None:
    """Refuse an OUT that exists, unless it is empty, or `force` and an earlier conversion."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not force:
        raise UserError(f"{out}: already exists; pass --force to replace it")
    if not (out.is_dir() and _is_conversion(out)):
        raise UserError(f"{out}: exists and is not an mlx-spec conversion (no 'mlx_spec' in its config.json); not replacing it")


def write_atomically(out: Path, fill: Callable[[Path], None], force: bool = False) -> None:
    """Make OUT with `fill(directory)`, all or nothing (see the module docstring)."""
    check_out(out, force)
    replace_atomically(out, fill)
