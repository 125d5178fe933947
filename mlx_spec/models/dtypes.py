"""The dtype models compute in on this machine."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map


def compute_dtype() -> mx.Dtype | None:
    """float32 on the CPU (bf16/fp16 matmul there is slow and skips BLAS); None
    keeps the checkpoint's dtype on a GPU."""
    gpu = mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available())
    return None if gpu else mx.float32


def cast_floating(module: nn.Module, dtype: mx.Dtype | None) -> nn.Module:
    """`module` with its floating parameters in `dtype` (None: as they are), read now."""
    if dtype is not None:
        module.update(tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a,
                               module.parameters()))
        mx.eval(module.parameters())
    return module
