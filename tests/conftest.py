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
    """`helpers.cli_here`: for the many runs that end in an error (what the test printed before is let go)."""
    from helpers import cli_here

    def run(*args):
        capsys.readouterr()
        return cli_here(*args)

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
    # Empty rather than absent: `helpers.cli` lays these over the test's own environment. One thread: two
    # test workers share the cores, and OpenBLAS's helpers would spin beside the other worker's process.
    return {**os.environ, "MLX_SPEC_NO_OPENBLAS": "", "OPENBLAS_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def copy_model(tmp_path_factory) -> Path:
    """A tiny Qwen3 trained to continue a segment it has seen earlier in its context
    (`tiny.train_copy_model`, 400 steps; tests/fixtures/copy-model, copied here)."""
    return _task_model(tmp_path_factory, "copy")


@pytest.fixture(scope="session")
def stride_model(tmp_path_factory) -> Path:
    """A tiny Qwen3 trained on letters walked with a stride (`tiny.stride_row`; 200 steps)."""
    return _task_model(tmp_path_factory, "stride")


def _task_model(tmp_path_factory, task: str) -> Path:
    """The trained model of `task` as it ships in tests/fixtures (training it is a minute of the
    suite's time on 2 cores: `tiny.train_copy_model(folder, 400)` writes the copy model again,
    `(folder, 200, task="stride")` the stride model), in a folder of its own that a test may write in."""
    import shutil

    out = tmp_path_factory.mktemp(f"{task}-model")
    shutil.copytree(Path(__file__).parent / "fixtures" / f"{task}-model", out, dirs_exist_ok=True)
    return out
