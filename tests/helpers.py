"""Running the command line from tests."""

import os
import subprocess
import sys


def cli(*args, env=None) -> subprocess.CompletedProcess:
    """`mlx-spec ARGS` in a subprocess, as a user would run it."""
    return subprocess.run(
        [sys.executable, "-m", "mlx_spec.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles) -> None:
    """Exit code 2 and a single stderr line naming each of `needles`, no traceback."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert str(needle) in lines[0], lines[0]
