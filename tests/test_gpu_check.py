"""scripts/gpu_check.sh, the check a machine with a GPU runs, runs to its end here at a small size."""

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_check_runs_to_its_end_and_prints_as_it_goes(tmp_path):
    env = {**os.environ, "MLX_SPEC_NO_OPENBLAS": "", "OPENBLAS_NUM_THREADS": "1", "TOKENS": "4", "PROMPTS": "1",
           "CONCURRENCY": "1,2", "WIDEN": "--hidden 256 --heads 4 --intermediate 768 --layers 8 --dtype float32",
           "DRAFTERS": "student lookup", "BENCH_ARGS": "--no-mlx-lm"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for step in ("== device", "== widening the demo", "== greedy exactness", "== mlx-spec bench", "== done"):
        assert step in out, out
    for spec in (f"draft={tmp_path}/widened/student", "lookup"):
        assert f"{spec} (default): identical to plain:" in out  # up to float rounding: either, with the margin if not
        assert f"{spec} --exact: identical to plain: True" in out
    assert "elapsed, about" in proc.stderr and "measured in" in proc.stderr  # the bench's progress
    report = json.loads((tmp_path / "bench.json").read_text())
    assert {r["name"] for r in report["rows"]} == {"mlx-spec", f"mlx-spec draft={tmp_path}/widened/student",
                                                   "mlx-spec lookup"}
    assert {r["batch"] for r in report["concurrency"]} == {1, 2}
    assert set(report["verification_ms"]) == {"1", "2"}
