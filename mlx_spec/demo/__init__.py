"""The demo that ships with mlx-spec: a small Qwen3 target trained on the
Python standard library's source, and its drafters, each trained with
mlx-spec's own commands (`scripts/build_demo.py` rebuilds them all).

`--model demo` is this target, and `--drafter KIND` with no source is then
the demo's own drafter of that kind. `--model demo-layerskip` is a copy of the
target tuned for early exit, for `--drafter layerskip`; `demo-student-labels`
is the student trained on the labels alone as long as its first distillation,
the baseline the distilled student (`--drafter draft`) is measured against.
"""

from __future__ import annotations

from pathlib import Path

from mlx_spec.errors import UserError

ROOT = Path(__file__).parent
NAME = "mlx-spec/demo"  # the target's `_name_or_path`, how the drafter registry knows it
# --model short name -> folder
MODELS = {"demo": "target", "demo-layerskip": "layerskip", "demo-student": "student",
          "demo-student-labels": "student-labels"}
# --drafter kind -> the folder of the demo's drafter of that kind
DRAFTERS = {"draft": "student", "medusa": "medusa", "eagle3": "eagle3", "dflash": "dflash", "mtp-heads": "mtp-heads"}


def path(name: str = "target") -> Path:
    """The folder of one demo artifact; a clear error when the demo was not built."""
    folder = ROOT / name
    if not (folder / "config.json").is_file():
        raise UserError(
            f"the demo's {name} is not installed in {ROOT} (rebuild it with scripts/build_demo.py WORK --install)"
        )
    return folder
