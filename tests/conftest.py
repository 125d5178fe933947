"""Shared fixtures. Tests run with the reference BLAS (no OpenBLAS preload), where
one-token and many-token forwards give bit-identical logits, so exactness is
asserted with no tolerance."""

import os
from pathlib import Path

os.environ.setdefault("MLX_SPEC_NO_OPENBLAS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Two test workers share the cores: pinning each process's threads (meant for one process alone) would put
# both workers' compute on the same core.
os.environ.setdefault("MLX_SPEC_NO_PIN", "1")
# scripts/tiny.py (the tiny checkpoints tests build) for the scripts tests run in processes of their own too
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[1] / "scripts"),
                                                         os.environ.get("PYTHONPATH")]))

import pytest  # noqa: E402

import mlx_spec  # noqa: E402,F401
from tiny import make_checkpoint  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture
def in_process(capsys):
    """`mlx-spec ARGS` run by `cli.main` in this process, as `helpers.cli` runs it in a subprocess (its exit
    code, stdout and stderr) without an interpreter's start: for the many runs that end in an error."""
    import subprocess

    from mlx_spec.cli import main

    def run(*args) -> subprocess.CompletedProcess:
        capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse's own errors
            code = e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict:
    """One tiny checkpoint per architecture, plus a 4-bit quantized and a sharded one."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {arch: make_checkpoint(root / arch, arch, seed=i) for i, arch in enumerate(ARCHS)}
    out["qwen3-4bit"] = make_checkpoint(
        root / "qwen3-4bit", "qwen3", seed=7, quantize_bits=4, group_size=32,
        hidden_size=128, head_dim=32, intermediate_size=256,
    )
    out["llama-sharded"] = make_checkpoint(root / "llama-sharded", "llama", seed=0, shards=3)
    return out


def _fast_blas_env() -> dict:
    # Training needs no bit-exactness, and the reference BLAS selected above
    # makes it several times slower: train in a child process with OpenBLAS.
    # Empty rather than absent: `helpers.cli` lays these over the test's own environment.
    return {**os.environ, "MLX_SPEC_NO_OPENBLAS": ""}


@pytest.fixture(scope="session")
def copy_model(tmp_path_factory):
    """A tiny Qwen3 trained (here, for a few hundred steps) to continue a
    segment it has seen earlier in its context."""
    return _train_task_model(tmp_path_factory, "copy", 400)


@pytest.fixture(scope="session")
def stride_model(tmp_path_factory):
    """A tiny Qwen3 trained on letters walked with a stride (`tiny.stride_row`)."""
    return _train_task_model(tmp_path_factory, "stride", 200)


def _train_task_model(tmp_path_factory, task: str, steps: int):
    import fcntl
    import subprocess
    import sys

    # Trained once per test run: pytest-xdist's workers share the parent of
    # their temporary folders, and take turns through a lock on it.
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out, done = root / f"{task}-model", root / f"{task}-model.done"
    with open(root / f"{task}-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            code = f"from tiny import train_copy_model; train_copy_model({str(out)!r}, {steps}, task={task!r})"
            subprocess.run([sys.executable, "-c", code], env=_fast_blas_env(), check=True, timeout=600)
            done.touch()
    return out
