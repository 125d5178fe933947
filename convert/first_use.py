"""`--drafter KIND=SOURCE` on what people publish: a folder or Hub repo as it is.

A drafter folder that mlx-spec reads as it is (z-lab's DFlash folders, one
`mlx-spec convert` or `mlx-spec train` wrote) is used where it lies. Any other
is converted once, the way `mlx-spec convert` would, into mlx-spec's data
folder (`converted/KIND/NAME-KEY`), and read from there after. KEY stands for
exactly what was converted: a Hub snapshot by its repo and commit, a local
folder by its path and its files' names, sizes and modification times; a
new commit or an edited file converts again. A conversion is written all at
once (config.json last), so an interrupted one is done again next time.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path
from typing import Callable

from mlx_spec import hub
from mlx_spec.drafters import REGISTRY as DRAFTERS
from mlx_spec.drafters.base import Conversion
from mlx_spec.errors import UserError
from mlx_spec.files import data_dir
from mlx_spec.models.load import read_json

WEIGHTS = ("*.json", "*.safetensors", "*.bin", "*.pt")  # what a drafter repo's conversion may read


def conversion(kind: str) -> Conversion | None:
    """How `kind`'s published folders are read ("target": `--model`, read as a draft model is)."""
    kind = "draft" if kind == "target" else kind
    return DRAFTERS[kind].convert if kind in DRAFTERS else None


def _key(source: str, path: Path) -> str:
    """What the conversion is of: a Hub snapshot's repo and commit, or a local folder's files."""
    local = Path(hub.expand(source)).expanduser()
    if local.is_dir():
        files = sorted(f for f in local.rglob("*") if f.is_file())
        stamp = [str(local.resolve())] + [f"{f.relative_to(local)}:{f.stat().st_size}:{f.stat().st_mtime_ns}"
                                          for f in files]
    else:  # a snapshot folder is named by its commit
        stamp = [source, path.name]
    return hashlib.sha256("\n".join(stamp).encode()).hexdigest()[:16]


def stderr_line(message: str) -> None:
    print(f"mlx-spec: {message}", file=sys.stderr, flush=True)


def ready(kind: str, source: str, revision: str | None, target: Path | None,
          report: Callable[[str], None] = stderr_line) -> str:
    """SOURCE as the `kind` drafter's loader reads it ("target": as the target's
    does): itself, or its conversion, made now if there is none yet. A
    conversion is of SOURCE alone (`target`, the target's folder, shapes only
    MTP modules): the loader checks it against the target."""
    how = conversion(kind)
    if how is None:
        return source
    whole = how.whole  # a model is fetched whole anyway
    path = hub.resolve(source, revision, hub.MODEL_PATTERNS if whole else ["config.json"])
    if whole and not any(path.glob("*.safetensors")):  # published in pytorch_model.bin form only
        path = hub.resolve(source, revision, hub.MODEL_PATTERNS + ("pytorch_model*",))
    config = read_json(path / "config.json") if (path / "config.json").exists() else {}
    if isinstance(config.get("mlx_spec"), dict) or how.as_is(path, config):  # converted earlier, or read as it is
        return source
    local = Path(hub.expand(source)).expanduser()
    name = local.name if local.is_dir() else source.replace("/", "--")  # a repo id: owner--name
    out = data_dir() / "converted" / kind / f"{re.sub(r'[^A-Za-z0-9._-]+', '-', name)[-64:]}-{_key(source, path)}"
    if (out / "config.json").exists():
        return str(out)
    if how.family != "mtp":
        from mlx_spec.convert import llama, pipeline

        # A model is read as one whatever else it holds (a Medusa-2 model's heads, say).
        family = llama if whole else pipeline.detect(pipeline.read_source(source, revision))
        if family.NAME != how.family:
            found = next((k.name for k in DRAFTERS.values() if k.convert and k.convert.family == family.NAME),
                         family.NAME)
            raise UserError(f"--drafter {kind}={source}: it is a {family.NAME} checkpoint; "
                            f"use --drafter {found}={source}")
    report(f"converting {source} for {'--model' if kind == 'target' else f'--drafter {kind}'}, once: {out}")
    if how.family == "mtp":
        from mlx_spec.convert.mtp import convert_mtp

        convert_mtp(hub.resolve(source, revision, WEIGHTS), out, read_json(target / "config.json"))
        return str(out)
    pipeline.convert(source, out, revision=revision, family=family)  # whether it fits: the drafter's loader says
    return str(out)
