"""Shared fixtures. Tests run with the reference BLAS (no OpenBLAS preload), where
one-token and many-token forwards give bit-identical logits, so exactness is
asserted with no tolerance."""

import os

os.environ.setdefault("MLX_SPEC_NO_OPENBLAS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

import mlx_spec  # noqa: E402,F401
from mlx_spec.testing import make_checkpoint  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen3")


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
